"""Token statistics of a rollout batch: the staleness check of every consumed token, and the step's
useful FLOPs (perf/flops, perf/mfu) counted with the one FLOP model (shapes/flops.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rpeg_jax.runtime.rollout.prompts import StalenessError
from rpeg_jax.shapes.flops import Dims


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
