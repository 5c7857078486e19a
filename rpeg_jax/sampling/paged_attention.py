"""Attention over a paged KV cache, in pure JAX (gather the pages, then dense masked attention).

Called by the sampler's device functions (`sampling/engine.py`) through the model's pluggable
attention interface: `PagedAttention(...)(q, k, v, layer=l, cache=(k_pool, v_pool))` writes this
call's k/v into layer `l` of the pools and attends over each sequence's pages.

Letters: B sequences, T query tokens per sequence, H query heads, K kv heads, G = H // K,
E head_dim, L layers, P pages, S page size, W page-table width, C = W * S key columns.
Pools are stacked over layers: `k_pool_LxPxSxKxE`, `v_pool_LxPxSxKxE`; page 0 is the null page.

Safety: key column c of sequence b holds position c. Columns >= kv_len_B (stale or garbage pages,
the tail of a partial page, the null page) are masked in the scores by a select (so a NaN score is
replaced, not multiplied) AND zeroed in V before p @ V, so a NaN there cannot leak into the output
even as NaN * 0. A different kernel (e.g. a
fused GPU paged kernel) can replace `attend_pages` behind the same `PagedAttention` interface.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, as in the model's attention: masked scores, never NaN from inf - inf


def write_pages(pool_LxPxSxKxE, layer, x_BxTxKxE, page_BxT, offset_BxT):
    """Scatter x into `pool[layer, page, offset]`; rows whose page is out of range (>= P) are
    dropped, which is how padding and inactive sequences avoid writing (never to page 0)."""
    return pool_LxPxSxKxE.at[layer, page_BxT, offset_BxT].set(
        x_BxTxKxE.astype(pool_LxPxSxKxE.dtype), mode="drop")


def gather_pages(pool_LxPxSxKxE, layer, table_BxW):
    """[B, W*S, K, E]: the pages of each sequence laid end to end (column c = position c)."""
    b, w = table_BxW.shape
    _, _, s, kh, e = pool_LxPxSxKxE.shape
    # One gather indexed by (layer, page) reads only the listed pages (no copy of the layer slab).
    return pool_LxPxSxKxE[layer, table_BxW].reshape(b, w * s, kh, e)


def dense_attention(q_BxTxHxE, k_BxCxKxE, v_BxCxKxE, q_pos_BxT, kv_len_B):
    """Causal GQA attention where key column c sits at position c; columns >= kv_len_B are invalid.
    Scores and softmax in float32 (as the model's DenseAttention), output in q's dtype.

    NaN safety: a garbage K column only reaches its own score, which the select replaces by NEG_INF;
    a garbage V column would reach the output through p * v even with p = 0, so V is zeroed there.
    A query with no valid column (padding rows only) returns zeros."""
    b, t, h, e = q_BxTxHxE.shape
    c, kh = k_BxCxKxE.shape[1], k_BxCxKxE.shape[2]
    col_C = jnp.arange(c, dtype=jnp.int32)
    valid_BxC = col_C[None, :] < kv_len_B[:, None]
    v = jnp.where(valid_BxC[:, :, None, None], v_BxCxKxE, jnp.zeros((), v_BxCxKxE.dtype))
    q = q_BxTxHxE.reshape(b, t, kh, h // kh, e)
    s_BxKxGxTxC = jnp.einsum("btkge,bcke->bkgtc", q, k_BxCxKxE, preferred_element_type=jnp.float32)
    s_BxKxGxTxC = s_BxKxGxTxC * (e ** -0.5)
    mask_BxTxC = valid_BxC[:, None, :] & (col_C[None, None, :] <= q_pos_BxT[:, :, None])
    s = jnp.where(mask_BxTxC[:, None, None], s_BxKxGxTxC, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgtc,bcke->btkge", p, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, e).astype(q_BxTxHxE.dtype)


def attend_pages(q_BxTxHxE, k_pool, v_pool, layer, table_BxW, q_pos_BxT, kv_len_B):
    """The "gather" implementation: gather the pages, then `dense_attention`."""
    k = gather_pages(k_pool, layer, table_BxW)
    v = gather_pages(v_pool, layer, table_BxW)
    return dense_attention(q_BxTxHxE, k, v, q_pos_BxT, kv_len_B)


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """The model-facing attention function for one device call (its fields are traced arrays).

    write_page_BxT / write_off_BxT: where each new token's k/v goes (page >= P drops the write);
    table_BxW: each sequence's pages; q_pos_BxT: query positions; kv_len_B: valid key columns
    (after this call's writes)."""

    write_page_BxT: jax.Array
    write_off_BxT: jax.Array
    table_BxW: jax.Array
    q_pos_BxT: jax.Array
    kv_len_B: jax.Array

    def __call__(self, q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, *, layer, cache):
        k_pool, v_pool = cache
        k_pool = write_pages(k_pool, layer, k_BxTxKxE, self.write_page_BxT, self.write_off_BxT)
        v_pool = write_pages(v_pool, layer, v_BxTxKxE, self.write_page_BxT, self.write_off_BxT)
        out = attend_pages(q_BxTxHxE, k_pool, v_pool, layer, self.table_BxW, self.q_pos_BxT, self.kv_len_B)
        return out, (k_pool, v_pool)


def write_targets(table_BxW, pos_BxT, valid_BxT, num_pages: int, page_size: int):
    """(page_BxT, offset_BxT) for writing position pos of each row; invalid rows get page
    `num_pages` (out of range, so the scatter drops them)."""
    w = table_BxW.shape[1]
    idx = jnp.clip(pos_BxT // page_size, 0, w - 1)
    page = jnp.take_along_axis(table_BxW, idx, axis=1)
    page = jnp.where(valid_BxT, page, num_pages)
    return page.astype(jnp.int32), (pos_BxT % page_size).astype(jnp.int32)


def copy_pages(k_pool, v_pool, src_N, dst_N):
    """Copy pages src -> dst in every layer (GRPO fork of a partial last page). Padding entries
    use dst >= P and are dropped."""
    k_pool = k_pool.at[:, dst_N].set(k_pool[:, jnp.clip(src_N, 0, k_pool.shape[1] - 1)], mode="drop")
    v_pool = v_pool.at[:, dst_N].set(v_pool[:, jnp.clip(src_N, 0, v_pool.shape[1] - 1)], mode="drop")
    return k_pool, v_pool
