"""The stage kernels: what each RPEG stage kind computes, registered for the compiler.

    registry = default_registry()       # every StageKind bound to its kernel factory
    registry.register(StageKind.REWARD, my_factory, overwrite=True)   # users may replace any

A factory gets its StageEnv (stage, plan entry, ports, the RuntimeContext) and returns a Kernel
`fn(inputs: {port: value}) -> {port: value}`. Device kernels are pure and jitted by the
compiler as one program per (fused) stage; `generate`, `reward` and `weight_sync` are host
kernels (the sampler needs host control; verifiers are Python; resharding is its own program).

Data values (see runtime/rollout/layout.py): `completions` is a dict of [B, ...] arrays in the rollout
layout (prompts left-padded to P, responses right-padded to R) plus `host_*` metadata; every
per-token output is response-aligned [B, R]. Host kernels also receive `_step` (int) and
`_piece`/`_pieces` from the executor.

Forward passes (scoring and updates) run each group's shared prompt once when the batch allows it
(`shared_prompt_groups`: rows in whole groups of rl.group_size, whole groups on every device, no
explicit mesh axes on the batch); the update then shuffles and splits whole groups. Same values to float32 rounding.
The scoring forwards (ref / old / critic) run in rl.forward_micro_batches pieces when asked
(`scoring_fn`: a loop inside the one program, pieces spread over all devices, same values).
With train.pack_sequences every forward runs packed rows instead (runtime/packed_forward.py), the
plan made by the stage's host step (`Kernel.prepare`: `_pack_prepare`, `_forward_pack_prepare`).

One-step rewrites (graph/passes.py): an actor update with options.proximal_from_update takes π_old
from its own forward; a fused advantage+critic_update (or advantage+actor_update on a shared
backbone) with options.values_from_update is one dedicated program: the update's forward gives the values, GAE
runs inside it, and the advantage stage's outputs and metrics come from those values.

Called by: graph/compile.py via runtime/trainer.py.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rpeg_jax.config.base import ConfigError
from rpeg_jax.graph.compile import Kernel, KernelRegistry, StageEnv
from rpeg_jax.graph.ir import StageKind
from rpeg_jax.models import adapters
from rpeg_jax.models.logprobs import chunked_logprobs, token_logprobs
from rpeg_jax.models.prefix import group_hidden, group_token_logprobs
from rpeg_jax.rl import (
    batch_metrics,
    compute_advantages,
    grad_dtype,
    make_actor_critic_update,
    make_actor_update,
    make_critic_update,
    make_critic_values_update,
    overlong_mask,
    packing,
)
from rpeg_jax.rl.layout import merge_rows, split_tree
from rpeg_jax.runtime.packed_forward import packed_forward_fn
from rpeg_jax.runtime.rollout import scoring
from rpeg_jax.runtime.routing import EXPERTS, router_stats
from rpeg_jax.shapes.packing import prompt_groups_fit
from rpeg_jax.sharding.axes import explicit_spec

K = StageKind


def _shifted(tokens_BxS):
    """targets[:, j] = tokens[:, j + 1] (the last column is padding)."""
    return jnp.concatenate([tokens_BxS[:, 1:], jnp.zeros_like(tokens_BxS[:, :1])], axis=1)


def shared_prompt_groups(c: dict, group_size: int, pieces: int = 1, devices: int = 1) -> int:
    """The group size to run the prompt once per group with (models/prefix.py), or 1 (plain pass).

    Sharing needs groups of G >= 2 consecutive rows (the rollout layout), >= 2 response columns,
    every one of the `pieces` (minibatches x micro-batches) made of whole groups, and as many
    groups per piece as a multiple of the stage's `devices`, so that each device's rows are whole
    groups and regrouping moves no rows between devices; a batch with explicit mesh axes (sharding
    in types) keeps the plain pass."""
    tokens, r = c["tokens_BxS"], c["response_mask_BxR"].shape[1]
    b = tokens.shape[0]
    if EXPERTS in c:  # a MoE rollout: the plain pass carries the routing (replay, aux loss, agreement)
        return 1
    if not prompt_groups_fit(b, group_size, pieces, devices):
        return 1
    if r < 2 or tokens.shape[1] <= r or explicit_spec(tokens) is not None:
        return 1
    return group_size


def forward_fn(
    graphdef,
    *,
    temperature: float,
    logp: bool,
    entropy: bool,
    values: bool,
    group_size: int = 1,
    routing: str = "recompute",
    router: bool = False,
):
    """(params, completions) -> {"logp", "entropy", "values"} over the response window [B, R].

    group_size > 1: the rows come in groups of that many responses to one prompt, and the
    prompt runs once per group (models/prefix.py; the same values to float32 rounding).
    A MoE model (plain pass): routing="replay" imposes the sampler's recorded experts (EXPERTS in
    the completions; rl.routing), and `router` adds {"router": router_stats(...)} (the update)."""

    def fn(params, c):
        model = nnx.merge(graphdef, params)
        r = c["response_mask_BxR"].shape[1]
        start = c["tokens_BxS"].shape[1] - r - 1  # column P-1 predicts the first response token
        args = (model, c["tokens_BxS"], c["positions_BxS"], c["segment_ids_BxS"])
        out = {"logp": None, "entropy": None, "values": None}
        if any(model.cfg.sparse_layers) and group_size == 1:
            forced = c.get(EXPERTS) if routing == "replay" else None
            hfull, _, route = model.hidden_routed(*args[1:], experts_BxTxSxK=forced)
            h = jax.lax.slice_in_dim(hfull, start, start + r, axis=1)
            if logp:
                tg = jax.lax.slice_in_dim(_shifted(c["tokens_BxS"]), start, start + r, axis=1)
                lp, ent = chunked_logprobs(h, model.output_matrix(), tg, temperature=temperature, with_entropy=entropy)
                out.update(logp=lp, entropy=ent)
            if router:
                out["router"] = router_stats(route, c, model.cfg.num_experts_per_tok)
        elif logp and group_size > 1:
            lp, ent, h = group_token_logprobs(
                *args,
                response_len=r,
                group_size=group_size,
                temperature=temperature,
                with_entropy=entropy,
                return_hidden=True,
            )
            out.update(logp=lp, entropy=ent)
        elif logp:
            lp, ent, h = token_logprobs(
                *args,
                _shifted(c["tokens_BxS"]),
                start=start,
                length=r,
                temperature=temperature,
                with_entropy=entropy,
                return_hidden=True,
            )
            out.update(logp=lp, entropy=ent)
        elif group_size > 1:
            h, _ = group_hidden(*args, response_len=r, group_size=group_size)
        else:
            hfull, _ = model.hidden(*args[1:])
            h = jax.lax.slice_in_dim(hfull, start, start + r, axis=1)
        if values:
            out["values"] = model.values(h)
        return out

    return fn


def _devices(env: StageEnv) -> int:
    return math.prod(env.plan.mesh.values()) if env.plan.mesh else 1


def forward_micro_batches(env: StageEnv) -> int:
    """rl.forward_micro_batches for a scoring stage, checked against its plan entry before anything
    compiles: each of the stage's pieces (pipeline.pieces) must split into that many
    micro-batches with the same number of rows on every device of its batch axes (data x fsdp)."""
    n = env.context.cfg.rl.forward_micro_batches
    if n == 1:
        return 1
    cfg = env.context.cfg
    rows = cfg.data.prompts_per_step * cfg.rl.group_size // max(env.plan.pieces, 1)
    shards = env.plan.mesh.get("data", 1) * env.plan.mesh.get("fsdp", 1)
    if rows % (n * shards):
        raise ConfigError(
            "rl.forward_micro_batches",
            n,
            f"stage {env.stage.name!r} scores {rows} sequences over data x fsdp = {shards} devices "
            f"({rows / shards:g} per device), which do not split into {n} equal micro-batches",
        )
    return n


def scoring_fn(graphdef, group_size: int, devices: int, micro: int = 1, **kw):
    """A forward pass over the whole batch, sharing each group's prompt when the batch allows it.

    micro > 1 (rl.forward_micro_batches): the batch is split into `micro` strided pieces (whole
    groups when the prompt is shared; each piece spread over every device, rl.layout.split_tree),
    run one after the other in a loop (lax.map: one piece's activations live at a time), and
    the per-row outputs are put back in batch order. Every row's values are those of the single pass.

    With a packing plan (train.pack_sequences: `pack`, rl/packing.forward_plan, leading [micro])
    each piece is a row split (packed passes share no prompts) run as its plan's packed rows
    (runtime/packed_forward.py); the outputs are 0 at response cells without a real token."""
    fwds = {}

    def fn(params, c, pack=None):
        g = 1 if pack is not None else shared_prompt_groups(c, group_size, micro, devices)
        if (g, pack is None) not in fwds:
            fwds[g, pack is None] = (
                forward_fn(graphdef, group_size=g, **kw) if pack is None else packed_forward_fn(graphdef, **kw)
            )
        fwd = fwds[g, pack is None]
        if micro == 1:
            return fwd(params, c if pack is None else {**c, packing.PLAN_KEY: jax.tree.map(lambda p: p[0], pack)})
        pieces = split_tree(c, micro, g)
        if pack is not None:
            pieces[packing.PLAN_KEY] = pack
        out = jax.lax.map(lambda piece: fwd(params, piece), pieces)
        return jax.tree.map(lambda y: merge_rows(y, g), out)

    return fn


FORWARD_PACK = "_pack_forward"  # the scoring stages' input port carrying their packing plan


def _forward_pack_prepare(env: StageEnv):
    """train.pack_sequences: a scoring stage's host step, its packing plan (rl/packing.forward_plan)
    from the batch's segment ids, as input FORWARD_PACK (the parts of a fused forwards stage each
    make the same one)."""
    if not env.context.cfg.train.pack_sequences:
        return None
    micro, devices = forward_micro_batches(env), _devices(env)
    return lambda i: {FORWARD_PACK: packing.forward_plan(i["completions"], micro, devices)}


def _scoring_kernel(env: StageEnv, fn) -> Kernel:
    """Kernel(fn) with the packing host step; fn's outputs get perf/<stage>_pack_fill and _pack_rows."""

    def with_metrics(i):
        out = fn(i)
        if FORWARD_PACK in i:
            out["metrics"] = packing.plan_metrics(i[FORWARD_PACK], env.stage.name)
        return out

    return Kernel(with_metrics, prepare=_forward_pack_prepare(env))


def actor_params(i: dict, node: str = "actor"):
    """A stage's actor params for the actor's graphdef: with model.lora the frozen base (the runtime's
    extra input adapters.BASE_PORT) joined with the adapters the "actor" state holds."""
    if node == "actor" and adapters.BASE_PORT in i:
        return adapters.join(i[adapters.BASE_PORT], i["actor"])
    return i[node]


def _rl_batch(inputs: dict, ports: dict[str, str]) -> dict:
    """The learner's flat batch from stage inputs: completions' arrays + named [B, R] arrays."""
    c = inputs["completions"]
    batch = {k: v for k, v in c.items() if not k.startswith("host_")}
    for port, key in ports.items():
        if port in inputs:
            batch[key] = inputs[port]
    return batch


_BATCH_KEYS = {
    "old_logp": "old_logp_BxR",
    "behav_logp": "behav_logp_BxR",
    "ref_logp": "ref_logp_BxR",
    "values": "values_BxR",
    "advantages": "advantages_BxR",
    "returns": "returns_BxR",
    "rewards": "rewards_B",
}


def _actor_batch(inputs: dict, ctx) -> dict:
    """The actor update's batch; with rl.overlong=mask truncated responses leave the policy loss
    (rl.losses.overlong_mask on the response mask the update aggregates over)."""
    batch = _rl_batch(inputs, _BATCH_KEYS)
    if ctx.cfg.rl.overlong == "mask":
        r = batch["response_mask_BxR"].shape[1]
        batch["response_mask_BxR"], _ = overlong_mask(
            batch["tokens_BxS"][:, -r:],
            batch["response_mask_BxR"],
            ctx.cfg.rollout.max_new_tokens,
            scoring.stop_ids(ctx.cfg),
        )
    return batch


# ---- device kernels ---------------------------------------------------------------------------
def ref_forward(env: StageEnv) -> Kernel:
    ctx = env.context
    fwd = scoring_fn(
        ctx.graphdefs["reference"],
        ctx.cfg.rl.group_size,
        _devices(env),
        forward_micro_batches(env),
        temperature=ctx.temperature,
        logp=True,
        entropy=False,
        values=False,
        routing=ctx.cfg.rl.routing,
    )
    # train.offload=optimizer+reference: the weights come in from host memory inside this program
    return _scoring_kernel(
        env,
        lambda i: {
            "ref_logp": fwd(ctx.offload.fetch("reference", i["reference"]), i["completions"], i.get(FORWARD_PACK))[
                "logp"
            ]
        },
    )


def old_forward(env: StageEnv) -> Kernel:
    """π_old over the batch; with a shared backbone the same pass yields the values."""
    ctx = env.context
    want_values = "values" in env.stage.workload.heads  # a shared backbone (share_actor_critic)
    fwd = scoring_fn(
        ctx.graphdefs["actor"],
        ctx.cfg.rl.group_size,
        _devices(env),
        forward_micro_batches(env),
        temperature=ctx.temperature,
        logp=True,
        entropy=False,
        values=want_values,
        routing=ctx.cfg.rl.routing,
    )

    def fn(i):
        out = fwd(actor_params(i), i["completions"], i.get(FORWARD_PACK))
        res = {"old_logp": out["logp"]}
        if want_values:
            res["values"] = out["values"]
        return res

    return _scoring_kernel(env, fn)


def critic_forward(env: StageEnv) -> Kernel:
    ctx = env.context
    src = "critic" if env.stage.workload.models[0].role == "critic" else "actor"  # actor: shared backbone
    fwd = scoring_fn(
        ctx.graphdefs[src],
        ctx.cfg.rl.group_size,
        _devices(env),
        forward_micro_batches(env),
        temperature=ctx.temperature,
        logp=False,
        entropy=False,
        values=True,
        routing=ctx.cfg.rl.routing,
    )
    return _scoring_kernel(
        env, lambda i: {"values": fwd(actor_params(i, src), i["completions"], i.get(FORWARD_PACK))["values"]}
    )


def _advantages(batch: dict, ctx, step):
    out, metrics = compute_advantages(batch, ctx.cfg.rl)
    metrics.update(batch_metrics({**batch, **out}, version=step, max_response_len=ctx.cfg.rollout.max_new_tokens))
    return out, metrics


def advantage(env: StageEnv) -> Kernel:
    def fn(i):
        out, metrics = _advantages(_rl_batch(i, _BATCH_KEYS), env.context, i["_step"])
        return {"advantages": out["advantages_BxR"], "returns": out["returns_BxR"], "metrics": metrics}

    return Kernel(fn)


def _grouped_update(make, graphdef, optimizer, ctx, accum_dtype, devices, make_kw=None, **fwd_kw):
    """update(params, opt_state, batch, rng, pack=None) that shares each group's prompt in its
    forward passes when the batch's minibatches and micro-batches split into whole groups (decided
    per batch shape while tracing; the forward and the update's shuffles agree on it). With a
    packing plan (train.pack_sequences, `_pack_prepare`) the forward runs packed rows instead and
    the shuffles and splits stay those of the unpacked update.

    base (model.lora): the frozen base params; `params` are then the adapters, the only parameters
    differentiated and updated (the forward joins them with the base: models/adapters.py)."""
    rl = ctx.cfg.rl
    updates = {}

    def update(params, opt_state, batch, rng, pack=None, base=None):
        g = shared_prompt_groups(batch, rl.group_size, rl.minibatches * rl.micro_batches, devices)
        if base is not None or (g, pack is None) not in updates:
            if pack is None:
                fwd = forward_fn(graphdef, temperature=ctx.temperature, group_size=g, **fwd_kw)
            else:
                fwd = packed_forward_fn(graphdef, temperature=ctx.temperature, **fwd_kw)
            if base is None:
                policy = lambda params, mb, fwd=fwd: fwd(params, mb)  # noqa: E731
            else:  # built per trace: it closes over this trace's base
                policy = lambda params, mb, fwd=fwd: fwd(adapters.join(base, params), mb)  # noqa: E731
            built = make(policy, optimizer, rl, accum_dtype=accum_dtype, group_size=g, **(make_kw or {}))
            if base is not None:
                return built(params, opt_state, batch, rng, pack)
            updates[g, pack is None] = built
        return updates[g, pack is None](params, opt_state, batch, rng, pack)

    return update


def _pack_prepare(env: StageEnv, port: str, rng_of):
    """train.pack_sequences: the update's host step, its packing plan (rl/packing.py) from the
    batch's segment ids, as input `port`; rng_of(inputs): the key the update shuffles with."""
    ctx = env.context
    if not ctx.cfg.train.pack_sequences:
        return None
    rl, devices = ctx.cfg.rl, _devices(env)

    def prepare(i):
        c = i["completions"]
        g = shared_prompt_groups(c, rl.group_size, rl.minibatches * rl.micro_batches, devices)
        return {port: packing.stage_plan(c, rl, g, rng_of(i), devices)}

    return prepare


def actor_update(env: StageEnv) -> Kernel:
    ctx = env.context
    opts = env.stage.effective_options
    shared = opts.value_loss
    proximal = opts.proximal_from_update  # graph pass proximal_from_update: π_old = sg(own logp)
    rl = ctx.cfg.rl
    make = make_actor_critic_update if shared else make_actor_update
    update = _grouped_update(
        make,
        ctx.graphdefs["actor"],
        ctx.optimizers["actor"],
        ctx,
        grad_dtype(ctx.cfg.optim),
        _devices(env),
        make_kw={"proximal_from_update": proximal, "opt_memory": ctx.offload.memory("actor_opt")},
        logp=True,
        entropy=rl.entropy_coef > 0,
        values=shared,
        routing=rl.routing,
        router=True,
    )

    rng_of = lambda i: jax.random.fold_in(ctx.update_key, i["_step"])  # noqa: E731

    def fn(i):
        batch = _actor_batch(i, ctx)
        params, opt_state, metrics = update(
            i["actor"], i["actor_opt"], batch, rng_of(i), i.get("_pack_actor"), i.get(adapters.BASE_PORT)
        )
        metrics.update(packing.plan_metrics(i.get("_pack_actor"), "actor"))
        return {"actor": params, "actor_opt": opt_state, "metrics": metrics}

    return Kernel(fn, donate=("actor", "actor_opt"), prepare=_pack_prepare(env, "_pack_actor", rng_of))


def _critic_updater(make, env: StageEnv):
    """The critic's grouped update built by `make` (make_critic_update / make_critic_values_update)."""
    ctx = env.context
    return _grouped_update(
        make,
        ctx.graphdefs["critic"],
        ctx.optimizers["critic"],
        ctx,
        grad_dtype(ctx.cfg.critic_optim or ctx.cfg.optim),
        _devices(env),
        make_kw={"opt_memory": ctx.offload.memory("critic_opt")},
        logp=False,
        entropy=False,
        values=True,
        routing=ctx.cfg.rl.routing,
    )


def critic_update(env: StageEnv) -> Kernel:
    ctx = env.context
    update = _critic_updater(make_critic_update, env)

    rng_of = lambda i: jax.random.fold_in(ctx.update_key, i["_step"] + 1_000_003)  # noqa: E731

    def fn(i):
        batch = _rl_batch(i, _BATCH_KEYS)
        params, opt_state, metrics = update(i["critic"], i["critic_opt"], batch, rng_of(i), i.get("_pack_critic"))
        metrics.update(packing.plan_metrics(i.get("_pack_critic"), "critic"))
        return {"critic": params, "critic_opt": opt_state, "metrics": metrics}

    return Kernel(fn, donate=("critic", "critic_opt"), prepare=_pack_prepare(env, "_pack_critic", rng_of))


def critic_values_update(env: StageEnv) -> Kernel | None:
    """advantage+critic_update after values_from_critic_update: ONE program in which the critic's
    forward gives V_old = sg(V) (its one optimizer step runs at φ_t, where critic_forward ran), the
    value loss uses GAE returns from them, and the advantages (GAE, whitened if asked, exactly as
    the advantage stage) go to the actor update. None (compose the parts) for a plain fusion."""
    if not env.stage.options.values_from_update:
        return None
    ctx = env.context
    update = _critic_updater(make_critic_values_update, env)

    def fn(i):
        batch = _rl_batch(i, _BATCH_KEYS)
        params, opt_state, metrics, rows = update(i["critic"], i["critic_opt"], batch, None, i.get("_pack_critic"))
        out, adv_metrics = _advantages({**batch, **rows}, ctx, i["_step"])
        return {
            "critic": params,
            "critic_opt": opt_state,
            "advantages": out["advantages_BxR"],
            "metrics": {**adv_metrics, **metrics},
        }

    return Kernel(fn, donate=("critic", "critic_opt"), prepare=_pack_prepare(env, "_pack_critic", lambda i: None))


def shared_values_update(env: StageEnv) -> Kernel | None:
    """advantage+actor_update after values_from_critic_update on a shared backbone: the shared
    update's forward gives the values, its loss computes the advantages and returns from them
    (rl.update.make_actor_critic_update(values_from_update=True)); the advantage stage's metrics
    come from the values it returns. None (compose the parts) for the plain fuse=advantage."""
    if not env.stage.options.values_from_update:
        return None
    ctx = env.context
    kw = {
        "proximal_from_update": env.stage.effective_options.proximal_from_update,
        "values_from_update": True,
        "opt_memory": ctx.offload.memory("actor_opt"),
    }
    update = _grouped_update(
        make_actor_critic_update,
        ctx.graphdefs["actor"],
        ctx.optimizers["actor"],
        ctx,
        grad_dtype(ctx.cfg.optim),
        _devices(env),
        make_kw=kw,
        logp=True,
        entropy=ctx.cfg.rl.entropy_coef > 0,
        values=True,
        routing=ctx.cfg.rl.routing,
        router=True,
    )

    def fn(i):
        batch = _actor_batch(i, ctx)
        params, opt_state, metrics, rows = update(i["actor"], i["actor_opt"], batch, None, i.get("_pack_actor"))
        _, adv_metrics = _advantages({**batch, **rows}, ctx, i["_step"])
        return {"actor": params, "actor_opt": opt_state, "metrics": {**adv_metrics, **metrics}}

    return Kernel(fn, donate=("actor", "actor_opt"), prepare=_pack_prepare(env, "_pack_actor", lambda i: None))


# ---- host kernels -----------------------------------------------------------------------------
def generate(env: StageEnv) -> Kernel:
    """Sample G completions of each prompt of the step with the weights of version t - ahead; under
    continuous admission, the first groups to complete in the engine that outlives the step."""
    ctx = env.context
    weights_offset = next(p.offset for p in env.reads if p.node == "rollout_weights")

    def fn(i: dict[str, Any]) -> dict[str, Any]:
        step, piece, pieces = int(i["_step"]), i["_piece"], i["_pieces"]
        version = max(0, step + weights_offset)
        if "rollout_buffer" in i:
            i["rollout_buffer"].admit(step, version)
        comps, behav, metrics = ctx.rollout.batch(
            i["rollout_weights"], version, i["data_iterator"], step, piece, pieces
        )
        out = {"completions": comps, "behav_logp": behav, "data_iterator": i["data_iterator"], "metrics": metrics}
        if "rollout_buffer" in i:
            out["rollout_buffer"] = i["rollout_buffer"]
        return out

    return Kernel(fn, jittable=False)


def reward(env: StageEnv) -> Kernel:
    ctx = env.context

    def fn(i):
        rewards, metrics = scoring.score(ctx, i["completions"])
        return {"rewards": rewards, "metrics": metrics}

    return Kernel(fn, jittable=False)


def weight_sync(env: StageEnv) -> Kernel:
    """Training layout -> generation layout (an explicit, cached resharding program); with model.lora
    the adapters are merged into a copy of the base first (W + s A B: the sampler runs a plain model),
    or on disjoint devices only the adapters move and merge there (runtime/setup.AdapterSync)."""
    ctx = env.context

    def fn(i):
        return {"rollout_weights": ctx.rollout_params(i["actor"])}

    return Kernel(fn, jittable=False)


def default_registry() -> KernelRegistry:
    reg = KernelRegistry()
    for kind, factory in (
        (K.GENERATE, generate),
        (K.REWARD, reward),
        (K.REF_FORWARD, ref_forward),
        (K.OLD_FORWARD, old_forward),
        (K.CRITIC_FORWARD, critic_forward),
        (K.ADVANTAGE, advantage),
        (K.ACTOR_UPDATE, actor_update),
        (K.CRITIC_UPDATE, critic_update),
        (K.WEIGHT_SYNC, weight_sync),
    ):
        reg.register(kind, factory)
    reg.register_fused((K.ADVANTAGE, K.CRITIC_UPDATE), critic_values_update)
    reg.register_fused((K.ADVANTAGE, K.ACTOR_UPDATE), shared_values_update)
    return reg
