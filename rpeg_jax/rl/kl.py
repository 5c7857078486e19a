"""Estimators of KL(π_θ || π_ref) from per-token log-probabilities of tokens sampled from π_θ.

Schulman, "Approximating KL Divergence" (2020), with log-ratio d = log π_θ(y) - log π_ref(y):
  k1 = d                      unbiased, high variance, can be negative per token
  k2 = d² / 2                 biased, low variance
  k3 = (e^{-d} - 1) + d       unbiased, low variance, >= 0 (GRPO's estimator, Shao 2024 eq. 4)
Used as a loss term (β·KL, GRPO) or folded into the per-token reward (PPO-RLHF); see
rl.losses and rl.advantages.
"""

from __future__ import annotations

import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "k2", "k3")
_K3_LOG_RATIO_CLAMP = 20.0  # e^{-d} overflows float32 near d = -88; verl clamps d to ±20 as well


def kl_estimate(logp, ref_logp, estimator: str = "k3"):
    """Per-token KL estimate (float32, same shape as the inputs)."""
    d = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * jnp.square(d)
    if estimator == "k3":
        d = jnp.clip(d, -_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
        return jnp.expm1(-d) + d
    raise ValueError(f"rl.kl_estimator={estimator!r}: must be one of {KL_ESTIMATORS}")
