"""Update steps for the RPEG graph's actor_update / critic_update stages (pure, jit-able).

    update = make_actor_update(policy_fn, optimizer, rl_cfg)          # or critic / actor-critic
    params, opt_state, metrics = jax.jit(update, ...)(params, opt_state, batch, rng)

`policy_fn(params, batch) -> {"logp": [B,R], "entropy": [B,R] | None, "values": [B,R] | None}` is
built by the runtime from the model; this package never sees the model. `batch` is a flat dict
of arrays, each with the leading batch axis B (keys as in the rollout layout of runtime/rollout/layout.py, e.g.
response_mask_BxR, advantages_BxR, old_logp_BxR; anything else policy_fn needs rides along).

One call runs rl.ppo_epochs × rl.minibatches optimizer steps (a per-epoch permutation drawn
from `rng`; None keeps the order; minibatch k of M takes rows k, k+M, k+2M, ... of the
(permuted) batch, see rl.layout.split_rows). With `group_size=G > 1` (the runtime passes it when
the forward runs each group's prompt once) the batch holds groups of G consecutive rows, and the
shuffles and splits move whole groups (rl.layout.split_groups). Each optimizer step sums the
gradients of rl.micro_batches micro-batches (lax.scan); the loss weights are fixed over the
minibatch (rl.losses.agg_weights), so accumulation equals the big-batch gradient.
Sequence packing (train.pack_sequences): `update(..., pack=rl.packing.update_plan(...))` takes
each epoch's row order from the plan (drawn on the host from the same key, so the same as without
it) and hands each micro-batch its packing plan under `rl.packing.PLAN_KEY`, for a policy_fn that
runs the packed forward (runtime/packed_forward.py); losses and metrics are computed as without it.
NaN guard: when the loss or the gradient norm of a step is not finite, the step keeps the old params
and optimizer state and is counted in `<prefix>/nan_skipped`; with rl.on_nan=stop,
`<prefix>/nan_stop` is 1 and the runtime must stop the run. A minibatch with no response tokens is
skipped too (`<prefix>/empty_skipped`).
Other metrics are means over the applied steps (NaN if none was applied).

One-step rewrites (graph passes proximal_from_update / values_from_critic_update; need
rl.ppo_epochs = rl.minibatches = 1, else ConfigError): `make_actor_update(...,
proximal_from_update=True)` takes π_old = stop_gradient(logp) of its own forward (no old_logp_BxR
in the batch); `make_critic_values_update` takes V_old = stop_gradient(V) of its own forward,
computes the returns by GAE inside the loss, and also returns those values (for the advantages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from rpeg_jax.config.base import check
from rpeg_jax.config.rl import RLConfig
from rpeg_jax.rl.advantages import compute_advantages
from rpeg_jax.rl.layout import group_permutation, merge_rows, permute_tree, split_tree
from rpeg_jax.rl.losses import actor_objective, agg_weights, critic_objective
from rpeg_jax.rl.masked import masked_count
from rpeg_jax.rl.optimizer import current_lr

MASK = "response_mask_BxR"
ACTOR_KEYS = (MASK, "advantages_BxR", "old_logp_BxR")
CRITIC_KEYS = (MASK, "values_BxR", "returns_BxR")


PLAN_KEY = "_packing"  # the micro-batch entry that carries its packing plan into policy_fn (rl/packing.py)


def check_batch(batch: dict, needs, cfg: RLConfig, stage: str, group_size: int = 1) -> None:
    """Shapes and keys, checked while tracing (before compiling); errors name the field."""
    missing = [k for k in needs if k not in batch]
    if missing:
        raise ValueError(f"{stage}: batch is missing {missing} (has {sorted(batch)})")
    b, r = batch[MASK].shape
    for k, x in batch.items():
        shape = tuple(getattr(x, "shape", ()))
        if not shape or shape[0] != b:
            raise ValueError(f"{stage}: batch[{k!r}] has shape {shape}; every entry needs the leading batch axis B={b}")
        if k.endswith("_BxR") and shape[:2] != (b, r):
            raise ValueError(f"{stage}: batch[{k!r}] has shape {shape}, expected ({b}, {r}) like {MASK}")
    n = cfg.minibatches * cfg.micro_batches
    check(
        b % n == 0,
        "rl.minibatches",
        cfg.minibatches,
        f"a batch of B={b} sequences does not split into rl.minibatches={cfg.minibatches} x "
        f"rl.micro_batches={cfg.micro_batches} equal pieces",
    )
    check(
        group_size == 1 or b % (n * group_size) == 0,
        "rl.group_size",
        group_size,
        f"{stage}: a batch of B={b} rows does not split into {n} pieces of whole groups",
    )


def epoch_order(key, b: int, group_size: int = 1):
    """The row order of one epoch: a permutation of the rows, of whole groups when group_size > 1."""
    return jax.random.permutation(key, b) if group_size == 1 else group_permutation(key, b, group_size)


def _tree_where(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _minibatch_grads(grad_fn, params, mb, cfg: RLConfig, accum_dtype, group_size, rows=False, plan=None):
    """(loss, summed metrics, grads) of one minibatch, accumulated over micro-batches.
    rows: the aux is (metrics, {key: [b, ...]}); the per-row arrays are put back in row order.
    plan: the minibatch's packing plans [micro_batches, ...] (rl/packing.py); each micro-batch
    gets its own under PLAN_KEY."""
    loss_w, tok_w = agg_weights(mb[MASK], cfg.loss_agg, cfg.loss_agg_norm)
    cast = lambda g: jax.tree.map(lambda x: x.astype(accum_dtype), g)  # noqa: E731
    with_plan = lambda m, p: m if p is None else {**m, PLAN_KEY: p}  # noqa: E731
    if cfg.micro_batches == 1:
        first = None if plan is None else jax.tree.map(lambda x: x[0], plan)
        (loss, aux), grads = grad_fn(params, with_plan(mb, first), loss_w, tok_w)
        return loss, aux, cast(grads)

    def body(acc, piece):
        (m, lw, tw), p = piece
        (loss, aux), grads = grad_fn(params, with_plan(m, p), lw, tw)
        return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads), (loss, aux)

    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=accum_dtype), params)
    pieces = (split_tree((mb, loss_w, tok_w), cfg.micro_batches, group_size), plan)
    grads, (losses, auxs) = jax.lax.scan(body, zeros, pieces)
    if rows:
        metrics, per_row = auxs
        return (
            jnp.sum(losses),
            (
                jax.tree.map(lambda x: jnp.sum(x, 0), metrics),
                jax.tree.map(lambda y: merge_rows(y, group_size), per_row),
            ),
            grads,
        )
    return jnp.sum(losses), jax.tree.map(lambda x: jnp.sum(x, 0), auxs), grads


def _summarise(stats, cfg: RLConfig, prefix):
    """Per-step stats [epochs, minibatches] -> scalar metrics (means over applied steps)."""
    ok, finite, empty = (stats.pop(k).reshape(-1) for k in ("ok", "finite", "empty"))
    lr = stats.pop("_lr").reshape(-1)[-1]  # the rate the final state records (its last step's)
    n_ok = jnp.sum(ok.astype(jnp.float32))
    out = {}
    for k, v in stats.items():
        v = v.reshape(-1).astype(jnp.float32)
        total = jnp.sum(jnp.where(ok, v, 0.0))
        out[k] = jnp.where(n_ok > 0, total / jnp.maximum(n_ok, 1.0), jnp.nan)
    nan_skipped = jnp.sum((~finite).astype(jnp.float32))
    out.update(
        {
            f"{prefix}/lr": lr,
            f"{prefix}/updates": n_ok,
            f"{prefix}/nan_skipped": nan_skipped,
            f"{prefix}/empty_skipped": jnp.sum((finite & empty).astype(jnp.float32)),
            f"{prefix}/nan_stop": (nan_skipped > 0).astype(jnp.float32) if cfg.on_nan == "stop" else jnp.float32(0),
        }
    )
    if "actor/pg_clipfrac" in out:
        out["actor/clipfrac"] = out["actor/pg_clipfrac"]
    return out


def check_pack(pack: dict, b: int, cfg: RLConfig) -> dict:
    """A packing plan (rl/packing.update_plan) for this update: leading axes [epochs, minibatches,
    micro_batches] (order_ExB: [epochs, B], the rows' order in each epoch)."""
    pack = dict(pack)
    order = pack["order_ExB"]
    if tuple(order.shape) != (cfg.ppo_epochs, b):
        raise ValueError(f"packing plan: order_ExB has shape {tuple(order.shape)}, expected ({cfg.ppo_epochs}, {b})")
    lead = (cfg.ppo_epochs, cfg.minibatches, cfg.micro_batches)
    for k, v in pack.items():
        if k != "order_ExB" and tuple(v.shape[:3]) != lead:
            raise ValueError(f"packing plan: {k} has shape {tuple(v.shape)}, expected leading axes {lead}")
    return pack


def check_one_step(cfg: RLConfig, what: str) -> None:
    """The one-step rewrites are exact only when the update takes one optimizer step per batch."""
    for name in ("ppo_epochs", "minibatches"):
        v = getattr(cfg, name)
        check(v == 1, f"rl.{name}", v, f"{what} needs one optimizer step per batch (rl.ppo_epochs=1, rl.minibatches=1)")


def make_update(
    loss_fn,
    optimizer: optax.GradientTransformation,
    cfg,
    *,
    prefix: str,
    needs=(MASK,),
    accum_dtype=jnp.float32,
    group_size: int = 1,
    rows: bool = False,
    opt_memory=None,
):
    """Generic update step from `loss_fn(params, mb, loss_w_BxR, tok_w_BxR) -> (loss, metrics)`,
    whose metrics must be additive over micro-batches (sums weighted by tok_w or loss_w).
    group_size > 1: shuffles and splits keep groups of that many consecutive rows together.
    rows=True (one optimizer step only): loss_fn returns (loss, (metrics, {key: [B, ...]})) and
    the update returns those per-row arrays as a 4th output, in batch order; `rng` is not used
    (one step over one minibatch: a shuffle would only reorder the micro-batches of one sum).

    opt_memory=(fetch, park) (train.offload, runtime/offload.py): the optimizer state comes in and
    leaves in host memory. With one optimizer step per call it is fetched after the backward pass,
    right before the optimizer step, and parked right after it (the loops of length 1 are unrolled,
    so no loop carries host memory and XLA may overlap the copy-in with the backward's tail); with
    several it is fetched at the start of the update and parked at its end. Same numerics."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if rows:
        check_one_step(cfg, f"{prefix} update with per-row outputs")
    one = cfg.ppo_epochs * cfg.minibatches == 1
    fetch, park = opt_memory if opt_memory is not None else (None, None)
    inner = opt_memory is not None and one  # transfers around the optimizer step itself
    outer = opt_memory is not None and not one  # around the whole update
    unroll = True if inner else 1

    def step(carry, xs):
        params, opt_state = carry
        mb, plan = xs
        loss, aux, grads = _minibatch_grads(grad_fn, params, mb, cfg, accum_dtype, group_size, rows, plan)
        aux, per_row = aux if rows else (aux, None)
        gnorm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        empty = masked_count(mb[MASK]) == 0
        ok = finite & ~empty
        grads = jax.tree.map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)  # no NaN into Adam moments
        opt_state = fetch(opt_state) if inner else opt_state
        updates, new_state = optimizer.update(grads, opt_state, params)
        new_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_state, opt_state)
        new_params = optax.apply_updates(params, updates)
        kept = _tree_where(ok, new_state, opt_state)
        carry = (_tree_where(ok, new_params, params), park(kept) if inner else kept)
        stats = dict(aux, ok=ok, finite=finite, empty=empty, _lr=current_lr(kept))
        stats.update({f"{prefix}/loss": loss, f"{prefix}/grad_norm": gnorm})
        return carry, (stats, per_row) if rows else stats

    def update(params, opt_state, batch: dict, rng=None, pack=None):
        check_batch(batch, needs, cfg, f"{prefix}_update", group_size)
        b = batch[MASK].shape[0]

        def epoch(carry, xs):
            key, order, plan = xs
            if order is not None:  # the order the plan was made for (the same draw from the same key)
                data = permute_tree(batch, order)
            elif key is None:
                data = batch
            else:
                data = permute_tree(batch, epoch_order(key, b, group_size))
            pieces = (split_tree(data, cfg.minibatches, group_size), plan)
            return jax.lax.scan(step, carry, pieces, unroll=unroll)

        keys = None if rng is None or rows else jax.random.split(rng, cfg.ppo_epochs)
        order = None
        if pack is not None:
            pack = check_pack(pack, b, cfg)
            keys, order = None, pack.pop("order_ExB")
        opt_state = fetch(opt_state) if outer else opt_state
        (params, opt_state), stats = jax.lax.scan(
            epoch, (params, opt_state), (keys, order, pack), length=cfg.ppo_epochs, unroll=unroll
        )
        opt_state = park(opt_state) if outer else opt_state
        if rows:
            stats, per_row = stats
            per_row = jax.tree.map(lambda x: x[0, 0], per_row)  # [epochs=1, minibatches=1, B, ...]
            return params, opt_state, _summarise(dict(stats), cfg, prefix), per_row
        return params, opt_state, _summarise(dict(stats), cfg, prefix)

    return update


def _proximal(out: dict, mb: dict, on: bool) -> dict:
    """proximal_from_update: π_old = π_θ without gradient, from this very forward (one step: θ = θ_t)."""
    return {**mb, "old_logp_BxR": jax.lax.stop_gradient(out["logp"])} if on else mb


def make_actor_update(
    policy_fn,
    optimizer,
    cfg,
    *,
    accum_dtype=jnp.float32,
    group_size: int = 1,
    proximal_from_update: bool = False,
    opt_memory=None,
):
    """Policy update (PPO/GRPO/GSPO surrogate, decoupled/TIS weights, KL and entropy terms)."""
    if proximal_from_update:
        check_one_step(cfg, "pipeline.proximal_from_update")

    def loss_fn(params, mb, loss_w, tok_w):
        out = policy_fn(params, mb)
        return actor_objective(out, _proximal(out, mb, proximal_from_update), cfg, loss_w, tok_w)

    needs = tuple(k for k in ACTOR_KEYS if not (proximal_from_update and k == "old_logp_BxR"))
    return make_update(
        loss_fn,
        optimizer,
        cfg,
        prefix="actor",
        needs=needs,
        accum_dtype=accum_dtype,
        group_size=group_size,
        opt_memory=opt_memory,
    )


def make_critic_update(
    value_fn, optimizer, cfg: RLConfig, *, accum_dtype=jnp.float32, group_size: int = 1, opt_memory=None
):
    """Separate critic: clipped value loss; value_fn(params, batch) -> {"values": [B, R]}."""

    def loss_fn(params, mb, loss_w, tok_w):
        return critic_objective(value_fn(params, mb), mb, cfg, loss_w, tok_w)

    return make_update(
        loss_fn,
        optimizer,
        cfg,
        prefix="critic",
        needs=CRITIC_KEYS,
        accum_dtype=accum_dtype,
        group_size=group_size,
        opt_memory=opt_memory,
    )


def make_critic_values_update(
    value_fn, optimizer, cfg: RLConfig, *, accum_dtype=jnp.float32, group_size: int = 1, opt_memory=None
):
    """values_from_critic_update: the critic's one optimizer step with V_old = stop_gradient(V) of
    its own forward and the returns computed from it by GAE inside the loss (returns are per row
    and never whitened, so each micro-batch computes its own). update(...) -> (params, opt_state,
    metrics, {"values_BxR": V_old in batch order}); the caller computes the advantages from them."""
    check_one_step(cfg, "pipeline.values_from_critic_update")

    def loss_fn(params, mb, loss_w, tok_w):
        out = value_fn(params, mb)
        mb = _own_values(out, mb, cfg)
        loss, metrics = critic_objective(out, mb, cfg, loss_w, tok_w)
        return loss, (metrics, {"values_BxR": mb["values_BxR"]})

    return make_update(
        loss_fn,
        optimizer,
        cfg,
        prefix="critic",
        needs=(MASK, "rewards_B"),
        accum_dtype=accum_dtype,
        group_size=group_size,
        rows=True,
        opt_memory=opt_memory,
    )


def _own_values(out: dict, mb: dict, cfg: RLConfig) -> dict:
    """values_from_critic_update: V_old = sg(V) of this forward, advantages and returns from it."""
    v = jax.lax.stop_gradient(out["values"])
    adv = compute_advantages({**mb, "values_BxR": v}, cfg)[0]
    return {**mb, "values_BxR": v, **adv}


def make_actor_critic_update(
    policy_fn,
    optimizer,
    cfg,
    *,
    accum_dtype=jnp.float32,
    group_size: int = 1,
    proximal_from_update: bool = False,
    values_from_update: bool = False,
    opt_memory=None,
):
    """One backbone with policy and value heads: L = L_actor + c_v·L_v (policy_fn returns values).

    values_from_update (one optimizer step): V_old = sg(V) of this forward, the advantages and
    returns computed from it inside the loss (per micro-batch: exact for GAE unless advantages are
    whitened over the batch), and the values returned as a 4th output like make_critic_values_update."""
    if proximal_from_update:
        check_one_step(cfg, "pipeline.proximal_from_update")
    if values_from_update:
        check_one_step(cfg, "pipeline.values_from_critic_update")

    def loss_fn(params, mb, loss_w, tok_w):
        out = policy_fn(params, mb)
        mb = _own_values(out, mb, cfg) if values_from_update else mb
        a_loss, a_metrics = actor_objective(out, _proximal(out, mb, proximal_from_update), cfg, loss_w, tok_w)
        v_loss, v_metrics = critic_objective(out, mb, cfg, loss_w, tok_w)
        loss, metrics = a_loss + cfg.vf_coef * v_loss, {**a_metrics, **v_metrics}
        return (loss, (metrics, {"values_BxR": mb["values_BxR"]})) if values_from_update else (loss, metrics)

    drop = ({"old_logp_BxR"} if proximal_from_update else set()) | (
        {"advantages_BxR", "values_BxR", "returns_BxR"} if values_from_update else set()
    )
    needs = tuple(k for k in ACTOR_KEYS + CRITIC_KEYS[1:] if k not in drop) + (
        ("rewards_B",) if values_from_update else ()
    )
    return make_update(
        loss_fn,
        optimizer,
        cfg,
        prefix="actor",
        needs=needs,
        accum_dtype=accum_dtype,
        group_size=group_size,
        rows=values_from_update,
        opt_memory=opt_memory,
    )
