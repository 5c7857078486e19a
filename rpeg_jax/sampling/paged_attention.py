"""Attention over a paged KV cache, in pure JAX (gather the pages, then dense masked attention).

Called by the sampler's device functions (`sampling/engine.py`) through the model's pluggable
attention interface: `PagedAttention(...)(q, k, v, layer=l, cache=(k_pool, v_pool))` writes this
call's k/v into layer `l` of the pools and attends over each sequence's pages.

Letters: B sequences, T query tokens per sequence, H query heads, K kv heads, G = H // K,
Q = G * T query rows per kv head, E head_dim, L layers, P pages, S page size, W page-table width,
C = W * S key columns. Pools are stacked over layers and heads-major: `k_pool_LxKxPxSxE`,
`v_pool_LxKxPxSxE`; page 0 is the null page. Heads-major because a sequence's gathered pages are
then one [K, B, C, E] block per layer, whose q.k and p.v products are plain batched matrix
products over (K, B); the token-major layout needed a transpose or a transposed-operand product,
2-3x slower on CPU (measured), and is no better for GPU batched matmuls.

Safety: key column c of sequence b holds position c. Columns >= kv_len_B (stale or garbage pages,
the tail of a partial page, the null page) are masked in the scores by a select (a garbage K column
only reaches its own score, which is replaced, not multiplied) AND zeroed in V before p @ V, so a
NaN there cannot leak into the output even as NaN * 0.

Implementations behind `PagedAttention`: "gather" (`attend_pages`: gather the table's pages, one
dense product), "blocked" (`attend_blocked`: an online-softmax loop over blocks of pages that
stops at the longest sequence) and, for the decode step, "kernel" (sampling/kernel_attention.py:
JAX's Pallas paged-attention kernel reading the pages in place; the K/V write stays `write_pages`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rpeg_jax.sampling.kernel_attention import attend_kernel

NEG_INF = -1e30  # finite, as in the model's attention: masked scores, never NaN from inf - inf


def write_pages(pool_LxKxPxSxE, layer, x_BxTxKxE, page_BxT, offset_BxT):
    """Scatter x into `pool[layer, :, page, offset]`; rows whose page is out of range (>= P) are
    dropped, which is how padding and inactive sequences avoid writing (never to page 0)."""
    return pool_LxKxPxSxE.at[layer, :, page_BxT, offset_BxT].set(x_BxTxKxE.astype(pool_LxKxPxSxE.dtype), mode="drop")


def gather_pages(pool_LxKxPxSxE, layer, table_BxW, batched_heads: bool = False):
    """[K, B, W*S, E]: each sequence's pages laid end to end (column c = position c).

    `batched_heads` (kv heads sharded over a mesh axis, e.g. `tensor`): one gather per head as a
    batch dimension (vmap), which XLA's SPMD partitioner splits per head shard with no collective.
    The (head, page) index form below made it all-gather the layer's pool over `tensor` (or gather
    the indices and all-reduce the gathered pages), seen in the decode HLO on a (data 2, tensor 2)
    mesh. On one CPU the batched form lowers to the slower [B, W, K] gather + transpose, so it is
    used only when heads are sharded."""
    b, w = table_BxW.shape
    _, kh, _, s, e = pool_LxKxPxSxE.shape
    pages = jax.lax.dynamic_index_in_dim(pool_LxKxPxSxE, layer, axis=0, keepdims=False)  # [K, P, S, E]
    if batched_heads:
        return jax.vmap(lambda p_PxSxE: p_PxSxE[table_BxW])(pages).reshape(kh, b, w * s, e)
    # Index (head, page) pairs so the gather emits [K, B, W] blocks of contiguous [S, E] rows in
    # output order (indexing pages only would gather [B, W, K, S, E] and transpose it: 2x slower).
    heads = jnp.arange(kh, dtype=table_BxW.dtype)[:, None, None]
    return pages[heads, table_BxW[None]].reshape(kh, b, w * s, e)


def _scores(q_BxTxHxE, k_KxBxCxE, q_pos_BxT, kv_len_B, col0=0):
    """(scores float32 [K, B, C, G, T] with masked entries at NEG_INF, mask [B, C, 1, T], valid [B, C])."""
    b, t, h, e = q_BxTxHxE.shape
    kh, _, c, _ = k_KxBxCxE.shape
    g = h // kh
    q_KxBxQxE = q_BxTxHxE.reshape(b, t, kh, g, e).transpose(2, 0, 3, 1, 4).reshape(kh, b, g * t, e)
    # K as the left operand: contraction over its minor axis is a standard (fast) product layout.
    s = jnp.einsum("kbce,kbqe->kbcq", k_KxBxCxE, q_KxBxQxE, preferred_element_type=jnp.float32)
    s = (s * (e**-0.5)).reshape(kh, b, c, g, t)
    col_C = col0 + jnp.arange(c, dtype=jnp.int32)
    valid_BxC = col_C[None, :] < kv_len_B[:, None]
    mask = (valid_BxC[:, :, None] & (col_C[None, :, None] <= q_pos_BxT[:, None, :]))[:, :, None, :]
    return jnp.where(mask[None], s, NEG_INF), mask, valid_BxC


def _weighted_values(p_KxBxCxGxT, v_KxBxCxE, valid_BxC):
    """sum_c p[c] * v[c] -> float32 [K, B, G, T, E], V zeroed at invalid columns first."""
    kh, b, c, g, t = p_KxBxCxGxT.shape
    v = jnp.where(valid_BxC[None, :, :, None], v_KxBxCxE, jnp.zeros((), v_KxBxCxE.dtype))
    p = p_KxBxCxGxT.reshape(kh, b, c, g * t).swapaxes(2, 3).astype(v.dtype)
    out = jnp.einsum("kbqc,kbce->kbqe", p, v, preferred_element_type=jnp.float32)
    return out.reshape(kh, b, g, t, -1)


def _to_heads(o_KxBxGxTxE, like_BxTxHxE):
    b, t, h, e = like_BxTxHxE.shape
    return o_KxBxGxTxE.transpose(1, 3, 0, 2, 4).reshape(b, t, h, e).astype(like_BxTxHxE.dtype)


def dense_attention(q_BxTxHxE, k_KxBxCxE, v_KxBxCxE, q_pos_BxT, kv_len_B):
    """Causal GQA attention where key column c sits at position c and columns >= kv_len_B are
    invalid. Scores and softmax in float32 (as the model's DenseAttention), output in q's dtype.
    A query with no valid column (padding rows only) returns zeros."""
    s, _, valid = _scores(q_BxTxHxE, k_KxBxCxE, q_pos_BxT, kv_len_B)
    p = jax.nn.softmax(s, axis=2)
    return _to_heads(_weighted_values(p, v_KxBxCxE, valid), q_BxTxHxE)


def attend_pages(q_BxTxHxE, k_pool, v_pool, layer, table_BxW, q_pos_BxT, kv_len_B, *, batched_heads: bool = False):
    """The "gather" implementation: gather the pages, then `dense_attention`."""
    k = gather_pages(k_pool, layer, table_BxW, batched_heads)
    v = gather_pages(v_pool, layer, table_BxW, batched_heads)
    return dense_attention(q_BxTxHxE, k, v, q_pos_BxT, kv_len_B)


def attend_blocked(
    q_BxTxHxE, k_pool, v_pool, layer, table_BxW, q_pos_BxT, kv_len_B, *, block_pages: int, batched_heads: bool = False
):
    """The "blocked" implementation: a loop over blocks of `block_pages` pages with an online
    softmax (flash-decoding without split-K). The trip count is dynamic, ceil(max kv_len / block), so
    each step reads only the pages the longest sequence needs, whatever the table width; each
    block's gather stays small (cache-resident on CPU). Same masking rules as `dense_attention`."""
    b, t, h, e = q_BxTxHxE.shape
    kh, s = k_pool.shape[1], k_pool.shape[3]
    g, cols = h // kh, block_pages * s
    nblk = -(-table_BxW.shape[1] // block_pages)
    table = jnp.pad(table_BxW, ((0, 0), (0, nblk * block_pages - table_BxW.shape[1])))
    n = jnp.clip((jnp.max(kv_len_B) + cols - 1) // cols, 0, nblk)

    def body(j, carry):
        m, l, acc = carry  # running max, sum and weighted V: [K,B,G,T] x2, [K,B,G,T,E]
        pages = jax.lax.dynamic_slice_in_dim(table, j * block_pages, block_pages, axis=1)
        k, v = gather_pages(k_pool, layer, pages, batched_heads), gather_pages(v_pool, layer, pages, batched_heads)
        sc, mask, valid = _scores(q_BxTxHxE, k, q_pos_BxT, kv_len_B, col0=j * cols)
        m_new = jnp.maximum(m, jnp.max(sc, axis=2))
        p = jnp.where(mask[None], jnp.exp(sc - m_new[:, :, None]), 0.0)
        corr = jnp.exp(m - m_new)
        pv = _weighted_values(p, v, valid)
        return m_new, l * corr + jnp.sum(p, axis=2), acc * corr[..., None] + pv

    init = (
        jnp.full((kh, b, g, t), NEG_INF, jnp.float32),
        jnp.zeros((kh, b, g, t), jnp.float32),
        jnp.zeros((kh, b, g, t, e), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, n, body, init)
    out = acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]  # l = 0: padding row -> 0
    return _to_heads(out, q_BxTxHxE)


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
    block_pages: int = 0  # 0: "gather" implementation; > 0: "blocked" with this many pages per block
    batched_heads: bool = False  # kv heads sharded over a mesh axis (see gather_pages)
    kernel: bool = False  # the "kernel" implementation (decode only: T = 1); overrides block_pages
    interpret: bool = False  # run the kernel through the Pallas interpreter (CPU)
    heads_mesh: Any = None  # with `kernel`: the mesh whose `tensor` axis splits the kv heads

    def __call__(self, q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, *, layer, cache):
        k_pool, v_pool = cache
        k_pool = write_pages(k_pool, layer, k_BxTxKxE, self.write_page_BxT, self.write_off_BxT)
        v_pool = write_pages(v_pool, layer, v_BxTxKxE, self.write_page_BxT, self.write_off_BxT)
        if self.kernel:  # the query of a decode step sits at kv_len - 1: the length mask is causal
            out = attend_kernel(
                q_BxTxHxE,
                k_pool,
                v_pool,
                layer,
                self.table_BxW,
                self.kv_len_B,
                interpret=self.interpret,
                heads_mesh=self.heads_mesh,
            )
            return out, (k_pool, v_pool)
        args = (q_BxTxHxE, k_pool, v_pool, layer, self.table_BxW, self.q_pos_BxT, self.kv_len_B)
        if self.block_pages:
            out = attend_blocked(*args, block_pages=self.block_pages, batched_heads=self.batched_heads)
        else:
            out = attend_pages(*args, batched_heads=self.batched_heads)
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
    """Copy pages src -> dst in every layer and head (GRPO fork of a partial last page). Padding
    entries use dst >= P and are dropped."""
    src = jnp.clip(src_N, 0, k_pool.shape[2] - 1)
    k_pool = k_pool.at[:, :, dst_N].set(k_pool[:, :, src], mode="drop")
    v_pool = v_pool.at[:, :, dst_N].set(v_pool[:, :, src], mode="drop")
    return k_pool, v_pool
