"""Batch-level metrics of a rollout batch, under the names verl users know.

Called by the runtime once per step on the batch the update consumed (jit-able):
  reward/{mean,std,max,min,nonfinite}, response_length/{mean,max,min,clip_ratio},
  advantages/{mean,max,min}, returns/{mean,max,min}, critic/values/mean,
  staleness/{mean,max} (trainer version minus the version that produced each token).
Learner metrics (actor/*, critic/*) come from rl.update.
"""

from __future__ import annotations

import jax.numpy as jnp

from rpeg_jax.rl.masked import masked_max, masked_mean, masked_min


def _stats(prefix, x, mask, which=("mean", "max", "min")):
    fns = {"mean": masked_mean, "max": masked_max, "min": masked_min}
    return {f"{prefix}/{w}": fns[w](x, mask) for w in which}


def batch_metrics(batch: dict, *, version=None, max_response_len: int | None = None) -> dict:
    """Scalar float32 metrics of a rollout batch (fields that are absent are skipped).
    `max_response_len` is the generation limit (a response reaching it was clipped); default R."""
    mask = batch["response_mask_BxR"]
    out = {}
    if "rewards_B" in batch:
        r = batch["rewards_B"].astype(jnp.float32)
        fin = jnp.isfinite(r)
        mean = masked_mean(r, fin)
        out.update(_stats("reward", r, fin))
        out["reward/std"] = jnp.sqrt(masked_mean(jnp.square(r - mean), fin))
        out["reward/nonfinite"] = jnp.sum(~fin).astype(jnp.float32)
    length = jnp.sum(mask > 0, -1).astype(jnp.float32)
    out.update(
        {
            "response_length/mean": jnp.mean(length),
            "response_length/max": jnp.max(length),
            "response_length/min": jnp.min(length),
            "response_length/clip_ratio": jnp.mean(
                (length >= (max_response_len or mask.shape[-1])).astype(jnp.float32)
            ),
        }
    )
    for key, name in (("advantages_BxR", "advantages"), ("returns_BxR", "returns")):
        if key in batch:
            out.update(_stats(name, batch[key].astype(jnp.float32), mask))
    if "values_BxR" in batch:
        out["critic/values/mean"] = masked_mean(batch["values_BxR"].astype(jnp.float32), mask)
    if "versions_BxR" in batch and version is not None:
        lag = (jnp.asarray(version) - batch["versions_BxR"]).astype(jnp.float32)
        out.update(_stats("staleness", lag, mask, ("mean", "max")))
    return out
