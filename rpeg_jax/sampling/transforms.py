"""Token sampling on device: temperature, top-k, top-p, min-p, greedy, per-sequence random keys,
and the float32 logprob of the sampled token under the distribution actually sampled from.

Called inside the decode loop (`sampling/engine.py`); pure functions of arrays, one row per
sequence (B rows, V vocabulary entries). Every per-row setting is a traced array, so changing a
temperature or top-p never recompiles.

Definitions (row-wise; l = float32 logits, T = temperature):
- sampling row (T > 0): s = l / T; top-k keeps the k largest s (k = 0: all); top-p keeps the
  smallest prefix of the sorted top-k distribution whose mass reaches p (the token that crosses p is
  kept); min-p keeps tokens with prob >= min_p * max prob. Ties with the last kept value are kept.
  The distribution is softmax(s) renormalised over the kept set, and the returned logprob is
  log of that: s_tok - logsumexp(s over kept). With top_k = 0, top_p = 1, min_p = 0 this is
  exactly log_softmax(l / T), what a trainer recomputes.
- greedy row (T == 0): the token is argmax l; its logprob is log_softmax(l)[tok] (T = 1, no
  truncation), as vLLM reports it; a point mass has no useful logprob.
- randomness: key = fold_in(fold_in(fold_in(PRNGKey(seed), prompt_id), sample_id), position), where
  position is the sampled token's position in the sequence, so a sequence's draws do not depend on
  its batch, slot, page size, chunk size or preemption. One uniform u per row and position (the
  Threefry-2x32 hash (20 rounds, Salmon et al. 2011, the hash behind jax.random) of counter 0 under
  the row's key, `_threefry_uniform`) draws the token by inversion: the first vocabulary entry whose
  cumulative probability under softmax(s) exceeds u (`_invert`). The cumulative sum is taken in two
  levels, sums of blocks of CDF_BLOCK entries and then the entries of the block u falls in, so each
  step reads the [B, V] scores twice (the max; the exponentials and their block sums, which also give
  the logsumexp of the logprob) and never hashes a counter per vocabulary entry.
  Why not Gumbel-max (the draw before 2026-12-06: a Threefry hash and -log(-log u) per entry, then an
  argmax): on CPU, SmolLM2-135M's shape at 32 rows x 49152 entries, it cost ~6 ms of a ~114 ms
  decode step (the per-entry hash, the logs, and XLA:CPU's (value, index) argmax reduction at
  ~2.5 ms); inversion costs ~1.5 ms (bench/NOTES.md, session 25). Why not `jax.random.gumbel` per
  row: its vmapped, rolled-loop lowering was slower still (6.7 ms per model-S step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sequence_keys(seed_B, prompt_id_B, sample_id_B):
    """Per-sequence base keys (raw uint32 [B, 2])."""

    def one(seed, pid, sid):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), pid), sid)

    return jax.vmap(one)(seed_B, prompt_id_B, sample_id_B)


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32, 20 rounds (the Random123 reference schedule), elementwise over uint32 arrays."""
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):  # 5 groups of 4 rounds, a key injection after each
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ((x1 << jnp.uint32(r)) | (x1 >> jnp.uint32(32 - r))) ^ x0
        x0, x1 = x0 + ks[(i + 1) % 3], x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def _threefry_uniform(key_Bx2, v: int):
    """float32 [B, v] uniform in (0, 1): the hash of counters (j, 0), j < ceil(v / 2), under each
    row's key gives two 32-bit words per counter; the top 23 bits of a word are the mantissa."""
    half = (v + 1) // 2
    ctr = jnp.arange(half, dtype=jnp.uint32)[None, :]
    k = key_Bx2.astype(jnp.uint32)
    a, b = _threefry2x32(k[:, :1], k[:, 1:], ctr, jnp.zeros_like(ctr))
    bits = jnp.concatenate([a, b], axis=1)[:, :v]
    u = jax.lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    return jnp.maximum(u, jnp.finfo(jnp.float32).tiny)  # [0, 1) -> (0, 1)


def _truncate_sorted(s_BxV, top_k_B, top_p_B):
    """Mask (to -inf) the tokens outside top-k, then outside top-p, using one descending sort."""
    v = s_BxV.shape[-1]
    sorted_BxV = -jnp.sort(-s_BxV, axis=-1)
    rank_V = jnp.arange(v, dtype=jnp.int32)
    k_B = jnp.where((top_k_B > 0) & (top_k_B < v), top_k_B, v)
    in_k = rank_V[None, :] < k_B[:, None]
    p = jnp.where(in_k, jax.nn.softmax(sorted_BxV, axis=-1), 0.0)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    mass_before = jnp.cumsum(p, axis=-1) - p  # exclusive prefix sum: keep until mass reaches top_p
    keep = in_k & (mass_before < top_p_B[:, None])
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold_B = jnp.take_along_axis(sorted_BxV, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(s_BxV >= threshold_B, s_BxV, -jnp.inf)


def processed_logits(logits_BxV, temperature_B, top_k_B, top_p_B, min_p_B):
    """float32 [B, V]: l / T with excluded tokens at -inf (greedy rows: T treated as 1)."""
    l = logits_BxV.astype(jnp.float32)
    t = jnp.where(temperature_B > 0, temperature_B, 1.0).astype(jnp.float32)
    s = l / t[:, None]
    sampling = temperature_B > 0
    needs_sort = jnp.any(sampling & (((top_k_B > 0) & (top_k_B < l.shape[-1])) | (top_p_B < 1.0)))
    # Sorting the vocabulary is the costly part; skip it at run time when no row asks for it.
    truncated = jax.lax.cond(needs_sort, _truncate_sorted, lambda x, *_: x, s, top_k_B, top_p_B)
    s = jnp.where(sampling[:, None], truncated, s)
    # min-p in log space: p_i >= min_p * p_max  <=>  s_i >= s_max + log(min_p) (log 0 = -inf).
    floor = jnp.max(s, axis=-1, keepdims=True) + jnp.log(min_p_B.astype(jnp.float32))[:, None]
    return jnp.where(sampling[:, None] & (s < floor), -jnp.inf, s)


CDF_BLOCK = 128  # vocabulary entries per block of the two-level cumulative sum (`_invert`)


def _first_above(cum_BxN, target_B, positive_BxN):
    """Per row: the first index whose cumulative value exceeds target (>= 0), clamped to the last
    index with a positive term (rounding can leave target at or above the total)."""
    n = cum_BxN.shape[-1]
    first = jnp.sum((cum_BxN <= target_B[:, None]).astype(jnp.int32), axis=-1)
    last = jnp.max(jnp.where(positive_BxN, jnp.arange(n, dtype=jnp.int32)[None, :], -1), axis=-1)
    return jnp.minimum(first, last)


def _invert(s_BxV, m_B, u_B):
    """(token_B, z_B): the first entry whose cumulative probability under softmax(s) exceeds u_B, and
    z = sum(exp(s - m)) (m = max s per row), so logsumexp(s) = m + log z.

    Two levels: the sums of blocks of CDF_BLOCK entries and their cumulative sum pick the block (the
    first whose cumulative sum exceeds u z); the block's own cumulative sum picks the entry, at u z
    minus the mass before the block. An entry with probability 0 (s = -inf) is never picked: it
    never raises a cumulative sum above the target (targets are >= 0), and the clamps go to the
    last positive block and entry. float32 sums of at most V / CDF_BLOCK and CDF_BLOCK terms: the
    probability moved between neighbouring entries by rounding is ~1e-7 of the total."""
    b, v = s_BxV.shape
    nb = -(-v // CDF_BLOCK)
    pad = ((0, 0), (0, nb * CDF_BLOCK - v))
    padded = s_BxV if nb * CDF_BLOCK == v else jnp.pad(s_BxV, pad, constant_values=-jnp.inf)
    block_sums = jnp.sum(jnp.exp(padded - m_B[:, None]).reshape(b, nb, CDF_BLOCK), axis=-1)  # [B, nb]
    z = jnp.sum(block_sums, axis=-1)
    cum = jnp.cumsum(block_sums, axis=-1)
    target = u_B * z
    j = _first_above(cum, target, block_sums > 0)
    before = jnp.take_along_axis(cum - block_sums, j[:, None], axis=-1)[:, 0]
    cols = j[:, None] * CDF_BLOCK + jnp.arange(CDF_BLOCK, dtype=jnp.int32)[None, :]
    e = jnp.exp(jnp.take_along_axis(padded, cols, axis=-1) - m_B[:, None])  # the block's terms [B, CDF_BLOCK]
    i = _first_above(jnp.cumsum(e, axis=-1), jnp.maximum(target - before, 0.0), e > 0)
    return jnp.clip(j * CDF_BLOCK + i, 0, v - 1), z


def sample(logits_BxV, key_Bx2, position_B, temperature_B, top_k_B, top_p_B, min_p_B):
    """(token_B int32, logprob_B float32): one draw per row; see the module docstring."""
    s = processed_logits(logits_BxV, temperature_B, top_k_B, top_p_B, min_p_B)
    v = s.shape[-1]
    greedy = temperature_B <= 0
    m = jnp.max(s, axis=-1)
    keys = jax.vmap(jax.random.fold_in)(key_Bx2, position_B)
    drawn_B, z = _invert(s, m, _threefry_uniform(keys, 1)[:, 0])

    def first_max(s):  # argmax, the first of equal maxima, as two plain reductions (max above, min here)
        return jnp.min(jnp.where(s == m[:, None], jnp.arange(v, dtype=jnp.int32)[None, :], v), axis=-1)

    # Batches without a greedy row skip the argmax at run time.
    top_B = jax.lax.cond(jnp.any(greedy), first_max, lambda s: jnp.zeros(s.shape[:1], jnp.int32), s)
    token_B = jnp.minimum(jnp.where(greedy, top_B, drawn_B), v - 1).astype(jnp.int32)
    s_tok = jnp.take_along_axis(s, token_B[:, None], axis=-1)[:, 0]
    logprob_B = s_tok - (m + jnp.log(z))
    return token_B, logprob_B
