"""Paged attention (gather + dense) against a float64 NumPy reference on contiguous K/V, for page sizes
1, 3, 16, 64, GQA ratios 1/2/4, permuted page ids, shared prefix pages, and NaN in every unused page,
every partial-page tail and the null page. Tolerance: 2e-5 absolute + 1e-5 relative (float32 vs
float64); the gather path must also be bit-identical to the same dense kernel on contiguous K/V."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import E, build_case, ref_attention

from rpeg_jax.sampling.paged_attention import (
    PagedAttention,
    attend_blocked,
    attend_pages,
    copy_pages,
    dense_attention,
    write_pages,
    write_targets,
)


@pytest.mark.parametrize("page_size,kv_heads", [(1, 2), (3, 2), (3, 1), (3, 4), (16, 2), (64, 2)])
def test_paged_equals_dense_reference_with_nan_garbage(page_size, kv_heads):
    heads = 4
    lengths = [2 * page_size + 1, 2 * page_size + 5, page_size, 1, 3 * page_size - 1]
    shared = 2 * page_size
    k, v, table, pk, pv = build_case(page_size, kv_heads, lengths, shared)
    rng = np.random.default_rng(1)
    t = 3  # the last 3 positions of each sequence as queries (prefill-like), then decode (t = 1)
    q = rng.standard_normal((len(lengths), t, heads, E)).astype(np.float32)
    qpos = np.stack([np.maximum(np.arange(n - t, n), 0) for n in lengths]).astype(np.int32)
    kv_len = np.asarray(lengths, np.int32)
    out = attend_pages(
        jnp.asarray(q), jnp.asarray(pk), jnp.asarray(pv), 1, jnp.asarray(table), jnp.asarray(qpos), jnp.asarray(kv_len)
    )
    out = np.asarray(out)
    assert np.isfinite(out).all(), "NaN from unused pages leaked into the output"
    for i, n in enumerate(lengths):
        ref = ref_attention(q[i], k[i, :n], v[i, :n], qpos[i])
        np.testing.assert_allclose(out[i], ref, atol=2e-5, rtol=1e-5)
    # bit-identical to the same kernel on contiguous K/V of the gathered width
    c = table.shape[1] * page_size
    kc = np.zeros((kv_heads, len(lengths), c, E), np.float32)  # [K, B, C, E]
    vc = kc.copy()
    for i, n in enumerate(lengths):
        kc[:, i, :n], vc[:, i, :n] = k[i, :n].transpose(1, 0, 2), v[i, :n].transpose(1, 0, 2)
    dense = dense_attention(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(qpos), jnp.asarray(kv_len))
    np.testing.assert_array_equal(out, np.asarray(dense))
    # the blocked implementation (online softmax over blocks of 2 pages) against the same reference
    blocked = np.asarray(
        attend_blocked(
            jnp.asarray(q),
            jnp.asarray(pk),
            jnp.asarray(pv),
            1,
            jnp.asarray(table),
            jnp.asarray(qpos),
            jnp.asarray(kv_len),
            block_pages=2,
        )
    )
    assert np.isfinite(blocked).all()
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(blocked[i], ref_attention(q[i], k[i, :n], v[i, :n], qpos[i]), atol=2e-5, rtol=1e-5)


def test_write_then_attend_through_the_model_interface():
    """PagedAttention writes new k/v at (page, offset) of layer `layer` only, drops padding rows, keeps
    page 0 and other pages untouched, and attends over what it wrote."""
    page_size, kvh, heads, layers = 3, 2, 4, 3
    lengths = [7, 4]
    _, _, table, pk, pv = build_case(page_size, kvh, [7, 5], shared=0, layer=0, num_layers=layers)
    pk[:, :, 0], pv[:, :, 0] = 0.0, 0.0  # a real pool keeps the null page zero
    rng = np.random.default_rng(2)
    t = 7
    k_new = rng.standard_normal((2, t, kvh, E)).astype(np.float32)
    v_new = rng.standard_normal((2, t, kvh, E)).astype(np.float32)
    q = rng.standard_normal((2, t, heads, E)).astype(np.float32)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (2, t))
    valid = pos < np.asarray(lengths)[:, None]
    page, off = write_targets(jnp.asarray(table), jnp.asarray(pos), jnp.asarray(valid), pk.shape[2], page_size)
    attn = PagedAttention(page, off, jnp.asarray(table), jnp.asarray(pos), jnp.asarray(lengths, np.int32))
    out, (nk, nv) = jax.jit(lambda q, k, v, c: attn(q, k, v, layer=jnp.int32(2), cache=c))(
        jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), (jnp.asarray(pk), jnp.asarray(pv))
    )
    nk, out = np.asarray(nk), np.asarray(out)
    expect = pk.copy()
    for i, n in enumerate(lengths):
        for p in range(n):
            expect[2, :, table[i, p // page_size], p % page_size] = k_new[i, p]
    np.testing.assert_array_equal(nk, expect)  # NaN == NaN elsewhere: untouched
    for i, n in enumerate(lengths):
        ref = ref_attention(q[i, :n], k_new[i, :n], v_new[i, :n], pos[i, :n])
        np.testing.assert_allclose(out[i, :n], ref, atol=2e-5, rtol=1e-5)


def test_copy_pages_copies_every_layer_and_drops_padding():
    pk = jnp.asarray(np.random.default_rng(3).standard_normal((2, 2, 6, 3, 2)).astype(np.float32))
    nk, _ = copy_pages(pk, pk, jnp.asarray([1, 2, 0]), jnp.asarray([4, 5, 6]))
    expect = np.asarray(pk).copy()
    expect[:, :, 4], expect[:, :, 5] = expect[:, :, 1], expect[:, :, 2]
    np.testing.assert_array_equal(np.asarray(nk), expect)


def test_write_pages_drops_out_of_range_rows():
    pool = jnp.zeros((1, 1, 3, 2, 1))
    out = write_pages(pool, 0, jnp.ones((1, 2, 1, 1)), jnp.asarray([[3, 1]]), jnp.asarray([[0, 1]]))
    expect = np.zeros((1, 1, 3, 2, 1))
    expect[0, 0, 1, 1] = 1
    np.testing.assert_array_equal(np.asarray(out), expect)


@pytest.mark.parametrize("page_size,kv_heads,per_layer", [(1, 2, True), (3, 4, False), (16, 1, True)])
def test_chunk_attention_equals_reference_with_nan_garbage(page_size, kv_heads, per_layer):
    """The "chunk" decode attention: the slots' pages gathered once (NaN everywhere unused), then one
    decode step writes each slot's newest K/V into the buffers and attends; against float64. Then
    `flush_chunk` writes exactly the new column of each active slot into its page."""
    from rpeg_jax.sampling.chunk_attention import ChunkAttention, flush_chunk, gather_chunk

    heads, layer = 4, 1
    lengths = [2 * page_size + 1, 2 * page_size + 5, page_size, 1, 3 * page_size - 1]
    k, v, table, pk, pv = build_case(page_size, kv_heads, lengths, shared=2 * page_size)
    b = len(lengths)
    # the newest token of each sequence is not in the pages yet: the step writes it
    last = np.asarray(lengths) - 1
    for i, n in enumerate(lengths):
        p = table[i, last[i] // page_size]
        if not (i == 1 and (last[i] // page_size + 1) * page_size <= 2 * page_size):
            pk[layer, :, p, last[i] % page_size] = np.nan
            pv[layer, :, p, last[i] % page_size] = np.nan
    q = np.random.default_rng(5).standard_normal((b, 1, heads, E)).astype(np.float32)
    active = np.array([True, True, True, True, False])  # an inactive slot must write nothing
    pools = (jnp.asarray(pk), jnp.asarray(pv))
    kv_before = jnp.asarray(np.where(active, last, 0), jnp.int32)
    bufs = gather_chunk(pools, jnp.asarray(table), kv_before, per_layer=per_layer)
    cols = table.shape[1] * page_size
    attn = ChunkAttention(
        jnp.asarray(np.where(active, last, cols), jnp.int32), jnp.asarray(np.where(active, lengths, 0), jnp.int32)
    )
    k_new = jnp.asarray(k[np.arange(b), last][:, None])
    v_new = jnp.asarray(v[np.arange(b), last][:, None])
    step = jax.jit(lambda q, kk, vv, c, layer: attn(q, kk, vv, layer=layer, cache=c), static_argnums=4)
    for other in range(pk.shape[0]):  # a decode step writes every layer's buffers (checked: `layer`)
        if other != layer:
            bufs = step(jnp.asarray(q), k_new, v_new, bufs, other)[1]
    out, bufs = step(jnp.asarray(q), k_new, v_new, bufs, layer)
    out = np.asarray(out)
    assert np.isfinite(out).all(), "NaN from unused pages leaked into the output"
    for i, n in enumerate(lengths):
        if active[i]:
            np.testing.assert_allclose(
                out[i], ref_attention(q[i], k[i, :n], v[i, :n], last[i : i + 1]), atol=2e-5, rtol=1e-5
            )
        else:
            np.testing.assert_array_equal(out[i], 0.0)
    stop = np.where(active, last + 1, last)  # an inactive slot's position did not advance
    nk, nv = (
        np.asarray(x)
        for x in flush_chunk(
            pools, bufs, jnp.asarray(table), jnp.asarray(last, jnp.int32), jnp.asarray(stop, jnp.int32), 3
        )
    )
    expect_k, expect_v = pk.copy(), pv.copy()
    for i in range(b):
        if active[i]:
            expect_k[:, :, table[i, last[i] // page_size], last[i] % page_size] = k[i, last[i]]
            expect_v[:, :, table[i, last[i] // page_size], last[i] % page_size] = v[i, last[i]]
    # every other entry (other pages and offsets; the inactive slot's NaN) is unchanged
    np.testing.assert_array_equal(nk, expect_k)
    np.testing.assert_array_equal(nv, expect_v)
    assert np.isnan(nk[layer, :, table[4, last[4] // page_size], last[4] % page_size]).all()


@pytest.mark.parametrize("per_layer", [True, False])
def test_flush_chunk_writes_every_new_column_across_blocks(per_layer):
    """A chunk longer than `FLUSH_BLOCK` decode steps: `flush_chunk` writes every buffer column in
    [start, stop) of each slot into its page and offset, in every layer, and nothing else (numpy
    reference; slot 3 wrote nothing, slot 1 starts at 0, slot 0 runs past two block boundaries)."""
    from rpeg_jax.sampling.chunk_attention import FLUSH_BLOCK, flush_chunk, gather_chunk

    page_size, kv_heads = 4, 2
    lengths = [40, 30, 32, 8]
    _, _, table, pk, pv = build_case(page_size, kv_heads, lengths, shared=0)
    start = np.array([3, 0, 10, 5], np.int32)
    stop = np.array([40, 25, 32, 5], np.int32)
    steps = int((stop - start).max())
    assert steps > 2 * FLUSH_BLOCK
    pools = (jnp.asarray(pk), jnp.asarray(pv))
    bufs = gather_chunk(pools, jnp.asarray(table), jnp.asarray(start), per_layer=per_layer)
    rng = np.random.default_rng(3)
    kt = [np.array(x) for x in (bufs[0] if per_layer else list(bufs[0]))]  # per layer [K, B, E, C]
    vb = [np.array(x) for x in (bufs[1] if per_layer else list(bufs[1]))]  # per layer [K, B, C, E]
    expect_k, expect_v = pk.copy(), pv.copy()
    for layer in range(pk.shape[0]):
        for i in range(len(lengths)):
            for p in range(start[i], stop[i]):
                kk = rng.standard_normal((kv_heads, E)).astype(np.float32)
                vv = rng.standard_normal((kv_heads, E)).astype(np.float32)
                kt[layer][:, i, :, p], vb[layer][:, i, p, :] = kk, vv
                page, off = table[i, p // page_size], p % page_size
                expect_k[layer, :, page, off], expect_v[layer, :, page, off] = kk, vv
    new = (
        (tuple(jnp.asarray(x) for x in kt), tuple(jnp.asarray(x) for x in vb))
        if per_layer
        else (jnp.asarray(np.stack(kt)), jnp.asarray(np.stack(vb)))
    )
    nk, nv = (
        np.asarray(x) for x in flush_chunk(pools, new, jnp.asarray(table), jnp.asarray(start), jnp.asarray(stop), steps)
    )
    np.testing.assert_array_equal(nk, expect_k)
    np.testing.assert_array_equal(nv, expect_v)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_batched_heads_gather_equals_the_indexed_gather(kv_heads):
    """gather_pages(batched_heads=True) (the form used when kv heads are sharded over `tensor`) gathers
    exactly the pages the default form does, checked against numpy indexing of the pool."""
    from rpeg_jax.sampling.paged_attention import gather_pages

    rng = np.random.default_rng(4)
    pool = rng.standard_normal((2, kv_heads, 9, 3, E)).astype(np.float32)
    table = rng.integers(0, 9, size=(5, 4)).astype(np.int32)
    ref = pool[1][:, table].reshape(kv_heads, 5, 4 * 3, E)  # numpy: [K, B, W, S, E] -> [K, B, C, E]
    for batched in (False, True):
        got = np.asarray(gather_pages(jnp.asarray(pool), 1, jnp.asarray(table), batched))
        np.testing.assert_array_equal(got, ref)
