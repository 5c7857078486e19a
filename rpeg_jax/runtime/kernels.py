"""The stage kernels: what each RPEG stage kind computes, registered for the compiler.

    registry = default_registry()       # every StageKind bound to its kernel factory
    registry.register(StageKind.REWARD, my_factory, overwrite=True)   # users may replace any

A factory gets its StageEnv (stage, plan entry, ports, the RuntimeContext) and returns a Kernel
`fn(inputs: {port: value}) -> {port: value}`. Device kernels are pure and jitted by the
compiler as one program per (fused) stage; `generate`, `reward` and `weight_sync` are host
kernels (the sampler needs host control; verifiers are Python; resharding is its own program).

Data values (see runtime/rollouts.py): `completions` is a dict of [B, ...] arrays in the rollout
layout (prompts left-padded to P, responses right-padded to R) plus `host_*` metadata; every
per-token output is response-aligned [B, R]. Host kernels also receive `_step` (int) and
`_piece`/`_pieces` from the executor.

Called by: graph/compile.py via runtime/trainer.py.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rpeg_jax.graph.compile import Kernel, KernelRegistry, StageEnv
from rpeg_jax.graph.ir import StageKind
from rpeg_jax.models.logprobs import token_logprobs
from rpeg_jax.rl import (batch_metrics, compute_advantages, grad_dtype, make_actor_critic_update, make_actor_update,
                         make_critic_update)
from rpeg_jax.runtime import rollouts

K = StageKind


def _shifted(tokens_BxS):
    """targets[:, j] = tokens[:, j + 1] (the last column is padding)."""
    return jnp.concatenate([tokens_BxS[:, 1:], jnp.zeros_like(tokens_BxS[:, :1])], axis=1)


def forward_fn(graphdef, *, temperature: float, logp: bool, entropy: bool, values: bool):
    """(params, completions) -> {"logp", "entropy", "values"} over the response window [B, R]."""

    def fn(params, c):
        model = nnx.merge(graphdef, params)
        r = c["response_mask_BxR"].shape[1]
        start = c["tokens_BxS"].shape[1] - r - 1  # column P-1 predicts the first response token
        out = {"logp": None, "entropy": None, "values": None}
        if logp:
            lp, ent, h = token_logprobs(model, c["tokens_BxS"], c["positions_BxS"], c["segment_ids_BxS"],
                                        _shifted(c["tokens_BxS"]), start=start, length=r,
                                        temperature=temperature, with_entropy=entropy, return_hidden=True)
            out.update(logp=lp, entropy=ent)
        else:
            hfull, _ = model.hidden(c["tokens_BxS"], c["positions_BxS"], c["segment_ids_BxS"])
            h = jax.lax.slice_in_dim(hfull, start, start + r, axis=1)
        if values:
            out["values"] = model.values(h)
        return out

    return fn


def _rl_batch(inputs: dict, ports: dict[str, str]) -> dict:
    """The learner's flat batch from stage inputs: completions' arrays + named [B, R] arrays."""
    c = inputs["completions"]
    batch = {k: v for k, v in c.items() if not k.startswith("host_")}
    for port, key in ports.items():
        if port in inputs:
            batch[key] = inputs[port]
    return batch


_BATCH_KEYS = {"old_logp": "old_logp_BxR", "behav_logp": "behav_logp_BxR", "ref_logp": "ref_logp_BxR",
               "values": "values_BxR", "advantages": "advantages_BxR", "returns": "returns_BxR",
               "rewards": "rewards_B"}


# ---- device kernels ---------------------------------------------------------------------------
def ref_forward(env: StageEnv) -> Kernel:
    ctx = env.context
    fwd = forward_fn(ctx.graphdefs["reference"], temperature=ctx.temperature, logp=True, entropy=False,
                     values=False)
    return Kernel(lambda i: {"ref_logp": fwd(i["reference"], i["completions"])["logp"]})


def old_forward(env: StageEnv) -> Kernel:
    """π_old over the batch; with a shared backbone the same pass yields the values."""
    ctx = env.context
    want_values = "values" in env.stage.workload.heads  # a shared backbone (share_actor_critic)
    fwd = forward_fn(ctx.graphdefs["actor"], temperature=ctx.temperature, logp=True, entropy=False,
                     values=want_values)

    def fn(i):
        out = fwd(i["actor"], i["completions"])
        res = {"old_logp": out["logp"]}
        if want_values:
            res["values"] = out["values"]
        return res

    return Kernel(fn)


def critic_forward(env: StageEnv) -> Kernel:
    ctx = env.context
    src = "critic" if env.stage.workload.models[0].role == "critic" else "actor"  # actor: shared backbone
    fwd = forward_fn(ctx.graphdefs[src], temperature=ctx.temperature, logp=False, entropy=False, values=True)
    return Kernel(lambda i: {"values": fwd(i[src], i["completions"])["values"]})


def advantage(env: StageEnv) -> Kernel:
    cfg = env.context.cfg.rl

    def fn(i):
        batch = _rl_batch(i, _BATCH_KEYS)
        out, metrics = compute_advantages(batch, cfg)
        metrics.update(batch_metrics({**batch, **out}, version=i["_step"],
                                     max_response_len=env.context.cfg.rollout.max_new_tokens))
        return {"advantages": out["advantages_BxR"], "returns": out["returns_BxR"], "metrics": metrics}

    return Kernel(fn)


def actor_update(env: StageEnv) -> Kernel:
    ctx = env.context
    shared = bool(env.stage.attrs.get("value_loss")) or any(
        p.attrs.get("value_loss") for p in env.stage.parts)
    rl = ctx.cfg.rl
    fwd = forward_fn(ctx.graphdefs["actor"], temperature=ctx.temperature, logp=True,
                     entropy=rl.entropy_coef > 0, values=shared)
    policy = lambda params, mb: fwd(params, mb)  # noqa: E731  (mb carries the completion arrays)
    make = make_actor_critic_update if shared else make_actor_update
    update = make(policy, ctx.optimizers["actor"], rl, accum_dtype=grad_dtype(ctx.cfg.optim))

    def fn(i):
        batch = _rl_batch(i, _BATCH_KEYS)
        rng = jax.random.fold_in(ctx.update_key, i["_step"])
        params, opt_state, metrics = update(i["actor"], i["actor_opt"], batch, rng)
        return {"actor": params, "actor_opt": opt_state, "metrics": metrics}

    return Kernel(fn, donate=("actor", "actor_opt"))


def critic_update(env: StageEnv) -> Kernel:
    ctx = env.context
    fwd = forward_fn(ctx.graphdefs["critic"], temperature=ctx.temperature, logp=False, entropy=False, values=True)
    update = make_critic_update(lambda params, mb: fwd(params, mb), ctx.optimizers["critic"], ctx.cfg.rl,
                                accum_dtype=grad_dtype((ctx.cfg.critic_optim or ctx.cfg.optim)))

    def fn(i):
        batch = _rl_batch(i, _BATCH_KEYS)
        rng = jax.random.fold_in(ctx.update_key, i["_step"] + 1_000_003)
        params, opt_state, metrics = update(i["critic"], i["critic_opt"], batch, rng)
        return {"critic": params, "critic_opt": opt_state, "metrics": metrics}

    return Kernel(fn, donate=("critic", "critic_opt"))


# ---- host kernels -----------------------------------------------------------------------------
def generate(env: StageEnv) -> Kernel:
    """Sample G completions of each prompt of the step with the weights of version t-k."""
    ctx = env.context
    weights_offset = next(p.offset for p in env.reads if p.node == "rollout_weights")

    def fn(i: dict[str, Any]) -> dict[str, Any]:
        step, piece, pieces = int(i["_step"]), i["_piece"], i["_pieces"]
        version = max(0, step + weights_offset)
        prompts = i["data_iterator"].get(step)
        if "rollout_buffer" in i:
            i["rollout_buffer"].admit(step, version)
        comps, behav, metrics = rollouts.generate_piece(ctx, i["rollout_weights"], version, prompts, step,
                                                        piece, pieces)
        out = {"completions": comps, "behav_logp": behav, "data_iterator": i["data_iterator"], "metrics": metrics}
        if "rollout_buffer" in i:
            out["rollout_buffer"] = i["rollout_buffer"]
        return out

    return Kernel(fn, jittable=False)


def reward(env: StageEnv) -> Kernel:
    ctx = env.context

    def fn(i):
        rewards, metrics = rollouts.score(ctx, i["completions"])
        return {"rewards": rewards, "metrics": metrics}

    return Kernel(fn, jittable=False)


def weight_sync(env: StageEnv) -> Kernel:
    """Training layout -> generation layout (an explicit, cached resharding program)."""
    ctx = env.context

    def fn(i):
        return {"rollout_weights": ctx.to_rollout(i["actor"])}

    return Kernel(fn, jittable=False)


def default_registry() -> KernelRegistry:
    reg = KernelRegistry()
    for kind, factory in ((K.GENERATE, generate), (K.REWARD, reward), (K.REF_FORWARD, ref_forward),
                          (K.OLD_FORWARD, old_forward), (K.CRITIC_FORWARD, critic_forward),
                          (K.ADVANTAGE, advantage), (K.ACTOR_UPDATE, actor_update),
                          (K.CRITIC_UPDATE, critic_update), (K.WEIGHT_SYNC, weight_sync)):
        reg.register(kind, factory)
    return reg
