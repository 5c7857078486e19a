"""Attention implementations behind the model's pluggable interface.

    attention(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, *, layer, cache) -> (out_BxTxHxE, cache)

q and k arrive with RoPE applied. `layer` is the traced layer index inside the layer scan and
`cache` any pytree carried through it (the sampler's paged KV pools; see rpeg_jax/sampling).
`DenseAttention` is the training / reference implementation: causal within each nonzero segment
(segment 0 is padding), scores and softmax in float32, grouped-query heads without repeating K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from rpeg_jax.sharding.axes import explicit_spec

NEG_INF = -1e30  # finite: fully masked rows (padding queries) stay finite instead of NaN


def _group_heads(q_BxTxHxE, k_BxSxKxE):
    """q [B, T, H, E] -> [B, T, K, G, E]. With sharding in types the split of a sharded head axis
    is stated: the kv-head axis takes k's layout (q's heads gathered first when k's kv heads are
    not sharded, e.g. fewer kv heads than tensor devices)."""
    b, t, h, e = q_BxTxHxE.shape
    kv = k_BxSxKxE.shape[2]
    q_spec = explicit_spec(q_BxTxHxE)
    if q_spec is None:
        return q_BxTxHxE.reshape(b, t, kv, h // kv, e)
    k_spec = explicit_spec(k_BxSxKxE) or (None,) * 4
    if q_spec[2] != k_spec[2]:
        q_BxTxHxE = jax.reshard(q_BxTxHxE, jax.P(q_spec[0], q_spec[1], k_spec[2], q_spec[3]))
    return jnp.reshape(
        q_BxTxHxE, (b, t, kv, h // kv, e), out_sharding=jax.P(q_spec[0], q_spec[1], k_spec[2], None, q_spec[3])
    )


def gqa_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS) -> jax.Array:
    """softmax(q·kᵀ/√E + mask)·v with H query heads sharing K kv heads (H % K == 0).

    Scores accumulate in float32; the output has q's dtype. Masked entries get NEG_INF.
    """
    b, t, h, e = q_BxTxHxE.shape
    q = _group_heads(q_BxTxHxE, k_BxSxKxE)
    scores = jnp.einsum("btkge,bske->bkgts", q, k_BxSxKxE, preferred_element_type=jnp.float32)
    scores = scores * (e**-0.5)
    scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bske->btkge", probs.astype(v_BxSxKxE.dtype), v_BxSxKxE, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, e).astype(q_BxTxHxE.dtype)


def causal_segment_mask(segment_ids_BxT: jax.Array) -> jax.Array:
    """mask[b, i, j] = j <= i and seg[b, i] == seg[b, j] != 0."""
    t = segment_ids_BxT.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    seg = segment_ids_BxT
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    return causal[None] & same


@dataclass(frozen=True)
class DenseAttention:
    """Full causal attention over the current tokens (training, scoring, reference decoding)."""

    segment_ids_BxT: jax.Array

    def __call__(self, q, k, v, *, layer, cache):
        del layer
        return gqa_attention(q, k, v, causal_segment_mask(self.segment_ids_BxT)), cache


jax.tree_util.register_dataclass(DenseAttention, data_fields=["segment_ids_BxT"], meta_fields=[])
