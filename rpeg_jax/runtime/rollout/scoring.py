"""Rewards of rollout rows with the run's verifier (the reward stage, dynamic sampling's scorer), plus
DAPO's soft overlong penalty (rl.overlong=soft_penalty) and the truncation flags. Samples are built
by data/rewards.make_samples, as evaluation builds them."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rpeg_jax.data.rewards import make_samples, overlong_penalty, text_stop_ids, truncated
from rpeg_jax.data.rewards import score as score_samples
from rpeg_jax.runtime.rollout.layout import HOST_FIELDS


def stop_ids(cfg) -> tuple[int, ...]:
    """The ids a response stops at (where the sampler stopped it: eos unless ignored, and stop ids)."""
    eos = () if cfg.rollout.ignore_eos or cfg.rollout.forced_lengths is not None else cfg.model.end_ids
    return (*eos, *cfg.rollout.stop_token_ids)


def score_rows(ctx, tokens: np.ndarray, lengths: np.ndarray, host: dict) -> tuple[np.ndarray, int, np.ndarray]:
    """Rewards [B] of response rows (tokens [B, R], their lengths, host columns prompt/answer/record)
    with the configured verifier, plus DAPO's soft overlong penalty when rl.overlong=soft_penalty;
    returns (rewards float32, reward errors, truncated [B]: hit rollout.max_new_tokens without a stop)."""
    cfg = ctx.cfg
    text_stops = text_stop_ids(cfg.model.end_ids, cfg.rollout.stop_token_ids)  # where the completion's text ends
    rows = [tokens[b].tolist() for b in range(tokens.shape[0])]
    samples = make_samples(
        host["prompt"], host["answer"], host["record"], rows, ctx.tokenizer, stop_ids=text_stops, lengths=lengths
    )
    rewards, errors = score_samples(samples, ctx.reward_fn, cfg.data.reward_on_error, ctx.reward_name)
    last = tokens[np.arange(tokens.shape[0]), np.maximum(lengths - 1, 0)]
    cut = truncated(np.where(lengths > 0, last, -1), lengths, cfg.rollout.max_new_tokens, stop_ids(cfg))
    rl = cfg.rl
    if rl.overlong == "soft_penalty":
        cap = cfg.rollout.max_new_tokens
        rewards = rewards + overlong_penalty(lengths, cap, rl.overlong_buffer, rl.overlong_penalty)
    return rewards.astype(np.float32), errors, cut


def score(ctx, comps: dict) -> tuple[Any, dict]:
    """Rewards [B] of a rollout batch with the configured verifier (host), and metrics. A batch
    that dynamic sampling scored already (rl.filter_groups) carries its rewards in host_rewards."""
    R = comps["host_mask"].shape[1]
    tokens = comps["host_tokens"][:, -R:]
    lengths = comps["host_mask"].sum(1).astype(int)
    host = {k: comps[f"host_{k}"] for k, _ in HOST_FIELDS}
    t0 = time.perf_counter()
    rewards, errors, cut = score_rows(ctx, tokens, lengths, host) if "host_rewards" not in comps else (None, 0, None)
    if rewards is None:
        rewards, errors, cut = comps["host_rewards"], int(comps["host_reward_errors"].sum()), comps["host_truncated"]
    metrics = {"reward/errors": float(errors), "timing_s/reward_fn": time.perf_counter() - t0}
    if ctx.cfg.rl.overlong != "none":
        metrics["rollout/overlong"] = float(np.mean(cut)) if len(cut) else 0.0
    return ctx.placement.put_batch(rewards), metrics


def score_group(ctx, responses: list, host: dict) -> tuple[np.ndarray, int, np.ndarray]:
    """score_rows for one group's G responses (token lists) and its host columns (G entries each)."""
    lengths = np.array([len(t) for t in responses], int)
    tokens = np.zeros((len(responses), max(1, int(lengths.max()))), np.int64)
    for b, t in enumerate(responses):
        tokens[b, : len(t)] = t
    return score_rows(ctx, tokens, lengths, host)


def group_scores(ctx, g) -> tuple[np.ndarray, int, np.ndarray]:
    """Continuous admission's scorer (runtime/rollout/continuous.py): the rewards of a completed Group."""
    seqs = sorted(g.seqs, key=lambda s: s.sample_index)
    return score_group(ctx, [s.tokens for s in seqs], {k: [g.host[k]] * len(seqs) for k, _ in HOST_FIELDS})


def cached_scores(kept) -> dict:
    """host_rewards / host_reward_errors / host_truncated of scored groups (rewards, errors, truncated)."""
    errs = [np.zeros(len(r), np.int32) for r, *_ in kept]
    for e, (_, n, _) in zip(errs, kept):
        e[0] = n
    return {
        "host_rewards": np.concatenate([r for r, *_ in kept]).astype(np.float32),
        "host_reward_errors": np.concatenate(errs),
        "host_truncated": np.concatenate([c for *_, c in kept]),
    }
