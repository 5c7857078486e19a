"""Advantage estimators: GRPO / Dr. GRPO, RLOO and GAE, plus the per-token KL-penalised reward.

All are pure functions over response-aligned arrays (B sequences, R response tokens, mask
1 for generated tokens). The advantage stage of the RPEG graph calls `compute_advantages`;
the formulas, each with its paper:

  GRPO (Shao 2024, §4.1.2):  A_i = (r_i - mean_g r) / (std_g r + ε)   (std unbiased, as torch.std)
  Dr. GRPO (Liu 2025, §3.2): A_i = r_i - mean_g r                        (norm_by_std=False)
  RLOO (Ahmadian 2024 eq. 9): A_i = r_i - 1/(G-1) Σ_{j≠i} r_j
  GAE (Schulman 2016 eq. 16): δ_t = r_t + γ V_{t+1} - V_t,  A_t = Σ_l (γλ)^l δ_{t+l},
                              V after the last response token = 0 (episode ends), R_t = A_t + V_t.

A group whose rewards are all identical (zero std) gets advantage exactly 0, not 0/ε noise.
Non-finite rewards propagate NaN into their own group only; the update's NaN guard then skips
the step (see rl.update).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rpeg_jax.config.rl import RLConfig
from rpeg_jax.rl.kl import kl_estimate
from rpeg_jax.rl.layout import replicated
from rpeg_jax.rl.masked import masked_mean, masked_whiten, where_mask


def _group_stats(rewards_B, group_ids_B, group_size):
    """Per sequence: its group's (count, sum, max, min), from contiguous groups or group ids."""
    r = rewards_B.astype(jnp.float32)
    if group_ids_B is None:
        b = r.shape[0]
        if b % group_size:
            raise ValueError(f"rewards_B has {b} entries, not a multiple of rl.group_size={group_size}")
        g = r.reshape(b // group_size, group_size)
        stats = (
            jnp.full_like(g, group_size),
            jnp.sum(g, 1, keepdims=True),
            jnp.max(g, 1, keepdims=True),
            jnp.min(g, 1, keepdims=True),
        )
        return tuple(jnp.broadcast_to(s, g.shape).reshape(b) for s in stats)
    # B x B "same group" table: group ids may be any ints (global prompt ids), no segment count.
    # Rows keep the batch sharding; the columns (all of the batch) are gathered to every device.
    same = group_ids_B[:, None] == replicated(group_ids_B)[None, :]
    rr = jnp.broadcast_to(replicated(r)[None, :], same.shape)
    return (
        jnp.sum(same, 1).astype(jnp.float32),
        jnp.sum(jnp.where(same, rr, 0.0), 1),
        jnp.max(jnp.where(same, rr, -jnp.inf), 1),
        jnp.min(jnp.where(same, rr, jnp.inf), 1),
    )


def _group_sq_dev(rewards_B, mean_B, group_ids_B, group_size):
    """Σ_{j in group(i)} (r_j - mean_i)²."""
    r = rewards_B.astype(jnp.float32)
    if group_ids_B is None:
        g = r.reshape(-1, group_size)
        ss = jnp.sum(jnp.square(g - mean_B.reshape(g.shape)[:, :1]), 1, keepdims=True)
        return jnp.broadcast_to(ss, g.shape).reshape(-1)
    same = group_ids_B[:, None] == replicated(group_ids_B)[None, :]
    return jnp.sum(jnp.where(same, jnp.square(replicated(r)[None, :] - mean_B[:, None]), 0.0), 1)


def grpo_advantages(
    rewards_B, *, group_ids_B=None, group_size: int | None = None, norm_by_std: bool = True, eps: float = 1e-6
):
    """Sequence-level GRPO advantage A_B (float32). Groups: `group_ids_B` or contiguous of G."""
    n, s, hi, lo = _group_stats(rewards_B, group_ids_B, group_size)
    mean = s / n
    adv = rewards_B.astype(jnp.float32) - mean
    if norm_by_std:
        std = jnp.sqrt(_group_sq_dev(rewards_B, mean, group_ids_B, group_size) / jnp.maximum(n - 1.0, 1.0))
        adv = adv / (std + eps)
    return jnp.where(hi == lo, 0.0, adv)  # identical rewards (or a singleton group): exactly 0


def rloo_advantages(rewards_B, *, group_ids_B=None, group_size: int | None = None):
    """RLOO: reward minus the mean of the other G-1 rewards of the group (float32 [B])."""
    n, s, hi, lo = _group_stats(rewards_B, group_ids_B, group_size)
    r = rewards_B.astype(jnp.float32)
    adv = r - (s - r) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(hi == lo, 0.0, adv)


def last_token_mask(mask_BxR):
    """1 at each row's last valid response token (none for an empty response)."""
    r = mask_BxR.shape[-1]
    valid = mask_BxR > 0
    last = r - 1 - jnp.argmax(valid[:, ::-1], axis=-1)
    onehot = jnp.arange(r)[None, :] == last[:, None]
    return (onehot & jnp.any(valid, -1, keepdims=True)).astype(jnp.float32)


def token_rewards(rewards_B, mask_BxR, *, kl_BxR=None, kl_coef: float = 0.0):
    """Per-token reward: the sequence reward at the last valid token, minus β·KL_t per token."""
    last = last_token_mask(mask_BxR)
    out = jnp.where(last > 0, rewards_B.astype(jnp.float32)[:, None], 0.0)
    if kl_BxR is not None and kl_coef:
        out = out - kl_coef * where_mask(kl_BxR.astype(jnp.float32), mask_BxR)
    return out


def gae(rewards_BxR, values_BxR, mask_BxR, *, gamma: float, lam: float):
    """GAE(γ, λ) by a reverse scan over tokens. Returns (advantages_BxR, returns_BxR), 0 at padding.

    Masked positions are skipped (the carried next-value and trace pass through them), so holes in
    the mask (e.g. tool output in multi-turn) are handled as verl does; after the last valid token
    V = 0 (terminal).
    """
    m = (mask_BxR > 0).T
    r = where_mask(rewards_BxR.astype(jnp.float32), mask_BxR).T
    v = where_mask(values_BxR.astype(jnp.float32), mask_BxR).T

    def step(carry, x):
        next_v, next_a = carry
        r_t, v_t, m_t = x
        a_t = r_t + gamma * next_v - v_t + gamma * lam * next_a
        carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
        return carry, jnp.where(m_t, a_t, 0.0)

    zeros = jnp.zeros_like(r[0])  # [B], laid out like the batch (sharding in types)
    _, adv = jax.lax.scan(step, (zeros, zeros), (r, v, m), reverse=True)
    adv = adv.T
    return adv, where_mask(adv + values_BxR.astype(jnp.float32), mask_BxR)


def compute_advantages(batch: dict, cfg: RLConfig) -> tuple[dict, dict]:
    """The advantage stage: batch (rewards_B, response_mask_BxR, ...) -> ({advantages_BxR,
    returns_BxR}, metrics). `cfg` is an RLConfig. GRPO/RLOO returns equal the advantages (as verl)."""
    mask = batch["response_mask_BxR"]
    est = cfg.advantage_estimator
    metrics = {}
    if est in ("grpo", "rloo"):
        if cfg.kl_in_reward:
            raise ValueError(f"rl.kl_in_reward=True needs rl.advantage=gae, not {est!r}")
        gid = batch.get("group_ids_B")
        if est == "grpo":
            adv_B = grpo_advantages(
                batch["rewards_B"],
                group_ids_B=gid,
                group_size=cfg.group_size,
                norm_by_std=cfg.norm_adv_by_std,
                eps=cfg.adv_eps,
            )
        else:
            adv_B = rloo_advantages(batch["rewards_B"], group_ids_B=gid, group_size=cfg.group_size)
        adv = where_mask(jnp.broadcast_to(adv_B[:, None], mask.shape), mask)
        ret = adv
    elif est == "gae":
        kl = None
        if cfg.kl_in_reward and cfg.kl_coef:
            logp = batch.get("old_logp_BxR", batch.get("behav_logp_BxR"))
            if logp is None or "ref_logp_BxR" not in batch:
                raise ValueError("rl.kl_in_reward needs old_logp_BxR (or behav_logp_BxR) and ref_logp_BxR in the batch")
            kl = kl_estimate(logp, batch["ref_logp_BxR"], cfg.kl_estimator)
            metrics["actor/reward_kl_penalty"] = masked_mean(kl, mask)
            metrics["actor/reward_kl_penalty_coeff"] = jnp.float32(cfg.kl_coef)
        rew = token_rewards(batch["rewards_B"], mask, kl_BxR=kl, kl_coef=cfg.kl_coef)
        adv, ret = gae(rew, batch["values_BxR"], mask, gamma=cfg.gamma, lam=cfg.lam)
    else:
        raise ValueError(f"rl.advantage={est!r}: unknown estimator")
    if cfg.whiten_advantages:
        adv = masked_whiten(adv, mask, eps=cfg.adv_eps)
    return {"advantages_BxR": adv, "returns_BxR": ret}, metrics
