"""The planner: imports no JAX, returns checked plans, rejects what does not fit, finds the
optimum of what it searches, and its baselines are the best of their own families."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel import planner as P
from rpeg_jax.costmodel import scoring as SC
from rpeg_jax.costmodel import space as SP
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.costmodel.schedule import simulate, unroll
from rpeg_jax.graph.ir import GraphError
from rpeg_jax.graph.passes import apply_pipeline
from rpeg_jax.graph.plan import Plan, graph_for_plan

GH = load_hardware("gh200", calibrated=False)
CPU = load_hardware("cpu", calibrated=False)


def without_sync_costs(hw):
    """`hw` with the weight sync's fixed and per-bucket costs and the per-step framework cost at 0:
    for tests of how the tail of generation is hidden, which a multi-second sync (configs/hardware
    since session 12) would otherwise decide in favour of a split plan that hides the sync."""
    eff = dataclasses.replace(hw.efficiency, sync_fixed_s=0.0, sync_bucket_s=0.0, host_step_s=0.0)
    return dataclasses.replace(hw, efficiency=eff)


P1 = [
    "model.dtype=bfloat16",
    "model.param_dtype=float32",
    "data.prompts_per_step=32",
    "rl.group_size=16",
    "data.max_prompt_len=512",
    "costmodel.prompt_len=512",
    "rollout.max_new_tokens=4096",
    "costmodel.response_len_min=256",
    "costmodel.response_len_median=1024",
    "costmodel.response_len_sigma=0.8",
    "train.pack_sequences=true",
]


def cfg_of(*extra, model="qwen2-1.5b"):
    return load_config(None, [f"model.preset={model}", *P1, *extra])


def test_planning_path_imports_no_jax():
    """Transitively, at import time (which package may import which, function-level imports
    included: tests/test_layers.py)."""
    code = (
        "import sys, rpeg_jax.costmodel.planner, rpeg_jax.cli.plan, rpeg_jax.cli.calibrate; "
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib', 'flax'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_choose_plan_default_config_is_a_checked_plan():
    cfg = load_config(None, [])
    plan = P.choose_plan(cfg, 8, CPU)
    assert isinstance(plan, Plan) and plan.source == "planner"
    g = graph_for_plan(cfg, plan)
    plan.check(g)
    times = P.predicted_stage_times(plan)
    assert set(times) == set(g.stage_names()) and all(t >= 0 for t in times.values())
    assert set(plan.settings) == {
        "rl.micro_batches",
        "rl.forward_micro_batches",
        "model.remat",
        "rollout.max_slots",
        "rollout.admission",
        "train.offload",
    }
    for key in ("step_time_s", "memory_per_gpu_gb", "utilization", "stage_s"):
        assert key in plan.predicted
    again = Plan.from_json(plan.to_json())
    assert again.stages == plan.stages and again.knobs == plan.knobs


def test_rejects_plans_that_do_not_fit():
    cfg = cfg_of("costmodel.memory_budget=0.05", model="qwen2-72b")
    with pytest.raises(GraphError, match="no plan fits"):
        P.search(cfg, 4, GH)


@pytest.mark.slow
def test_memory_forces_sharding_and_every_plan_fits():
    # 7B with float32 Adam state is 16 B/param = 122 GB replicated: it must be sharded on 8 H100s.
    hw = load_hardware("h100", calibrated=False)
    cfg = cfg_of(model="qwen2-7b")
    res = P.search(cfg, 8, hw)
    budget = cfg.costmodel.memory_budget * hw.hbm_bytes / 1e9
    for p in [res.chosen, *res.runners_up, *res.baselines.values()]:
        assert p.memory_per_gpu_gb <= budget + 1e-6
        tr = p.layout["train"]
        assert tr["fsdp"] * tr["tensor"] >= 2


def test_slow_links_rule_out_tensor_parallelism():
    cfg = cfg_of(model="qwen2-7b")
    fast = P.search(cfg, 4, GH)
    slow_hw = dataclasses.replace(GH, node=dataclasses.replace(GH.node, latency_s=2e-3, link_bw=1e9))
    slow = P.search(cfg, 4, slow_hw)
    assert slow.chosen.layout["generate"]["tensor"] == 1
    assert slow.chosen.layout["train"]["tensor"] == 1
    assert fast.chosen.step_time_s < slow.chosen.step_time_s


def test_long_tail_favours_bounded_asynchrony_when_allowed():
    # (Without elision nor π_prox from the update: skipping old_forward makes the synchronous plan as
    # fast on this workload. With a KL reference pass: the training side must be long enough for the
    # overlap to pay; with the group's prompt run once in the training passes, GRPO without KL leaves
    # too little of it here.)
    keep = ("costmodel.search_elide_old_forward=false", "costmodel.search_one_step_rewrites=false", "rl.kl_coef=0.04")
    # One process owning 16 GH200: the model's what-if (one per node, 4, runs no split or continuous
    # admission: test_several_processes_search_only_what_the_runtime_runs).
    cfg = cfg_of("costmodel.max_staleness=1", "costmodel.search_algorithmic=true", *keep)
    res = P.search(cfg, 16, GH, processes=1)
    assert res.chosen.knobs["staleness"] == 1
    sync_only = P.search(cfg_of("costmodel.max_staleness=0", *keep), 16, GH, processes=1)
    assert sync_only.chosen.knobs["staleness"] == 0
    assert res.chosen.step_time_s < sync_only.chosen.step_time_s


def test_continuous_admission_hides_the_tail():
    # Step admission: each step's batch is one generate call, tail included, and staleness only
    # overlaps the groups; continuous admission keeps the engine full across weight updates.
    # (One process owning 16 GH200: the model's what-if, as above.)
    gh = without_sync_costs(GH)
    base = P.search(cfg_of("costmodel.max_staleness=0"), 16, gh, processes=1)
    ca = P.search(cfg_of("costmodel.max_staleness=1", "costmodel.search_algorithmic=true"), 16, gh, processes=1)
    assert ca.chosen.layout["generate"]["admission"] == "continuous"
    assert ca.chosen.step_time_s < base.chosen.step_time_s
    assert ca.chosen.stage_times_s["generate"] < base.chosen.stage_times_s["generate"]
    ctx = CX.make_context(cfg_of("costmodel.max_staleness=1", "costmodel.search_algorithmic=true"), 16, GH)
    opts = SC.option_graphs(ctx, SP.structural_options(ctx, "colocated", False))
    assert {(o.staleness, SC.admission_of(g)) for o, g in opts} == {(0, "step"), (1, "continuous")}


def _all_periods(ctx, placement, share, graph, tab):
    dur, pieces = SC.durations(ctx, graph, tab)
    return simulate(unroll(graph, shared_resource=ctx.hw.shared_host), dur, pieces)[0]


@pytest.mark.parametrize("algo, n", [("grpo", 8), pytest.param("ppo", 8, marks=pytest.mark.slow)])
def test_search_finds_the_optimum_of_its_space_and_baselines_are_family_best(algo, n):
    # With the same generation engine (per-replica KV pools) our space contains both baselines.
    cfg = cfg_of(f"rl.algorithm={algo}", "rl.kl_coef=0.05", "rollout.kv_pool=sharded")
    res = P.search(cfg, n, GH)
    ctx = CX.make_context(cfg, n, GH)
    cache = {}
    best = np.inf
    for placement, share in SP.families(ctx):  # brute force: every option x every row, no pruning
        for pipe, g in SC.option_graphs(ctx, SP.structural_options(ctx, placement, share)):
            tab = SC.family_table(ctx, g, placement, cache)
            best = min(best, float(np.min(_all_periods(ctx, placement, share, g, tab))))
    assert res.chosen.step_time_s == pytest.approx(best, rel=1e-9)
    # Baselines: best over their own family (colocated, synchronous, unfused).
    base = SC.option_graphs(ctx, [PipelineConfig(placement="colocated")])[0][1]
    tab = SC.family_table(ctx, base, "colocated", cache)
    per = _all_periods(ctx, "colocated", False, base, tab)
    verl = (tab.t == 1) & (tab.d == tab.fd) & (tab.f == tab.ff) & (tab.t == tab.ft)
    real = res.baselines["real_like"]
    if "concurrent" in real.layout:  # ReaL's per-call sub-meshes won (tests/test_costmodel_gains.py)
        assert real.step_time_s < per.min()
    else:
        assert real.step_time_s == pytest.approx(per.min(), rel=1e-9)
    assert res.baselines["verl_like"].step_time_s == pytest.approx(per[verl].min(), rel=1e-9)
    assert real.step_time_s <= res.baselines["verl_like"].step_time_s
    assert res.chosen.step_time_s <= res.baselines["verl_like"].step_time_s
    v = res.baselines["verl_like"].layout
    assert v["train"] == {**v["train"], **{k: v["forward"][k] for k in ("data", "fsdp", "tensor")}}
    assert all(b.knobs["staleness"] == 0 and not b.knobs["fuse"] for b in res.baselines.values())


@pytest.mark.slow
def test_baselines_use_their_own_engines():
    # Our sampler shards its KV pool per replica (kv_pool=replicated prices the older sampler); the
    # verl/ReaL engines are priced with their own engines (no straw men), whatever kv_pool says.
    rep = P.search(cfg_of("rollout.kv_pool=replicated"), 16, GH)
    shd = P.search(cfg_of("rollout.kv_pool=sharded"), 16, GH)
    for name in ("verl_like", "real_like"):
        assert rep.baselines[name].step_time_s == pytest.approx(shd.baselines[name].step_time_s)
    assert shd.chosen.step_time_s <= rep.chosen.step_time_s + 1e-9


def test_replicated_kv_pool_costs_memory_per_replica():
    from rpeg_jax.costmodel import stages as S

    ctx = CX.make_context(cfg_of("rollout.kv_pool=replicated", model="qwen2-7b"), 16, GH)
    ms = CX.roles_of(ctx, ctx.base).actor
    st = ctx.st
    one = float(S.generate_memory(st, ms, 4, 8, reps=1))
    four = float(S.generate_memory(st, ms, 4, 8, reps=4))
    kv = 8 * (st.P + st.R) * ms.kv_bytes_per_token / 4
    assert four - one == pytest.approx(3 * kv)
    sharded = dataclasses.replace(st, kv_replicated=False)
    assert float(S.generate_memory(sharded, ms, 4, 8, reps=4)) == pytest.approx(one)


def test_cli_json_fields(tmp_path, capsys):
    from rpeg_jax.cli import main

    out = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            "--hardware",
            "gh200",
            "--gpus",
            "16",
            "--model",
            "qwen2-1.5b",
            "--json",
            str(out),
            "--save-plan",
            str(tmp_path / "chosen.json"),
            *P1,
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "verl_like" in text and "real_like" in text and "why:" in text
    d = json.loads(out.read_text())
    for k in ("step_time_s", "memory_per_gpu_gb", "utilization", "stage_times_s", "plan"):
        assert k in d["chosen"]
    for b in ("verl_like", "real_like"):
        assert d["baselines"][b]["step_time_s"] > 0 and d["ratios"][b] >= 1.0 - 1e-9
    assert d["search_seconds"] > 0 and d["evaluations"] > 0
    assert Plan.load(str(tmp_path / "chosen.json")).num_devices == 16


@pytest.mark.slow
def test_256_gpu_search_is_fast():
    res = P.search(
        cfg_of(
            "rollout.max_new_tokens=16384",
            "costmodel.response_len_min=4096",
            "costmodel.response_len_median=6144",
            model="qwen2-7b",
        ),
        256,
        GH,
        processes=1,  # the whole space (split, continuous admission); 64 processes would refuse 32 prompts
    )
    assert res.search_seconds < 60
    assert res.evaluations / res.search_seconds >= 1e3


def test_config_for_plan_applies_the_planner_settings():
    from rpeg_jax.graph.plan import config_for_plan

    cfg = cfg_of(model="qwen2-7b")
    res = P.search(cfg, 16, GH)
    out, changed = config_for_plan(cfg, res.chosen.plan)
    assert changed, "the chosen plan should differ from the defaults somewhere"
    for dotted, (old, new) in changed.items():
        section, name = dotted.split(".")
        assert getattr(getattr(cfg, section), name) == old and getattr(getattr(out, section), name) == new
    lay = res.chosen.layout
    assert out.rl.micro_batches == lay["train"]["micro_batches"]
    assert out.model.remat == lay["train"]["remat"]
    # The sampler's max_slots spans a process's replicas (the slot axis is sharded over them); 16 GH200
    # are 4 processes (one per node) by default.
    assert res.processes == 4
    assert out.rollout.max_slots == lay["generate"]["slots"] * lay["generate"]["replicas"] // 4
    assert out.pipeline.staleness == res.chosen.knobs["staleness"]
    assert out.pipeline.placement == res.chosen.knobs["placement"]


def test_useful_flops_counts_fused_parts_and_sharing():
    from rpeg_jax.config.pipeline import PipelineConfig
    from rpeg_jax.graph.algorithms import build_graph

    cfg = cfg_of("rl.algorithm=ppo", "rl.kl_coef=0.05")
    ctx = CX.make_context(cfg, 8, GH)
    plain = CX.useful_flops(ctx.st, ctx.base)
    fused = apply_pipeline(build_graph(cfg), PipelineConfig(fuse=("forwards", "advantage")))
    assert CX.useful_flops(ctx.st, fused) == pytest.approx(plain)
    shared = apply_pipeline(build_graph(cfg), PipelineConfig(share_actor_critic=True))
    # Sharing removes the critic's forward and update: 4 forward-equivalents of the model.
    ms = CX.roles_of(ctx, ctx.base).actor
    lens = ctx.st.dist.lengths(ctx.st.B).astype(float)
    one = float(ms.forward_flops(np.sum(ctx.st.P + lens), np.sum(lens), np.sum((ctx.st.P + lens) ** 2), True))
    assert plain - CX.useful_flops(ctx.st, shared) == pytest.approx(4 * one, rel=0.01)


# ---- meshes, processes, shared host, elision, defaults ---------------------------------------
def _candidates(res):
    return [res.chosen, *res.runners_up, *res.baselines.values()]


@pytest.mark.parametrize("hw", [CPU, GH], ids=["cpu", "gh200"])
def test_mesh_axes_divide_the_batches_they_shard(hw):
    cfg = load_config(None, ["costmodel.runners_up=12"])
    res = P.search(cfg, 8, hw, 1)
    B = cfg.data.prompts_per_step * cfg.rl.group_size
    for p in _candidates(res):
        m = p.knobs["pieces"]
        piece = B // m
        gen, tr, fw = p.layout["generate"], p.layout["train"], p.layout["forward"]
        assert B % m == 0 and cfg.data.prompts_per_step % m == 0, p.label
        assert piece % gen["replicas"] == 0, (p.label, gen)
        assert piece % (tr["data"] * tr["fsdp"]) == 0 and piece % (fw["data"] * fw["fsdp"]) == 0, p.label
        assert p.plan.settings["rollout.max_slots"] % gen["replicas"] == 0
    # 7 does not divide 128 sequences: no 7-device generation group or 7-way mesh.
    sizes = {p.layout["generate"]["replicas"] for p in _candidates(res)}
    assert 7 not in sizes


def _refused(cfg, plan, processes):
    """The runtime's refusal (graph/processes.check_plan, as runtime/setup.build calls it) of a plan."""
    from rpeg_jax.graph.plan import config_for_plan
    from rpeg_jax.graph.processes import NotRunnable, check_plan

    run_cfg, _ = config_for_plan(cfg, plan)
    try:
        check_plan(run_cfg, plan, graph_for_plan(run_cfg, plan), processes)
    except NotRunnable as e:
        return str(e)
    return None


@pytest.mark.parametrize("hw", [CPU, GH], ids=["cpu", "gh200"])
def test_several_processes_search_only_what_the_runtime_runs(hw):
    """The planner filters with the rules the runtime refuses by (graph/processes.py): with 2
    processes every plan it offers passes the runtime's check, while one process is offered plans
    two cannot run (a split that is not whole processes, a sub-mesh). The
    baselines keep their own engines' layouts."""
    cfg = load_config(
        None, ["costmodel.runners_up=12", "costmodel.search_algorithmic=true", "costmodel.max_staleness=1"]
    )
    one = P.search(cfg, 8, hw, processes=1)
    res = P.search(cfg, 8, hw, processes=2)
    ours = [res.chosen, *res.runners_up, res.equal_algorithm]
    assert not [(p.label, _refused(cfg, p.plan, 2)) for p in ours if _refused(cfg, p.plan, 2)]
    if hw.shared_host:  # CPU: splits and sub-meshes of any size (GH200: whole nodes, which 2 processes run)
        assert any(_refused(cfg, p.plan, 2) for p in [one.chosen, *one.runners_up])
    B = cfg.data.prompts_per_step * cfg.rl.group_size
    for p in ours:
        # colocated on all 8, or a split of whole processes (one generates, the other trains)
        assert p.layout["groups"] in ({"all": 8}, {"gen": 4, "train": 4}), p.layout["groups"]
        assert (p.knobs["placement"] == "split") == ("gen" in p.layout["groups"])
        # tensor-parallel decode inside a process (4 devices each), replicas across processes
        assert 4 % p.layout["generate"]["tensor"] == 0  # either admission: continuous runs on several too
        gen = p.layout["generate"]
        generating = 1 if "gen" in p.layout["groups"] else 2
        assert p.plan.settings["rollout.max_slots"] == gen["slots"] * gen["replicas"] // generating  # each engine
    s = res.chosen.plan.settings
    gen = res.chosen.layout["generate"]
    share = B if "gen" in res.chosen.layout["groups"] else B // 2  # the one generating process's, or half
    assert gen["admission"] == "continuous" or s["rollout.max_slots"] <= share  # step: at most its share
    assert res.processes == res.chosen.plan.predicted["processes"] == 2
    assert res.baselines["verl_like"].step_time_s == pytest.approx(one.baselines["verl_like"].step_time_s)
    with pytest.raises(GraphError, match=r"costmodel.processes=3: 3 processes cannot own 8 devices"):
        P.search(cfg, 8, GH, processes=3)


@pytest.mark.parametrize(
    "over, key",
    [
        (["rl.filter_groups=zero_variance"], "rl.filter_groups='zero_variance'"),  # under step admission
        (["data.prompts_per_step=6"], "data.prompts_per_step=6"),
    ],
)
def test_planner_refuses_a_config_several_processes_cannot_run(over, key, capsys):
    """What the config pins and the runtime cannot run with 4 processes is one line naming the key and
    the value (`rpeg plan` exits 2), the line the runtime gives (graph/processes.why_not)."""
    from rpeg_jax.cli import main

    with pytest.raises(GraphError, match=f"^config error: {key}: "):
        P.search(load_config(None, over), 8, CPU, processes=4)
    assert main(["plan", "--hardware", "cpu", "--gpus", "8", "--processes", "4", "--quiet", *over]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: {key}: ") and "\n" not in err
    P.search(load_config(None, over), 8, CPU, processes=1)  # one process runs it


def test_continuous_admission_and_filters_are_planned_on_several_processes():
    """Each process runs its engine on its data shard, the counts global (runtime/admission.py):
    continuous admission, and DAPO's filters under it, are plans for 4 processes."""
    over = ["pipeline.staleness=1", "rollout.admission=continuous", "rl.filter_groups=zero_variance"]
    res = P.search(load_config(None, over), 8, CPU, processes=4)
    assert res.chosen.layout["generate"]["admission"] == "continuous"
    assert res.chosen.plan.settings["rollout.admission"] == "continuous" and res.processes == 4


def test_a_cluster_is_planned_as_one_process_per_node():
    from rpeg_jax.config import ConfigError
    from rpeg_jax.costmodel.devices import resolve

    cfg = load_config("configs/p1.yaml", [])
    for n, procs in ((2, 1), (4, 1), (64, 16), (128, 32), (256, 64)):
        assert resolve(cfg, n, "gh200", None)[2] == procs  # node.devices 4
    assert resolve(cfg, 64, "h100", None)[2] == 8
    assert resolve(cfg, 64, "gh200", 4)[2] == 4  # the caller's: rpeg plan --processes, the runtime's count
    assert resolve(load_config("configs/p1.yaml", ["costmodel.processes=8"]), 64, "gh200", None)[2] == 8
    with pytest.raises(ConfigError, match=r"^config error: costmodel.processes=None: 6 devices do not fill whole 4-"):
        resolve(cfg, 6, "gh200", None)


def test_rpeg_plan_prices_p1_as_the_processes_that_launch_on_it(tmp_path, capsys):
    """`rpeg plan --config configs/p1.yaml --hardware gh200 --gpus N` plans N / 4 processes: the header
    and the JSON say so, the chosen plan is one the runtime runs with them, also at 256 GPUs (64
    processes for 32 prompts: 2 processes per prompt, 8 of its 16 samples each, under step admission),
    where a config pinning continuous admission is refused in one line naming the prompt count."""
    from rpeg_jax.cli import main

    out, saved = tmp_path / "p1.json", tmp_path / "plan.json"
    args = ["plan", "--config", "configs/p1.yaml", "--hardware", "gh200"]
    assert main([*args, "--gpus", "64", "--json", str(out), "--save-plan", str(saved)]) == 0
    assert capsys.readouterr().out.startswith("rpeg plan: 64 x gh200 in 16 processes (4 devices each); ")
    d = json.loads(out.read_text())
    assert d["processes"] == 16 == d["chosen"]["plan"]["predicted"]["processes"]
    assert _refused(load_config("configs/p1.yaml", []), Plan.load(str(saved)), 16) is None
    assert main([*args, "--gpus", "256", "--json", str(out), "--save-plan", str(saved)]) == 0
    assert capsys.readouterr().out.startswith("rpeg plan: 256 x gh200 in 64 processes (4 devices each); ")
    d = json.loads(out.read_text())
    assert d["processes"] == 64 == d["chosen"]["plan"]["predicted"]["processes"]
    plan = Plan.load(str(saved))
    assert _refused(load_config("configs/p1.yaml", []), plan, 64) is None
    assert plan.settings["rollout.admission"] == "step"  # sub-groups: continuous needs whole groups
    assert plan.settings["rollout.max_slots"] == 32 * 16 // 64  # each process: 8 samples of one prompt
    cont = ["rollout.admission=continuous", "pipeline.staleness=1"]
    assert main([*args, "--gpus", "256", "--quiet", *cont]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: data.prompts_per_step=32: 64 processes share its 32 groups, 2 per prompt ")
    assert "rollout.admission=continuous" in err and "raise data.prompts_per_step to 64" in err
    assert err.count("\n") == 1


def test_shared_host_groups_do_not_overlap_but_gpus_do():
    # A split's period on a shared host is its groups' busy time added up (one machine's cores),
    # never the slower group's alone; on GPUs the groups overlap.
    cfg = load_config(None, ["pipeline.staleness=1", "costmodel.max_staleness=1"])
    for hw, overlap in ((CPU, False), (GH, True)):
        ctx = CX.make_context(cfg, 8, hw)
        opts = [o for o in SP.structural_options(ctx, "split", False) if o.staleness == 1 and o.pieces == 1]
        pipe, g = SC.option_graphs(ctx, opts[:1])[0]
        tab = SC.family_table(ctx, g, "split", {})
        period, _ = SC.periods(ctx, g, tab)
        dur, _ = SC.durations(ctx, g, tab)
        device = sum(v for k, v in dur.items() if k != "reward")
        fin = np.isfinite(period)
        assert fin.any()
        if overlap:
            assert (period[fin] < device[fin] - 1e-12).any()
        else:
            assert np.allclose(period[fin], device[fin] + 0.0, rtol=1e-9, atol=dur["reward"][0] + 1e-12)


def test_shared_host_may_leave_devices_idle_but_gpus_use_all():
    cfg = load_config(None, [])
    assert {n for n, _ in SP.allocations(CX.make_context(cfg, 8, CPU), "colocated")} == set(range(1, 9))
    assert SP.allocations(CX.make_context(cfg, 8, GH), "colocated") == [(8, 8)]
    assert all(g + t == 8 for g, t in SP.allocations(CX.make_context(cfg, 8, GH), "split"))
    assert all(g + t <= 8 for g, t in SP.allocations(CX.make_context(cfg, 8, CPU), "split"))
    res = P.search(cfg, 8, CPU, 1)
    used = res.chosen.plan.groups
    assert all(max(g.devices) < 8 for g in used)


def test_elide_old_forward_is_searched_and_priced():
    cfg = load_config(None, ["costmodel.search_one_step_rewrites=false"])  # old_forward kept unless elided
    ctx = CX.make_context(cfg, 4, GH)
    opts = SP.structural_options(ctx, "colocated", False)
    assert {o.elide_old_forward for o in opts} == {False, True}
    assert all(o.staleness == 0 for o in opts if o.elide_old_forward)
    sync = [o for o in opts if not o.fuse and not o.staleness]
    pairs = dict((o.elide_old_forward, g) for o, g in SC.option_graphs(ctx, sync))
    tab = SC.family_table(ctx, pairs[False], "colocated", {})
    full, _ = SC.periods(ctx, pairs[False], tab)
    elided, _ = SC.periods(ctx, pairs[True], tab)
    dur, _ = SC.durations(ctx, pairs[False], tab)
    assert "old_forward" not in pairs[True].stage_names()
    # colocated: serial, except the host reward that ran beside old_forward is now on the path
    saved = dur["old_forward"] - np.minimum(dur["reward"], dur["old_forward"])
    np.testing.assert_allclose(full - elided, saved, rtol=1e-9)
    # Truncated sampling (top_p < 1) makes the sampler's logprobs differ from the trainer's.
    ctx = CX.make_context(load_config(None, ["rollout.top_p=0.9"]), 4, GH)
    assert not any(o.elide_old_forward for o in SP.structural_options(ctx, "colocated", False))
    ctx = CX.make_context(load_config(None, ["costmodel.search_elide_old_forward=false"]), 4, GH)
    assert not any(o.elide_old_forward for o in SP.structural_options(ctx, "colocated", False))


def test_utilization_on_a_shared_host_counts_the_host_once():
    cfg = load_config(None, [])
    one = P.search(cfg, 1, CPU, 1).chosen
    eight = P.search(cfg, 8, CPU, 1).chosen
    # the same machine: the same useful FLOPs per second give the same utilization
    assert one.utilization * one.step_time_s == pytest.approx(eight.utilization * eight.step_time_s, rel=0.05)


def test_rpeg_plan_defaults_to_the_devices_a_run_sees_and_uses_a_calibration_only_when_asked(tmp_path):
    import os

    from rpeg_jax.config.base import ConfigError
    from rpeg_jax.costmodel.devices import resolve
    from rpeg_jax.costmodel.hardware import calibrated_path, profile_path, save_hardware

    # In this process JAX sees the 8 forced devices (conftest): that is what plans default to.
    hw, n, procs = resolve(load_config(None, []), None, None, None)
    assert (hw.name, n, procs) == ("cpu", 8, 1)
    assert hw.source == profile_path("cpu")
    # A calibrated cpu profile (a host twice as fast) in the cache: a plan uses it only under
    # costmodel.calibration=cached (`rpeg plan` too), and says which file it priced with.
    fast = dataclasses.replace(
        CPU,
        device=dataclasses.replace(
            CPU.device,
            peak_flops=2 * CPU.device.peak_flops,
            peak_flops_fp32=2 * CPU.device.peak_flops_fp32,
            memory_bw=2 * CPU.device.memory_bw,
        ),
    )
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["RPEG_CACHE"] = str(cache)
    old = os.environ.get("RPEG_CACHE")
    os.environ["RPEG_CACHE"] = str(cache)
    cached = ["costmodel.calibration=cached"]
    try:
        with pytest.raises(ConfigError, match="costmodel.calibration='cached': no calibrated cpu profile"):
            P.choose_plan(load_config(None, cached), 1, None, 1)
        cal = save_hardware(fast, calibrated_path("cpu"))
        direct = P.search(load_config(None, []), 1, fast, 1).chosen.step_time_s
        shipped = P.choose_plan(load_config(None, []), 1, None, 1).predicted
        auto = P.choose_plan(load_config(None, cached), 1, None, 1).predicted
    finally:
        os.environ.pop("RPEG_CACHE") if old is None else os.environ.__setitem__("RPEG_CACHE", old)
    assert auto["step_time_s"] == pytest.approx(direct)
    assert (
        direct < shipped["step_time_s"] == pytest.approx(P.search(load_config(None, []), 1, CPU, 1).chosen.step_time_s)
    )
    assert shipped["hardware_source"] == f"cpu from {profile_path('cpu')} (shipped)"
    assert auto["hardware_source"].startswith(f"cpu from {cal} (calibrated, written ")
    # A plain CPU process (what `make run` starts) sees one device.
    out = tmp_path / "plan.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rpeg_jax.cli",
            "plan",
            "--config",
            "configs/default.yaml",
            "--quiet",
            "--json",
            str(out),
            "costmodel.calibration=cached",
        ],
        check=True,
        env=env,
        cwd=root,
    )
    d = json.loads(out.read_text())
    assert (d["num_devices"], d["hardware"], d["processes"]) == (1, "cpu", 1)
    assert d["chosen"]["step_time_s"] == pytest.approx(direct)


def test_price_reproduces_planner_predictions_and_streamed_pieces_cost_calls():
    from rpeg_jax.costmodel.pricing import best_by_groups, price

    cfg = load_config(None, ["costmodel.runners_up=3"])
    res = P.search(cfg, 8, CPU, 1)
    alts = best_by_groups(cfg, 8, CPU, 1)
    assert alts[0].step_time_s == pytest.approx(res.chosen.step_time_s)
    assert [a.step_time_s for a in alts] == sorted(a.step_time_s for a in alts)
    for p in [res.chosen, *res.runners_up, *alts[:4]]:
        assert price(cfg, p.plan, CPU, 1).step_time_s == pytest.approx(p.step_time_s, rel=1e-9)
    # The runtime generates each streamed piece with its own call: m pieces of B/m sequences
    # cost m calls, each paying every decode step (more than one call of B on a CPU host).
    ctx = CX.make_context(cfg, 8, CPU)
    opts = [
        o
        for o in SP.structural_options(ctx, "split", False)
        if o.staleness == 0 and not o.fuse and not o.elide_old_forward and o.pieces in (1, 8)
    ]
    (o1, g1), (o8, g8) = sorted(SC.option_graphs(ctx, opts), key=lambda x: x[0].pieces)
    tab = SC.family_table(ctx, g1, "split", {})
    d1, _ = SC.durations(ctx, g1, tab)
    d8, pieces = SC.durations(ctx, g8, tab)
    np.testing.assert_allclose(d8["generate"], 8 * tab.t_gen_pieces[8], rtol=1e-9)
    np.testing.assert_allclose(sum(pieces["generate"]), d8["generate"], rtol=1e-9)
    assert (d8["generate"] > d1["generate"]).all()


def test_price_refuses_a_plan_with_groups_it_does_not_model():
    """A widened plan (generation on a nested group of its own) is not one of the model's
    placements: pricing it as if generation ran on the training group would be silently wrong."""
    import dataclasses

    from rpeg_jax.costmodel.pricing import price
    from rpeg_jax.graph.ir import GraphError
    from rpeg_jax.graph.plan import graph_for_plan, plan_from_config, widen_generation

    cfg = load_config(None, ["pipeline.plan=manual"])
    one = dataclasses.replace(plan_from_config(cfg, 1), num_devices=2)
    price(cfg, one, CPU, 1)  # the model's own placement prices
    wide = widen_generation(one, graph_for_plan(cfg, one), cfg, (0, 1))
    with pytest.raises(GraphError, match="gen_wide"):
        price(cfg, wide, CPU, 1)


def test_layout_rules_shard_every_axis_the_planner_prices():
    """The plan's rule preset per stage follows its mesh: `tensor` > 1 shards heads/MLP/vocab,
    `fsdp` > 1 the weights; a user's own preset is kept."""
    from rpeg_jax.config.sharding import BUILTIN_RULES
    from rpeg_jax.graph.algorithms import build_graph
    from rpeg_jax.graph.ir import StageKind
    from rpeg_jax.graph.plan import layout_rules
    from rpeg_jax.sharding import rules as R

    # the presets a priced plan may lift: every built-in one (config/sharding.PRESET_DATA)
    assert set(BUILTIN_RULES) == set(R._PRESET_DATA) and set(BUILTIN_RULES) <= set(R.PRESETS.names())

    cfg = load_config(None, [])
    g = build_graph(cfg)
    upd, gen = g.find(StageKind.ACTOR_UPDATE), g.find(StageKind.GENERATE)
    m = lambda d=1, f=1, t=1: {"data": d, "fsdp": f, "tensor": t}  # noqa: E731
    assert layout_rules(upd, cfg, m(f=2, t=2), priced=True) == "fsdp_tensor"
    assert layout_rules(upd, cfg, m(t=2), priced=True) == "tensor"
    assert layout_rules(upd, cfg, m(f=4), priced=True) == "fsdp"
    assert layout_rules(upd, cfg, m(d=2), priced=True) == "fsdp"
    assert layout_rules(gen, cfg, m(d=2, t=2), priced=True) == "tensor"
    assert layout_rules(gen, cfg, m(d=4), priced=True) == "data"
    assert layout_rules(gen, cfg, m(f=2), priced=True) == "data"  # generation keeps whole weights per replica
    fixed = load_config(None, ["sharding.train_rules=data"])  # a built-in preset: lifted for a priced mesh
    assert layout_rules(upd, fixed, m(t=2), priced=True) == "tensor"
    assert layout_rules(upd, fixed, m(d=2), priced=True) == "data"
    assert layout_rules(upd, fixed, m(t=2), priced=False) == "data"  # a manual plan: as given
    ep = load_config(None, ["sharding.train_rules=fsdp_expert"])
    assert layout_rules(upd, ep, m(f=4, t=2), priced=True) == "fsdp_expert_tensor"  # experts over fsdp kept
    assert layout_rules(upd, ep, m(f=4), priced=True) == "fsdp_expert"
    assert layout_rules(upd, ep, m(f=4, t=2), priced=False) == "fsdp_expert"  # a manual plan: as given
    own = load_config(None, ["sharding.train_rules=mine", "sharding.rules.mine=[[batch, [data, fsdp]]]"])
    assert layout_rules(upd, own, m(f=2, t=2), priced=True) == "mine"


def test_planned_stages_shard_their_parameters_over_every_mesh_axis():
    """Every stage of every plan the search weighed splits its parameters over each of its mesh's
    `fsdp` and `tensor` axes above 1 (the runtime's layouts, abstract meshes). Before the plan
    carried layout_rules, a priced (fsdp 2, tensor 2) update ran under `fsdp` rules: the tensor
    axis replicated the whole update (0.96 vs 0.52 CPU s per step measured). The config names
    those old defaults explicitly: `auto` would resolve on any mesh by itself, and the planner must
    lift a named built-in preset too."""
    from flax import nnx

    from rpeg_jax.models import Transformer
    from rpeg_jax.sharding import layout_for

    cfg = load_config(None, ["sharding.train_rules=fsdp", "sharding.generate_rules=data"])
    tree = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(params=0))), nnx.Param)
    from rpeg_jax.costmodel.pricing import best_by_groups

    seen = set()
    for p in best_by_groups(cfg, 8, CPU, 1):
        for sp in p.plan.stages:
            if sp.rules == "host":
                continue
            role = "generate" if "generate" in sp.stage else "train"
            lay = layout_for(sp.mesh, sp.rules, cfg.sharding, num_devices=p.plan.group(sp.group).size, role=role)
            used = {
                a
                for spec in jax_leaves(lay.param_specs(tree))
                for e in spec
                for a in ((e,) if isinstance(e, str) else (e or ()))
            }
            for axis in ("fsdp", "tensor"):
                if sp.mesh.get(axis, 1) > 1:
                    seen.add((role, axis))
                    assert axis in used, (p.label, sp.stage, sp.mesh, sp.rules)
    assert ("train", "tensor") in seen and ("generate", "tensor") in seen  # the search weighed both


def jax_leaves(tree):
    import jax
    from jax.sharding import PartitionSpec

    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


def test_a_max_slots_the_config_sets_is_kept_and_the_priced_one_recorded():
    from rpeg_jax.graph.plan import config_for_plan

    free = P.choose_plan(load_config(None, []), 1, CPU, 1)
    planned = free.settings["rollout.max_slots"]
    assert "slots_priced" not in free.predicted
    pinned = planned // 2 or 1
    cfg = load_config(None, [f"rollout.max_slots={pinned}"])
    plan = P.choose_plan(cfg, 1, CPU, 1)
    assert plan.settings["rollout.max_slots"] == pinned
    assert config_for_plan(cfg, plan)[0].rollout.max_slots == pinned  # what the run's sampler gets
    assert plan.predicted["slots_priced"] == planned
