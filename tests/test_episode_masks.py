"""Training on multi-turn episodes (issue 32 item 5): observation tokens are 0 in response_mask_BxR between
sampled turns, and the actor objective (PPO-clip policy loss, k3 KL as a loss, entropy bonus, decoupled-PPO
behaviour weights, token-mean and seq-mean-token-mean normalisers) gives them exactly zero gradient and
counts only sampled tokens. References: (a) the same rows with the observation tokens cut out (a plain
right-padded layout with no interior zeros), (b) a float64 numpy formula of the token-mean loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpeg_jax import rl
from rpeg_jax.config import RLConfig

# 3 episodes: sampled turns (1) with observations (0) between them, then padding (0)
MASK = np.array(
    [
        [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1],
        [1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
    ],
    np.float32,
)


def case(seed=0):
    rng = np.random.default_rng(seed)
    shape = MASK.shape
    logp = rng.normal(-2.0, 0.5, shape)
    old = logp + rng.normal(0, 0.3, shape)  # ratios both inside and outside the clip range
    behav = old + rng.normal(0, 0.2, shape)
    ref = logp + rng.normal(0, 0.3, shape)
    ent = rng.uniform(0.5, 3.0, shape)
    adv = np.repeat(rng.normal(0, 1, (shape[0], 1)), shape[1], 1)  # GRPO: one advantage per episode
    junk = MASK == 0  # what sits at observation positions must not matter
    for a in (old, behav, ref, ent, adv):
        a[junk] = rng.normal(0, 50, junk.sum())
    return logp, old, behav, ref, ent, adv


def objective(mask, logp, old, behav, ref, ent, adv, cfg):
    mb = {
        "response_mask_BxR": jnp.asarray(mask),
        "old_logp_BxR": jnp.asarray(old, jnp.float32),
        "behav_logp_BxR": jnp.asarray(behav, jnp.float32),
        "ref_logp_BxR": jnp.asarray(ref, jnp.float32),
        "advantages_BxR": jnp.asarray(adv, jnp.float32),
    }
    lw, tw = rl.agg_weights(mb["response_mask_BxR"], cfg.loss_agg)

    def f(lp, en):
        return rl.actor_objective({"logp": lp, "entropy": en}, mb, cfg, lw, tw)[0]

    lp, en = jnp.asarray(logp, jnp.float32), jnp.asarray(ent, jnp.float32)
    loss, (g_lp, g_en) = jax.value_and_grad(f, argnums=(0, 1))(lp, en)
    return float(loss), np.asarray(g_lp), np.asarray(g_en)


def compact(mask, *arrays):
    """Rows with the observation tokens cut out, right-padded: the single-turn layout."""
    n = mask.sum(1).astype(int)
    out = []
    for a in arrays:
        c = np.zeros((mask.shape[0], n.max()), np.float64)
        for i in range(mask.shape[0]):
            c[i, : n[i]] = a[i][mask[i] > 0]
        out.append(c)
    m = (np.arange(n.max())[None] < n[:, None]).astype(np.float32)
    return m, out


def scatter(mask, g_compact):
    g = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        g[i][mask[i] > 0] = g_compact[i, : int(mask[i].sum())]
    return g


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_observation_tokens_get_zero_gradient_and_equal_the_compacted_rows(agg):
    cfg = RLConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, loss_agg=agg, behav_weight_cap=5.0)
    arrays = case()
    loss, g_lp, g_en = objective(MASK, *arrays, cfg)
    assert np.isfinite(loss)
    assert np.all(g_lp[MASK == 0] == 0) and np.all(g_en[MASK == 0] == 0)
    assert np.any(g_lp[MASK == 1] != 0) and np.all(g_en[MASK == 1] != 0)
    m, comp = compact(MASK, *arrays)
    loss_c, g_lp_c, g_en_c = objective(m, *comp, cfg)
    np.testing.assert_allclose(loss, loss_c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_lp, scatter(MASK, g_lp_c), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(g_en, scatter(MASK, g_en_c), rtol=1e-4, atol=1e-7)


def test_token_mean_loss_and_gradient_equal_a_float64_reference():
    eps, beta, ce = 0.2, 0.1, 0.01
    cfg = RLConfig(clip_eps=eps, kl_coef=beta, entropy_coef=ce, behav_weight_cap=None)
    logp, old, behav, ref, ent, adv = case(1)
    loss, g_lp, _ = objective(MASK, logp, old, behav, ref, ent, adv, cfg)
    m = MASK > 0
    n = m.sum()

    def ref_loss(lp):
        ratio = np.exp(lp - old)
        w = np.exp(old - behav)  # decoupled PPO: pi_prox / pi_behav, no cap
        pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps, 1 + eps)) * w
        d = ref - lp
        kl = np.exp(d) - d - 1  # k3
        return float(np.sum(np.where(m, pg + beta * kl - ce * ent, 0.0)) / n)

    np.testing.assert_allclose(loss, ref_loss(logp.astype(np.float64)), rtol=1e-5)
    h = 1e-6
    for i, t in zip(*np.nonzero(np.ones_like(MASK))):
        e = np.zeros_like(logp)
        e[i, t] = h
        fd = (ref_loss(logp + e) - ref_loss(logp - e)) / (2 * h)
        assert abs(g_lp[i, t] - fd) < 1e-4 + 1e-3 * abs(fd), (i, t, g_lp[i, t], fd)
