"""Policy and value losses of PPO-family RL, per token, with explicit loss aggregation.

Pure functions of arrays; the update stages (rl.update) call `actor_objective`,
`critic_objective`. Formulas (ratio ρ_t = π_θ(y_t)/π_prox(y_t), advantage A_t):

  PPO clipped surrogate (Schulman 2017 eq. 7), DAPO clip-higher (Yu 2025 eq. 10):
      L_t = -min(ρ_t A_t, clip(ρ_t, 1-ε_low, 1+ε_high) A_t)
  Dual-clip (Ye 2020 eq. 5): for A_t < 0, L_t = min(L_t, -c·A_t)
  GSPO (Zheng 2025 eq. 7, the GSPO-token form): ρ_t has the value of the sequence ratio
      s_i = exp(mean_t log(π_θ/π_prox)) and the gradient s_i ∇log π_θ(y_t)
  Decoupled PPO (Fu 2025, AReaL eq. 5): L_t is multiplied by the behaviour weight
      w_t = π_prox(y_t)/π_behav(y_t) (no gradient); tokens with w_t > C are dropped (AReaL)
  TIS (Yao 2025): w_t <- min(w_t, C_tis), the same weight truncated instead of dropped
  Value loss (PPO2 / verl): 0.5·max((V-R)², (V_old + clip(V-V_old, ±ε_v) - R)²)

Aggregation is a weighted sum Σ w_{i,t}·L_{i,t} with weights fixed over the whole minibatch
(`agg_weights`), so splitting a minibatch into micro-batches and summing their losses gives
exactly the minibatch loss (gradient accumulation is exact, unlike per-micro-batch means).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rpeg_jax.config.rl import RLConfig
from rpeg_jax.rl.kl import kl_estimate
from rpeg_jax.rl.masked import masked_count, where_mask

_LOG_RATIO_CLAMP = 20.0  # exp() of a log-ratio is taken after clamping to ±20 (as verl), no overflow


def agg_weights(mask_BxR, mode: str, norm_len: int | None = None):
    """Per-token weights (loss_w, tok_w) for one minibatch: loss = Σ loss_w·L; tok_w = token mean.

    token-mean:              Σ_{i,t} L / Σ_{i,t} m                 (DAPO's token-level loss)
    seq-mean-token-mean:     mean_i [Σ_t L / |y_i|] over non-empty i (GRPO, Shao 2024 eq. 3)
    seq-mean-token-sum-norm: Σ_{i,t} L / (B · norm_len)            (Dr. GRPO, constant normaliser)
    """
    m = (mask_BxR > 0).astype(jnp.float32)
    tok_w = m / jnp.maximum(jnp.sum(m), 1.0)
    if mode == "token-mean":
        return tok_w, tok_w
    if mode == "seq-mean-token-mean":
        length = jnp.sum(m, -1, keepdims=True)
        n_seq = jnp.maximum(jnp.sum(length > 0), 1).astype(jnp.float32)
        return m / jnp.maximum(length, 1.0) / n_seq, tok_w
    if mode == "seq-mean-token-sum-norm":
        norm = float(norm_len if norm_len is not None else m.shape[-1])
        return m / (m.shape[0] * norm), tok_w
    raise ValueError(f"rl.loss_agg={mode!r}: unknown aggregation")


def overlong_mask(tokens_BxR, mask_BxR, max_len: int, stop_ids=()):
    """DAPO's overlong filtering: the response mask with every truncated row zeroed (a row of
    `max_len` tokens whose last token is no eos/stop id), so it carries no policy-loss weight and
    no weight in the loss normaliser; returns (mask_BxR, truncated_B float32)."""
    m = mask_BxR > 0
    length = jnp.sum(m, -1)
    last = jnp.take_along_axis(tokens_BxR, jnp.maximum(length - 1, 0)[:, None].astype(jnp.int32), axis=1)[:, 0]
    stopped = jnp.isin(last, jnp.asarray(stop_ids, last.dtype)) if len(stop_ids) else jnp.zeros_like(m[:, 0])
    cut = (length >= max_len) & ~stopped
    return jnp.where(cut[:, None], jnp.zeros_like(mask_BxR), mask_BxR), cut.astype(jnp.float32)


def wsum(x, w):
    """Σ w·x with x selected by w > 0 (padding never contributes, NaN there included)."""
    return jnp.sum(jnp.where(w > 0, x, 0.0) * w)


def ppo_token_loss(
    logp,
    old_logp,
    adv,
    mask,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    seq_ratio: bool = False,
):
    """Per-token clipped-surrogate loss and its clip indicators (float32 [B, R] each)."""
    logp, old_logp, adv = (where_mask(x.astype(jnp.float32), mask) for x in (logp, old_logp, adv))
    log_ratio = logp - old_logp
    if seq_ratio:  # GSPO: value = mean log-ratio of the sequence, gradient = ∇ log π_θ(y_t)
        seq = jnp.sum(log_ratio, -1, keepdims=True) / jnp.maximum(masked_count(mask, -1)[:, None], 1.0)
        log_ratio = jax.lax.stop_gradient(seq) + logp - jax.lax.stop_gradient(logp)
    ratio = jnp.exp(jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(l1, l2)
    clipped = (l2 > l1).astype(jnp.float32)
    lower = jnp.zeros_like(loss)
    if dual_clip is not None:
        l3 = -adv * dual_clip
        lower = ((adv < 0) & (loss > l3)).astype(jnp.float32)
        loss = jnp.where(adv < 0, jnp.minimum(loss, l3), loss)
    return where_mask(loss, mask), where_mask(clipped, mask), where_mask(lower, mask)


def behaviour_weights(prox_logp, behav_logp, mask, *, cap: float | None, tis_cap: float | None):
    """w_t = π_prox/π_behav (no gradient): 0 where w > cap (dropped), truncated at tis_cap.

    A NaN weight is kept (not dropped), so a NaN logprob reaches the loss and the NaN guard.
    Returns (w_BxR, dropped_BxR, truncated_BxR)."""
    d = where_mask(prox_logp.astype(jnp.float32) - behav_logp.astype(jnp.float32), mask)
    w = jax.lax.stop_gradient(jnp.exp(jnp.clip(d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)))
    dropped = jnp.zeros_like(w) if cap is None else ((w > cap) & (mask > 0)).astype(jnp.float32)
    w = jnp.where(dropped > 0, 0.0, w)
    truncated = jnp.zeros_like(w)
    if tis_cap is not None:
        truncated = ((w > tis_cap) & (mask > 0)).astype(jnp.float32)
        w = jnp.minimum(w, tis_cap)
    return where_mask(w, mask), dropped, truncated


def value_token_loss(values, old_values, returns, mask, clip: float | None):
    """0.5·max((V-R)², (V_clipped-R)²) per token and the clip indicator."""
    v, v_old, ret = (where_mask(x.astype(jnp.float32), mask) for x in (values, old_values, returns))
    l1 = jnp.square(v - ret)
    if clip is None:
        return where_mask(0.5 * l1, mask), jnp.zeros_like(l1)
    l2 = jnp.square(v_old + jnp.clip(v - v_old, -clip, clip) - ret)
    return where_mask(0.5 * jnp.maximum(l1, l2), mask), where_mask((l2 > l1).astype(jnp.float32), mask)


def all_finite(mask, *arrays):
    """True when every array is finite at every response token (padding is ignored)."""
    ok = jnp.array(True)
    for x in arrays:
        ok = ok & jnp.all(jnp.isfinite(where_mask(x, mask)))
    return ok


def actor_objective(out: dict, mb: dict, cfg: RLConfig, loss_w, tok_w):
    """Actor loss (pg - c_e·H + β·KL) for one (micro-)batch and its additive metrics.

    `out` = policy_fn output (logp, optional entropy, optional router: a MoE forward's scalar
    aux_loss and agreements, added to the loss as rl.router_aux_loss x aux_loss, logged as moe/*,
    each weighted by the micro-batch's share of tokens); `mb` holds response_mask_BxR,
    advantages_BxR, old_logp_BxR and optionally behav_logp_BxR, ref_logp_BxR. Non-finite inputs at
    response tokens make the loss NaN on purpose, so that the update's guard skips the step."""
    mask, logp = mb["response_mask_BxR"], out["logp"]
    old, adv = mb["old_logp_BxR"], mb["advantages_BxR"]
    pg_tok, clipped, lower = ppo_token_loss(
        logp,
        old,
        adv,
        mask,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        dual_clip=cfg.dual_clip,
        seq_ratio=cfg.policy_loss == "gspo",
    )
    checked = [logp, old, adv]
    metrics = {}
    if "behav_logp_BxR" in mb:
        w, dropped, truncated = behaviour_weights(
            old, mb["behav_logp_BxR"], mask, cap=cfg.behav_weight_cap, tis_cap=cfg.tis_cap
        )
        pg_tok = pg_tok * w
        checked.append(mb["behav_logp_BxR"])
        metrics.update(
            {
                "actor/behav_weight_mean": wsum(w, tok_w),
                "actor/behav_dropped_frac": wsum(dropped, tok_w),
                "actor/tis_clipfrac": wsum(truncated, tok_w),
            }
        )
    pg_loss = wsum(pg_tok, loss_w)
    loss = pg_loss
    metrics.update(
        {
            "actor/pg_loss": pg_loss,
            "actor/pg_clipfrac": wsum(clipped, tok_w),
            "actor/ppo_kl": wsum(where_mask(old - logp, mask), tok_w),
        }
    )
    if cfg.dual_clip is not None:
        metrics["actor/pg_clipfrac_lower"] = wsum(lower, tok_w)
    use_kl_loss = cfg.kl_coef > 0 and not cfg.kl_in_reward
    if use_kl_loss and "ref_logp_BxR" not in mb:
        raise ValueError(f"rl.kl_coef={cfg.kl_coef} (KL as a loss) needs ref_logp_BxR in the batch")
    if "ref_logp_BxR" in mb:
        kl = kl_estimate(where_mask(logp, mask), where_mask(mb["ref_logp_BxR"], mask), cfg.kl_estimator)
        checked.append(mb["ref_logp_BxR"])
        kl_loss = wsum(kl, loss_w)
        metrics.update({"actor/kl": wsum(kl, tok_w), "actor/kl_loss": kl_loss})
        if use_kl_loss:
            loss = loss + cfg.kl_coef * kl_loss
    ent = out.get("entropy")
    if cfg.entropy_coef > 0 and ent is None:
        raise ValueError(f"rl.entropy_coef={cfg.entropy_coef} needs policy_fn to return 'entropy'")
    if ent is not None:
        checked.append(ent)
        metrics["actor/entropy"] = wsum(ent, tok_w)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * wsum(ent, loss_w)
    router = out.get("router")  # a MoE forward's routing stats over this micro-batch (runtime/kernels.router_stats)
    if router is not None:
        share = jnp.sum(tok_w)  # the micro-batch's share of the minibatch's tokens: the metrics stay additive
        metrics.update({f"moe/{k}": v * share for k, v in router.items()})
        if cfg.router_aux_loss > 0:
            loss = loss + cfg.router_aux_loss * router["aux_loss"] * share
    elif cfg.router_aux_loss > 0:
        raise ValueError(f"rl.router_aux_loss={cfg.router_aux_loss} needs policy_fn to return 'router' (a MoE model)")
    loss = jnp.where(all_finite(mask, *checked), loss, jnp.nan)
    return loss, metrics


def critic_objective(out: dict, mb: dict, cfg: RLConfig, loss_w, tok_w):
    """Value loss for one (micro-)batch: needs out['values'], values_BxR (old), returns_BxR."""
    if out.get("values") is None:
        raise ValueError("the critic/shared update needs the forward function to return 'values'")
    mask, v = mb["response_mask_BxR"], out["values"]
    vf_tok, clipped = value_token_loss(v, mb["values_BxR"], mb["returns_BxR"], mask, cfg.value_clip)
    vf_loss = wsum(vf_tok, loss_w)
    metrics = {
        "critic/vf_loss": vf_loss,
        "critic/vf_clipfrac": wsum(clipped, tok_w),
        "critic/vpred_mean": wsum(where_mask(v, mask), tok_w),
    }
    ok = all_finite(mask, v, mb["values_BxR"], mb["returns_BxR"])
    return jnp.where(ok, vf_loss, jnp.nan), metrics
