"""A mixture of experts' routing in the update forwards: the key of the sampler's expert records in a
batch and the routing metrics (rl.router_aux_loss, moe/*) over a forward's real tokens, shared by
the plain pass (runtime/kernels.py) and the packed one (runtime/packed_forward.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rpeg_jax.models.moe import load_balancing_loss, routing_agreement

EXPERTS = "experts_BxSxLxK"  # the sampler's record of each token's experts (runtime/rollout/layout.py)


def router_stats(route: dict, c: dict, k: int) -> dict:
    """The update forward's routing metrics over the batch's real tokens (segment id > 0), every
    sparse layer's tokens concatenated as HF does: "aux_loss" (models/moe.load_balancing_loss) and,
    where the rollout recorded experts, "routing_agreement" (the experts the forward used vs the
    sampler's, per token and layer: 1 under replay) and "topk_agreement" (the forward's own router
    top-k vs the sampler's: how far recompute would drift). `c`: segment_ids_BxS and EXPERTS laid
    out as the forward's rows (the batch's, or the packed rows')."""
    logits = route["logits"]  # [B, S, L, X]
    X = logits.shape[-1]
    real = jnp.broadcast_to((c["segment_ids_BxS"] > 0)[:, :, None], logits.shape[:3]).reshape(-1)
    out = {"aux_loss": load_balancing_loss(logits.reshape(-1, X), k, real)}
    if EXPERTS in c:
        rec = c[EXPERTS].reshape(-1, k)
        valid = real & jnp.all(rec >= 0, axis=-1)
        own = jax.lax.top_k(logits.reshape(-1, X), k)[1]
        out["routing_agreement"] = routing_agreement(route["experts"].reshape(-1, k), rec, valid)
        out["topk_agreement"] = routing_agreement(own, rec, valid)
    return out
