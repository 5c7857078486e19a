"""Decode attention that reads each sequence's pages in place (the "kernel" implementation).

Called by `PagedAttention` (sampling/paged_attention.py) for the decode step (one query per slot)
when `SamplerConfig.attention = "kernel"`. It runs JAX's own Pallas GPU kernel,
`jax.experimental.pallas.ops.gpu.paged_attention.paged_attention`: per (sequence, kv head) a
flash-decoding loop over blocks of the sequence's pages, split into `k_splits` partitions of the
page table, that loads the pages through the block table (no gathered copy of the KV) and stops
at the sequence's length. With `interpret=True` the same kernel runs through the Pallas
interpreter, so it runs (slowly) on CPU for tests. docs/kernels.md lists the constraints.

Layout, without a transpose or a copy of the pools: the kernel wants k_pages [K', pages, S, E]
with the kv heads outermost and one page table per sequence shared by every kv head; our pools
are [L, K, P, S, E] (layer outermost) and the layer is picked inside the model's layer loop (a
traced index under its scan). Slicing a layer out would hand the kernel a copy of that layer's
whole pool every step, and a [K, L*P, S, E] view would need the pools transposed. Instead the
pools are viewed as ONE kv head of L*K*P pages (`reshape(1, L*K*P, S, E)`: merging contiguous
leading axes, a bitcast), and every (sequence b, kv head k) pair becomes a row of the kernel's
batch with the G query heads of kv head k and the page table `table[b] + (layer*K + k) * P`
(page p of layer l, head k is page (l*K + k)*P + p of the view). The kernel already runs one
program per (sequence, kv head) with that head's G query rows (padded to block_h = 16), so the
work is the same as its native layout; the page ids only move by a per-row offset.

Letters as in paged_attention.py.

Masking: the kernel masks key columns >= kv_len_B in the scores (softmax weight exactly 0) but,
unlike the gather path, does not zero V there, so a non-finite value in a stale page's tail within
the last block would reach the output as 0 * inf. The pools only ever hold K/V the model wrote
(zero-initialised, the null page never written), so this needs a non-finite model activation in
an earlier sequence. A slot with kv_len 0 (inactive) gets zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
from jax.sharding import PartitionSpec as P

TENSOR = "tensor"  # the mesh axis that splits kv heads (sampling/sharding.py)
BLOCK_COLS = 128  # key columns per compute block of the kernel (pages_per_compute_block * S)
MAX_SPLITS = 16  # partitions of a page table (the kernel's k_splits default)


def pow2floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def kernel_blocks(width: int, page_size: int) -> tuple[int, int, int]:
    """(pages per compute block, k_splits, padded table width) for a table of `width` pages.

    The kernel needs the table width divisible by k_splits and each partition divisible by the
    compute block, and Triton needs the block's key columns a power of two: blocks of a
    power-of-two page count near BLOCK_COLS columns (no wider than the table), as many partitions
    as the table has blocks up to MAX_SPLITS, and the table padded with null pages to the product
    (at most one block per partition). Padding costs
    nothing at run time: the kernel's loop stops at each sequence's last page (partitions beyond
    it are skipped), so only the page ids are longer."""
    ppcb = max(1, min(pow2floor(max(1, BLOCK_COLS // page_size)), pow2floor(width)))
    splits = min(MAX_SPLITS, -(-width // ppcb))
    per = -(-width // (splits * ppcb)) * ppcb  # pages per partition, a multiple of the block
    return ppcb, splits, splits * per


def attend_kernel(q_BxTxHxE, k_pool, v_pool, layer, table_BxW, kv_len_B, *, interpret: bool, heads_mesh=None):
    """Attention of one query per slot (T = 1) over its first kv_len_B key columns, read from the
    pools [L, K, P, S, E] in place. Scores and softmax in float32 (the kernel's accumulators), the
    1/sqrt(E) scale folded into q (exact for power-of-four E; one rounding of q otherwise).
    `heads_mesh`: a mesh whose `tensor` axis splits the kv heads (and the query heads with them):
    the kernel then runs per head shard under `jax.shard_map` over `tensor`, on the shard's own
    pool slice, with no collective."""
    b, t, h, e = q_BxTxHxE.shape
    if t != 1:
        raise ValueError(f"attend_kernel: decode attention takes one query per slot, got T={t}")
    layer = jnp.asarray(layer, jnp.int32)
    fn = lambda q, kp, vp, lay, tab, n: _attend_local(q, kp, vp, lay, tab, n, interpret)  # noqa: E731
    if heads_mesh is not None:
        heads = P(None, None, TENSOR)  # [B, T, H, E] over its head axis
        pool = P(None, TENSOR)  # [L, K, P, S, E] over its kv-head axis
        context = jax.sharding.get_abstract_mesh()  # inside the engine's shard_map over data: its mesh
        fn = jax.shard_map(
            fn,
            mesh=heads_mesh if context.empty else context,
            in_specs=(heads, pool, pool, P(), P(), P()),
            out_specs=heads,
            axis_names={TENSOR},
            check_vma=False,
        )
    return fn(q_BxTxHxE, k_pool, v_pool, layer, table_BxW, kv_len_B)


def _attend_local(q_BxTxHxE, k_pool, v_pool, layer, table_BxW, kv_len_B, interpret: bool):
    b, _, h, e = q_BxTxHxE.shape
    nl, kh, np_, s, _ = k_pool.shape
    g = h // kh
    ppcb, splits, width = kernel_blocks(table_BxW.shape[1], s)
    table = jnp.pad(table_BxW.astype(jnp.int32), ((0, 0), (0, width - table_BxW.shape[1])))
    offset_K = (layer * kh + jnp.arange(kh, dtype=jnp.int32)) * np_  # first page of (layer, head k)
    table_RxW = (table[:, None, :] + offset_K[None, :, None]).reshape(b * kh, width)  # R = B*K rows
    len_R = jnp.repeat(kv_len_B.astype(jnp.int32), kh)
    q_RxGxE = (q_BxTxHxE[:, 0].astype(jnp.float32) * (e**-0.5)).astype(q_BxTxHxE.dtype).reshape(b * kh, g, e)
    out_RxGxE = paged_attention(
        q_RxGxE,
        k_pool.reshape(1, nl * kh * np_, s, e),
        v_pool.reshape(1, nl * kh * np_, s, e),
        table_RxW,
        len_R,
        pages_per_compute_block=ppcb,
        k_splits=splits,
        interpret=interpret,
    )
    return out_RxGxE.reshape(b, 1, h, e)
