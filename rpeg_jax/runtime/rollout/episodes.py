"""Rollouts of multi-turn episodes (env.name other than single_turn; issue 32 items 4-5), under step
admission: each piece's prompts run as G episodes each on the streaming sampler
(sampling/episodes.EpisodeDriver: tools on the EnvRunner's bounded pool while the engine decodes the
others). A row's response is every token after the prompt (sampled turns and the observations between
them); response_mask_BxR is 1 on sampled tokens only, so observation tokens are out of the policy loss,
the KL, the entropy and the token-mean normalisers, and their behaviour logprobs are 0 (unused). The
episode's reward (the environment's) rides along in host_rewards; a GRPO group is the G episodes of one
record. rollout.max_new_tokens is the episode's token budget (sampled + observation tokens); an episode
that reaches it is truncated (counted in env/truncated).
"""

from __future__ import annotations

import time

import numpy as np

from rpeg_jax.env.runner import EnvRunner
from rpeg_jax.runtime.rollout.continuous import rollout_seed
from rpeg_jax.runtime.rollout.layout import HOST_FIELDS, lay_out
from rpeg_jax.runtime.rollout.scoring import cached_scores
from rpeg_jax.sampling import SamplingParams
from rpeg_jax.sampling.episodes import EpisodeDriver


class EpisodeSource:
    def __init__(self, ctx, runner: EnvRunner | None = None):
        self.ctx = ctx
        self.runner = runner or EnvRunner.build(ctx.cfg, ctx.tokenizer)

    def batch(self, params, version, prompts, step, piece, pieces):
        ctx, cfg, sampler = self.ctx, self.ctx.cfg, self.ctx.sampler
        batch = prompts.get(step)
        n = len(batch.prompt_tokens)
        lo, hi = piece * n // pieces, (piece + 1) * n // pieces
        if sampler.version != version:
            sampler.update_weights(params, version)
        G = cfg.rl.group_size
        sp = SamplingParams.from_rollout(cfg.rollout, n=G, seed=rollout_seed(cfg.train.seed, step))
        drv = EpisodeDriver(sampler, self.runner, sp, max_total_tokens=cfg.rollout.max_new_tokens)
        self.runner.busy_s(reset=True)
        t0 = time.perf_counter()
        res = drv.run([batch.record(i) for i in range(lo, hi)], group=G)
        gen_s = time.perf_counter() - t0
        rows = [(r.prompt_ids, r.response_ids, r.logprobs, [version] * len(r.response_ids)) for r in res]
        gids = np.repeat(np.arange(lo, hi, dtype=np.int32) + ctx.prompt_offset, G)
        host = {k: [getattr(batch, a)[i] for i in range(lo, hi)] for k, a in HOST_FIELDS}
        comps, behav, _ = lay_out(ctx, rows, gids, host)
        R = comps["host_mask"].shape[1]
        mask = np.zeros((len(res), R), np.float32)
        for b, r in enumerate(res):
            mask[b, : len(r.mask)] = r.mask
        comps["response_mask_BxR"] = ctx.placement.put_batch(mask)
        comps["host_mask"] = mask
        rewards = np.array([r.reward for r in res], np.float32)
        errors = sum(int(r.session.stats.errors.get("env_exception", 0)) for r in res)
        cut = np.array([r.truncated for r in res])
        comps.update(cached_scores([(rewards, errors, cut)]))
        sampled = int(mask.sum())
        metrics = {
            "perf/gen_tokens_per_s": sampled / gen_s if gen_s > 0 else 0.0,
            "rollout/weights_version": float(version),
            "rollout/occupancy": drv.last_stats["occupancy"],
            **self.runner.metrics([r.session.stats for r in res]),
        }
        return comps, behav, metrics
