"""The naive generation baseline for bench/generate.py: a dense per-sequence KV cache
([L, B, max_len, K, E], every sequence reserves max_len) and a Python loop of single jitted decode
steps, reading each step's tokens back to the host (as a simple loop checking stop conditions does).

It reuses the model's pluggable attention and the sampler's sampling transforms, so the two variants
differ only in the engine (paging, chunked device loop, prefix sharing), not in the model.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rpeg_jax.sampling.transforms import sample, sequence_keys


@dataclasses.dataclass(frozen=True)
class DenseCacheAttention:
    """Writes this step's k/v at `pos` of a dense cache and attends causally over it."""

    pos_B: jax.Array

    def __call__(self, q, k, v, *, layer, cache):
        kc, vc = cache  # [L, B, M, K, E]
        b = q.shape[0]
        rows = jnp.arange(b)
        kc = kc.at[layer, rows, self.pos_B].set(k[:, 0].astype(kc.dtype))
        vc = vc.at[layer, rows, self.pos_B].set(v[:, 0].astype(vc.dtype))
        keys, vals = kc[layer], vc[layer]  # [B, M, K, E]
        m, kh, e = keys.shape[1], keys.shape[2], keys.shape[3]
        qg = q.reshape(b, 1, kh, q.shape[2] // kh, e)
        s = jnp.einsum("btkge,bmke->bkgtm", qg, keys, preferred_element_type=jnp.float32) * (e**-0.5)
        valid = jnp.arange(m)[None, :] <= self.pos_B[:, None]
        s = jnp.where(valid[:, None, None, None, :], s, -1e30)
        p = jax.nn.softmax(s, axis=-1).astype(vals.dtype)
        out = jnp.einsum("bkgtm,bmke->btkge", p, vals, preferred_element_type=jnp.float32)
        return out.reshape(q.shape).astype(q.dtype), (kc, vc)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _step(graphdef, params, cache, token_B, pos_B, keys_Bx2, temperature_B):
    model = nnx.merge(graphdef, params)
    h, cache = model.hidden(token_B[:, None], pos_B[:, None], attention=DenseCacheAttention(pos_B), cache=cache)
    logits = model.logits(h[:, 0])
    b = token_B.shape[0]
    zeros_i, ones_f = jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32)
    tok, logp = sample(logits, keys_Bx2, pos_B + 1, temperature_B, zeros_i, ones_f, jnp.zeros((b,), jnp.float32))
    return cache, tok, logp


def naive_generate(
    model, prompts: list[list[int]], max_new_tokens: int, temperature: float, n: int = 1, seed: int = 0
) -> np.ndarray:
    """Tokens [len(prompts) * n, max_new_tokens] (no stopping: benchmark use, ignore eos). Every
    sequence runs its own prompt through the step loop (no prefill, no sharing)."""
    cfg = model.cfg
    graphdef, params = nnx.split(model, nnx.Param)
    seqs = [p for p in prompts for _ in range(n)]
    b, lp = len(seqs), max(map(len, seqs))
    max_len = lp + max_new_tokens
    shape = (cfg.num_layers, b, max_len, cfg.num_kv_heads, cfg.head_size)
    dt = jnp.dtype(cfg.dtype)
    cache = (jnp.zeros(shape, dt), jnp.zeros(shape, dt))
    keys = sequence_keys(
        jnp.full((b,), seed, jnp.int32), jnp.repeat(jnp.arange(len(prompts)), n), jnp.tile(jnp.arange(n), len(prompts))
    )
    temp = jnp.full((b,), temperature, jnp.float32)
    lens = np.asarray([len(s) for s in seqs])
    known = np.zeros((b, max_len), np.int32)
    for i, s in enumerate(seqs):
        known[i, : len(s)] = s
    out = np.zeros((b, max_new_tokens), np.int32)
    # Equal-length prompts (the G1 workloads) step in lockstep: position t feeds token t.
    assert (lens == lp).all(), "naive baseline: prompts of equal length only"
    for t in range(lp + max_new_tokens - 1):
        pos = jnp.full((b,), t, jnp.int32)
        cache, tok, _ = _step(graphdef, params, cache, jnp.asarray(known[:, t]), pos, keys, temp)
        tok = np.asarray(tok)  # host readback every step
        if t + 1 >= lp:
            known[:, t + 1] = tok
            out[:, t + 1 - lp] = tok
    return out
