"""Update steps (rl.update) on a toy policy: a logits table params["table"][row, t, :], so every
response token has its own logits and gradients are easy to read.

Checks: gradient signs (positive-advantage logprob rises, negative falls; clipping zeroes the
gradient where PPO / dual-clip say so); micro-batch accumulation == one big batch (SGD deltas,
float32 atol 1e-6); minibatches × epochs == a plain Python loop of optax steps (atol 1e-5; minibatch k of M is
rows k::M of the permuted batch);
critic and shared actor-critic steps vs analytic float64 gradients; NaN/inf/empty handling;
explicit-sharding run == unsharded run; optimizer schedule and AdamW vs numpy.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import B, R, make_case, policy_fn, value_fn

from rpeg_jax import rl
from rpeg_jax.config import ConfigError, OptimConfig, RLConfig, build


def compiled(kind="actor", tx="sgd", **cfg_kw):
    return _compiled(kind, tx, RLConfig(**cfg_kw))  # keyed by the config: defaults share a compile


@functools.lru_cache(maxsize=None)
def _compiled(kind, tx, cfg):
    wd = 0.01 if tx == "adamw" else 0.0  # "adam": no weight decay, so untouched rows stay bitwise equal
    opt = optax.sgd(0.5) if tx == "sgd" else rl.make_optimizer(OptimConfig(lr=0.05, grad_clip=1.0, weight_decay=wd))
    factory = {"actor": rl.make_actor_update, "critic": rl.make_critic_update, "shared": rl.make_actor_critic_update}[
        kind
    ]
    fn = value_fn if kind == "critic" else policy_fn
    return jax.jit(factory(fn, opt, cfg)), opt, cfg


def run(params, batch, rng=None, **kw):
    upd, opt, _ = compiled(**kw)
    return upd(params, opt.init(params), batch, rng)


# ---------------------------------------------------------------- gradient signs and clipping
def test_one_step_moves_logprobs_with_the_advantage_sign():
    params, batch = make_case(1)
    batch["old_logp_BxR"] = policy_fn(params, batch)["logp"]  # on-policy: ratio 1, nothing clipped
    sign = np.where(np.random.default_rng(2).random((B, R)) > 0.5, 1.0, -1.0)
    mask = np.asarray(batch["response_mask_BxR"])
    batch["advantages_BxR"] = jnp.asarray(sign * mask, jnp.float32)
    new, _, m = run(params, batch)
    delta = np.asarray(policy_fn(new, batch)["logp"] - policy_fn(params, batch)["logp"])
    assert np.all(delta[(mask > 0) & (sign > 0)] > 0)
    assert np.all(delta[(mask > 0) & (sign < 0)] < 0)
    assert np.all(delta[mask == 0] == 0)
    assert float(m["actor/updates"]) == 1 and float(m["actor/clipfrac"]) == 0


@pytest.mark.parametrize("dual", [None, 1.3])
def test_clipping_zeroes_the_gradient_where_it_should(dual):
    params, batch = make_case(3)
    logp = np.asarray(policy_fn(params, batch)["logp"])
    # Rows 0-3: (ratio, advantage) = (1.5, +1), (1.5, -1), (0.5, -1), (0.5, +1); ε = 0.2.
    ratio = np.ones((B, R))
    adv = np.zeros((B, R))
    cases = [(1.5, 1.0), (1.5, -1.0), (0.5, -1.0), (0.5, 1.0)]
    for row, (r, a) in enumerate(cases):
        ratio[row], adv[row] = r, a
    batch["response_mask_BxR"] = jnp.ones((B, R))
    batch["old_logp_BxR"] = jnp.asarray(logp - np.log(ratio), jnp.float32)
    batch["advantages_BxR"] = jnp.asarray(adv, jnp.float32)
    cfg = RLConfig(clip_eps=0.2, dual_clip=dual, behav_weight_cap=None)
    mb = {k: v for k, v in batch.items() if k != "behav_logp_BxR"}
    lw, tw = rl.agg_weights(mb["response_mask_BxR"], "token-mean")
    g = jax.jit(jax.grad(lambda p: rl.actor_objective(policy_fn(p, mb), mb, cfg, lw, tw)[0]))(params)["table"]
    norms = np.abs(np.asarray(g)).sum(axis=(1, 2))
    assert norms[0] == 0  # A>0, ratio above 1+ε: clipped
    assert norms[2] == 0  # A<0, ratio below 1-ε: clipped
    assert norms[3] > 0  # A>0, ratio below 1-ε: the unclipped branch is the min
    if dual is None:
        assert norms[1] > 0  # A<0, ratio above 1+ε: PPO keeps pushing down
    else:
        assert norms[1] == 0  # dual-clip: loss capped at -c·A = const


# ---------------------------------------------------------------- accumulation and loop
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_equal_one_big_batch(mode):
    params, batch = make_case(4, behav_noise=0.3)
    kw = dict(loss_agg=mode, kl_coef=0.1, entropy_coef=0.01, tis_cap=1.2, behav_weight_cap=1.5)
    big, _, m1 = run(params, batch, **kw, micro_batches=1)
    acc, _, m4 = run(params, batch, **kw, micro_batches=4)
    d_big = np.asarray(big["table"] - params["table"])
    d_acc = np.asarray(acc["table"] - params["table"])
    assert np.abs(d_big).max() > 1e-3
    np.testing.assert_allclose(d_acc, d_big, rtol=0, atol=1e-6)
    for k in ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/pg_clipfrac", "actor/behav_dropped_frac"):
        np.testing.assert_allclose(float(m4[k]), float(m1[k]), rtol=1e-5, atol=1e-6)


LOOP_KW = dict(tx="adamw", minibatches=2, ppo_epochs=2, micro_batches=2, kl_coef=0.05, loss_agg="seq-mean-token-mean")


def plain_loop(params, batch, rng, opt, cfg, rows_of):
    """The reference for the update's epochs x minibatches: 2 epochs (one key each from `rng`),
    2 minibatches per epoch with rows `rows_of(key, j)`, one plain SGD step of the actor objective each."""

    @jax.jit
    def sgd_step(p, st, mb):
        lw, tw = rl.agg_weights(mb["response_mask_BxR"], cfg.loss_agg)
        g = jax.grad(lambda q: rl.actor_objective(policy_fn(q, mb), mb, cfg, lw, tw)[0])(p)
        u, st = opt.update(g, st, p)
        return optax.apply_updates(p, u), st

    p, st = params, opt.init(params)
    for key in jax.random.split(rng, 2):
        for j in range(2):
            p, st = sgd_step(p, st, {k: v[rows_of(key, j)] for k, v in batch.items()})
    return p


def test_minibatches_and_epochs_match_a_plain_loop():
    params, batch = make_case(5, behav_noise=0.2)
    rng = jax.random.key(7)
    new, state, m = run(params, batch, rng, **LOOP_KW)
    _, opt, cfg = compiled(**LOOP_KW)
    p = plain_loop(params, batch, rng, opt, cfg, lambda key, j: np.asarray(jax.random.permutation(key, B))[j::2])
    np.testing.assert_allclose(np.asarray(new["table"]), np.asarray(p["table"]), rtol=0, atol=1e-5)
    assert float(m["actor/updates"]) == 4
    np.testing.assert_allclose(float(m["actor/lr"]), 0.05, rtol=1e-6)


def test_group_mode_moves_whole_groups():
    """group_size=2: epochs shuffle whole groups and minibatch k of M is groups k::M (a plain loop
    over group-permuted rows, atol 1e-5); every micro-batch the policy sees holds whole groups."""
    params, batch = make_case(5, behav_noise=0.2)
    g, rng = 2, jax.random.key(7)
    _, opt, cfg = compiled(**LOOP_KW)
    seen = []

    def grouped_policy(p, mb):  # records the rows of each micro-batch (traced once per piece shape)
        jax.debug.callback(lambda r: seen.append(np.asarray(r)), mb["row_B"])
        return policy_fn(p, mb)

    upd = jax.jit(rl.make_actor_update(grouped_policy, opt, cfg, group_size=g))
    new, _, m = upd(params, opt.init(params), batch, rng)
    jax.effects_barrier()

    def rows(key, j):  # minibatch j of 2: groups j::2 of the permutation, each group's rows in order
        groups = np.asarray(jax.random.permutation(key, B // g))
        return (groups[j::2][:, None] * g + np.arange(g)).reshape(-1)

    p = plain_loop(params, batch, rng, opt, cfg, rows)
    np.testing.assert_allclose(np.asarray(new["table"]), np.asarray(p["table"]), rtol=0, atol=1e-5)
    assert float(m["actor/updates"]) == 4
    assert len(seen) == 8 and all(len(r) == g and r[0] % g == 0 and r[1] == r[0] + 1 for r in seen)
    with pytest.raises(ConfigError, match="whole groups"):
        jax.jit(rl.make_actor_update(policy_fn, opt, cfg, group_size=4))(params, opt.init(params), batch, rng)


# ---------------------------------------------------------------- critic and shared backbone
def np_value_grad(v, v_old, ret, mask, clip):
    """d/dv of 0.5·token-mean max((v-R)², (v_old+clip(v-v_old)-R)²), float64."""
    v, v_old, ret = (np.asarray(x, np.float64) for x in (v, v_old, ret))
    vc = v_old + np.clip(v - v_old, -clip, clip)
    inside = np.abs(v - v_old) < clip
    use_clipped = (vc - ret) ** 2 > (v - ret) ** 2
    g = np.where(use_clipped, np.where(inside, vc - ret, 0.0), v - ret)
    return g * mask / mask.sum()


def test_critic_step_matches_analytic_gradient():
    params, batch = make_case(6, critic=True)
    new, _, m = run(params, batch, kind="critic", value_clip=0.2)
    mask = np.asarray(batch["response_mask_BxR"])
    ref = -0.5 * np_value_grad(params["v"], batch["values_BxR"], batch["returns_BxR"], mask, 0.2)
    np.testing.assert_allclose(np.asarray(new["v"] - params["v"]), ref, rtol=1e-5, atol=1e-6)
    assert 0 < float(m["critic/vf_clipfrac"]) < 1 and "critic/vpred_mean" in m


def test_shared_actor_critic_is_pg_plus_cv_times_vf():
    params, batch = make_case(7, critic=True)
    shared, _, m = run(params, batch, kind="shared", vf_coef=0.25)
    actor, _, _ = run({"table": params["table"]}, batch)
    critic, _, _ = run(params, batch, kind="critic")
    np.testing.assert_allclose(np.asarray(shared["table"]), np.asarray(actor["table"]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(shared["v"] - params["v"]), 0.25 * np.asarray(critic["v"] - params["v"]), rtol=0, atol=1e-6
    )
    assert {"actor/pg_loss", "critic/vf_loss", "actor/grad_norm"} <= set(m)


# ---------------------------------------------------------------- bad input
NAN_KW = dict(tx="adam", minibatches=2, on_nan="stop")


def test_nan_reward_skips_only_its_minibatch_and_is_counted():
    params, batch = make_case(8)
    rewards = np.random.default_rng(9).normal(size=B).astype(np.float32)
    rewards[5] = np.nan  # the group of odd rows = the second minibatch (rows 1::2)
    adv, _ = rl.compute_advantages(
        {
            "rewards_B": jnp.asarray(rewards),
            "response_mask_BxR": batch["response_mask_BxR"],
            "group_ids_B": jnp.arange(B) % 2,
        },
        RLConfig(group_size=4),
    )
    batch.update(adv)
    new, state, m = run(params, batch, **NAN_KW)
    assert float(m["actor/nan_skipped"]) == 1 and float(m["actor/updates"]) == 1 and float(m["actor/nan_stop"]) == 1
    np.testing.assert_array_equal(np.asarray(new["table"][1::2]), np.asarray(params["table"][1::2]))
    assert np.all(np.isfinite(np.asarray(new["table"]))) and np.any(new["table"][0::2] != params["table"][0::2])
    assert int(optax.tree_utils.tree_get(state, "count", filtering=lambda p, v: "inner_state" in str(p))) == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("old_logp_BxR", np.nan),
        ("behav_logp_BxR", np.inf),
        ("ref_logp_BxR", -np.inf),
        ("advantages_BxR", np.inf),
        ("table", np.nan),
    ],
)
def test_nonfinite_logprobs_keep_params_and_opt_state(field, value):
    params, batch = make_case(10)
    if field == "table":  # the policy itself produces NaN logprobs
        params = {"table": params["table"].at[0].set(value)}
    else:
        batch[field] = batch[field].at[0, 0].set(value)
    new, state, m = run(params, batch, **NAN_KW)
    assert float(m["actor/nan_skipped"]) == 1 and float(m["actor/updates"]) == 1
    np.testing.assert_array_equal(np.asarray(new["table"][0::2]), np.asarray(params["table"][0::2]))


def test_nan_at_padding_is_ignored():
    params, batch = make_case(11, behav_noise=0.1)
    clean, _, m_clean = run(params, batch, **NAN_KW)
    pad = jnp.where(batch["response_mask_BxR"] > 0, 0.0, jnp.nan)
    for k in ("old_logp_BxR", "behav_logp_BxR", "ref_logp_BxR", "advantages_BxR"):
        batch[k] = batch[k] + pad
    dirty, _, m = run(params, batch, **NAN_KW)
    assert float(m["actor/nan_skipped"]) == 0 and float(m["actor/updates"]) == 2
    np.testing.assert_allclose(np.asarray(dirty["table"]), np.asarray(clean["table"]), rtol=0, atol=1e-7)


def test_all_skipped_and_empty_minibatches():
    params, batch = make_case(12)
    mask = np.asarray(batch["response_mask_BxR"]).copy()
    mask[0::2] = 0  # first minibatch (rows 0::2): all responses empty
    batch["response_mask_BxR"] = jnp.asarray(mask)
    batch["advantages_BxR"] = batch["advantages_BxR"].at[:, :].set(jnp.nan)  # and the second has NaN advantages
    new, state, m = run(params, batch, **NAN_KW)
    assert float(m["actor/empty_skipped"]) == 1 and float(m["actor/nan_skipped"]) == 1
    assert float(m["actor/updates"]) == 0 and np.isnan(float(m["actor/pg_loss"]))
    np.testing.assert_array_equal(np.asarray(new["table"]), np.asarray(params["table"]))


def test_bad_batches_are_rejected_by_name():
    params, batch = make_case(13)
    upd, opt, _ = compiled(minibatches=3)
    with pytest.raises(ConfigError, match="rl.minibatches"):
        upd(params, opt.init(params), batch)
    upd, opt, _ = compiled()
    with pytest.raises(ValueError, match="advantages_BxR"):
        upd(params, opt.init(params), {k: v for k, v in batch.items() if k != "advantages_BxR"})
    with pytest.raises(ValueError, match="old_logp_BxR"):
        upd(params, opt.init(params), {**batch, "old_logp_BxR": batch["old_logp_BxR"][:, :3]})
    with pytest.raises(ValueError, match="ref_logp_BxR"):
        rl.make_actor_update(policy_fn, opt, RLConfig(kl_coef=0.1))(
            params, opt.init(params), {k: v for k, v in batch.items() if k != "ref_logp_BxR"}
        )


# ---------------------------------------------------------------- sharding
def test_explicit_sharding_matches_unsharded(cpu_devices):
    params, batch = make_case(14, behav_noise=0.2)
    rng = jax.random.key(3)
    ref, _, m_ref = run(params, batch, rng, **LOOP_KW)
    upd, opt, _ = compiled(**LOOP_KW)
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=explicit, devices=cpu_devices[:8])
    with jax.set_mesh(mesh):
        sb = {k: jax.device_put(v, jax.NamedSharding(mesh, jax.P("data"))) for k, v in batch.items()}
        sp = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
        new, _, m = upd(sp, opt.init(sp), sb, rng)
    np.testing.assert_allclose(np.asarray(new["table"]), np.asarray(ref["table"]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(m["actor/pg_loss"]), float(m_ref["actor/pg_loss"]), rtol=1e-5)
    # 8 rows -> 2 minibatches -> 2 micro-batches of 2 rows cannot spread over 4 data devices.
    mesh4 = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=explicit, devices=cpu_devices[:8])
    with jax.set_mesh(mesh4):
        sb = {k: jax.device_put(v, jax.NamedSharding(mesh4, jax.P("data"))) for k, v in batch.items()}
        sp = jax.device_put(params, jax.NamedSharding(mesh4, jax.P()))
        with pytest.raises(ValueError, match="rl.micro_batches"):
            upd(sp, opt.init(sp), sb, rng)


def test_bfloat16_params_with_float32_accumulation_keep_their_dtypes():
    params, batch = make_case(16)
    params = {"table": params["table"].astype(jnp.bfloat16)}
    ocfg = OptimConfig(lr=0.05, mu_dtype="float32", grad_dtype="float32")
    tx = rl.make_optimizer(ocfg)
    update = jax.jit(rl.make_actor_update(policy_fn, tx, RLConfig(micro_batches=2), accum_dtype=rl.grad_dtype(ocfg)))
    state = tx.init(params)
    new, new_state, m = update(params, state, batch)
    assert new["table"].dtype == jnp.bfloat16 and float(m["actor/updates"]) == 1
    assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)
    assert np.all(np.isfinite(np.asarray(new["table"], np.float32))) and np.any(new["table"] != params["table"])


# ---------------------------------------------------------------- optimizer and config
def test_schedule_matches_formula():
    cfg = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=4, decay_steps=20, min_lr_ratio=0.1)
    sched = rl.make_schedule(cfg)
    for t in range(25):
        if t < 4:
            ref = 1e-3 * (t + 1) / 4
        else:
            p = min(1.0, (t - 4) / 16)
            ref = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * p)))
        np.testing.assert_allclose(float(sched(t)), ref, rtol=1e-5)
    lin = rl.make_schedule(OptimConfig(lr=2.0, schedule="linear", decay_steps=10), None)
    np.testing.assert_allclose([float(lin(t)) for t in (0, 5, 10, 15)], [2.0, 1.0, 0.0, 0.0], atol=1e-6)


def test_adamw_with_clipping_matches_numpy():
    cfg = OptimConfig(lr=0.1, grad_clip=0.5, weight_decay=0.1, b1=0.9, b2=0.99, eps=1e-8)
    tx = rl.make_optimizer(cfg)
    rng = np.random.default_rng(15)
    p = {"w": jnp.asarray(rng.normal(size=5), jnp.float32)}
    st = tx.init(p)
    ref, m, v = np.asarray(p["w"], np.float64), 0.0, 0.0
    for step in range(1, 4):
        g = rng.normal(size=5)
        u, st = tx.update({"w": jnp.asarray(g, jnp.float32)}, st, p)
        p = optax.apply_updates(p, u)
        g = g * min(1.0, 0.5 / np.linalg.norm(g))
        m, v = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g
        ref = ref - 0.1 * ((m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.99**step)) + 1e-8) + 0.1 * ref)
    np.testing.assert_allclose(np.asarray(p["w"]), ref, rtol=1e-5, atol=1e-6)
    assert float(rl.current_lr(st)) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "section,data,bad_key",
    [
        (RLConfig, {"clip_eps_low": 1.5}, "rl.clip_eps_low"),
        (RLConfig, {"loss_agg_norm": 0}, "rl.loss_agg_norm"),
        (RLConfig, {"loss_agg": "mean"}, "rl.loss_agg"),
        (RLConfig, {"dual_clip": 1.0}, "rl.dual_clip"),
        (OptimConfig, {"schedule": "cosine", "warmup_steps": 10, "decay_steps": 10}, "optim.decay_steps"),
        (OptimConfig, {"grad_dtype": "float16"}, "optim.grad_dtype"),
    ],
)
def test_config_validation_names_the_key(section, data, bad_key):
    with pytest.raises(ConfigError, match=bad_key.replace(".", r"\.")):
        build(section, data, bad_key.split(".")[0])
