"""rl.forward_micro_batches: the scoring forwards (runtime/kernels.scoring_fn) run the batch as a
loop over micro-batches. The reference is the single pass (itself tested against a float64 numpy
decoder in test_models.py and the shared-prompt pass in test_model_prefix.py), with the
group-shared prompt and without:

- on one device the micro-batched forward is bitwise the single pass run on each piece alone
  (the loop adds no arithmetic), and within float32 rounding of the single pass over the whole
  batch: XLA's CPU kernels round differently at another batch size (the single pass on a quarter
  of the rows differs from the same rows of the whole batch by as much), a few ulps of the
  outputs' scale (REL = 4e-6 x max|output|; seen: logp 8e-6 at |logp| <= 10, values 6e-5 at
  |v| <= 40);
- on data x fsdp (x tensor) meshes of CPU devices, the same against one device's single pass,
  the outputs sharded over the batch axes, and the per-device temporaries shrinking with micro.

The rewrite is shown first: the micro-batched program has a top-level loop of `micro` pieces."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpeg_jax.config import model_preset
from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.sharding import ShardingConfig
from rpeg_jax.models import init_model
from rpeg_jax.rl.layout import merge_rows, split_tree
from rpeg_jax.runtime.kernels import forward_micro_batches, scoring_fn, shared_prompt_groups
from rpeg_jax.sharding import layout_for

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, init_std=0.2)
N_GROUPS, G, P, R = 8, 4, 6, 7  # B = 32 rows
B = N_GROUPS * G
REL = 4e-6  # x max|output|: float32 rounding of the same rows at another batch size


def rollout_batch(seed=0):
    """Rollout layout: groups of G rows with one prompt (left-padded to P), responses right-padded."""
    rng = np.random.default_rng(seed)
    tok, pos, seg = (np.zeros((B, P + R), np.int32) for _ in range(3))
    for grp in range(N_GROUPS):
        lp = int(rng.integers(1, P + 1))
        prompt = rng.integers(3, 128, lp)
        for j in range(G):
            row, lr = grp * G + j, int(rng.integers(1, R + 1))
            tok[row, P - lp : P], tok[row, P : P + lr] = prompt, rng.integers(3, 128, lr)
            pos[row, P - lp : P + lr] = np.arange(lp + lr)
            seg[row, P - lp : P + lr] = 1
    return {
        "tokens_BxS": tok,
        "positions_BxS": pos,
        "segment_ids_BxS": seg,
        "response_mask_BxR": (seg[:, P:] > 0).astype(np.float32),
    }


@pytest.fixture(scope="module")
def model():
    mdl = init_model(model_preset("tiny", value_head=True, **SMALL), seed=3)
    rng = np.random.default_rng(0)  # the value head starts at zero: give it weights, or values are 0 == 0
    mdl.value_w.set_value(jnp.asarray(rng.normal(size=mdl.value_w.get_value().shape), jnp.float32))
    mdl.value_b.set_value(jnp.float32(0.3))
    return nnx.split(mdl, nnx.Param)


def scorer(graphdef, micro, group_size=G, devices=1):
    return scoring_fn(graphdef, group_size, devices, micro, temperature=0.8, logp=True, entropy=False, values=True)


def top_loops(fn, *args):
    """Lengths of the scans at the top level of fn's jaxpr (the model's layer loops sit inside)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    eqns = [e for e in jaxpr.eqns if e.primitive.name == "pjit"]
    inner = eqns[0].params["jaxpr"].jaxpr.eqns if len(jaxpr.eqns) == 1 and eqns else jaxpr.eqns
    return [e.params["length"] for e in inner if e.primitive.name == "scan"]


def assert_same(out, ref, mask, rel=REL):
    """Every response token's logp and value within rel x max|ref| (rel=0: bitwise)."""
    m = np.asarray(mask) > 0
    assert m.sum() > B  # response tokens compared
    for k in ("logp", "values"):
        a, b = np.asarray(out[k]), np.asarray(ref[k])
        assert a.shape == b.shape == (B, R)
        assert np.all(np.isfinite(b[m])) and np.abs(b[m]).max() > 1.0
        np.testing.assert_allclose(a[m], b[m], atol=rel * np.abs(b[m]).max(), rtol=0, err_msg=k)


def per_piece(graphdef, params, c, micro, group_size):
    """The single pass run on each strided piece alone (one program per piece), merged back."""
    g = shared_prompt_groups(c, group_size, micro, 1)
    pieces = split_tree(c, micro, g)
    fwd = jax.jit(scorer(graphdef, 1, g))
    outs = [fwd(params, jax.tree.map(lambda x: x[i], pieces)) for i in range(micro)]
    return {k: merge_rows(jnp.stack([o[k] for o in outs]), g) for k in ("logp", "values")}


@pytest.mark.parametrize("group_size", [G, 1])  # shared prompt per group (split_groups) / plain (split_rows)
def test_micro_batched_forward_equals_single_pass(model, group_size):
    graphdef, params = model
    c = {k: jnp.asarray(v) for k, v in rollout_batch().items()}
    ref = jax.jit(scorer(graphdef, 1, group_size))(params, c)
    plain = top_loops(scorer(graphdef, 1, group_size), params, c)
    for micro in (2, 4, 8):
        fn = scorer(graphdef, micro, group_size)
        loops = top_loops(fn, params, c)
        assert micro in loops and micro not in plain, f"micro={micro}: loops {loops}, single pass {plain}"
        out = jax.jit(fn)(params, c)
        assert_same(out, per_piece(graphdef, params, c, micro, group_size), c["response_mask_BxR"], rel=0)
        assert_same(out, ref, c["response_mask_BxR"])


@pytest.mark.parametrize(
    "mesh",
    [pytest.param({"data": 2, "fsdp": 2, "tensor": 1}, marks=pytest.mark.slow), {"data": 2, "fsdp": 2, "tensor": 2}],
    ids=["d2f2", "d2f2t2"],  # d2f2 is slow (session 24's trim): d2f2t2 has the same data and fsdp axes
)
def test_micro_batched_forward_on_a_mesh(model, cpu_devices, mesh):
    """Weights and batch in a stage layout (rules `auto`: batch over data x fsdp, weights over fsdp
    and tensor), as runtime/placement puts them: same values as one device's single pass, the
    outputs stay sharded over the batch axes, and each device's temporaries shrink with micro."""
    graphdef, params = model
    host = rollout_batch(1)
    c1 = {k: jnp.asarray(v) for k, v in host.items()}
    ref = jax.jit(scorer(graphdef, 1))(params, c1)
    n = mesh["data"] * mesh["fsdp"] * mesh["tensor"]
    layout = layout_for(mesh, "auto", ShardingConfig(), cpu_devices[:n])
    sharded = jax.device_put(params, layout.params(params))
    c = {k: jax.device_put(v, layout.sharding(("batch",) + (None,) * (v.ndim - 1), v.shape)) for k, v in host.items()}
    assert c["tokens_BxS"].sharding.spec[0] == ("data", "fsdp")
    # per-device temporaries of a batch where activations dominate (compiled, not run): 64 rows of 160
    big = {
        k: jax.ShapeDtypeStruct((64, 160) if k != "response_mask_BxR" else (64, 128), v.dtype, sharding=v.sharding)
        for k, v in c.items()
    }
    temp, collectives = {}, {}
    for micro in (1, 2, 4):
        fn = scorer(graphdef, micro, devices=n)
        with layout.activations():
            out = jax.jit(fn)(sharded, c)
            compiled = jax.jit(fn).lower(sharded, big).compile()
        temp[micro] = compiled.memory_analysis().temp_size_in_bytes
        hlo = compiled.as_text()  # the pieces stay where their rows are: no batch moves between devices
        collectives[micro] = {op: len(re.findall(rf"= \S+ {op}\(", hlo)) for op in ("all-gather", "all-to-all")}
        assert_same(out, ref, host["response_mask_BxR"])
        for k in ("logp", "values"):  # B rows spread over data x fsdp: B / 4 per device
            shard_rows = {s.data.shape[0] for s in out[k].addressable_shards}
            assert shard_rows == {B // (mesh["data"] * mesh["fsdp"])}, (micro, k, shard_rows)
    assert temp[4] < 0.7 * temp[2] < 0.7**2 * temp[1], temp
    assert collectives[1]["all-gather"] > 0 and collectives[1]["all-to-all"] == 0  # fsdp's weight gathers
    assert collectives[2] == collectives[4] == collectives[1], collectives


def test_explicit_axes_micro_batches(model, cpu_devices):
    """sharding.axis_types=explicit: the batch's sharding is in its type; the pieces are strided
    splits that keep it (rl.layout.split_rows) and the merged outputs are batch-sharded again."""
    graphdef, params = model
    host = rollout_batch(2)
    ref = jax.jit(scorer(graphdef, 1))(params, {k: jnp.asarray(v) for k, v in host.items()})
    mesh = {"data": 2, "fsdp": 2, "tensor": 1}
    layout = layout_for(mesh, "auto", ShardingConfig(axis_types="explicit"), cpu_devices[:4])
    sharded = jax.device_put(params, layout.params(params))
    c = {k: jax.device_put(v, layout.sharding(("batch",) + (None,) * (v.ndim - 1), v.shape)) for k, v in host.items()}
    with layout.activations():
        out = jax.jit(scorer(graphdef, 4, devices=4))(sharded, c)
    assert_same(out, ref, host["response_mask_BxR"])
    assert out["logp"].sharding.spec[0] == ("data", "fsdp")


class _Env:
    """The part of a StageEnv that forward_micro_batches reads."""

    def __init__(self, micro, mesh, pieces=1, prompts=8, group=4):
        from types import SimpleNamespace as NS

        rl = NS(forward_micro_batches=micro, group_size=group)
        self.context = NS(cfg=NS(rl=rl, data=NS(prompts_per_step=prompts)))
        self.plan = NS(mesh=mesh, pieces=pieces)
        self.stage = NS(name="ref_forward")


def test_bad_forward_micro_batches_are_named():
    from rpeg_jax.config import load_config

    with pytest.raises(ConfigError, match=r"rl\.forward_micro_batches.*0.*>= 1"):
        load_config(None, ["rl.forward_micro_batches=0"])
    with pytest.raises(ConfigError, match=r"rl\.forward_micro_batches.*3.*32 sequences"):
        load_config(None, ["data.prompts_per_step=8", "rl.group_size=4", "rl.forward_micro_batches=3"])
    assert load_config(None, ["data.prompts_per_step=8", "rl.group_size=4", "rl.forward_micro_batches=8"])
    # per device, against the stage's plan entry (kernel binding, before anything compiles)
    assert forward_micro_batches(_Env(4, {"data": 2, "fsdp": 4, "tensor": 1})) == 4  # 32 rows, 4 per device
    with pytest.raises(ConfigError, match=r"rl\.forward_micro_batches.*8.*ref_forward.*4 per device"):
        forward_micro_batches(_Env(8, {"data": 2, "fsdp": 4, "tensor": 1}))
    with pytest.raises(ConfigError, match=r"rl\.forward_micro_batches.*4.*16 sequences.*2 per device"):
        forward_micro_batches(_Env(4, {"data": 8, "fsdp": 1, "tensor": 1}, pieces=2))
    assert forward_micro_batches(_Env(1, {"data": 8, "fsdp": 4, "tensor": 1})) == 1  # 1: today's program


# ---- the cost model searches it, the planner emits it, the runtime applies it --------------------
P1_32B = ["model.preset=qwen2-32b", "train.offload=optimizer"]  # configs/p1.yaml: B = 32 x 16 = 512


def _p1(extra=()):
    from rpeg_jax.config import load_config

    return load_config("configs/p1.yaml", P1_32B + list(extra))


def test_forward_memory_drops_with_micro():
    """costmodel.stages.forward_memory at 32B, B = 512, P = 512, R = 16384 (p1) on d1 f8 t1: the
    activations are those of B / (8 micro) rows (x micro constant while the prompt stays shared,
    micro <= 4: 32/micro groups per piece, a multiple of the 8 devices); the gathered weights and
    the logits chunk do not change; past that the pieces lose prompt sharing but still shrink."""
    from rpeg_jax.costmodel import context as CX
    from rpeg_jax.costmodel import stages as S
    from rpeg_jax.costmodel.hardware import load_hardware

    gh = load_hardware("gh200", calibrated=False)
    ctx = CX.make_context(_p1(["train.pack_sequences=false"]), 8, gh)  # padded: the prompt-sharing law
    st, ms, eff = ctx.st, CX.roles_of(ctx, ctx.base).actor, gh.efficiency
    assert st.B == 512 and not st.packing
    weights = ms.pass_weight_bytes(8, 1, eff.fsdp_gather, eff.weight_copies, train=False)
    mem = {m: float(S.forward_memory(st, ms, d=1, f=8, t=1, micro=m)) for m in (1, 2, 4, 8, 16, 64)}
    # one logits chunk (capped at LOGITS_BUDGET, the same at every micro here) and the weights are fixed
    fixed = {m: weights + eff.fwd_act_memory_factor * ms.logits_bytes(64 / m * st.seq_scored) for m in mem}
    assert len({round(v) for v in fixed.values()}) == 1
    act = {m: (v - fixed[m]) * m for m, v in mem.items()}
    assert act[1] > 10 * fixed[1] > 0
    np.testing.assert_allclose([act[2], act[4]], [act[1], act[1]], rtol=1e-9)
    assert mem[2] > st.budget_bytes > mem[4]  # padded to R = 16384 (packed, 2 pieces fit: the planner test)
    assert mem[1] > mem[2] > mem[4] > mem[8] > mem[16] > mem[64] > weights


def test_planner_picks_forward_micro_batches_when_one_pass_does_not_fit():
    """p1 with qwen2-32b and train.offload=optimizer on 8 GH200: one scoring pass over 64 sequences
    per device needs more than the whole budget, so the plan micro-batches the forwards (main before
    this: no plan fits). At B = 128 one pass fits and is the fastest: the planner keeps 1. The
    choice is a plan setting, and the run's config takes it (graph/plan.config_for_plan)."""
    from rpeg_jax.costmodel import context as CX
    from rpeg_jax.costmodel import planner as P
    from rpeg_jax.costmodel import stages as S
    from rpeg_jax.costmodel.hardware import load_hardware
    from rpeg_jax.graph.plan import config_for_plan

    gh = load_hardware("gh200", calibrated=False)
    cfg = _p1()
    res = P.search(cfg, 8, gh, processes=1)  # tensor-parallel generation (two processes fit nothing)
    fw = res.chosen.layout["forward"]
    ctx = CX.make_context(cfg, 8, gh)
    st, ms = ctx.st, CX.roles_of(ctx, ctx.base).actor
    d, f, t, micro = fw["data"], fw["fsdp"], fw["tensor"], fw["micro_batches"]
    assert micro > 1 and float(S.forward_memory(st, ms, d=d, f=f, t=t, micro=1)) > st.budget_bytes
    assert res.chosen.memory_per_gpu_gb * 1e9 <= st.budget_bytes + 1e-3
    plan = res.chosen.plan
    assert plan.settings["rl.forward_micro_batches"] == micro
    run_cfg, changed = config_for_plan(cfg, plan)
    assert run_cfg.rl.forward_micro_batches == micro and changed["rl.forward_micro_batches"] == (1, micro)
    small = P.search(_p1(["data.prompts_per_step=8"]), 8, gh, processes=1).chosen
    assert small.layout["forward"]["micro_batches"] == 1 == small.plan.settings["rl.forward_micro_batches"]


@pytest.mark.slow  # two tiny PPO runs: ~24 s with a cold XLA cache, ~7 s warm
def test_a_plan_micro_batches_the_runs_scoring_forwards(tmp_path, monkeypatch):
    """A plan file whose settings carry rl.forward_micro_batches=2 (what `pipeline.plan=auto` gets
    from the planner): the run's ref / old / critic forwards are built with 2 micro-batches (the
    positive control), and the run equals the one-pass run (metrics and final weights, float32)."""
    import dataclasses

    from helpers import PPO, assert_same_run, run

    from rpeg_jax.config import load_config
    from rpeg_jax.graph.plan import plan_from_config
    from rpeg_jax.runtime import kernels

    built = []
    original = kernels.scoring_fn

    def spy(graphdef, group_size, devices, micro=1, **kw):
        built.append(micro)
        return original(graphdef, group_size, devices, micro, **kw)

    monkeypatch.setattr(kernels, "scoring_fn", spy)
    plain = run(tmp_path, "plain", PPO, steps=2)
    assert sorted(built) == [1, 1, 1]
    cfg = load_config(None, PPO)
    plan = plan_from_config(cfg, jax.device_count())
    path = str(tmp_path / "plan.json")
    dataclasses.replace(plan, settings={**plan.settings, "rl.forward_micro_batches": 2}).save(path)
    built.clear()
    micro = run(tmp_path, "micro", PPO + [f"pipeline.plan={path}"], steps=2)
    assert sorted(built) == [2, 2, 2]  # ref_forward, old_forward, critic_forward
    assert_same_run(micro, plain)
