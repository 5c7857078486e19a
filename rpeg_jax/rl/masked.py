"""Masked reductions over response tokens, NaN-safe at padding.

Every learner quantity lives on response-aligned [B, R] arrays with a 0/1 mask. Padding may
hold anything (NaN included: a sampler may leave garbage there), so values are selected with
`jnp.where` before any arithmetic; `0 * NaN` would otherwise leak NaN into sums and gradients.

Called by: rl.advantages, rl.losses, rl.metrics.
"""

from __future__ import annotations

import jax.numpy as jnp


def where_mask(x, mask):
    """x where mask else 0 (NaN at padding does not propagate, also not through gradients)."""
    return jnp.where(mask > 0, x, jnp.zeros_like(x))


def masked_sum(x, mask, axis=None):
    return jnp.sum(where_mask(x, mask), axis=axis)


def masked_count(mask, axis=None):
    return jnp.sum((mask > 0).astype(jnp.float32), axis=axis)


def masked_mean(x, mask, axis=None):
    """Mean over masked entries; 0 where there are none."""
    return masked_sum(x, mask, axis) / jnp.maximum(masked_count(mask, axis), 1.0)


def masked_var(x, mask, unbiased: bool = True):
    """Variance over all masked entries (unbiased by default, as torch.var); 0 for < 2 entries."""
    n = masked_count(mask)
    mean = masked_mean(x, mask)
    ss = masked_sum(jnp.square(x - mean), mask)
    denom = jnp.maximum(n - 1.0, 1.0) if unbiased else jnp.maximum(n, 1.0)
    return ss / denom


def masked_whiten(x, mask, eps: float = 1e-6, shift_mean: bool = True):
    """(x - mean) / sqrt(var + eps) over masked entries; 0 at padding."""
    mean = masked_mean(x, mask)
    out = (x - mean) * jnp.reciprocal(jnp.sqrt(masked_var(x, mask) + eps))
    if not shift_mean:
        out = out + mean
    return where_mask(out, mask)


def masked_max(x, mask):
    return jnp.max(jnp.where(mask > 0, x, -jnp.inf))


def masked_min(x, mask):
    return jnp.min(jnp.where(mask > 0, x, jnp.inf))
