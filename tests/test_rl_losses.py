"""Policy/value losses, aggregation and off-policy weights vs float64 numpy references.

References written here from the papers: PPO clipped surrogate (Schulman 2017 eq. 7), DAPO
clip-higher (Yu 2025 eq. 10), dual-clip (Ye 2020 eq. 5), GSPO (Zheng 2025 eq. 5-7, sequence
ratio s_i = (π_θ(y_i)/π_old(y_i))^{1/|y_i|}), decoupled PPO (Fu 2025 / AReaL eq. 5: ratio to the
proximal policy times the behaviour weight π_prox/π_behav, tokens above the cap dropped), TIS
(Yao 2025: min(π_old/π_rollout, C)), loss aggregation modes (token-mean: DAPO; seq-mean-token-mean:
GRPO eq. 3; seq-mean-token-sum-norm: Dr. GRPO), PPO2 clipped value loss.
Tolerances: float32 vs float64, rtol 1e-5, atol 1e-5 (values); finite-difference gradients
rtol 1e-3, atol 1e-4 (float64 central differences, step 1e-6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpeg_jax import rl
from rpeg_jax.config import RLConfig

TOL = dict(rtol=1e-5, atol=1e-5)
B, R = 6, 7


def make_inputs(seed, scale=0.4):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, R + 1, B)
    lens[0], lens[1] = 0, R
    mask = (np.arange(R)[None] < lens[:, None]).astype(np.float32)
    old = (-rng.random((B, R)) * 2).astype(np.float32)
    logp = (old + rng.normal(size=(B, R)) * scale).astype(np.float32)
    adv = rng.normal(size=(B, R)).astype(np.float32)
    return mask, logp, old, adv


# ---------------------------------------------------------------- numpy references (float64)
def np_ppo_tok(logp, old, adv, el, eh, dual=None):
    ratio = np.exp(logp.astype(np.float64) - old)
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - el, 1 + eh))
    if dual is not None:
        loss = np.where(adv < 0, np.minimum(loss, -dual * adv), loss)
    return loss


def np_agg(loss, mask, mode, norm=None):
    loss = np.where(mask > 0, loss, 0.0)
    if mode == "token-mean":
        return loss.sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        lens = mask.sum(1)
        per = [loss[i].sum() / lens[i] for i in range(len(lens)) if lens[i] > 0]
        return np.mean(per)
    return loss.sum() / (mask.shape[0] * (norm or mask.shape[1]))


def np_gspo(logp, old, adv_seq, mask, el, eh):
    """GSPO sequence objective, mean over non-empty sequences."""
    losses = []
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        if n == 0:
            continue
        s = np.exp(np.sum((logp[i, :n].astype(np.float64) - old[i, :n])) / n)
        losses.append(max(-adv_seq[i] * s, -adv_seq[i] * np.clip(s, 1 - el, 1 + eh)))
    return np.mean(losses)


def jx(*xs):
    return [jnp.asarray(x) for x in xs]


def agg_loss(tok_loss, mask, mode, norm=None):
    w, _ = rl.agg_weights(jnp.asarray(mask), mode, norm)
    return jnp.sum(jnp.where(w > 0, tok_loss, 0.0) * w)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("el,eh,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 1.2)])
def test_ppo_token_loss(el, eh, dual):
    mask, logp, old, adv = make_inputs(0)
    loss, clipped, lower = rl.ppo_token_loss(*jx(logp, old, adv, mask), eps_low=el, eps_high=eh, dual_clip=dual)
    ref = np_ppo_tok(logp, old, adv, el, eh, dual) * mask
    np.testing.assert_allclose(np.asarray(loss), ref, **TOL)
    ratio = np.exp(logp.astype(np.float64) - old)
    ref_clip = ((-adv * np.clip(ratio, 1 - el, 1 + eh)) > (-adv * ratio)) * mask
    np.testing.assert_array_equal(np.asarray(clipped), ref_clip)
    assert 0 < ref_clip.sum() < mask.sum()  # the inputs do exercise clipping
    if dual is not None:
        undual = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - el, 1 + eh))
        ref_lower = ((adv < 0) & (undual > -dual * adv)) * mask
        np.testing.assert_array_equal(np.asarray(lower), ref_lower)
        assert ref_lower.sum() > 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_modes(mode):
    mask, logp, old, adv = make_inputs(1)
    tok = np_ppo_tok(logp, old, adv, 0.2, 0.2)
    tok_nan = np.where(mask > 0, tok, np.nan).astype(np.float32)  # padding garbage is ignored
    got = agg_loss(jnp.asarray(tok_nan), mask, mode, 16 if mode.endswith("norm") else None)
    np.testing.assert_allclose(float(got), np_agg(tok, mask, mode, 16), **TOL)


def test_gspo_value_and_gradient():
    mask, logp, old, _ = make_inputs(2, scale=0.05)
    adv_seq = np.random.default_rng(3).normal(size=B).astype(np.float32)
    adv = np.repeat(adv_seq[:, None], R, 1) * mask
    el, eh = 0.02, 0.03

    def f(lp):
        tok, _, _ = rl.ppo_token_loss(lp, *jx(old, adv, mask), eps_low=el, eps_high=eh, seq_ratio=True)
        return agg_loss(tok, mask, "seq-mean-token-mean")

    val, grad = jax.value_and_grad(f)(jnp.asarray(logp))
    np.testing.assert_allclose(float(val), np_gspo(logp, old, adv_seq, mask, el, eh), **TOL)
    lp64, h, num = logp.astype(np.float64), 1e-6, np.zeros((B, R))
    for i, t in zip(*np.nonzero(mask)):
        e = np.zeros_like(lp64)
        e[i, t] = h
        up, down = (np_gspo(lp64 + s * e, old, adv_seq, mask, el, eh) for s in (1, -1))
        num[i, t] = (up - down) / (2 * h)
    np.testing.assert_allclose(np.asarray(grad), num, rtol=1e-3, atol=1e-4)
    assert np.abs(num).sum() > 0 and np.any(num == 0)  # both clipped and unclipped sequences occur


def np_behaviour(prox, behav, mask, cap, tis):
    w = np.exp(prox.astype(np.float64) - behav)
    keep = mask > 0
    if cap is not None:
        keep &= w <= cap
    w = np.where(keep, w, 0.0)
    return np.minimum(w, tis) if tis is not None else w


@pytest.mark.parametrize("cap,tis", [(1.5, None), (None, 1.2), (2.0, 1.3)])
def test_decoupled_and_tis_objective(cap, tis):
    mask, logp, prox, adv = make_inputs(4)
    behav = (prox + np.random.default_rng(5).normal(size=(B, R)) * 0.5).astype(np.float32)
    cfg = RLConfig(clip_eps=0.2, behav_weight_cap=cap, tis_cap=tis)
    keys = ["response_mask_BxR", "old_logp_BxR", "advantages_BxR", "behav_logp_BxR"]
    mb = dict(zip(keys, jx(mask, prox, adv, behav)))
    lw, tw = rl.agg_weights(mb["response_mask_BxR"], "token-mean")
    loss, metrics = rl.actor_objective({"logp": jnp.asarray(logp)}, mb, cfg, lw, tw)
    w = np_behaviour(prox, behav, mask, cap, tis)
    ref = np_agg(w * np_ppo_tok(logp, prox, adv, 0.2, 0.2), mask, "token-mean")
    np.testing.assert_allclose(float(loss), ref, **TOL)
    if cap is not None:
        dropped = ((np.exp(prox.astype(np.float64) - behav) > cap) & (mask > 0)).sum() / mask.sum()
        assert dropped > 0
        np.testing.assert_allclose(float(metrics["actor/behav_dropped_frac"]), dropped, **TOL)


def test_decoupled_reduces_to_ppo_when_behaviour_equals_proximal():
    mask, logp, old, adv = make_inputs(6)
    cfg = RLConfig(clip_eps=0.2, behav_weight_cap=2.0, tis_cap=1.5, dual_clip=3.0)
    base = dict(zip(["response_mask_BxR", "old_logp_BxR", "advantages_BxR"], jx(mask, old, adv)))
    lw, tw = rl.agg_weights(base["response_mask_BxR"], "token-mean")

    def f(lp, mb):
        return rl.actor_objective({"logp": lp}, mb, cfg, lw, tw)[0]

    plain = jax.value_and_grad(f)(jnp.asarray(logp), base)
    decoupled = jax.value_and_grad(f)(jnp.asarray(logp), {**base, "behav_logp_BxR": base["old_logp_BxR"]})
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(decoupled[0]))
    np.testing.assert_array_equal(np.asarray(plain[1]), np.asarray(decoupled[1]))


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss(clip):
    rng = np.random.default_rng(7)
    mask = make_inputs(7)[0]
    v, v_old, ret = (rng.normal(size=(B, R)).astype(np.float32) for _ in range(3))
    loss, clipped = rl.value_token_loss(*jx(v, v_old, ret, mask), clip)
    l1 = (v.astype(np.float64) - ret) ** 2
    if clip is None:
        ref = 0.5 * l1
    else:
        ref = 0.5 * np.maximum(l1, (v_old + np.clip(v.astype(np.float64) - v_old, -clip, clip) - ret) ** 2)
    np.testing.assert_allclose(np.asarray(loss), ref * mask, **TOL)


def test_actor_objective_with_kl_and_entropy():
    mask, logp, old, adv = make_inputs(8)
    rng = np.random.default_rng(9)
    ref_lp = (logp + rng.normal(size=(B, R)) * 0.3).astype(np.float32)
    ent = rng.random((B, R)).astype(np.float32)
    cfg = RLConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    mb = dict(zip(["response_mask_BxR", "old_logp_BxR", "advantages_BxR", "ref_logp_BxR"], jx(mask, old, adv, ref_lp)))
    lw, tw = rl.agg_weights(mb["response_mask_BxR"], cfg.loss_agg)
    loss, m = rl.actor_objective({"logp": jnp.asarray(logp), "entropy": jnp.asarray(ent)}, mb, cfg, lw, tw)
    d = logp.astype(np.float64) - ref_lp
    k3 = np.exp(-d) - 1 + d
    mode = "seq-mean-token-mean"
    ref = (
        np_agg(np_ppo_tok(logp, old, adv, 0.2, 0.2), mask, mode)
        + 0.1 * np_agg(k3, mask, mode)
        - 0.01 * np_agg(ent, mask, mode)
    )
    np.testing.assert_allclose(float(loss), ref, **TOL)
    np.testing.assert_allclose(float(m["actor/kl"]), np_agg(k3, mask, "token-mean"), **TOL)
    np.testing.assert_allclose(float(m["actor/entropy"]), np_agg(ent, mask, "token-mean"), **TOL)
    ppo_kl = np_agg(old - logp.astype(np.float64), mask, "token-mean")
    np.testing.assert_allclose(float(m["actor/ppo_kl"]), ppo_kl, **TOL)


def test_nonfinite_inputs_make_the_loss_nan_but_padding_is_ignored():
    mask, logp, old, adv = make_inputs(10)
    cfg = RLConfig()
    lw, tw = rl.agg_weights(jnp.asarray(mask), "token-mean")
    keys = ["response_mask_BxR", "old_logp_BxR", "advantages_BxR", "behav_logp_BxR"]

    def loss(o, a, bh, lp=logp):
        return float(rl.actor_objective({"logp": jnp.asarray(lp)}, dict(zip(keys, jx(mask, o, a, bh))), cfg, lw, tw)[0])

    pad = np.where(mask > 0, 0.0, np.nan).astype(np.float32)
    assert np.isfinite(loss(old + pad, adv + pad, old + pad, logp + pad))
    np.testing.assert_allclose(loss(old + pad, adv + pad, old + pad), loss(old, adv, old), **TOL)
    i, t = 1, 3  # a response token
    for bad in (np.nan, np.inf, -np.inf):
        for which in range(4):
            arrs = [old.copy(), adv.copy(), old.copy(), logp.copy()]
            arrs[which][i, t] = bad
            assert np.isnan(loss(*arrs)), (bad, which)
