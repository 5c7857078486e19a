"""Decode attention over a per-chunk dense copy of the slots' pages (the "chunk" implementation).

Called by the sampler's decode chunk (`sampling/engine.py`) through the model's pluggable attention
interface, like `PagedAttention`. At the start of a chunk of decode steps the page table is fixed, so
`gather_chunk` copies each slot's pages once into dense per-layer buffers; every step then writes its
token's K/V into the buffers only and attends over them with two plain batched products; after the
chunk's last step `flush_chunk` writes the new columns into the page pools (the cache between
chunks), one scatter per layer per block of FLUSH_BLOCK columns. The per-step page gather of the
"gather" implementation is replaced by one gather per chunk, and the per-step page scatters by one
flush per chunk (measured: the per-step scatters into the pools were ~0.3 ms of a ~5 ms model-T
step).

Why: on XLA:CPU the per-step gather is materialised element by element (about 3 GB/s) and the
q.k product over a gathered [.., C, E] operand contracts its minor axis (a transposed operand, about
4x slower than the standard layout); together they were ~65% of a model-T decode step. Here K is
kept transposed ([K, B, E, C], so q.k is a standard [G, E] x [E, C] product per (kv head, slot)) and
V is zeroed beyond each slot's length once per chunk (so no per-step select over V). Measured on the
2-core CPU, model T, batch 64, 128 key columns, 4 layers: 9.4 ms -> 3.3 ms of CPU time per step.
The cost is memory: the buffers hold every slot's keys and values at the chunk's table width (a
dense cache of that width), so "auto" uses this on CPU only.

Safety (same rules as paged_attention.py): columns >= the slot's length are masked in the scores by
a select (K there is never multiplied into anything else), and V there is zero (garbage or NaN in
stale pages is zeroed when the buffers are built; columns written later in the chunk hold real
values before they become valid), so exp(-1e30 - m) = 0 multiplies finite zeros only.

Letters as in paged_attention.py; C = W * S key columns of the chunk's table width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rpeg_jax.sampling.paged_attention import NEG_INF, gather_pages, write_pages, write_targets


def gather_chunk(pools, table_BxW, kv_len_B, *, per_layer: bool, batched_heads: bool = False):
    """(kt, v): the slots' keys transposed [L][K, B, E, C] and values [L][K, B, C, E] in the pools'
    dtype, zero at columns >= kv_len_B. Tuples of per-layer arrays when `per_layer` (the attention is
    then called with a Python-int layer), else arrays stacked over L. `batched_heads`: see
    paged_attention.gather_pages."""
    k_pool, v_pool = pools
    c = table_BxW.shape[1] * k_pool.shape[3]
    valid_BxC = jnp.arange(c, dtype=jnp.int32)[None, :] < kv_len_B[:, None]
    kts, vs = [], []
    for layer in range(k_pool.shape[0]):
        k = jnp.where(valid_BxC[None, :, :, None], gather_pages(k_pool, layer, table_BxW, batched_heads), 0)
        v = jnp.where(valid_BxC[None, :, :, None], gather_pages(v_pool, layer, table_BxW, batched_heads), 0)
        kts.append(k.swapaxes(2, 3))
        vs.append(v)
    if per_layer:
        return tuple(kts), tuple(vs)
    return jnp.stack(kts), jnp.stack(vs)


def _get(buf, layer):
    return buf[layer] if isinstance(buf, tuple) else jax.lax.dynamic_index_in_dim(buf, layer, 0, keepdims=False)


def _put(buf, layer, x):
    if isinstance(buf, tuple):
        return buf[:layer] + (x,) + buf[layer + 1 :]
    return jax.lax.dynamic_update_index_in_dim(buf, x, layer, 0)


def attend_dense_t(q_BxHxE, kt_KxBxExC, v_KxBxCxE, kv_len_B):
    """One query per slot over key columns [0, kv_len_B): float32 scores and softmax, output in q's
    dtype [B, H, E]. A slot with kv_len 0 gets zeros."""
    b, h, e = q_BxHxE.shape
    kh, c = kt_KxBxExC.shape[0], kt_KxBxExC.shape[3]
    g = h // kh
    q = q_BxHxE.reshape(b, kh, g, e).swapaxes(0, 1).astype(kt_KxBxExC.dtype)  # [K, B, G, E]
    s = jnp.einsum("kbge,kbec->kbgc", q, kt_KxBxExC, preferred_element_type=jnp.float32) * (e**-0.5)
    valid_BxC = jnp.arange(c, dtype=jnp.int32)[None, :] < kv_len_B[:, None]
    s = jnp.where(valid_BxC[None, :, None, :], s, NEG_INF)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("kbgc,kbce->kbge", p.astype(v_KxBxCxE.dtype), v_KxBxCxE, preferred_element_type=jnp.float32)
    o = jnp.where(kv_len_B[None, :, None, None] > 0, o / l, 0.0)
    return o.swapaxes(0, 1).reshape(b, h, e).astype(q_BxHxE.dtype)


@dataclasses.dataclass(frozen=True)
class ChunkAttention:
    """The model-facing attention for one decode step over chunk buffers (T = 1 query per slot).

    cache = (kt, v) from `gather_chunk`. col_B: the buffer column of this step's token (its
    position; >= C drops the write, for inactive slots); kv_len_B: valid key columns after this
    step's write (0 for inactive slots). The pools are not touched: `flush_chunk` writes the chunk's
    new columns into the pages once, after the last step."""

    col_B: jax.Array
    kv_len_B: jax.Array

    def __call__(self, q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, *, layer, cache: Any):
        kt, vb = cache
        rows = jnp.arange(q_BxTxHxE.shape[0])
        # numpy indexing: (rows, col) separated by a slice put the update's dims first ([B, K, E]);
        # adjacent, in place ([K, B, E]).
        kt_l = _get(kt, layer).at[:, rows, :, self.col_B].set(k_BxTxKxE[:, 0].astype(kt[0].dtype), mode="drop")
        v_l = (
            _get(vb, layer).at[:, rows, self.col_B].set(v_BxTxKxE[:, 0].swapaxes(0, 1).astype(vb[0].dtype), mode="drop")
        )
        out = attend_dense_t(q_BxTxHxE[:, 0], kt_l, v_l, self.kv_len_B)[:, None]
        return out, (_put(kt, layer, kt_l), _put(vb, layer, v_l))


FLUSH_BLOCK = 16  # buffer columns per flush block (one take + one pool scatter per layer each)


def flush_chunk(pools, bufs, table_BxW, start_B, stop_B, steps: int):
    """Write buffer columns [start_B, stop_B) (the positions a chunk of at most `steps` decode steps
    wrote) into every layer's pages; the pools are the cache between chunks. Slots with
    start == stop write nothing (their rows go to page P, dropped).

    Why blocks: a chunk usually runs fewer steps than `steps` (it ends where the width bucket grows,
    or when every slot stops), and each flushed column costs an element-wise take from the buffers
    plus a pool scatter; a loop over blocks of FLUSH_BLOCK columns that stops after the longest
    slot's new columns reads only those (measured on model T: the flush of a 16-step chunk read
    128 columns)."""
    k_pool, v_pool = pools
    kt, vb = bufs
    num_pages, page_size = k_pool.shape[2], k_pool.shape[3]
    c = _get(kt, 0).shape[3]
    blk = min(FLUSH_BLOCK, steps)
    n_blocks = (jnp.max(stop_B - start_B) + blk - 1) // blk

    def block(i, pools):
        k_pool, v_pool = pools
        pos_BxT = start_B[:, None] + i * blk + jnp.arange(blk, dtype=jnp.int32)[None, :]
        page, off = write_targets(table_BxW, pos_BxT, pos_BxT < stop_B[:, None], num_pages, page_size)
        col_BxT = jnp.clip(pos_BxT, 0, c - 1)
        for layer in range(k_pool.shape[0]):
            k = jnp.take_along_axis(_get(kt, layer), col_BxT[None, :, None, :], axis=3)  # [K, B, E, T]
            v = jnp.take_along_axis(_get(vb, layer), col_BxT[None, :, :, None], axis=2)  # [K, B, T, E]
            k_pool = write_pages(k_pool, layer, k.transpose(1, 3, 0, 2), page, off)
            v_pool = write_pages(v_pool, layer, v.transpose(1, 2, 0, 3), page, off)
        return k_pool, v_pool

    return jax.lax.fori_loop(0, n_blocks, block, (k_pool, v_pool))
