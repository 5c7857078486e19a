"""train.offload: optimizer states (and the reference's weights) in host memory between steps.

Checks: the update with its optimizer state offloaded (one optimizer step: transfers around the
step; several: around the update) gives bitwise the parameters, state and metrics of the plain
update, and its program does place arrays in host memory (positive control); a tiny GRPO run with
offload=optimizer equals offload=none bitwise after 2 steps, its optimizer state carrying the host
memory kind; PPO with optimizer+reference offloads critic_opt and the reference too; a resume from
a checkpoint of an offloaded run is exact and lands in host memory again; bad values are errors
naming train.offload. The memory-kind assertions are skipped only when the backend has no host
memory (CPU JAX 0.10 has pinned_host, so they run here); the numerics are checked everywhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import PPO, TINY, make_case, policy_fn, run

from rpeg_jax import rl
from rpeg_jax.config import ConfigError, OptimConfig, RLConfig, load_config
from rpeg_jax.runtime.offload import HOST_KIND, Offload, host_memory_kind, is_host

HOST = host_memory_kind(jax.local_devices())  # "pinned_host" here; None on a backend without host memory


def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _assert_host(tree):
    if HOST is None:  # nothing to place: the same code ran with the device sharding
        return
    assert _kinds(tree) == {HOST_KIND}


def _assert_bitwise(a, b, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def test_cpu_backend_exposes_memory_kinds():
    """What the tests below rely on, recorded: CPU JAX addresses device, pinned_host and unpinned_host."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if jax.devices()[0].platform == "cpu" and tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 10):
        assert {"device", "pinned_host"} <= kinds
        assert HOST == "pinned_host"


@pytest.mark.parametrize("minibatches", [1, 2])
def test_offloaded_update_is_bitwise_the_plain_update(minibatches):
    params, batch = make_case(4)
    cfg = RLConfig(minibatches=minibatches, ppo_epochs=2 if minibatches > 1 else 1)
    tx = rl.make_optimizer(OptimConfig(lr=0.05, grad_clip=1.0, weight_decay=0.01))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    dev = jax.sharding.NamedSharding(mesh, jax.P())
    params = jax.device_put(params, dev)
    state = jax.device_put(tx.init(params), dev)
    off = Offload(("actor_opt",), HOST)
    parked = off.park_now("actor_opt", state)
    _assert_host(parked)
    plain = jax.jit(rl.make_actor_update(policy_fn, tx, cfg))
    offl = jax.jit(rl.make_actor_update(policy_fn, tx, cfg, opt_memory=off.memory("actor_opt")))
    key = jax.random.key(3)
    if HOST is not None:  # positive control: the program does move the state to host memory
        assert HOST_KIND in offl.lower(params, parked, batch, key).as_text()
        assert HOST_KIND not in plain.lower(params, state, batch, key).as_text()
    p1, s1, m1 = plain(params, state, batch, key)
    p2, s2, m2 = offl(params, parked, batch, key)
    _assert_host(s2)
    assert float(m1["actor/updates"]) == cfg.minibatches * cfg.ppo_epochs
    _assert_bitwise(p1, p2, "params")
    _assert_bitwise(s1, s2, "optimizer state")
    assert set(m1) == set(m2)
    for k in m1:
        np.testing.assert_array_equal(np.asarray(m1[k]), np.asarray(m2[k]), err_msg=k)
    # ... and a second call takes its own (host) output back in
    p3, s3, _ = offl(p2, s2, batch, key)
    p4, s4, _ = plain(p1, s1, batch, key)
    _assert_bitwise(p4, p3, "params, 2nd call")
    _assert_host(s3)


def test_offloaded_update_numerics_against_optax_reference():
    """The offloaded update is also the plain optax step (independent reference: one adamw step on
    the gradient of the same loss, computed outside rl.update)."""
    params, batch = make_case(5)
    batch["old_logp_BxR"] = policy_fn(params, batch)["logp"]  # ratio 1: the surrogate's gradient is -A·∇logp
    cfg = RLConfig(behav_weight_cap=None)
    tx = optax.adam(0.01)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.P()))
    off = Offload(("actor_opt",), HOST)
    state = off.park_now("actor_opt", jax.device_put(tx.init(params), jax.sharding.NamedSharding(mesh, jax.P())))
    new, _, _ = jax.jit(rl.make_actor_update(policy_fn, tx, cfg, opt_memory=off.memory("actor_opt")))(
        params, state, batch, None
    )
    mask, adv = batch["response_mask_BxR"], batch["advantages_BxR"]

    def loss(p):  # token-mean surrogate at ratio 1
        return -jnp.sum(policy_fn(p, batch)["logp"] * adv * mask) / jnp.sum(mask)

    ref_state = tx.init(params)
    upd, _ = tx.update(jax.grad(loss)(params), ref_state, params)
    want = optax.apply_updates(params, upd)["table"]
    np.testing.assert_allclose(np.asarray(new["table"]), np.asarray(want), atol=1e-6)


def _opt_leaves_kind(state) -> set:
    return _kinds(state["actor_opt"])


def test_grpo_run_with_optimizer_offload_equals_plain(tmp_path):
    a = run(tmp_path, "none", TINY, steps=2)
    b = run(tmp_path, "opt", TINY + ["train.offload=optimizer"], steps=2)
    assert _opt_leaves_kind(a.state) == {"device"}
    _assert_host(b.state["actor_opt"])
    assert _kinds(b.state["actor"]) == {"device"}  # params stay on the device
    for name in ("actor", "actor_opt"):
        _assert_bitwise(a.state[name], b.state[name], name)
    for ra, rb in zip(a.metrics, b.metrics, strict=True):
        keys = [k for k in ra if isinstance(ra[k], float) and not k.startswith(("timing_s/", "perf/", "pred"))]
        assert len(keys) > 10 and "actor/lr" in keys
        for k in keys:
            assert rb[k] == ra[k] or (np.isnan(ra[k]) and np.isnan(rb[k])), (ra["step"], k, ra[k], rb[k])


# 24 s; test_grpo_run_with_optimizer_offload_equals_plain runs by default (slow: session 24's trim of the default run)
@pytest.mark.slow
def test_ppo_optimizer_and_reference_offload(tmp_path):
    """PPO (critic, reference, 2 minibatches: the update-wide transfers): every offloaded state in
    host memory, same results as no offload."""
    from rpeg_jax.graph.plan import graph_for_plan
    from rpeg_jax.runtime.setup import build
    from rpeg_jax.runtime.trainer import choose_plan

    over = PPO + ["rl.minibatches=2"]
    a = run(tmp_path, "none", over, steps=2)
    b = run(tmp_path, "off", over + ["train.offload=optimizer+reference"], steps=2)
    for name in ("actor_opt", "critic_opt"):
        _assert_host(b.state[name])
        assert _kinds(a.state[name]) == {"device"}
    for name in a.state:
        _assert_bitwise(a.state[name], b.state[name], name)
    cfg = load_config(None, over + ["train.offload=optimizer+reference", f"train.run_dir={tmp_path / 'b2'}"])
    cfg, plan = choose_plan(cfg)
    ctx, store = build(cfg, graph_for_plan(cfg, plan), plan)
    _assert_host(store.frozen["reference"])
    assert _kinds(store.latest("actor")[1]) == {"device"}
    assert ctx.offload.offloaded("reference") and not ctx.offload.offloaded("actor")


def test_resume_of_an_offloaded_run_is_exact(tmp_path):
    from rpeg_jax.runtime.checkpoint import Checkpointer
    from rpeg_jax.runtime.trainer import train

    over = TINY + ["train.offload=optimizer"]
    straight = run(tmp_path, "straight", over, steps=3)

    def go(steps):
        cfg = load_config(None, over + [f"train.steps={steps}", f"train.run_dir={tmp_path / 'resumed'}"])
        return train(cfg, keep_state=True)

    go(2)
    ckpt = Checkpointer(str(tmp_path / "resumed" / "checkpoints"))
    assert ckpt.latest_step() == 2
    ckpt.close()
    out = go(3)
    assert out["steps"] == 3
    _assert_host(out["state"]["actor_opt"])
    for name in ("actor", "actor_opt"):
        _assert_bitwise(straight.state[name], out["state"][name], name)


def test_checkpoint_round_trip_of_host_arrays(tmp_path):
    """Checkpointer.save/restore of a host-memory tree: bitwise, restored into host memory; a NaN
    in a host array is refused like one on the device."""
    from rpeg_jax.runtime.checkpoint import Checkpointer, NonFiniteError

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    dev = jax.sharding.NamedSharding(mesh, jax.P("data"))
    off = Offload(("actor_opt",), HOST)
    tree = {"mu": jnp.arange(8.0) / 3, "count": jnp.arange(4, dtype=jnp.int32)}
    parked = off.park_now("actor_opt", jax.device_put(tree, dev))
    _assert_host(parked)
    assert all(is_host(x) for x in jax.tree.leaves(parked)) == (HOST is not None)
    ck = Checkpointer(str(tmp_path / "ck"), async_save=False)
    ck.save(1, {"actor_opt": parked}, {"step": 1})
    restored, meta, _ = ck.restore(1, {"actor_opt": parked})
    assert meta["step"] == 1
    _assert_bitwise(parked, restored["actor_opt"], "restored")
    _assert_host(restored["actor_opt"])
    bad = off.park_now("actor_opt", jax.device_put({"mu": tree["mu"].at[5].set(jnp.nan), "count": tree["count"]}, dev))
    with pytest.raises(NonFiniteError, match="mu"):
        ck.save(2, {"actor_opt": bad}, {"step": 2})
    ck.close()


def test_bad_offload_values_name_the_field():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.offload=cpu"])
    assert e.value.key == "train.offload" and "optimizer+reference" in str(e.value)
    # no reference model with kl_coef = 0: asking to offload it is an error, not a silent no-op
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rl.kl_coef=0", "train.offload=optimizer+reference"])
    assert e.value.key == "train.offload" and "kl_coef" in str(e.value)
    assert load_config(None, ["rl.kl_coef=0.01", "train.offload=optimizer+reference"]).train.offload == (
        "optimizer+reference"
    )
    assert load_config(None, []).train.offload == "none"
