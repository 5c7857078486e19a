"""The one-step rewrites (graph passes proximal_from_update, values_from_critic_update): the graph
they produce, their legality (one optimizer step per batch, else a ConfigError / GraphError naming
the field), and end to end: the same seed gives the same metrics and parameters as the plain
pipeline that runs old_forward / critic_forward (float32 tolerance, tiny model, 2 steps)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TINY, assert_rewritten, assert_same_run, make_case, policy_fn, run, value_fn

from rpeg_jax import rl
from rpeg_jax.config import ConfigError, RLConfig, load_config
from rpeg_jax.graph.algorithms import build_graph
from rpeg_jax.graph.ir import GraphError, StageKind
from rpeg_jax.graph.passes import (
    apply_pipeline,
    bounded_async,
    fuse_named,
    proximal_from_update,
    share_actor_critic,
    values_from_critic_update,
)
from rpeg_jax.runtime.rollout.stats import step_flops

SIZES = ["data.prompts_per_step=4", "rl.group_size=2", "data.max_prompt_len=5", "rollout.max_new_tokens=7"]


def graph(*overrides):
    return build_graph(load_config(None, [*SIZES, *overrides]))


def kinds(g):
    return sorted(p.kind.value for s in g.stages() for p in (s.parts or (s,)))


# ---- the passes ---------------------------------------------------------------------------------
def test_proximal_from_update_drops_old_forward_also_under_staleness():
    g = bounded_async(proximal_from_update(graph("rl.kl_coef=0.1")), 1)
    assert "old_forward" not in g.stage_names() and "old_logp" not in g.nodes
    upd = g.stage("actor_update")
    assert upd.options.proximal_from_update and g.staleness == 1
    assert {e.port for e in g.inputs("actor_update")} >= {"behav_logp", "ref_logp", "advantages"}
    assert "old_logp" not in {e.port for e in g.inputs("actor_update")}
    assert proximal_from_update(g).nodes == g.nodes  # idempotent
    # With a shared backbone the values come from critic_forward reading the actor, as after elision.
    s = share_actor_critic(proximal_from_update(graph("rl.algorithm=ppo")))
    assert ("actor", "critic_forward") in {(e.src, e.dst) for e in s.edges}
    # ... and values_from_critic_update then moves them into the shared update's own forward.
    v = values_from_critic_update(s)
    assert "critic_forward" not in v.stage_names() and "values" not in v.nodes
    st = v.stage("advantage+actor_update")
    assert st.options.values_from_update and set(st.options.internal) == {"advantages", "returns", "values"}
    assert st.parts[1].options.proximal_from_update and st.parts[1].options.value_loss
    assert st.effective_options.value_loss and st.effective_options.proximal_from_update  # from its parts
    assert not st.options.value_loss and st.effective_options.internal == st.options.internal


def test_values_from_critic_update_fuses_gae_into_the_critic_update():
    plain = graph("rl.algorithm=ppo")
    g = values_from_critic_update(plain)
    assert "critic_forward" not in g.stage_names() and "values" not in g.nodes
    st = g.stage("advantage+critic_update")
    assert [p.kind for p in st.parts] == [StageKind.ADVANTAGE, StageKind.CRITIC_UPDATE]
    assert st.options.values_from_update and set(st.options.internal) == {"returns", "values"}
    assert g.producer("advantages") == st.name and "actor_update" in g.consumers("advantages")
    assert sorted(kinds(g) + ["critic_forward"]) == kinds(plain)
    assert fuse_named(g, "advantage").nodes == g.nodes  # GAE already inside the critic's program
    both = apply_pipeline(
        plain,
        load_config(
            None,
            [
                *SIZES,
                "rl.algorithm=ppo",
                "pipeline.staleness=1",
                "pipeline.proximal_from_update=true",
                "pipeline.values_from_critic_update=true",
                "pipeline.fuse=[forwards,advantage]",
            ],
        ).pipeline,
    )
    assert sorted(both.stage_names()) == [
        "actor_update",
        "advantage+critic_update",
        "generate",
        "reward",
        "weight_sync",
    ]


def test_one_step_rewrites_reject_several_optimizer_steps():
    for field in ("ppo_epochs", "minibatches"):
        for knob in ("proximal_from_update", "values_from_critic_update"):
            with pytest.raises(ConfigError, match=f"rl.{field}") as e:
                load_config(None, [*SIZES, "rl.algorithm=ppo", f"rl.{field}=2", f"pipeline.{knob}=true"])
            assert e.value.value == 2
        g = graph("rl.algorithm=ppo", f"rl.{field}=2")  # the passes check it too (planner plans)
        with pytest.raises(GraphError, match="one optimizer step"):
            proximal_from_update(g)
        with pytest.raises(GraphError, match="one optimizer step"):
            values_from_critic_update(g)
    with pytest.raises(ConfigError, match="pipeline.proximal_from_update"):
        load_config(None, [*SIZES, "pipeline.elide_old_forward=true", "pipeline.proximal_from_update=true"])
    with pytest.raises(ConfigError, match="pipeline.values_from_critic_update"):
        load_config(None, [*SIZES, "pipeline.values_from_critic_update=true"])  # GRPO: no critic
    with pytest.raises(GraphError, match="ride on old_forward"):
        values_from_critic_update(share_actor_critic(graph("rl.algorithm=ppo")))
    with pytest.raises(ConfigError, match="pipeline.values_from_critic_update"):
        load_config(
            None,
            [*SIZES, "rl.algorithm=ppo", "pipeline.share_actor_critic=true", "pipeline.values_from_critic_update=true"],
        )


def test_useful_flops_never_count_a_pass_one_step_makes_redundant():
    stats = {"resp": 3, "prompt": 5, "seq": 8, "resp_ctx": 3 * 6.5, "prompt_sq": 12.5}
    one = load_config(None, [*SIZES, "rl.algorithm=ppo", "pipeline.staleness=1"])
    two = load_config(None, [*SIZES, "rl.algorithm=ppo", "pipeline.staleness=1", "rl.minibatches=2"])
    on = load_config(
        None,
        [
            *SIZES,
            "rl.algorithm=ppo",
            "pipeline.staleness=1",
            "pipeline.proximal_from_update=true",
            "pipeline.values_from_critic_update=true",
        ],
    )
    assert step_flops(one, stats, 1) == step_flops(on, stats, 1) < step_flops(two, stats, 1)


def test_planner_plans_drop_the_passes_one_step_makes_redundant():
    from rpeg_jax.costmodel import context as CX
    from rpeg_jax.costmodel import planner as P
    from rpeg_jax.costmodel import scoring as SC
    from rpeg_jax.costmodel import space as SP
    from rpeg_jax.costmodel.hardware import load_hardware

    hw = load_hardware("gh200", calibrated=False)
    ctx = CX.make_context(load_config(None, ["rl.algorithm=ppo"]), 4, hw)
    for share in (False, True):
        opts = SP.structural_options(ctx, "colocated", share)
        assert all(o.proximal_from_update != o.elide_old_forward for o in opts)
        assert all(o.values_from_critic_update for o in opts)
        for _, g in SC.option_graphs(ctx, opts):
            assert not {"old_forward", "critic_forward"} & set(g.stage_names())
    res = P.search(load_config(None, ["rl.algorithm=ppo", "costmodel.search_share_actor_critic=false"]), 4, hw)
    assert res.chosen.knobs["values_from_critic_update"] and "advantage+critic_update" in res.chosen.stage_times_s
    assert not {"critic_forward", "old_forward"} & set(res.chosen.stage_times_s)
    off = CX.make_context(load_config(None, ["rl.algorithm=ppo", "costmodel.search_one_step_rewrites=false"]), 4, hw)
    assert not any(
        o.proximal_from_update or o.values_from_critic_update for o in SP.structural_options(off, "colocated", False)
    )
    two = CX.make_context(load_config(None, ["rl.algorithm=ppo", "rl.ppo_epochs=2"]), 4, hw)
    assert not any(
        o.proximal_from_update or o.values_from_critic_update for o in SP.structural_options(two, "colocated", False)
    )


# ---- the update functions against the plain two-pass computation ---------------------------------
def _close(a, b, tol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


@pytest.mark.parametrize("micro,group", [(1, 1), (2, 1), (2, 2)])
def test_critic_values_update_equals_forward_then_gae_then_update(micro, group):
    """V_old and the GAE returns from the update's own forward = a separate forward, then GAE, then
    the plain critic update; the values come back in batch order (micro-batches and groups split
    the rows: their order is undone)."""
    params, batch = make_case(3, critic=True)
    del batch["values_BxR"], batch["returns_BxR"]
    batch["rewards_B"] = jnp.asarray(np.random.default_rng(1).normal(size=batch["row_B"].shape), jnp.float32)
    cfg = RLConfig(algorithm="ppo", micro_batches=micro, value_clip=0.2, gamma=0.9, lam=0.8)
    opt = optax.adam(0.05)
    values = value_fn(params, batch)["values"]
    ret = rl.compute_advantages({**batch, "values_BxR": values}, cfg)[0]["returns_BxR"]
    plain = jax.jit(rl.make_critic_update(value_fn, opt, cfg, group_size=group))
    want_p, want_s, want_m = plain(params, opt.init(params), {**batch, "values_BxR": values, "returns_BxR": ret})
    fused = jax.jit(rl.make_critic_values_update(value_fn, opt, cfg, group_size=group))
    got_p, got_s, got_m, rows = fused(params, opt.init(params), batch)
    _close(rows["values_BxR"], values, 0.0)
    _close((got_p, got_s), (want_p, want_s))
    for k in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac"):
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-6, err_msg=k)


@pytest.mark.parametrize("micro", [2])
def test_shared_values_update_equals_forward_then_gae_then_update(micro):
    """Shared backbone: V_old, advantages and returns from the update's own forward (and π_old too)
    = a separate forward, GAE, then the plain actor-critic update."""
    params, batch = make_case(5, critic=True)
    for k in ("values_BxR", "returns_BxR", "advantages_BxR", "old_logp_BxR"):
        del batch[k]
    batch["rewards_B"] = jnp.asarray(np.random.default_rng(2).normal(size=batch["row_B"].shape), jnp.float32)
    cfg = RLConfig(algorithm="ppo", micro_batches=micro, gamma=0.9, lam=0.8, kl_coef=0.05)
    opt = optax.adam(0.05)
    out = policy_fn(params, batch)
    adv = rl.compute_advantages({**batch, "values_BxR": out["values"]}, cfg)[0]
    full = {**batch, **adv, "values_BxR": out["values"], "old_logp_BxR": out["logp"]}
    want = jax.jit(rl.make_actor_critic_update(policy_fn, opt, cfg))(params, opt.init(params), full)
    fused = rl.make_actor_critic_update(policy_fn, opt, cfg, proximal_from_update=True, values_from_update=True)
    got = jax.jit(fused)(params, opt.init(params), batch)
    _close(got[3]["values_BxR"], out["values"], 0.0)
    _close(got[:2], want[:2])
    for k, v in want[2].items():
        np.testing.assert_allclose(got[2][k], v, rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("decoupled", [False, True])
def test_actor_proximal_from_update_equals_a_separate_proximal_pass(decoupled):
    """π_old = sg(logp) of the update's forward = π_old from a separate forward at the same θ: the
    loss, its gradient and (decoupled) the behaviour weights π_prox/π_behav agree."""
    params, batch = make_case(4, behav_noise=0.3 if decoupled else 0.0)
    if not decoupled:
        del batch["behav_logp_BxR"]
    cfg = RLConfig(kl_coef=0.05, entropy_coef=0.01, behav_weight_cap=2.0, micro_batches=2)
    opt = optax.adam(0.05)
    batch["old_logp_BxR"] = policy_fn(params, batch)["logp"]  # the separate pass at θ_t
    want = jax.jit(rl.make_actor_update(policy_fn, opt, cfg))(params, opt.init(params), batch)
    del batch["old_logp_BxR"]
    got = jax.jit(rl.make_actor_update(policy_fn, opt, cfg, proximal_from_update=True))(params, opt.init(params), batch)
    _close(got[:2], want[:2])
    for k, v in want[2].items():
        np.testing.assert_allclose(got[2][k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    with pytest.raises(ConfigError, match="rl.ppo_epochs"):
        rl.make_actor_update(policy_fn, opt, RLConfig(ppo_epochs=2), proximal_from_update=True)


# ---- end to end: the same numbers as the plain pipeline ------------------------------------------
# Each test first checks that the rewrite changed what ran (assert_rewritten), then the numbers.
def test_proximal_from_update_equals_recomputed_proximal_under_staleness(tmp_path):
    """GRPO, k = 1 (decoupled PPO: behaviour weights π_prox/π_behav), with a KL term and entropy."""
    grpo = TINY + ["rl.kl_coef=0.04", "rl.entropy_coef=0.01", "pipeline.staleness=1"]
    plain = run(tmp_path, "recomputed", grpo, steps=2)
    rewritten = run(tmp_path, "rewritten", grpo + ["pipeline.proximal_from_update=true"], steps=2)
    assert_rewritten(rewritten, plain, absent={"old_forward"}, unread={"actor_update": {"old_logp"}})
    assert_same_run(plain, rewritten)


ONE_STEP = ["pipeline.values_from_critic_update=true", "pipeline.proximal_from_update=true"]
# PPO with a critic: critic_forward's values and the separate GAE move into the critic update;
# the actor update computes π_old itself.
CRITIC_ONE_STEP = dict(
    present={"advantage+critic_update"},
    absent={"old_forward", "critic_forward", "advantage", "critic_update"},
    unread={"actor_update": {"old_logp"}},
)


def test_ppo_one_step_rewrites_equal_the_plain_pipeline(tmp_path):
    """PPO with a critic, synchronous: values from the critic update (GAE in its program) and π_old
    from the actor update."""
    ppo = TINY + ["rl.algorithm=ppo", "rl.kl_coef=0.04"]
    plain = run(tmp_path, "plain", ppo, steps=2)
    rewritten = run(tmp_path, "rewritten", ppo + ONE_STEP, steps=2)
    assert_rewritten(rewritten, plain, **CRITIC_ONE_STEP)
    assert_same_run(plain, rewritten)


@pytest.mark.slow
def test_ppo_one_step_rewrites_under_staleness_and_micro_batches(tmp_path):
    """Also at k = 1 with micro-batches (the values come back in row order); fuse=[forwards,advantage]
    then has nothing left to fuse (ref_forward is alone, GAE is in the critic update)."""
    ppo = TINY + [
        "rl.algorithm=ppo",
        "rl.kl_coef=0.04",
        "pipeline.staleness=1",
        "rl.micro_batches=2",
        "rl.whiten_advantages=true",
    ]
    plain = run(tmp_path, "plain", ppo, steps=2)
    rewritten = run(tmp_path, "rewritten", ppo + ONE_STEP + ["pipeline.fuse=[forwards,advantage]"], steps=2)
    assert_rewritten(rewritten, plain, **CRITIC_ONE_STEP)
    assert_same_run(plain, rewritten)


@pytest.mark.slow
def test_shared_backbone_one_step_rewrites_equal_the_plain_pipeline(tmp_path):
    """One backbone: values and π_old from the shared update's own forward = old_forward giving both."""
    ppo = TINY + ["rl.algorithm=ppo", "rl.kl_coef=0.04", "pipeline.share_actor_critic=true"]
    plain = run(tmp_path, "plain", ppo, steps=2)
    rewritten = run(tmp_path, "rewritten", ppo + ONE_STEP, steps=2)
    assert_rewritten(
        rewritten, plain, present={"advantage+actor_update"}, absent={"old_forward", "advantage", "actor_update"}
    )
    assert_same_run(plain, rewritten)
