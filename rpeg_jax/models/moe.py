"""The Qwen3-MoE sparse MLP block: top-k softmax routing (optionally renormalised over the k chosen,
HF's norm_topk_prob), no shared expert, the experts computed with `jax.lax.ragged_dot` over the
tokens sorted by expert (one grouped GEMM per projection, not a loop over experts), and the
router's load-balancing loss (HF's `load_balancing_loss_func`, without an attention mask).

Letters: N tokens (B*T flattened), D hidden, X experts, F moe_intermediate_size, k experts per token.

`experts_NxK` lets a caller impose the experts (routing replay: the sampler's choice); the weights
are then the router's probabilities of those experts (renormalised as usual), so gradients still
reach the router. A token whose row holds a -1 (no record, e.g. padding) routes by its own top-k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    xs = x_NxD[token]  # [N*k, D] sorted by expert
    gate = jax.lax.ragged_dot(xs, w_gate_XxDxF.astype(dt), group_sizes)
    up = jax.lax.ragged_dot(xs, w_up_XxDxF.astype(dt), group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down_XxFxD.astype(dt), group_sizes)
    w = weights_NxK.reshape(-1)[order].astype(dt)
    return jnp.zeros((N, D), dt).at[token].add(out * w[:, None])


def moe_block(h_BxTxD, p: dict, k: int, norm_topk_prob: bool, experts_BxTxK=None):
    """The sparse MLP on normed hidden states: (output [B, T, D], router logits [B, T, X],
    chosen experts [B, T, k]). `p` holds w_router [D, X], we_gate/we_up [X, D, F], we_down [X, F, D]."""
    B, T, D = h_BxTxD.shape
    h = h_BxTxD.reshape(B * T, D)
    forced = None if experts_BxTxK is None else jnp.asarray(experts_BxTxK).reshape(B * T, k)
    logits, experts, weights = route(h, p["w_router"], k, norm_topk_prob, forced)
    y = experts_mlp(h, experts, weights, p["we_gate"], p["we_up"], p["we_down"])
    return y.reshape(B, T, D), logits.reshape(B, T, -1), experts.reshape(B, T, k)


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
