"""Rotary position embeddings (RoPE), with Llama-3 frequency scaling.

Hugging Face's convention (non-interleaved, "rotate half"): the head dimension E is split in two
halves (x1, x2) and rotated as (x1·cos − x2·sin, x2·cos + x1·sin) with angle = position · inv_freq.
Called by models/llama.py for q and k of every layer.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from rpeg_jax.config.model import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """inv_freq[i] = theta^(-2i/E), i < E/2, rescaled per Llama 3 when cfg.rope_scaling is set.

    Llama 3 scaling (Meta's reference, mirrored by HF `_compute_llama3_parameters`): wavelengths
    longer than original_max/low_freq_factor are divided by `factor`; shorter than
    original_max/high_freq_factor are kept; in between they are interpolated smoothly.
    """
    e = cfg.head_size
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e))
    s = cfg.rope_scaling
    if s is None:
        return inv.astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions_BxT: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin of shape [B, T, E/2] in float32, computed once per forward pass (see `_once`)."""
    angles = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return _once(jnp.cos(angles)), _once(jnp.sin(angles))


def _once(x):
    """x, materialised. XLA fuses an elementwise producer into each of its consumers, so cos/sin
    were recomputed for every head of q and k in every layer, forward and backward (XLA:CPU's
    cosine costs ~20x a multiply: ~10% of the tiny model's training step). A reduction is never
    fused into its consumers; this one adds exact zeros. (An optimization barrier does not help:
    XLA:CPU removes barriers before fusion.)"""
    return jnp.sum(jnp.stack([x, jnp.zeros_like(x)], axis=-1), axis=-1)


def apply_rope(x_BxTxNxE: jnp.ndarray, cos_BxTxE2: jnp.ndarray, sin_BxTxE2: jnp.ndarray) -> jnp.ndarray:
    """Rotate q or k (any head count N); computed in float32, returned in x's dtype."""
    x = x_BxTxNxE.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos_BxTxE2[:, :, None, :], sin_BxTxE2[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxE.dtype)
