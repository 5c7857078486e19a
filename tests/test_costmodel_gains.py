"""The planner's comparisons: utilization on fixed reference work, the systems / algorithmic split
of the gain over verl-like, and the ReaL-like baseline's own search space.
References: the reference work counted here by hand in forward-equivalents of the model (one
generation, one forward per scoring pass, three per update) from ModelShape.forward_flops; brute
force over the candidate tables for the family bests."""

import dataclasses
import json

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel import planner as P
from rpeg_jax.costmodel import scoring as SC
from rpeg_jax.costmodel import space as SP
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.graph.passes import apply_pipeline

GH = load_hardware("gh200", calibrated=False)
# The same profile without the weight sync's and the framework's fixed seconds per step (~9 s at
# this size, configs/hardware since session 12): they add alike to every plan and would hide the
# forwards' part of the comparison below.
GH_NO_FIXED = dataclasses.replace(
    GH, efficiency=dataclasses.replace(GH.efficiency, sync_fixed_s=0.0, sync_bucket_s=0.0, host_step_s=0.0)
)
P1 = [
    "model.dtype=bfloat16",
    "model.param_dtype=float32",
    "data.max_prompt_len=512",
    "costmodel.prompt_len=512",
    "rollout.max_new_tokens=4096",
    "costmodel.response_len_min=256",
    "costmodel.response_len_median=1024",
    "costmodel.response_len_sigma=0.8",
    "train.pack_sequences=true",
]
PPO = ["rl.algorithm=ppo", "rl.group_size=1", "data.prompts_per_step=128", "rl.kl_coef=0.05"]


def cfg_of(*extra, model="qwen2-1.5b"):
    return load_config(None, [f"model.preset={model}", *P1, *extra])


def _one_forward(ctx, ms):
    lens = ctx.st.dist.lengths(ctx.st.B).astype(float)
    tok, scored, sq = np.sum(ctx.st.P + lens), np.sum(lens), np.sum((ctx.st.P + lens) ** 2)
    return float(ms.forward_flops(tok, scored, sq, True))


def test_utilization_is_on_the_reference_work_of_the_synchronous_unfused_graph():
    # PPO with KL, one-step rewrites on: the chosen plan drops old_forward and critic_forward, yet it
    # is credited with verl's work: generate + ref + old + critic forwards + 3 (actor) + 3 (critic).
    cfg = cfg_of(*PPO)
    res = P.search(cfg, 8, GH)
    ctx = CX.make_context(cfg, 8, GH)
    roles = CX.roles_of(ctx, ctx.base)
    a, c = _one_forward(ctx, roles.actor), _one_forward(ctx, roles.critic)
    ref_work = a + a + a + c + 3 * a + 3 * c  # generate, ref, old, critic forward, two updates
    peak = GH.peak(roles.actor.dtype) * 8
    c0 = res.chosen
    assert not {"old_forward", "critic_forward"} & set(c0.stage_times_s), "the rewrite did not happen"
    for p in (c0, *res.runners_up, *res.baselines.values()):
        assert p.utilization * p.step_time_s * peak == pytest.approx(ref_work, rel=1e-3), p.label
    # Own work: the chosen plan runs fewer passes than the reference, so it is credited less.
    own = CX.useful_flops(ctx.st, apply_pipeline(ctx.base, _pipe(c0)))
    assert c0.utilization_own_work * c0.step_time_s * peak == pytest.approx(own, rel=1e-9)
    assert c0.utilization_own_work < c0.utilization
    # A faster plan on the same reference work has the higher utilization.
    verl = res.baselines["verl_like"]
    assert c0.step_time_s < verl.step_time_s and c0.utilization > verl.utilization
    assert verl.utilization == pytest.approx(verl.utilization_own_work, rel=1e-9)
    assert c0.plan.predicted["utilization_own_work"] == c0.utilization_own_work


def _pipe(p):
    from rpeg_jax.config.pipeline import PipelineConfig

    k = dict(p.knobs)
    k["fuse"] = tuple(k.get("fuse") or ())
    k["split_sizes"] = tuple(k.get("split_sizes") or ())
    return PipelineConfig(**{f: v for f, v in k.items() if f in PipelineConfig.__dataclass_fields__})


GRPO16 = ["rl.group_size=16", "data.prompts_per_step=32", "costmodel.max_staleness=2"]


def _brute_equal_algorithm(ctx):
    """The fastest plan at k = 0 with separate models over every option x every table row (no pruning)."""
    from rpeg_jax.costmodel.schedule import simulate, unroll

    cache, best = {}, np.inf
    for placement, share in SP.families(ctx, equal_algorithm=True):
        assert not share
        for pipe, g in SC.option_graphs(ctx, SP.structural_options(ctx, placement, share, equal_algorithm=True)):
            assert pipe.staleness == 0 and not pipe.share_actor_critic
            tab = SC.family_table(ctx, g, placement, cache)
            dur, pieces = SC.durations(ctx, g, tab)
            per = simulate(unroll(g, shared_resource=ctx.hw.shared_host), dur, pieces)[0]
            per = np.where(SP.divisible(ctx, g, tab), per, np.inf)
            best = min(best, float(np.min(per)))
    return best


def test_algorithmic_knobs_are_off_unless_asked_and_the_gain_is_all_systems():
    cfg = cfg_of(*PPO, "costmodel.max_staleness=2")  # a bound alone does not ask for staleness
    ctx = CX.make_context(cfg, 8, GH)
    assert {s for _, s in SP.families(ctx)} == {False}
    assert all(o.staleness == 0 for p, s in SP.families(ctx) for o in SP.structural_options(ctx, p, s))
    res = P.search(cfg, 8, GH)
    c, g = res.chosen, res.gains
    assert c.knobs["staleness"] == 0 and not c.knobs["share_actor_critic"]
    assert res.equal_algorithm is c and g["algorithmic"] == 1.0 and not g["algorithmic_searched"]
    verl = res.baselines["verl_like"]
    assert g["systems"] == pytest.approx(verl.step_time_s / c.step_time_s, rel=1e-12) == g["total"]
    # Asked for: the shared backbone is searched and its gain is algorithmic.
    on = P.search(cfg_of(*PPO, "costmodel.max_staleness=2", "costmodel.search_algorithmic=true"), 8, GH)
    assert on.gains["algorithmic_searched"] and on.chosen.step_time_s <= c.step_time_s * (1 + 1e-9)
    assert on.gains["equal_algorithm_step_s"] == pytest.approx(c.step_time_s, rel=1e-9)
    if on.chosen.knobs["share_actor_critic"] or on.chosen.knobs["staleness"]:
        assert on.gains["algorithmic"] > 1.0


def test_gains_split_staleness_from_systems_and_multiply_to_the_total():
    cfg = cfg_of(*GRPO16, "costmodel.search_algorithmic=true", "costmodel.response_len_sigma=1.0")
    res = P.search(cfg, 16, GH, processes=1)  # the whole space (one process: the model's what-if)
    c, g, a = res.chosen, res.gains, res.asynchrony
    assert c.knobs["staleness"] >= 1, "the tail should make staleness pay here"
    assert g["algorithmic_knobs"] == {"staleness": c.knobs["staleness"], "share_actor_critic": False}
    verl = res.baselines["verl_like"]
    assert g["total"] == pytest.approx(verl.step_time_s / c.step_time_s, rel=1e-12)
    assert g["systems"] * g["algorithmic"] == pytest.approx(g["total"], rel=1e-12)
    # The systems reference is the best k = 0 plan over the whole space (brute force, no pruning).
    ctx = CX.make_context(cfg, 16, GH)
    assert g["equal_algorithm_step_s"] == pytest.approx(_brute_equal_algorithm(ctx), rel=1e-9)
    assert res.equal_algorithm.knobs["staleness"] == 0
    # The chosen layout's own asynchrony factor is at least the algorithmic gain (the best k = 0
    # plan is at least as fast as the chosen layout at k = 0).
    assert a["asynchrony"] >= g["algorithmic"] * (1 - 1e-9) > 1.0
    assert any("gains by kind" in n for n in res.notes)


def test_a_pinned_staleness_still_gets_an_equal_algorithm_reference():
    cfg = cfg_of(*GRPO16, "pipeline.staleness=1", "costmodel.response_len_sigma=1.0")
    res = P.search(cfg, 16, GH, processes=1)  # as the brute force below (make_context: one process)
    assert res.chosen.knobs["staleness"] == 1  # the config's own choice is respected
    eq = res.equal_algorithm
    assert eq is not None and eq.knobs["staleness"] == 0 and eq is not res.chosen
    ctx = CX.make_context(cfg, 16, GH)
    assert eq.step_time_s == pytest.approx(_brute_equal_algorithm(ctx), rel=1e-9)
    assert res.gains["algorithmic"] == pytest.approx(eq.step_time_s / res.chosen.step_time_s, rel=1e-12)


def test_rpeg_plan_json_has_baselines_chosen_and_gains(tmp_path, capsys):
    import json

    from rpeg_jax.cli import main

    out = tmp_path / "p.json"
    args = ["plan", "--hardware", "gh200", "--gpus", "16", "--model", "qwen2-1.5b", "--json", str(out)]
    assert main([*args, *P1, *GRPO16, "--allow-algorithmic"]) == 0
    text = capsys.readouterr().out
    assert "gains over verl_like" in text and "algorithmic (searched" in text
    d = json.loads(out.read_text())
    for name in ("verl_like", "real_like"):
        for k in ("step_time_s", "utilization", "memory_per_gpu_gb"):
            assert d["baselines"][name][k] > 0
    for k in ("step_time_s", "utilization", "memory_per_gpu_gb", "utilization_own_work"):
        assert d["chosen"][k] > 0
    assert d["gains"]["algorithmic_searched"] is True
    assert d["gains"]["systems"] * d["gains"]["algorithmic"] == pytest.approx(d["ratios"]["verl_like"], rel=1e-9)
    assert main([*args, *P1, *GRPO16]) == 0
    assert json.loads(out.read_text())["gains"]["algorithmic_searched"] is False


def test_real_like_runs_the_scoring_forwards_side_by_side_on_disjoint_sub_meshes():
    # GRPO with KL: ref_forward and old_forward depend only on the rollouts; ReaL runs them at once on
    # two halves of the devices (each call in its own layout, weights reallocated into it).
    cfg = cfg_of(
        "rl.group_size=16",
        "data.prompts_per_step=32",
        "rl.kl_coef=0.05",
        "rollout.max_new_tokens=1024",
        "costmodel.response_len_median=512",
        model="qwen2-7b",
    )
    res = P.search(cfg, 16, GH_NO_FIXED)
    real, verl = res.baselines["real_like"], res.baselines["verl_like"]
    calls = real.layout["concurrent"]
    assert set(calls) == {"ref_forward", "old_forward"}
    assert sum(c["devices"] for c in calls.values()) <= 16
    for c in calls.values():
        assert c["data"] * c["fsdp"] * c["tensor"] == c["devices"]
    groups = {g.name: set(g.devices) for g in real.plan.groups}
    assert not groups["call0"] & groups["call1"] and groups["call0"] | groups["call1"] <= groups["all"]
    # The schedule: both calls start together when generation ends; the next stage on all devices
    # waits for both (nested groups serialise with their parent, the parts overlap each other).
    sp, st = real.spans, real.stage_times_s
    assert sp["ref_forward"][0] == pytest.approx(sp["old_forward"][0]) == pytest.approx(sp["generate"][1])
    assert sp["advantage"][0] == pytest.approx(max(sp["ref_forward"][1], sp["old_forward"][1]))
    serial = sum(v for k, v in st.items() if k not in calls) + max(st[k] for k in calls)
    assert real.step_time_s == pytest.approx(serial, abs=st["reward"] + 1e-9)
    # It beats the best serial plan of its old family (per-stage layouts on all devices) and verl-like.
    ctx = CX.make_context(cfg, 16, GH_NO_FIXED)
    g = CX.reference_graph(ctx)
    tab = SC.family_table(ctx, g, "colocated", {})
    assert real.step_time_s < float(np.min(SC.periods(ctx, g, tab)[0])) < verl.step_time_s * (1 + 1e-9)
    # (By how much depends on how far a forward is from linear scaling: with the GPU profiles'
    # train_matmul_cap, since session 12, the halves run almost as efficiently as the whole and
    # the gain here is ~0.2%; it was ~2% before.)


def test_fp32_compute_on_a_gpu_profile_is_warned_in_text_and_json(tmp_path, capsys):
    from rpeg_jax.cli import main

    out = tmp_path / "p.json"
    assert main(["plan", "--hardware", "gh200", "--gpus", "8", "--json", str(out)]) == 0  # default.yaml: fp32
    text = capsys.readouterr().out
    assert "warning: model.dtype=float32 on gh200: priced at the fp32 peak (67 TFLOP/s, not 989)" in text
    assert json.loads(out.read_text())["warnings"][0].startswith("model.dtype=float32 on gh200")
    assert main(["plan", "--hardware", "gh200", "--gpus", "8", "--json", str(out), "model.dtype=bfloat16"]) == 0
    assert "warning:" not in capsys.readouterr().out and json.loads(out.read_text())["warnings"] == []
    cpu = P.search(load_config(None, []), 1, load_hardware("cpu", calibrated=False))
    # the CPU computes in float32 at its one peak: no dtype warning (only the uncalibrated-profile one)
    assert not [w for w in cpu.warnings if "dtype" in w], cpu.warnings
    assert [w for w in cpu.warnings if w.startswith("the cpu profile is not calibrated")], cpu.warnings
