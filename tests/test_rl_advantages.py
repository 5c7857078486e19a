"""Advantage estimators, KL estimators, whitening and batch metrics vs float64 numpy references.

The references are written here from the published formulas, independently of rpeg_jax.rl:
GRPO (Shao 2024, §4.1.2, std as torch.std: ddof=1), Dr. GRPO (Liu 2025: no std), RLOO
(Ahmadian 2024 eq. 9), GAE (Schulman 2016 eq. 16, V = 0 after the last token), KL estimators
k1/k2/k3 (Schulman 2020 blog "Approximating KL Divergence"). Inputs are random with ragged
masks (including empty responses). Tolerance: float32 vs float64, rtol 1e-5, atol 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpeg_jax import rl
from rpeg_jax.config import RLConfig

TOL = dict(rtol=1e-5, atol=1e-5)


def ragged_mask(rng, b, r, holes=False):
    lens = rng.integers(0, r + 1, b)
    lens[0], lens[1] = 0, r  # always one empty and one full response
    m = (np.arange(r)[None] < lens[:, None]).astype(np.float32)
    if holes:  # masked-out tokens inside a response (e.g. tool output)
        m = m * (rng.random((b, r)) > 0.25)
    return m


# ---------------------------------------------------------------- numpy references (float64)
def np_grpo(r, gid, norm_std, eps):
    out = np.zeros(len(r))
    for g in np.unique(gid):
        idx = gid == g
        rg = r[idx].astype(np.float64)
        if rg.max() == rg.min():
            continue  # zero std: advantage 0
        a = rg - rg.mean()
        out[idx] = a / (rg.std(ddof=1) + eps) if norm_std else a
    return out


def np_rloo(r, gid):
    out = np.zeros(len(r))
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if gid[j] == gid[i] and j != i]
        out[i] = r[i] - np.mean(others) if others else 0.0
    return out


def np_gae(tok_r, values, mask, gamma, lam):
    """GAE on the valid tokens of each row taken as one contiguous episode (holes skipped)."""
    adv = np.zeros(tok_r.shape)
    for i in range(tok_r.shape[0]):
        idx = np.nonzero(mask[i])[0]
        a, n = 0.0, len(idx)
        for k in reversed(range(n)):
            t = idx[k]
            v_next = values[i, idx[k + 1]] if k + 1 < n else 0.0
            delta = tok_r[i, t] + gamma * v_next - values[i, t]
            a = delta + gamma * lam * a
            adv[i, t] = a
    return adv, (adv + values) * mask


def np_kl(logp, ref, kind):
    d = logp.astype(np.float64) - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": np.exp(-d) - 1.0 + d}[kind]


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("norm_std", [True, False])
@pytest.mark.parametrize("by_ids", [False, True])
def test_grpo_matches_reference(norm_std, by_ids):
    rng = np.random.default_rng(1)
    g, n = 4, 6
    r = rng.normal(size=g * n).astype(np.float32)
    r[4:8] = 0.7  # a group with identical rewards
    gid = np.repeat(np.arange(n), g)
    if by_ids:  # arbitrary ids, groups interleaved
        perm = rng.permutation(g * n)
        r, gid = r[perm], (gid[perm] * 1000 + 17).astype(np.int32)
    kw = dict(group_ids_B=jnp.asarray(gid)) if by_ids else dict(group_size=g)
    got = rl.grpo_advantages(jnp.asarray(r), norm_by_std=norm_std, eps=1e-6, **kw)
    np.testing.assert_allclose(np.asarray(got), np_grpo(r, gid, norm_std, 1e-6), **TOL)


def test_zero_std_group_is_exactly_zero():
    r = jnp.asarray([0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 1.0], jnp.float32)
    for norm_std in (True, False):
        a = np.asarray(rl.grpo_advantages(r, group_size=4, norm_by_std=norm_std))
        assert np.all(a[:4] == 0.0) and np.all(np.isfinite(a))
    assert np.all(np.asarray(rl.rloo_advantages(r, group_size=4))[:4] == 0.0)


def test_nonfinite_reward_poisons_only_its_group():
    r = jnp.asarray([1.0, jnp.nan, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, jnp.inf, 0.0, 1.0, 0.0], jnp.float32)
    a = np.asarray(rl.grpo_advantages(r, group_size=4))
    assert np.all(np.isnan(a[:4])) and np.all(np.isfinite(a[4:8])) and np.all(~np.isfinite(a[8:]))


@pytest.mark.parametrize("by_ids", [False, True])
def test_rloo_matches_reference(by_ids):
    rng = np.random.default_rng(2)
    r = rng.normal(size=12).astype(np.float32)
    gid = np.repeat(np.arange(3), 4).astype(np.int32)
    kw = dict(group_ids_B=jnp.asarray(gid)) if by_ids else dict(group_size=4)
    np.testing.assert_allclose(np.asarray(rl.rloo_advantages(jnp.asarray(r), **kw)), np_rloo(r, gid), **TOL)


@pytest.mark.parametrize("gamma,lam,holes", [(1.0, 1.0, False), (0.99, 0.95, False), (0.9, 0.5, True)])
def test_gae_matches_reference(gamma, lam, holes):
    rng = np.random.default_rng(3)
    b, r = 6, 7
    mask = ragged_mask(rng, b, r, holes)
    tok_r = rng.normal(size=(b, r)).astype(np.float32)
    values = rng.normal(size=(b, r)).astype(np.float32)
    tok_r[mask == 0] = np.nan  # garbage at padding must not leak
    values_in = values.copy()
    values_in[mask == 0] = np.nan
    adv, ret = rl.gae(jnp.asarray(tok_r), jnp.asarray(values_in), jnp.asarray(mask), gamma=gamma, lam=lam)
    ref_adv, ref_ret = np_gae(np.nan_to_num(tok_r), values * mask, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, **TOL)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, **TOL)


def test_token_rewards_last_token_and_kl_penalty():
    rng = np.random.default_rng(4)
    b, r, beta = 5, 6, 0.1
    mask = ragged_mask(rng, b, r)
    rew = rng.normal(size=b).astype(np.float32)
    kl = rng.normal(size=(b, r)).astype(np.float32)
    got = np.asarray(rl.token_rewards(jnp.asarray(rew), jnp.asarray(mask), kl_BxR=jnp.asarray(kl), kl_coef=beta))
    ref = -beta * kl * mask
    for i in range(b):
        n = int(mask[i].sum())
        if n:
            ref[i, n - 1] += rew[i]
    np.testing.assert_allclose(got, ref, **TOL)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators(kind):
    rng = np.random.default_rng(5)
    logp = -rng.random((4, 5)).astype(np.float32) * 3
    ref = -rng.random((4, 5)).astype(np.float32) * 3
    np.testing.assert_allclose(
        np.asarray(rl.kl_estimate(jnp.asarray(logp), jnp.asarray(ref), kind)),
        np_kl(logp, ref.astype(np.float64), kind),
        **TOL,
    )


def test_k3_is_nonnegative_and_unbiased_in_expectation():
    # E_{y~p}[k3] = KL(p||q): Monte Carlo over a categorical, float64 exact KL as the reference.
    rng = np.random.default_rng(6)
    p, q = rng.dirichlet(np.ones(5)), rng.dirichlet(np.ones(5))
    y = rng.choice(5, size=200_000, p=p)
    logp, logq = (jnp.log(jnp.asarray(d[y], jnp.float32)) for d in (p, q))
    k3 = np.asarray(rl.kl_estimate(logp, logq, "k3"))
    assert k3.min() >= 0.0
    np.testing.assert_allclose(k3.mean(), np.sum(p * np.log(p / q)), rtol=0.05)


def test_masked_whiten():
    rng = np.random.default_rng(7)
    mask = ragged_mask(rng, 5, 6)
    x = rng.normal(size=(5, 6)).astype(np.float32) * 3 + 1
    xv = x[mask > 0].astype(np.float64)
    ref = (x - xv.mean()) / np.sqrt(xv.var(ddof=1) + 1e-6) * mask
    x[mask == 0] = np.nan
    np.testing.assert_allclose(np.asarray(rl.masked_whiten(jnp.asarray(x), jnp.asarray(mask))), ref, **TOL)


def test_compute_advantages_dispatch():
    rng = np.random.default_rng(8)
    b, r = 8, 5
    mask = ragged_mask(rng, b, r)
    batch = {
        "response_mask_BxR": jnp.asarray(mask),
        "rewards_B": jnp.asarray(rng.normal(size=b), jnp.float32),
        "values_BxR": jnp.asarray(rng.normal(size=(b, r)), jnp.float32),
        "old_logp_BxR": jnp.asarray(-rng.random((b, r)), jnp.float32),
        "ref_logp_BxR": jnp.asarray(-rng.random((b, r)), jnp.float32),
    }
    out, _ = rl.compute_advantages(batch, RLConfig(group_size=4))
    ref = np_grpo(np.asarray(batch["rewards_B"]), np.repeat(np.arange(2), 4), True, 1e-6)[:, None] * mask
    np.testing.assert_allclose(np.asarray(out["advantages_BxR"]), ref, **TOL)
    cfg = RLConfig(
        algorithm="ppo", gamma=0.9, lam=0.8, kl_coef=0.05, kl_in_reward=True, kl_estimator="k1", whiten_advantages=True
    )
    out, metrics = rl.compute_advantages(batch, cfg)
    kl = np_kl(np.asarray(batch["old_logp_BxR"]), np.asarray(batch["ref_logp_BxR"], np.float64), "k1")
    tok = -0.05 * kl * mask
    for i in range(b):
        n = int(mask[i].sum())
        if n:
            tok[i, n - 1] += float(batch["rewards_B"][i])
    adv, ret = np_gae(tok, np.asarray(batch["values_BxR"]) * mask, mask, 0.9, 0.8)
    av = adv[mask > 0]
    np.testing.assert_allclose(np.asarray(out["returns_BxR"]), ret, **TOL)
    np.testing.assert_allclose(
        np.asarray(out["advantages_BxR"]), (adv - av.mean()) / np.sqrt(av.var(ddof=1) + 1e-6) * mask, **TOL
    )
    assert "actor/reward_kl_penalty" in metrics


def test_batch_metrics():
    rng = np.random.default_rng(9)
    b, r = 6, 5
    mask = ragged_mask(rng, b, r)
    rew = rng.normal(size=b).astype(np.float32)
    rew[3] = np.nan
    versions = rng.integers(0, 4, (b, r)).astype(np.int32)
    m = rl.batch_metrics(
        {"response_mask_BxR": jnp.asarray(mask), "rewards_B": jnp.asarray(rew), "versions_BxR": jnp.asarray(versions)},
        version=5,
    )
    fin = rew[np.isfinite(rew)].astype(np.float64)
    lens = mask.sum(1)
    np.testing.assert_allclose(float(m["reward/mean"]), fin.mean(), **TOL)
    np.testing.assert_allclose(float(m["reward/std"]), fin.std(), **TOL)
    assert float(m["reward/nonfinite"]) == 1.0
    np.testing.assert_allclose(float(m["response_length/mean"]), lens.mean(), **TOL)
    np.testing.assert_allclose(float(m["response_length/clip_ratio"]), np.mean(lens == r), **TOL)
    np.testing.assert_allclose(float(m["staleness/max"]), (5 - versions)[mask > 0].max(), **TOL)


def test_grpo_under_explicit_sharding(cpu_devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=cpu_devices[:8])
    r = np.random.default_rng(10).normal(size=16).astype(np.float32)
    gid = np.repeat(np.arange(4), 4).astype(np.int32)
    with jax.set_mesh(mesh):
        rs = jax.device_put(jnp.asarray(r), jax.NamedSharding(mesh, jax.P("data")))
        gs = jax.device_put(jnp.asarray(gid), jax.NamedSharding(mesh, jax.P("data")))
        got = jax.jit(lambda a, g: rl.grpo_advantages(a, group_ids_B=g))(rs, gs)
    np.testing.assert_allclose(np.asarray(got), np_grpo(r, gid, True, 1e-6), **TOL)
