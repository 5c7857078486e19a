"""The sampler's jitted device functions: prefill into pages, copy pages (GRPO fork), and a chunk of
up to K decode steps inside one `lax.while_loop`. The host scheduler (`sampling/sampler.py`) calls
them between its bookkeeping; nothing here allocates pages.

Every function takes a forward (`sampling/forward.py`: static, hashable) and the weights as a jit
ARGUMENT, so new weights of the same shapes/dtypes/shardings run without recompiling, and donates the KV pools
(`pools = (k_pool_LxKxPxSxE, v_pool_LxKxPxSxE)`) so they are updated in place. The functions are
module-level, so samplers of the same model shape share compiled code.

Decode convention: a slot's state is its last token `token_B` at position `pos_B` (not yet in the
cache). A step writes that token's K/V at `pos`, attends over positions <= pos, and samples the token
at pos + 1. Prefill therefore writes all but the last known token of a sequence, and every sampled
token comes from the same decode step (one place for sampling, logprobs and stop checks).

Sharded pool (static `mesh`, sampling/sharding.py): each function runs per data shard under
`jax.shard_map` over `data` only: the shard's slots/rows, its P/D pages addressed by local page ids
(page-table entries, write targets and copy indices are all local; the padding page id is P/D), and
the other mesh axes (kv heads over `tensor`) left to XLA. Without a mesh the bodies run as they are.

Qwen3-MoE (static `routed`): prefill and every decode step also return the experts each processed
token was routed to in every sparse layer (prefill: [B, T, S, k]; decode: [K, B, S, k], -1 where a
slot was inactive; int16), which the Sampler records per sequence (routing replay, rl.routing).

Letters: B slots, T tokens, W page-table width, N stop ids per slot, K chunk steps (buffer size),
S sparse (MoE) layers, k experts per token.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rpeg_jax.sampling.chunk_attention import ChunkAttention, flush_chunk, gather_chunk
from rpeg_jax.sampling.paged_attention import PagedAttention, copy_pages, write_targets
from rpeg_jax.sampling.transforms import sample, sequence_keys
from rpeg_jax.sharding.axes import use_resolver


class DecodeState(NamedTuple):
    """Per-slot inputs of a decode chunk (all traced; sizes fixed by max_slots and the W bucket)."""

    token_B: jax.Array  # int32 last token (input of the next step)
    pos_B: jax.Array  # int32 its position
    active_B: jax.Array  # bool: slot is generating
    end_B: jax.Array  # int32 sequence length at which the slot stops (prompt + max_new_tokens)
    table_BxW: jax.Array  # int32 pages (0 = null page)
    stop_ids_BxN: jax.Array  # int32 stop token ids, -1 = unused
    temperature_B: jax.Array  # float32, 0 = greedy
    top_k_B: jax.Array  # int32, 0 = off
    top_p_B: jax.Array  # float32, 1 = off
    min_p_B: jax.Array  # float32, 0 = off
    seed_B: jax.Array  # int32 (with prompt_id and sample_id: the sequence's random stream)
    prompt_id_B: jax.Array  # int32
    sample_id_B: jax.Array  # int32


class ChunkResult(NamedTuple):
    tokens_KxB: jax.Array  # int32 sampled tokens per step (-1 where the slot was inactive)
    logprobs_KxB: jax.Array  # float32
    steps: jax.Array  # int32 steps actually run
    token_B: jax.Array  # state after the chunk
    pos_B: jax.Array
    active_B: jax.Array
    experts_KxBxSxK: Any = None  # int16 experts of each step's input token (routed models; -1 inactive)


DATA = "data"
# expert ids as recorded (-1 = none): int16 holds any expert count up to 32767 at half int32's host
# memory (Qwen3-30B-A3B: 48 layers x top-8 = 768 bytes per token)
EXPERT_DTYPE = jnp.int16
_POOL = (P(None, None, DATA), P(None, None, DATA))  # page axis over data (kv heads stay Auto)
_ROWS = P(DATA)


def _per_shard(fn, mesh, in_specs, out_specs):
    """`fn` itself without a mesh; else `fn` run per data shard (`jax.shard_map` over `data` only:
    every array's leading slot/row axis and the pools' page axis are split, the other mesh axes stay
    Auto). Model activation constraints are off inside: `data` is manual there."""
    if mesh is None:
        return fn

    def local(*args):
        with use_resolver(None):
            return fn(*args)

    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={DATA}, check_vma=False)


@functools.partial(jax.jit, static_argnames=("fwd", "mesh", "heads_sharded", "routed"), donate_argnames=("pools",))
def prefill(
    fwd,
    params,
    pools,
    tokens_BxT,
    lengths_B,
    table_BxW,
    starts_B,
    *,
    mesh=None,
    heads_sharded: bool = False,
    routed=False,
):
    """Run the model over right-padded `tokens_BxT` (the first lengths_B of each row are real) at
    positions starts_B.. and write their K/V into the rows' pages (a row with start s > 0 appends to
    a sequence whose cache holds positions < s: a resumed episode's observation, attending to its
    cached KV). Padding rows use length 0. Returns the pools, and with `routed` (a MoE model) (pools,
    experts [B, T, S, k]). With `mesh` (a sharded pool) the rows come in D blocks, block d for shard
    d, with local page ids.
    `heads_sharded`: the pools' kv heads are split over a mesh axis (paged_attention.gather_pages)."""
    body = functools.partial(_prefill, fwd, heads_sharded=heads_sharded, routed=routed)
    out_specs = (_POOL, _ROWS) if routed else _POOL
    return _per_shard(body, mesh, (P(), _POOL, _ROWS, _ROWS, _ROWS, _ROWS), out_specs)(
        params, pools, tokens_BxT, lengths_B, table_BxW, starts_B
    )


def _prefill(fwd, params, pools, tokens_BxT, lengths_B, table_BxW, starts_B, *, heads_sharded: bool, routed: bool):
    b, t = tokens_BxT.shape
    num_pages, page_size = pools[0].shape[2], pools[0].shape[3]
    idx_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    pos_BxT = starts_B[:, None] + idx_BxT
    page, off = write_targets(table_BxW, pos_BxT, idx_BxT < lengths_B[:, None], num_pages, page_size)
    kv_len_B = jnp.where(lengths_B > 0, starts_B + lengths_B, 0)
    attention = PagedAttention(page, off, table_BxW, pos_BxT, kv_len_B, batched_heads=heads_sharded)
    _, pools, experts = fwd.hidden(params, tokens_BxT, pos_BxT, attention, pools)
    return (pools, experts.astype(EXPERT_DTYPE)) if routed else pools


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("pools",))
def fork_pages(pools, src_N, dst_N, *, mesh=None):
    """Copy pages src -> dst in every layer (dst >= num_pages: padding, dropped). With `mesh`: D
    blocks of local page ids, block d copied within shard d."""
    body = lambda pools, src, dst: copy_pages(pools[0], pools[1], src, dst)  # noqa: E731
    return _per_shard(body, mesh, (_POOL, _ROWS, _ROWS), _POOL)(pools, src_N, dst_N)


def _decode_step(
    fwd,
    params,
    cache,
    st: DecodeState,
    keys_Bx2,
    token_B,
    pos_B,
    active_B,
    attention: str,
    block_pages: int,
    heads_sharded: bool,
    interpret: bool,
    heads_mesh,
):
    """One step for every slot: write K/V at pos, attend, sample the token at pos + 1. `cache` is the
    pools, or the chunk buffers (kt, v) for the "chunk" attention (the pools are flushed after)."""
    pos_Bx1 = pos_B[:, None]
    kv_len_B = jnp.where(active_B, pos_B + 1, 0)
    if attention == "chunk":
        cols = cache[0][0].shape[-1]  # C: an out-of-range column drops the write
        attn = ChunkAttention(jnp.where(active_B, pos_B, cols), kv_len_B)
    else:
        num_pages, page_size = cache[0].shape[2], cache[0].shape[3]
        page, off = write_targets(st.table_BxW, pos_Bx1, active_B[:, None], num_pages, page_size)
        attn = PagedAttention(
            page,
            off,
            st.table_BxW,
            pos_Bx1,
            kv_len_B,
            block_pages if attention == "blocked" else 0,
            heads_sharded,
            kernel=attention == "kernel",
            interpret=interpret,
            heads_mesh=heads_mesh,
        )
    h, cache, experts = fwd.hidden(params, token_B[:, None], pos_Bx1, attn, cache)
    logits_BxV = fwd.logits(params, h[:, 0])
    new_B, logp_B = sample(logits_BxV, keys_Bx2, pos_B + 1, st.temperature_B, st.top_k_B, st.top_p_B, st.min_p_B)
    return cache, new_B, logp_B, (None if experts is None else experts[:, 0])


@functools.partial(
    jax.jit,
    static_argnames=(
        "fwd",
        "chunk",
        "attention",
        "block_pages",
        "mesh",
        "heads_sharded",
        "interpret",
        "heads_mesh",
        "routed",
    ),
    donate_argnames=("pools",),
)
def decode_chunk(
    fwd,
    params,
    pools,
    st: DecodeState,
    num_steps,
    release=None,
    *,
    chunk: int,
    attention: str = "gather",
    block_pages: int = 4,
    mesh=None,
    heads_sharded: bool = False,
    interpret: bool = False,
    heads_mesh=None,
    routed: bool = False,
):
    """Up to min(num_steps, chunk) decode steps in one while_loop; exits early once every slot has
    stopped (stop id sampled or end reached). `attention`: "gather" (gather the pages every step),
    "blocked" (online softmax over blocks of `block_pages` pages), "chunk" (gather them once into
    dense buffers for the whole chunk, sampling/chunk_attention.py) or "kernel" (a Pallas kernel
    reads the pages in place, sampling/kernel_attention.py; `interpret`: through the Pallas
    interpreter; `heads_mesh`: the mesh whose `tensor` axis splits the kv heads, for the kernel's
    per-head-shard shard_map). Returns (pools, ChunkResult).
    `release` (int32 [2], optional: (min steps, slots)): also exit once at least `slots` slots have
    stopped in this chunk and at least `min steps` steps ran, so that a waiting group can be admitted
    (continuous admission); slots > max_slots never exits early.
    With `mesh` (a sharded pool) every data shard runs its own loop over its slots and local pages
    (no collective over `data`; a shard exits when its own slots stop) and `steps` is int32 [D].
    `routed` (a MoE model): the result also holds each step's experts (ChunkResult.experts_KxBxSxK)."""
    if release is None:
        release = jnp.array([0, st.token_B.shape[0] + 1], jnp.int32)
    body = functools.partial(
        _decode_chunk,
        fwd,
        chunk=chunk,
        attention=attention,
        block_pages=block_pages,
        heads_sharded=heads_sharded,
        interpret=interpret,
        heads_mesh=heads_mesh,
        routed=routed,
    )
    if mesh is not None:
        body = _steps_per_shard(body)
    experts_spec = P(None, DATA) if routed else None
    out_specs = (_POOL, ChunkResult(P(None, DATA), P(None, DATA), _ROWS, _ROWS, _ROWS, _ROWS, experts_spec))
    return _per_shard(body, mesh, (P(), _POOL, _ROWS, P(), P()), out_specs)(params, pools, st, num_steps, release)


def _steps_per_shard(body):
    def f(*args):
        pools, res = body(*args)
        return pools, res._replace(steps=res.steps[None])

    return f


def _decode_chunk(
    fwd,
    params,
    pools,
    st: DecodeState,
    num_steps,
    release,
    *,
    chunk: int,
    attention: str,
    block_pages: int,
    heads_sharded: bool,
    interpret: bool,
    heads_mesh,
    routed: bool,
):
    b = st.token_B.shape[0]
    keys_Bx2 = sequence_keys(st.seed_B, st.prompt_id_B, st.sample_id_B)
    limit = jnp.minimum(num_steps, chunk)
    cache = tuple(pools)
    if attention == "chunk":  # positions < pos are in the pages; the step writes pos itself
        kv_len_B = jnp.where(st.active_B, st.pos_B, 0)
        cache = gather_chunk(pools, st.table_BxW, kv_len_B, per_layer=fwd.static_layers, batched_heads=heads_sharded)

    started = jnp.sum(st.active_B.astype(jnp.int32))

    def cond(carry):
        step, _, _, _, active_B, _, _, _ = carry
        freed = started - jnp.sum(active_B.astype(jnp.int32))
        early = (step >= release[0]) & (freed >= release[1])
        return (step < limit) & jnp.any(active_B) & ~early

    def body(carry):
        step, cache, token_B, pos_B, active_B, tok_KxB, logp_KxB, exp_KxBxSxK = carry
        cache, new_B, logp_B, experts_BxSxK = _decode_step(
            fwd,
            params,
            cache,
            st,
            keys_Bx2,
            token_B,
            pos_B,
            active_B,
            attention,
            block_pages,
            heads_sharded,
            interpret,
            heads_mesh,
        )
        stopped = jnp.any(new_B[:, None] == st.stop_ids_BxN, axis=1) | (pos_B + 2 >= st.end_B)
        tok_KxB = tok_KxB.at[step].set(jnp.where(active_B, new_B, -1))
        logp_KxB = logp_KxB.at[step].set(jnp.where(active_B, logp_B, 0.0))
        if routed:
            rec = jnp.where(active_B[:, None, None], experts_BxSxK, -1).astype(EXPERT_DTYPE)
            exp_KxBxSxK = exp_KxBxSxK.at[step].set(rec)
        token_B = jnp.where(active_B, new_B, token_B)
        pos_B = jnp.where(active_B, pos_B + 1, pos_B)
        return step + 1, cache, token_B, pos_B, active_B & ~stopped, tok_KxB, logp_KxB, exp_KxBxSxK

    init = (
        jnp.zeros((), jnp.int32),
        cache,
        st.token_B,
        st.pos_B,
        st.active_B,
        jnp.full((chunk, b), -1, jnp.int32),
        jnp.zeros((chunk, b), jnp.float32),
        _experts_buffer(fwd, params, chunk, b) if routed else None,
    )
    steps, cache, token_B, pos_B, active_B, tok_KxB, logp_KxB, exp_KxBxSxK = jax.lax.while_loop(cond, body, init)
    if attention == "chunk":  # written: positions [pos at the start, pos now) of every slot
        pools = flush_chunk(pools, cache, st.table_BxW, st.pos_B, pos_B, chunk)
    else:
        pools = cache
    return pools, ChunkResult(tok_KxB, logp_KxB, steps, token_B, pos_B, active_B, exp_KxBxSxK)


def _experts_buffer(fwd, params, chunk: int, b: int):
    """-1s [K, B, S, k]: the decode chunk's record of the experts of each step's input token."""
    cfg = fwd.model_cfg(params)
    s = sum(cfg.sparse_layers)
    return jnp.full((chunk, b, s, cfg.num_experts_per_tok), -1, EXPERT_DTYPE)


def make_pools(
    num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, sharding: Any = None
):
    """Zero-initialised (k_pool, v_pool), each [L, K, P, S, E], optionally placed with `sharding`."""
    shape = (num_layers, kv_heads, num_pages, page_size, head_dim)
    if sharding is None:
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return zeros(), zeros()
