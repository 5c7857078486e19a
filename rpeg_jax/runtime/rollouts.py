"""Rollouts: sampler outputs -> the rollout batch layout; reward scoring; the prompt cache and
the rollout buffer that enforces the staleness bound.

Rollout layout: B = prompts x G sequences (a prompt's G rows adjacent), prompts LEFT-padded to
P, responses RIGHT-padded to R, S = P + R. `completions` holds global arrays sharded over `data`
(tokens_BxS, positions_BxS, segment_ids_BxS: 1 on real tokens, 0 on padding; response_mask_BxR,
versions_BxR: the policy version of each sampled token; group_ids_B) plus host-only `host_*`
fields (tokens, mask, prompt, answer, record) for the reward; the behaviour logprobs are a
separate [B, R] array. P and R are bucketed up to a multiple of shapes/buckets.LENGTH_BUCKET (fewer padded
tokens, few distinct compiled shapes) unless the run streams micro-batches, where every piece
must have the configured shape so pieces concatenate; under continuous admission R is
rollout.max_new_tokens (a batch's longest response changes every step, and each new R would
compile the training stages again).

DAPO's filters: `filtered_piece` is step admission's dynamic sampling (rl.filter_groups), and
`score_rows` adds the soft overlong penalty (rl.overlong=soft_penalty) to every reward.

Called by: runtime/kernels.py (generate, reward), runtime/setup.py (RolloutBuffer, StepPrompts),
runtime/trainer.py (token statistics, the staleness check, step FLOPs), runtime/resume.py
(host_fields).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from rpeg_jax.data.rewards import Sample, overlong_penalty, truncated
from rpeg_jax.data.rewards import score as score_samples
from rpeg_jax.data.tokenizer import completion_ids
from rpeg_jax.runtime.admission import FilterExhausted, forced_lengths, occupancy, rollout_seed
from rpeg_jax.sampling import SamplingParams
from rpeg_jax.shapes.buckets import length_bucket
from rpeg_jax.shapes.flops import Dims


class StalenessError(RuntimeError):
    pass


@dataclass
class StepPrompts:
    """The data-iterator state node's value: one PromptBatch per step, fetched in step order.
    Remembers the pipeline state before each fetch, so a checkpoint can rewind to it.

    Under dynamic sampling with step admission (rl.filter_groups) a step draws prompts from the
    stream by `draw` instead: `cursor` is the stream's next (data step, index), `cursor_before[t]`
    where step t started drawing and `sources[t]` the (data step, index) of each group of its batch."""

    pipeline: Any
    cache: dict[int, Any] = field(default_factory=dict)
    before: dict[int, dict] = field(default_factory=dict)
    cursor: tuple[int, int] = (0, 0)
    cursor_before: dict[int, tuple[int, int]] = field(default_factory=dict)
    sources: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    filtered: dict[int, int] = field(default_factory=dict)  # groups dropped so far for step t

    def get(self, step: int):
        while step not in self.cache:
            state = self.pipeline.get_state()
            batch = next(self.pipeline)
            self.cache[batch.step], self.before[batch.step] = batch, state
            if batch.step > step:
                raise RuntimeError(f"data pipeline is at step {batch.step}, step {step} was asked for")
        for s in [s for s in self.cache if s < step - 1]:
            del self.cache[s]
        floor = min([step - 16] + [d for d, _ in self.cursor_before.values()])  # a checkpoint may rewind there
        for s in [s for s in self.before if s < floor]:
            del self.before[s]
        return self.cache[step]

    def draw(self, n: int) -> list[tuple[int, int, Any]]:
        """The stream's next n prompts as (data step, index, PromptBatch), advancing the cursor."""
        out = []
        d, i = self.cursor
        for _ in range(n):
            batch = self.get(d)
            out.append((d, i, batch))
            d, i = (d + 1, 0) if i + 1 == len(batch.prompt_tokens) else (d, i + 1)
        self.cursor = (d, i)
        return out

    def begin(self, step: int) -> None:
        """Step `step` starts drawing its groups (dynamic sampling), at its first piece."""
        self.cursor_before[step], self.sources[step], self.filtered[step] = self.cursor, [], 0
        for t in [t for t in self.cursor_before if t < step - 32]:
            for d in (self.cursor_before, self.sources, self.filtered):
                d.pop(t, None)

    def state(self) -> dict:
        return self.pipeline.get_state()

    def state_before(self, step: int) -> dict:
        """The pipeline state just before step `step`'s prompts were drawn."""
        return self.before[step]

    def state_at(self, cursor: tuple[int, int]) -> dict:
        """The pipeline state from which `draw` continues at `cursor` (its data step fetched again)."""
        d = cursor[0]
        return self.before[d] if d in self.before else self.pipeline.get_state()


@dataclass
class RolloutBuffer:
    """Rollouts admitted ahead of their update (bounded asynchrony): admission refuses a rollout
    for step t made with weights older than t - k (k = the graph's staleness). Survives resume
    through `admitted`."""

    staleness: int
    admitted: dict[int, int] = field(default_factory=dict)  # step -> weights version

    def admit(self, step: int, version: int) -> None:
        if step - version > self.staleness:
            raise StalenessError(
                f"rollout for step {step} with weights version {version} exceeds the staleness bound k={self.staleness}"
            )
        self.admitted[step] = version
        for s in [s for s in self.admitted if s < step - self.staleness - 1]:
            del self.admitted[s]


def generate_piece(ctx, params, version: int, batch, step: int, piece: int, pieces: int):
    """Sample piece `piece` of step `step` and lay it out; returns (completions, behav_logp, metrics)."""
    n = len(batch.prompt_tokens)
    lo, hi = piece * n // pieces, (piece + 1) * n // pieces
    sampler, cfg = ctx.sampler, ctx.cfg
    if sampler.version != version:
        sampler.update_weights(params, version)
    G = cfg.rl.group_size
    sp = SamplingParams.from_rollout(cfg.rollout, n=G, seed=rollout_seed(cfg.train.seed, step))
    prompts = [list(p) for p in batch.prompt_tokens[lo:hi]]
    lengths = None
    if cfg.rollout.forced_lengths is not None:  # the same draw as continuous admission's first attempt
        draw = forced_lengths(cfg.rollout.forced_lengths, cfg.train.seed, G)
        lengths = [draw(step, i, 0) for i in range(lo, hi)]
    before = sampler.stats()
    t0 = time.perf_counter()
    outs = sampler.generate(prompts, sp, prompt_ids=[ctx.prompt_offset + i for i in range(lo, hi)], lengths=lengths)
    gen_s = time.perf_counter() - t0
    done = [(o.prompt_tokens, c) for o in outs for c in o.completions]
    rows = [(p, c.tokens, c.logprobs, c.policy_versions) for p, c in done]
    gids = np.repeat(np.arange(lo, hi, dtype=np.int32) + ctx.prompt_offset, G)
    host = {k: [getattr(batch, a)[i] for i in range(lo, hi)] for k, a in HOST_FIELDS}
    comps, behav, new_tokens = lay_out(ctx, rows, gids, host)
    metrics = {
        "perf/gen_tokens_per_s": new_tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/preemptions": float(sum(c.num_preemptions for _, c in done)),
        "rollout/weights_version": float(version),
        "rollout/occupancy": occupancy(before, sampler.stats()),
    }
    return comps, behav, metrics


def filtered_piece(ctx, params, version: int, prompts: StepPrompts, step: int, piece: int, pieces: int):
    """Dynamic sampling (rl.filter_groups=zero_variance) under step admission: piece `piece` of step
    `step` as the first groups drawn from the prompt stream whose rewards are not all equal. Each
    round generates as many new prompts as groups are missing (its own sampler seed), scores them,
    drops the zero-variance ones; at most rl.filter_max_rounds rounds (0: unbounded), else
    FilterExhausted. The rewards ride along in host_rewards (the reward stage does not score again).
    Returns (completions, behav_logp, metrics)."""
    cfg, sampler = ctx.cfg, ctx.sampler
    n = cfg.data.prompts_per_step // jax.process_count()  # this process's groups per step
    lo, hi = piece * n // pieces, (piece + 1) * n // pieces
    if sampler.version != version:
        sampler.update_weights(params, version)
    G, max_rounds = cfg.rl.group_size, cfg.rl.filter_max_rounds
    draw_len = forced_lengths(cfg.rollout.forced_lengths, cfg.train.seed, G) if cfg.rollout.forced_lengths else None
    if piece == 0:
        prompts.begin(step)
    kept: list[tuple] = []  # (prompt, completions, host, rewards, errors, truncated, source)
    rounds, filtered, new_tokens, preempt, gen_s = 0, 0, 0, 0, 0.0
    before = sampler.stats()
    while len(kept) < hi - lo:
        if max_rounds and rounds == max_rounds:
            raise FilterExhausted(
                f"step {step}: rl.filter_groups={cfg.rl.filter_groups} kept {len(kept)} of {hi - lo} groups after "
                f"rl.filter_max_rounds={max_rounds} generation rounds ({filtered} groups had equal rewards); raise "
                f"rl.filter_max_rounds (0 = unbounded) or use prompts the policy neither always solves nor always fails"
            )
        drawn = prompts.draw(hi - lo - len(kept))
        sp = SamplingParams.from_rollout(cfg.rollout, n=G, seed=rollout_seed(cfg.train.seed + 7919 * rounds, step))
        lengths = None if draw_len is None else [draw_len(d, i, 0) for d, i, _ in drawn]
        ids = [ctx.prompt_offset + lo + len(kept) + j for j in range(len(drawn))]
        t0 = time.perf_counter()
        outs = sampler.generate([list(b.prompt_tokens[i]) for _, i, b in drawn], sp, prompt_ids=ids, lengths=lengths)
        gen_s += time.perf_counter() - t0
        rounds += 1
        for (d, i, b), o in zip(drawn, outs):
            host = {k: [getattr(b, a)[i]] * G for k, a in HOST_FIELDS}
            rewards, errors, cut = score_group(ctx, [c.tokens for c in o.completions], host)
            new_tokens += sum(len(c.tokens) for c in o.completions)
            preempt += sum(c.num_preemptions for c in o.completions)
            if np.all(rewards == rewards[0]):
                filtered += 1
                continue
            kept.append((o.prompt_tokens, o.completions, {k: v[0] for k, v in host.items()}, rewards, errors, cut))
            prompts.sources[step].append((d, i))
    prompts.filtered[step] += filtered
    rows = [(p, c.tokens, c.logprobs, c.policy_versions) for p, cs, *_ in kept for c in cs]
    gids = np.repeat(np.arange(lo, hi, dtype=np.int32) + ctx.prompt_offset, G)
    host = {k: [h[k] for _, _, h, *_ in kept] for k, _ in HOST_FIELDS}
    comps, behav, _ = lay_out(ctx, rows, gids, host)
    comps.update(_cached_scores([(r, e, c) for *_, r, e, c in kept]))
    metrics = {
        "perf/gen_tokens_per_s": new_tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/preemptions": float(preempt),
        "rollout/weights_version": float(version),
        "rollout/occupancy": occupancy(before, sampler.stats()),
        "rollout/filtered_groups": float(prompts.filtered[step]),  # the step's total so far (pieces add up)
        "rollout/filter_rounds": float(rounds),
    }
    return comps, behav, metrics


def score_group(ctx, responses: list, host: dict) -> tuple[np.ndarray, int, np.ndarray]:
    """score_rows for one group's G responses (token lists) and its host columns (G entries each)."""
    lengths = np.array([len(t) for t in responses], int)
    tokens = np.zeros((len(responses), max(1, int(lengths.max()))), np.int64)
    for b, t in enumerate(responses):
        tokens[b, : len(t)] = t
    return score_rows(ctx, tokens, lengths, host)


def group_scores(ctx, g) -> tuple[np.ndarray, int, np.ndarray]:
    """Continuous admission's scorer (runtime/admission.py): the rewards of a completed Group."""
    seqs = sorted(g.seqs, key=lambda s: s.sample_index)
    return score_group(ctx, [s.tokens for s in seqs], {k: [g.host[k]] * len(seqs) for k, _ in HOST_FIELDS})


def _cached_scores(kept) -> dict:
    """host_rewards / host_reward_errors / host_truncated of scored groups (rewards, errors, truncated)."""
    errs = [np.zeros(len(r), np.int32) for r, *_ in kept]
    for e, (_, n, _) in zip(errs, kept):
        e[0] = n
    return {
        "host_rewards": np.concatenate([r for r, *_ in kept]).astype(np.float32),
        "host_reward_errors": np.concatenate(errs),
        "host_truncated": np.concatenate([c for *_, c in kept]),
    }


def continuous_batch(ctx, params, version: int, prompts, step: int):
    """Step `step`'s batch from the engine that outlives the step (runtime/admission.py): the first
    groups to complete that meet the staleness bound; returns (completions, behav_logp, metrics)."""
    engine = ctx.engine
    t0 = time.perf_counter()
    groups, st = engine.next_batch(step, version, params, prompts)
    gen_s = time.perf_counter() - t0
    G = ctx.cfg.rl.group_size
    seqs = [(g.prompt, s) for g in groups for s in sorted(g.seqs, key=lambda s: s.sample_index)]
    rows = [(p, s.tokens, s.logprobs, s.versions) for p, s in seqs]
    gids = np.repeat(np.array([g.gid for g in groups], np.int32), G)
    host = {k: [g.host[k] for g in groups] for k, _ in HOST_FIELDS}
    comps, behav, new_tokens = lay_out(ctx, rows, gids, host)
    if engine.scorer is not None:  # dynamic sampling scored every group as it completed
        comps.update(_cached_scores([g.scores for g in groups]))
    metrics = {
        "perf/gen_tokens_per_s": new_tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/preemptions": float(sum(s.preemptions for _, s in seqs)),
        "rollout/weights_version": float(version),
        "rollout/occupancy": st.occupancy,
        "rollout/requeued": float(st.requeued),
        "rollout/dropped": float(st.dropped),
        "rollout/in_flight": float(engine.in_flight_sequences()),
        "rollout/decode_steps": float(st.decode_steps),
    }
    if engine.scorer is not None:
        metrics["rollout/filtered_groups"] = float(st.filtered)
    return comps, behav, metrics


HOST_FIELDS = (("prompt", "prompts"), ("answer", "answers"), ("record", "records"))


def lay_out(ctx, rows, gids: np.ndarray, host: dict[str, list]) -> tuple[dict, Any, int]:
    """Rows (prompt tokens, response tokens, their logprobs, their policy versions) -> the rollout
    layout (module docstring) as this process's share of global arrays, plus host fields; returns
    (completions, behav_logp, new tokens)."""
    cfg, fixed = ctx.cfg, ctx.fixed_shapes
    toks = [np.asarray(t, np.int32) for _, t, _, _ in rows]
    lps = [np.asarray(lp, np.float32) for _, _, lp, _ in rows]
    vers = [np.asarray(v, np.int32) for _, _, _, v in rows]
    longest = np.array([max(len(r[0]) for r in rows), max(len(t) for t in toks)])
    if jax.process_count() > 1:  # every process must lay its rows out with the same P and R
        longest = multihost_utils.process_allgather(longest).max(axis=0)
    P = length_bucket(int(longest[0]), cfg.data.max_prompt_len if fixed else None)
    # under continuous admission each batch's longest response varies from step to step (whichever
    # groups completed first), so R is the cap: one compiled shape for the training stages
    fixed_r = fixed or cfg.rollout.admission == "continuous"
    R = length_bucket(int(longest[1]), cfg.rollout.max_new_tokens if fixed_r else None)
    B = len(rows)
    tokens = np.full((B, P + R), cfg.model.pad_id, np.int32)
    positions = np.zeros((B, P + R), np.int32)
    segments = np.zeros((B, P + R), np.int32)
    mask = np.zeros((B, R), np.float32)
    behav = np.zeros((B, R), np.float32)
    versions = np.zeros((B, R), np.int32)
    for b, (p, *_) in enumerate(rows):
        lp, lr = len(p), len(toks[b])
        tokens[b, P - lp : P] = p
        tokens[b, P : P + lr] = toks[b]
        positions[b, P - lp : P + lr] = np.arange(lp + lr)
        segments[b, P - lp : P + lr] = 1
        mask[b, :lr] = 1.0
        behav[b, :lr] = lps[b]
        versions[b, :lr] = vers[b]
    comps = {
        "tokens_BxS": tokens,
        "positions_BxS": positions,
        "segment_ids_BxS": segments,
        "response_mask_BxR": mask,
        "versions_BxR": versions,
        "group_ids_B": gids,
    }
    comps = {k: ctx.placement.put_batch(v) for k, v in comps.items()}
    comps.update(_host_columns(ctx.cfg.rl.group_size, host, tokens, mask))
    return comps, ctx.placement.put_batch(behav), int(mask.sum())


def _host_columns(G: int, host: dict[str, list], tokens: np.ndarray, mask: np.ndarray) -> dict:
    pi = np.repeat(np.arange(len(host["prompt"])), G)
    return {"host_tokens": tokens, "host_mask": mask, **{f"host_{k}": _objects(v, pi) for k, v in host.items()}}


def host_fields(ctx, batch, lo: int, hi: int, tokens: np.ndarray, mask: np.ndarray) -> dict:
    """Host-side fields of prompts [lo, hi) of a PromptBatch, G rows each (for the reward)."""
    host = {k: [getattr(batch, a)[i] for i in range(lo, hi)] for k, a in HOST_FIELDS}
    return _host_columns(ctx.cfg.rl.group_size, host, tokens, mask)


def stream_host_fields(ctx, prompts: StepPrompts, sources, tokens: np.ndarray, mask: np.ndarray) -> dict:
    """Host-side fields of the prompts at `sources` ((data step, index) each) of the stream, G rows each."""
    picked = [(prompts.get(d), i) for d, i in sources]
    host = {k: [getattr(b, a)[i] for b, i in picked] for k, a in HOST_FIELDS}
    return _host_columns(ctx.cfg.rl.group_size, host, tokens, mask)


def _objects(values, index) -> np.ndarray:
    out = np.empty(len(index), dtype=object)
    for j, i in enumerate(index):
        out[j] = values[i]
    return out


def stop_ids(cfg) -> tuple[int, ...]:
    """The ids a response stops at (where the sampler stopped it: eos unless ignored, and stop ids)."""
    eos = () if cfg.rollout.ignore_eos or cfg.rollout.forced_lengths is not None else cfg.model.end_ids
    return (*eos, *cfg.rollout.stop_token_ids)


def score_rows(ctx, tokens: np.ndarray, lengths: np.ndarray, host: dict) -> tuple[np.ndarray, int, np.ndarray]:
    """Rewards [B] of response rows (tokens [B, R], their lengths, host columns prompt/answer/record)
    with the configured verifier, plus DAPO's soft overlong penalty when rl.overlong=soft_penalty;
    returns (rewards float32, reward errors, truncated [B]: hit rollout.max_new_tokens without a stop)."""
    tok, cfg = ctx.tokenizer, ctx.cfg
    text_stops = (*cfg.model.end_ids, *cfg.rollout.stop_token_ids)  # where the completion's text ends
    samples = []
    for b in range(tokens.shape[0]):
        ids = completion_ids(tokens[b, : lengths[b]].tolist(), tok.eos_id, text_stops)
        samples.append(
            Sample(
                prompt=host["prompt"][b],
                completion=tok.decode(ids),
                completion_ids=tuple(ids),
                answer=host["answer"][b],
                record=host["record"][b],
            )
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


@jax.jit
def _token_stats(versions_BxR, mask_BxR, segment_ids_BxS):
    """Global reductions over a rollout batch (works on multi-process arrays)."""
    m = mask_BxR > 0
    resp = mask_BxR.sum(1)
    seq = segment_ids_BxS.sum(1).astype(jnp.float32)
    prompt = seq - resp
    return {
        "min_version": jnp.min(jnp.where(m, versions_BxR, jnp.iinfo(jnp.int32).max)),
        "resp": resp.sum(),
        "prompt": prompt.sum(),
        "seq": seq.sum(),
        "resp_ctx": (resp * (prompt + resp / 2.0)).sum(),
        "prompt_sq": (prompt * prompt / 2.0).sum(),
    }


def token_stats(comps: dict) -> dict[str, float]:
    out = _token_stats(comps["versions_BxR"], comps["response_mask_BxR"], comps["segment_ids_BxS"])
    return {k: float(v) for k, v in jax.device_get(out).items()}


def assert_staleness(stats: dict, step: int, k: int) -> None:
    """Every consumed token was produced by weights version >= step - k (the staleness/*
    metrics come from rl.batch_metrics)."""
    if stats["resp"] and step - stats["min_version"] > k:
        raise StalenessError(
            f"step {step} consumed tokens of weights version {int(stats['min_version'])}: "
            f"staleness {int(step - stats['min_version'])} exceeds k={k}"
        )


def generation_flops(cfg, stats: dict) -> float:
    """Sampling: the body and the head per generated token, the prompt once per group through the
    body (its logits are not needed), attention over each token's context (shapes/flops.Dims)."""
    d = Dims.of(cfg.model)
    return float(
        d.forward(stats["resp"], stats["resp"], stats["resp_ctx"]) + d.body_flops * stats["prompt"] / cfg.rl.group_size
    )


def pass_flops(m, stats: dict, group_size: int, *, logits: bool = True) -> float:
    """One forward pass of model `m` over the batch's real tokens: the body on every response
    token and on each group's shared prompt once, the LM head only where a response token is
    scored (prompt logits are never needed; none for a value model), attention causal (the
    prompt's own pairs once per group, each response token over its prompt and predecessors)."""
    tokens = stats["resp"] + stats["prompt"] / group_size
    pairs = stats["resp_ctx"] + stats["prompt_sq"] / group_size
    return float(Dims.of(m).forward(tokens, stats["resp"] if logits else 0.0, pairs))


def step_flops(cfg, stats: dict, staleness: int) -> float:
    """The step's useful matmul FLOPs, whatever rewrites ran: generation, the actor update
    (forward + backward = 3 passes), a reference forward when β > 0, for PPO the critic's value
    forward and update (4 passes of the critic, no LM head) unless the backbone is shared (then
    the value head rides on the actor's passes), and the proximal-policy forward only under
    bounded asynchrony (on-policy, the sampler's logprobs serve). Padding, prompt logits, a
    group's prompt beyond its first copy and passes a rewrite removes are not useful work.
    With one optimizer step per batch (rl.ppo_epochs = rl.minibatches = 1) the update's own forward
    runs at the scoring pass's parameters, so neither the proximal forward nor the critic's values
    forward is needed (graph passes proximal_from_update / values_from_critic_update), whether or
    not the run applies those rewrites: every variant of a workload has the same useful FLOPs.
    `staleness` is the run's bound k (the graph's), which decides whether a proximal forward is
    needed at all."""
    rl = cfg.rl
    one_step = rl.ppo_epochs * rl.minibatches == 1
    actor = pass_flops(cfg.model, stats, rl.group_size)
    flops = generation_flops(cfg, stats) + 3 * rl.ppo_epochs * actor
    flops += actor * (int(rl.kl_coef > 0) + int(staleness > 0 and not one_step))
    if rl.algorithm == "ppo" and not cfg.pipeline.share_actor_critic:
        values = int(not one_step)
        flops += (values + 3 * rl.ppo_epochs) * pass_flops(cfg.critic_model, stats, rl.group_size, logits=False)
    return float(flops)
