"""The Qwen3-MoE sparse MLP block: top-k softmax routing (optionally renormalised over the k chosen,
HF's norm_topk_prob), no shared expert, the experts computed with `jax.lax.ragged_dot` over the
tokens sorted by expert (one grouped GEMM per projection, not a loop over experts), and the
router's load-balancing loss (HF's `load_balancing_loss_func`, without an attention mask).

Letters: N tokens (B*T flattened), D hidden, X experts, F moe_intermediate_size, k experts per token.

`experts_NxK` lets a caller impose the experts (routing replay: the sampler's choice); the weights
are then the router's probabilities of those experts (renormalised as usual), so gradients still
reach the router. A token whose row holds a -1 (no record, e.g. padding) routes by its own top-k.

Expert parallelism (`experts_mlp_parallel`): when the experts' dimension is split over mesh axes
(the logical `expert` axis in the sharding rules, e.g. the `fsdp_expert` preset, or the sampler's
parameters placed so: sharding/axes.expert_layout), the block runs under `jax.shard_map` over those
axes (and the axes splitting the tokens and each expert's width) with explicit collectives, not
left to GSPMD:
- tokens split over the expert axes (training: the batch is over data x fsdp, the experts over
  fsdp): DISPATCH/COMBINE by `jax.lax.all_to_all`. Each device sorts its N*k (token, expert) pairs
  by expert, writes them into one fixed-size buffer per destination device (the device holding
  that expert) of C rows, exchanges the buffers, runs its local experts with `ragged_dot` over
  what it received, and sends the results back the same way; the sender weights and sums them
  per token. C = N*k (all of a device's pairs could go to one device), so NO pair is ever
  dropped: the result equals the single-device block to float rounding. The price is buffers of
  ep x N*k rows per layer (ep = the expert-parallel degree) where ~N*k are live, all of them
  sent: memory and all-to-all bytes ep x a perfectly balanced dispatch's.
- tokens replicated over the expert axes (the sampler: slots split over `data` only): each device
  runs the pairs routed to its own experts and the partial outputs are summed (`psum`) over the
  expert axes: no dispatch at all, one all-reduce of [N, D].
- each expert's width F split over more axes (`mlp`, e.g. `tensor`): the down projection's
  partial sums are added over them (`psum`).
Layouts where the expert axes split the tokens only partly run the plain block (GSPMD).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rpeg_jax.sharding.axes import ExpertLayout, expert_layout


def route(h_NxD, w_router_DxX, k: int, norm_topk_prob: bool, experts_NxK=None):
    """(router logits [N, X] float32, chosen experts [N, k] int32, their weights [N, k] float32)."""
    logits = jnp.dot(h_NxD, w_router_DxX.astype(h_NxD.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if experts_NxK is not None:  # a token with any -1 entry (not recorded) keeps its own top-k
        forced = jnp.asarray(experts_NxK, jnp.int32)
        experts = jnp.where(jnp.all(forced >= 0, axis=-1, keepdims=True), forced, experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, experts.astype(jnp.int32), weights


def experts_mlp(x_NxD, experts_NxK, weights_NxK, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD):
    """sum_j weights[n, j] * SwiGLU_{experts[n, j]}(x[n]) with grouped (ragged) matmuls: the N*k
    (token, expert) pairs are sorted by expert and each projection is one `ragged_dot`."""
    N, D = x_NxD.shape
    X = w_gate_XxDxF.shape[0]
    k = experts_NxK.shape[-1]
    dt = x_NxD.dtype
    flat = experts_NxK.reshape(-1)  # [N*k]
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=X).astype(jnp.int32)
    out = _grouped_swiglu(x_NxD[token], group_sizes, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD)
    w = weights_NxK.reshape(-1)[order].astype(dt)
    return jnp.zeros((N, D), dt).at[token].add(out * w[:, None])


def _grouped_swiglu(xs_MxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD):
    """SwiGLU of rows sorted by expert: group g's group_sizes[g] rows by expert g (one ragged_dot
    per projection). Rows past sum(group_sizes) belong to no expert: their output is zero."""
    dt = xs_MxD.dtype
    gate = jax.lax.ragged_dot(xs_MxD, w_gate_GxDxF.astype(dt), group_sizes_G)
    up = jax.lax.ragged_dot(xs_MxD, w_up_GxDxF.astype(dt), group_sizes_G)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down_GxFxD.astype(dt), group_sizes_G)
    live = jnp.arange(xs_MxD.shape[0]) < jnp.sum(group_sizes_G)
    return jnp.where(live[:, None], out, jnp.zeros((), dt))


def _local_experts(x_NxD, experts_NxK, weights_NxK, wg, wu, wd, first):
    """The pairs routed to this device's experts (first .. first + Xl - 1) run here, the others
    contribute zero: partial outputs [N, D] for the caller to sum over the expert axes."""
    N, D = x_NxD.shape
    Xl, k, dt = wg.shape[0], experts_NxK.shape[-1], x_NxD.dtype
    local = experts_NxK.reshape(-1) - first
    mine = (local >= 0) & (local < Xl)
    key = jnp.where(mine, local, Xl)  # the other devices' pairs sort last, in no group
    order = jnp.argsort(key, stable=True)
    token = order // k
    group_sizes = jnp.bincount(key, length=Xl + 1)[:Xl].astype(jnp.int32)
    out = _grouped_swiglu(x_NxD[token], group_sizes, wg, wu, wd)
    w = jnp.where(mine, weights_NxK.reshape(-1), 0.0)[order].astype(dt)
    return jnp.zeros((N, D), dt).at[token].add(out * w[:, None])


def _dispatched_experts(x_NxD, experts_NxK, weights_NxK, wg, wu, wd, axes, ep: int):
    """All-to-all dispatch and combine over the expert axes `axes` (ep devices, device j holding
    experts j*Xl .. (j+1)*Xl - 1): output [N, D]. Each destination's buffer holds C = N*k rows,
    as many as this device has pairs, so none is ever dropped."""
    N, D = x_NxD.shape
    Xl, k, dt = wg.shape[0], experts_NxK.shape[-1], x_NxD.dtype
    flat = experts_NxK.reshape(-1)  # [M = N*k]
    order = jnp.argsort(flat, stable=True)  # by expert, hence by destination device
    token = order // k
    dest = flat[order] // Xl
    capacity = flat.shape[0]
    counts = jnp.bincount(dest, length=ep)
    pos = jnp.arange(capacity) - (jnp.cumsum(counts) - counts)[dest]  # row within its destination's buffer
    send_x = jnp.zeros((ep, capacity, D), dt).at[dest, pos].set(x_NxD[token])
    send_e = jnp.full((ep, capacity), Xl, jnp.int32).at[dest, pos].set(flat[order] % Xl)
    # DISPATCH: recv[s] = the rows device s sent here (its pairs for this device's experts)
    recv_x = jax.lax.all_to_all(send_x, axes, 0, 0, tiled=True).reshape(ep * capacity, D)
    recv_e = jax.lax.all_to_all(send_e, axes, 0, 0, tiled=True).reshape(ep * capacity)
    by_expert = jnp.argsort(recv_e, stable=True)  # empty rows (Xl) last, in no group
    group_sizes = jnp.bincount(recv_e, length=Xl + 1)[:Xl].astype(jnp.int32)
    out = _grouped_swiglu(recv_x[by_expert], group_sizes, wg, wu, wd)
    out = jnp.zeros_like(recv_x).at[by_expert].set(out).reshape(ep, capacity, D)
    # COMBINE: back[j] = the results of the rows sent to device j, in the order they were sent
    back = jax.lax.all_to_all(out, axes, 0, 0, tiled=True)
    res = back[dest, pos]  # [M, D] in sorted pair order
    w = weights_NxK.reshape(-1)[order].astype(dt)
    return jnp.zeros((N, D), dt).at[token].add(res * w[:, None])


def experts_mlp_parallel(x_BxTxD, experts_BxTxK, weights_BxTxK, w_gate, w_up, w_down, layout: ExpertLayout):
    """`experts_mlp` with the experts split over `layout.expert` mesh axes (module docstring):
    output [B, T, D], or None when the layout's token split does not suit it (the caller runs
    the plain block)."""
    mesh = jax.sharding.get_abstract_mesh()  # the enclosing one (jax.set_mesh, a shard_map's)
    if mesh.empty:
        mesh = layout.mesh
    if mesh is None:
        return None
    sizes = dict(mesh.shape)
    manual = getattr(mesh, "manual_axes", ())
    live = lambda axes: tuple(a for a in axes if sizes.get(a, 1) > 1 and a not in manual)  # noqa: E731
    expert, tokens = live(layout.expert), live(layout.token_axes)
    mlp = tuple(a for a in live(layout.mlp) if a not in expert + tokens)
    X = w_gate.shape[0]
    ep = math.prod(sizes[a] for a in expert)
    if not expert or X % ep:
        return None
    if set(expert) <= set(tokens):
        mode = "dispatch"
    elif set(expert).isdisjoint(tokens):
        mode = "local"
    else:
        return None

    def entry(axes):
        return None if not axes else axes[0] if len(axes) == 1 else axes

    b_ax = tuple(a for a in _names(layout.tokens[0]) if a in tokens)
    t_ax = tuple(a for a in _names(layout.tokens[1]) if a in tokens)
    B, T, D = x_BxTxD.shape
    if B % math.prod(sizes[a] for a in b_ax) or T % math.prod(sizes[a] for a in t_ax):
        return None
    tok = P(entry(b_ax), entry(t_ax), None)
    wspec = P(entry(expert), None, entry(mlp))  # gate/up [X, D, F]
    dspec = P(entry(expert), entry(mlp), None)  # down [X, F, D]
    k = experts_BxTxK.shape[-1]

    def body(x, e, w, wg, wu, wd):
        b, t, d = x.shape
        x, e, w = x.reshape(b * t, d), e.reshape(b * t, k), w.reshape(b * t, k)
        if mode == "dispatch":
            y = _dispatched_experts(x, e, w, wg, wu, wd, expert, ep)
            if mlp:
                y = jax.lax.psum(y, mlp)
        else:
            # the tokens are the same on every expert shard but each shard's use of them differs: cast
            # them to varying explicitly so that their cotangents are summed over the expert axes (the
            # gather at shard-dependent indices alone left them unsummed: wrong input gradients)
            x, w = (jax.lax.pcast(a, expert, to="varying") for a in (x, w))
            first = jax.lax.axis_index(expert) * wg.shape[0]
            y = jax.lax.psum(_local_experts(x, e, w, wg, wu, wd, first), expert + mlp)
        return y.reshape(b, t, d)

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tok, P(*tok[:2], None), P(*tok[:2], None), wspec, wspec, dspec),
        out_specs=tok,
        axis_names=set(expert + tokens + mlp),
    )
    return fn(x_BxTxD, experts_BxTxK, weights_BxTxK, w_gate, w_up, w_down)


def _names(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def moe_block(h_BxTxD, p: dict, k: int, norm_topk_prob: bool, experts_BxTxK=None):
    """The sparse MLP on normed hidden states: (output [B, T, D], router logits [B, T, X],
    chosen experts [B, T, k]). `p` holds w_router [D, X], we_gate/we_up [X, D, F], we_down [X, F, D].
    With the experts split over mesh axes (sharding/axes.expert_layout) the experts run expert-
    parallel (`experts_mlp_parallel`); the routing itself is the plain computation either way."""
    B, T, D = h_BxTxD.shape
    h = h_BxTxD.reshape(B * T, D)
    forced = None if experts_BxTxK is None else jnp.asarray(experts_BxTxK).reshape(B * T, k)
    logits, experts, weights = route(h, p["w_router"], k, norm_topk_prob, forced)
    layout = expert_layout(p["we_gate"].shape, h_BxTxD.shape)
    ep = None
    if layout is not None:
        ep = experts_mlp_parallel(
            h_BxTxD, experts.reshape(B, T, k), weights.reshape(B, T, k), p["we_gate"], p["we_up"], p["we_down"], layout
        )
    if ep is not None:
        y = ep
    else:
        y = experts_mlp(h, experts, weights, p["we_gate"], p["we_up"], p["we_down"]).reshape(B, T, D)
    return y, logits.reshape(B, T, -1), experts.reshape(B, T, k)


def load_balancing_loss(router_logits_NxX, k: int, mask_N=None):
    """HF Qwen3-MoE's auxiliary loss: X * sum_x f_x * P_x, with f_x the fraction of (token, slot)
    pairs routed to expert x (averaged over the k slots as HF does: mean over tokens of the one-hot
    [N, k, X], then summed against P) and P_x the mean router probability. Logits of every MoE layer
    are concatenated along N by the caller (as HF does). `mask_N` (1 = real token) averages over
    real tokens only."""
    X = router_logits_NxX.shape[-1]
    probs = jax.nn.softmax(router_logits_NxX.astype(jnp.float32), axis=-1)
    _, chosen = jax.lax.top_k(probs, k)
    onehot = jax.nn.one_hot(chosen, X, dtype=jnp.float32)  # [N, k, X]
    if mask_N is None:
        f = jnp.mean(onehot, axis=0)  # [k, X]
        P = jnp.mean(probs, axis=0)  # [X]
    else:
        m = mask_N.astype(jnp.float32)
        denom = jnp.maximum(jnp.sum(m), 1.0)
        f = jnp.sum(onehot * m[:, None, None], axis=0) / denom
        P = jnp.sum(probs * m[:, None], axis=0) / denom
    return X * jnp.sum(f * P[None, :])


def routing_agreement(experts_a_NxK, experts_b_NxK, mask_N=None):
    """Fraction of tokens whose top-k expert *sets* match (order ignored)."""
    a = jnp.sort(experts_a_NxK, axis=-1)
    b = jnp.sort(experts_b_NxK, axis=-1)
    same = jnp.all(a == b, axis=-1).astype(jnp.float32)
    if mask_N is None:
        return jnp.mean(same)
    m = mask_N.astype(jnp.float32)
    return jnp.sum(same * m) / jnp.maximum(jnp.sum(m), 1.0)


MOE_PARAMS = ("w_router", "we_gate", "we_up", "we_down")


def layer_groups(sparse_layers) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dense index, sparse index) of each layer: its row in the dense MLP weights (stacked over the
    dense layers) and in the expert weights (stacked over the sparse layers); -1 where it has none."""
    dense, sparse, nd, ns = [], [], 0, 0
    for s in sparse_layers:
        dense.append(-1 if s else nd)
        sparse.append(ns if s else -1)
        nd, ns = nd + (not s), ns + s
    return tuple(dense), tuple(sparse)
