"""Where a step's rollout batch comes from: one RolloutSource, chosen once when the run is built
(`make_source`), so the generate stage never branches on the run's settings:

    StepSource        rollout.admission=step: each step (or piece of it) samples its own prompts to
                      completion
    FilteredSource    step admission with DAPO's dynamic sampling (rl.filter_groups): prompts drawn
                      from the stream until a piece's groups have unequal rewards
    ContinuousSource  rollout.admission=continuous: the first groups to complete in an engine that
                      outlives the step (runtime/rollout/continuous.py)

Each returns (completions, behav_logp, metrics) in the rollout layout (runtime/rollout/layout.py)
and talks to generation through the RolloutEngine protocol (runtime/rollout/engine.py), the seam
where multi-turn tool-using episodes and an external engine plug in.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from rpeg_jax.runtime.rollout.continuous import (
    FilterExhausted,
    filter_exhausted_why,
    forced_lengths,
    occupancy,
    rollout_seed,
)
from rpeg_jax.runtime.rollout.layout import HOST_FIELDS, lay_out
from rpeg_jax.runtime.rollout.prompts import StepPrompts
from rpeg_jax.runtime.rollout.scoring import cached_scores, score_group
from rpeg_jax.sampling import SamplingParams


class RolloutSource(Protocol):
    def batch(self, params, version: int, prompts: StepPrompts, step: int, piece: int, pieces: int):
        """Piece `piece` of `pieces` of step `step`'s rollout batch, generated with the weights
        `params` of `version`: (completions, behav_logp, metrics)."""
        ...


def generate_piece(ctx, params, version: int, batch, step: int, piece: int, pieces: int):
    """Sample piece `piece` of step `step` and lay it out; returns (completions, behav_logp, metrics)."""
    n = len(batch.prompt_tokens)
    lo, hi = piece * n // pieces, (piece + 1) * n // pieces
    sampler, cfg = ctx.sampler, ctx.cfg
    if sampler.version != version:
        sampler.update_weights(params, version)
    G = cfg.rl.group_size
    # this process's samples of each prompt: all G, or its part of a group that processes share
    first, n_s = ctx.sample_offset, ctx.samples or G
    sp = SamplingParams.from_rollout(cfg.rollout, n=n_s, seed=rollout_seed(cfg.train.seed, step))
    prompts = [list(p) for p in batch.prompt_tokens[lo:hi]]
    ids = [ctx.prompt_offset + i for i in range(lo, hi)]  # the prompts' indices in the step's whole batch
    lengths = None
    if cfg.rollout.forced_lengths is not None:  # the same draw as continuous admission's first attempt
        draw = forced_lengths(cfg.rollout.forced_lengths, cfg.train.seed, G)
        lengths = [draw(step, i, 0)[first : first + n_s] for i in ids]
    before = sampler.stats()
    t0 = time.perf_counter()
    outs = sampler.generate(prompts, sp, prompt_ids=ids, lengths=lengths, sample_offset=first)
    gen_s = time.perf_counter() - t0
    done = [(o.prompt_tokens, c) for o in outs for c in o.completions]
    rows = [(p, c.tokens, c.logprobs, c.policy_versions) for p, c in done]
    gids = np.repeat(np.array(ids, dtype=np.int32), n_s)  # a shared group's rows: one id on every process
    host = {k: [getattr(batch, a)[i] for i in range(lo, hi)] for k, a in HOST_FIELDS}
    comps, behav, new_tokens = lay_out(ctx, rows, gids, host, _experts([c for _, c in done]))
    preempt = np.array([sum(c.num_preemptions for _, c in done)], np.float64)
    if ctx.placement.gen_count > 1:  # the run's count: every generating process's sampler
        preempt = np.asarray(ctx.placement.gen_allgather(preempt)).sum(axis=0)
    metrics = {
        "perf/gen_tokens_per_s": new_tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/preemptions": float(preempt[0]),
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
    n = cfg.data.prompts_per_step // ctx.placement.gen_count  # this process's groups per step
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
                f"step {step + 1}: rl.filter_groups={cfg.rl.filter_groups} kept {len(kept)} of {hi - lo} groups after "
                f"rl.filter_max_rounds={max_rounds} generation rounds ({filtered} groups had equal rewards); raise "
                f"rl.filter_max_rounds (0 = unbounded) or use prompts the policy neither always solves nor always fails"
            )
        drawn = prompts.draw(hi - lo - len(kept))
        sp = SamplingParams.from_rollout(cfg.rollout, n=G, seed=rollout_seed(cfg.train.seed + 7919 * rounds, step))
        lengths = None if draw_len is None else [draw_len(d, ctx.prompt_offset + i, 0) for d, i, _ in drawn]
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
    comps, behav, _ = lay_out(ctx, rows, gids, host, _experts([c for _, cs, *_ in kept for c in cs]))
    comps.update(cached_scores([(r, e, c) for *_, r, e, c in kept]))
    metrics = {
        "perf/gen_tokens_per_s": new_tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/preemptions": float(preempt),
        "rollout/weights_version": float(version),
        "rollout/occupancy": occupancy(before, sampler.stats()),
        "rollout/filtered_groups": float(prompts.filtered[step]),  # the step's total so far (pieces add up)
        "rollout/filter_rounds": float(rounds),
    }
    return comps, behav, metrics


def continuous_batch(ctx, params, version: int, prompts, step: int):
    """Step `step`'s batch from the engine that outlives the step (runtime/rollout/continuous.py): the first
    groups to complete that meet the staleness bound; returns (completions, behav_logp, metrics)."""
    engine = ctx.engine
    nproc, me = ctx.placement.gen_count, ctx.placement.gen_rank
    t0 = time.perf_counter()
    try:
        groups, st = engine.next_batch(step, version, params, prompts)
        exhausted = None
    except FilterExhausted as e:
        exhausted = e
    if engine.scorer is not None and nproc > 1:
        # dynamic sampling ran out on one process's shard: every generating process learns it and ends
        # the run with the same line (one flag per process; the engines take no collective while decoding)
        flags = np.asarray(ctx.placement.gen_allgather(np.int32(exhausted is not None))).reshape(-1)
        if flags.any():
            who = [ctx.placement.gen_procs[i] for i in np.flatnonzero(flags)]
            raise FilterExhausted(
                f"step {step + 1}: on process{'es' if len(who) > 1 else ''} {', '.join(map(str, who))}: "
                f"{filter_exhausted_why(engine.max_filtered)}"
            )
    if exhausted is not None:
        raise exhausted
    gen_s = time.perf_counter() - t0
    G = ctx.cfg.rl.group_size
    # group ids unique over the generating processes (each one's engine numbers its own groups): gid * P + rank
    gids = np.repeat(np.array([g.gid * nproc + me for g in groups], np.int32), G)
    host = {k: [g.host[k] for g in groups] for k, _ in HOST_FIELDS}
    env_metrics = {}
    if engine.runner is not None:  # episodes: rows of every token after the prompt, observations masked
        eps = [e for g in groups for e in g.eps]
        seqs = []
        # (an episode cut by the budget may end with an observation past rollout.max_new_tokens: every
        # token there is an observation, masked, attended by no trained token, so the rows stop at the cap)
        cap = ctx.cfg.rollout.max_new_tokens
        rows = [(e.session.prompt_ids, e.session.response_ids()[:cap], e.logprobs[:cap], e.versions[:cap]) for e in eps]
        comps, behav, _ = lay_out(ctx, rows, gids, host)
        mask = np.zeros(comps["host_mask"].shape, np.float32)
        for b, e in enumerate(eps):
            m = e.session.response_mask()[:cap]
            assert sum(m) == sum(e.session.response_mask()), "sampled tokens past the episode's budget"
            mask[b, : len(m)] = m
        comps["response_mask_BxR"] = ctx.placement.put_batch(mask)
        comps["host_mask"] = mask
        new_tokens = int(mask.sum())
        rewards = np.array([e.session.total_reward for e in eps], np.float32)
        errors = sum(int(e.session.stats.errors.get("env_exception", 0)) for e in eps)
        cut = np.array([e.truncated or bool(e.session.stats.truncated) for e in eps])
        comps.update(cached_scores([(rewards, errors, cut)]))
        env_metrics = engine.runner.metrics([e.session.stats for e in eps])
    else:
        seqs = [(g.prompt, s) for g in groups for s in sorted(g.seqs, key=lambda s: s.sample_index)]
        rows = [(p, s.tokens, s.logprobs, s.versions) for p, s in seqs]
        records = [engine.sampler.experts_of(s) for _, s in seqs]
        comps, behav, new_tokens = lay_out(ctx, rows, gids, host, None if records[0] is None else records)
    if engine.scorer is not None:  # dynamic sampling scored every group as it completed
        comps.update(cached_scores([g.scores for g in groups]))
    counts = np.array(
        [
            sum(s.preemptions for _, s in seqs),
            st.requeued,
            st.dropped,
            engine.in_flight_sequences(),
            st.filtered,
            st.decode_steps,
            st.occupancy,
        ],
        np.float64,
    )
    if nproc > 1:  # the run's counts: every process's engine (sums; decode steps: the longest; occupancy: mean)
        every = np.asarray(ctx.placement.gen_allgather(counts)).reshape(nproc, -1)
        counts = np.concatenate([every[:, :5].sum(axis=0), every[:, 5:6].max(axis=0), every[:, 6:].mean(axis=0)])
    metrics = {
        "perf/gen_tokens_per_s": new_tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/preemptions": float(counts[0]),
        "rollout/weights_version": float(version),
        "rollout/occupancy": float(counts[6]),
        "rollout/requeued": float(counts[1]),
        "rollout/dropped": float(counts[2]),
        "rollout/in_flight": float(counts[3]),
        "rollout/decode_steps": float(counts[5]),
    }
    if engine.scorer is not None:
        metrics["rollout/filtered_groups"] = float(counts[4])
    metrics.update(env_metrics)
    return comps, behav, metrics


class StepSource:
    def __init__(self, ctx):
        self.ctx = ctx

    def batch(self, params, version, prompts, step, piece, pieces):
        return generate_piece(self.ctx, params, version, prompts.get(step), step, piece, pieces)


class FilteredSource:
    def __init__(self, ctx):
        self.ctx = ctx

    def batch(self, params, version, prompts, step, piece, pieces):
        return filtered_piece(self.ctx, params, version, prompts, step, piece, pieces)


class ContinuousSource:
    def __init__(self, ctx):
        self.ctx = ctx

    def batch(self, params, version, prompts, step, piece, pieces):
        return continuous_batch(self.ctx, params, version, prompts, step)


def make_source(ctx, runner=None) -> RolloutSource:
    """The run's rollout source (module docstring), from its context: the continuous engine when it
    has one, dynamic sampling under step admission, else plain step admission."""
    if ctx.engine is not None:  # (episodes too: the engine has the runner)
        return ContinuousSource(ctx)
    if ctx.cfg.env.name != "single_turn":
        from rpeg_jax.runtime.rollout.episodes import EpisodeSource  # step admission

        return EpisodeSource(ctx, runner)
    if ctx.cfg.rl.filter_groups != "none":
        return FilteredSource(ctx)
    return StepSource(ctx)


def _experts(completions) -> list | None:
    """The completions' expert records (a MoE model's sampler), or None."""
    return None if completions[0].experts is None else [c.experts for c in completions]
