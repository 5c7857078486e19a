"""graph/processes.py: the one rule set that says which plans the runtime runs with P processes. Each
rule refuses in one line naming the key and the value; the runtime's check reads a plan's groups,
generation mesh, placement and admission, and names the knob that set them. (The planner's side:
tests/test_costmodel_planner.py; the launched runtime's: tests/test_launch.py.)"""

import dataclasses

import pytest

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.graph.ir import GraphError
from rpeg_jax.graph.plan import DeviceGroup, config_for_plan, graph_for_plan, plan_for_config, plan_from_config
from rpeg_jax.graph.processes import NotRunnable, Runs, check_plan, share_of, sharers, why_not

SIZES = ["data.prompts_per_step=4", "rl.group_size=2"]


def cfg_of(*over):
    return load_config(None, [*SIZES, *over])


def _line(bad):
    return str(bad.error())


def test_one_process_runs_everything():
    cfg = cfg_of("rl.filter_groups=zero_variance", "data.prompts_per_step=3")
    runs = Runs(placement="split", admission="continuous", group_sizes=(3, 5), gen_tensor=4)
    assert why_not(cfg, 1, 8, runs) is None


@pytest.mark.parametrize(
    "over, processes, runs, line",
    [
        ([], 3, Runs(), "config error: costmodel.processes=3: 3 processes cannot own 8 devices evenly"),
        ([], 0, Runs(), "config error: costmodel.processes=0: "),
        (["data.prompts_per_step=6"], 4, Runs(), "config error: data.prompts_per_step=6: must be a multiple of the 4"),
        (
            ["rl.filter_groups=zero_variance"],
            2,
            Runs(),
            "config error: rl.filter_groups='zero_variance': with 2 processes dynamic sampling runs under "
            "rollout.admission=continuous only",
        ),
        (
            [],
            2,
            Runs(placement="split", group_sizes=(2, 6)),
            "config error: pipeline.plan='auto': split groups of [2, 6] devices: with 2 processes (4 devices each)",
        ),
        (
            [],
            2,
            Runs(placement="split", group_sizes=(4, 2)),
            "config error: pipeline.plan='auto': split groups of [4, 2]",
        ),
        (
            ["data.prompts_per_step=6"],
            8,
            Runs(placement="split", group_sizes=(4, 4)),
            "config error: data.prompts_per_step=6: must be a multiple of the 4 generating processes",
        ),
        (
            ["train.pack_sequences=true"],
            2,
            Runs(placement="split"),
            "config error: train.pack_sequences=True: with 2 processes and pipeline.placement=split this is not run",
        ),
        ([], 2, Runs(placement="split", pieces=2), "config error: pipeline.pieces=2: with 2 processes and pipeline"),
        (  # packed updates across several training processes (one runs: below)
            ["train.pack_sequences=true"],
            4,
            Runs(placement="split", group_sizes=(4, 4)),
            "config error: train.pack_sequences=True: with 4 processes and pipeline.placement=split this is not run",
        ),
        (
            [],
            2,
            Runs(placement="pipelined"),
            "config error: pipeline.placement='pipelined': with 2 processes: colocated",
        ),
        ([], 2, Runs(group_sizes=(8, 4)), "config error: pipeline.plan='auto': a stage runs on a group of 4 devices"),
        ([], 2, Runs(gen_tensor=8), "config error: pipeline.plan='auto': generation has tensor=8; with 2 processes"),
        ([], 2, Runs(gen_tensor=8, layout=("sharding.mesh", {"tensor": 8})), "config error: sharding.mesh={'tensor'"),
    ],
)
def test_each_rule_is_one_line_naming_the_key_and_value(over, processes, runs, line):
    bad = why_not(cfg_of(*over), processes, 8, runs)
    assert bad is not None and _line(bad).startswith(line) and "\n" not in _line(bad)
    assert isinstance(bad.error(), ConfigError) and isinstance(bad.error(), GraphError)


def test_a_prompt_count_processes_cannot_share_names_the_fix():
    """48 prompts on 64 processes: neither whole groups nor whole sub-groups; the line says which
    value would run (the next multiple of P), and it does."""
    bad = why_not(cfg_of("data.prompts_per_step=48"), 64, 256, Runs())
    assert _line(bad).endswith("(each generates whole groups of its share): raise data.prompts_per_step to 64")
    assert why_not(cfg_of("data.prompts_per_step=64"), 64, 256, Runs()) is None
    assert _line(why_not(cfg_of("data.prompts_per_step=6"), 4, 8, Runs())).endswith("to 8")
    assert why_not(cfg_of("data.prompts_per_step=8"), 4, 8, Runs()) is None


def _one_process_order(prompts, group):
    return [(p, j) for p in range(prompts) for j in range(group)]


@pytest.mark.parametrize("prompts, group, processes", [(32, 16, 64), (8, 4, 4), (1, 4, 2), (2, 4, 8), (3, 6, 6)])
def test_processes_share_groups_as_the_one_process_batch_in_its_order(prompts, group, processes):
    """share_of: every process generates prompts x G / P sequences, and the processes' shares, laid
    end to end in rank order (as the rollout's global arrays are), are the one-process batch, prompt by
    prompt, each sample once (the reference: the one-process enumeration)."""
    assert sharers(prompts, group, processes) == max(1, processes // prompts)
    rows = []
    for rank in range(processes):
        sh = share_of(prompts, group, processes, rank)
        assert sh.prompts * sh.samples == prompts * group // processes
        assert 0 <= sh.shard < sh.shards and prompts % sh.shards == 0 and sh.first_prompt == sh.shard * sh.prompts
        rows += [(p, j) for p in range(sh.first_prompt, sh.first_prompt + sh.prompts)
                 for j in range(sh.first_sample, sh.first_sample + sh.samples)]  # fmt: skip
    assert rows == _one_process_order(prompts, group)


def test_sub_groups_run_under_step_admission_only_and_the_rest_names_prompts_per_step():
    """Issue 31: P1's 32 prompts x 16 on 256 GH200's 64 processes run as 2 processes per prompt,
    8 samples each (colocated, step admission); what needs whole groups on a process is refused in
    one line naming data.prompts_per_step and the fix."""
    p1 = ["data.prompts_per_step=32", "rl.group_size=16"]
    assert sharers(32, 16, 64) == 2 and sharers(32, 15, 64) is None and sharers(48, 16, 64) is None
    assert sharers(64, 16, 64) == 1 and sharers(6, 4, 4) is None and sharers(2, 3, 4) is None
    assert why_not(cfg_of(*p1), 64, 256, Runs()) is None
    assert why_not(cfg_of(*p1), 64, 256, Runs(admission="step", placement="colocated", gen_tensor=4)) is None
    share = "config error: data.prompts_per_step=32: 64 processes share its 32 groups, 2 per prompt (each generates 8 "
    cases = [
        (cfg_of(*p1), Runs(admission="continuous"), "rollout.admission=continuous", ", or use rollout.admission=step"),
        (
            cfg_of(*p1, "rl.filter_groups=zero_variance", "rollout.admission=continuous", "pipeline.staleness=1"),
            Runs(),
            "rollout.admission=continuous",
            "",
        ),
        (cfg_of(*p1, "rl.filter_groups=zero_variance"), Runs(), "rl.filter_groups=zero_variance", ""),
        (cfg_of(*p1), Runs(pieces=2), "pipeline.pieces=2", ""),
    ]
    for cfg, runs, what, other in cases:
        line = _line(why_not(cfg, 64, 256, runs))
        assert line.startswith(share) and what in line and "\n" not in line, line
        assert f"{what} does not run (" in line and line.endswith(f"): raise data.prompts_per_step to 64{other}"), line
    line = _line(why_not(cfg_of("data.prompts_per_step=32", "rl.group_size=15"), 64, 256, Runs()))
    assert line.startswith("config error: data.prompts_per_step=32: must be a multiple of the 64 processes")
    assert "share each group over 2 processes" in line and "rl.group_size=15" in line and line.endswith("to 64")
    # a split's generating processes still take whole groups (runtime/split.py hands them over whole)
    bad = why_not(cfg_of(*p1), 64, 256, Runs(placement="split", group_sizes=(192, 64)))
    assert _line(bad).startswith("config error: data.prompts_per_step=32: must be a multiple of the 48 generating")


def test_rules_are_judged_in_order_and_unjudged_parts_pass():
    cfg = cfg_of("rl.filter_groups=zero_variance")
    both = Runs(admission="step", placement="split", gen_tensor=2)
    assert why_not(cfg, 2, 8, both).key == "rl.filter_groups"  # before pipeline.placement
    assert why_not(cfg, 2, 8, Runs(placement="split")).key == "rl.filter_groups"  # the config's admission: step
    # continuous admission (the plan's or the config's) runs on several processes, with dynamic sampling too
    # (colocated; a split across processes does not run dynamic sampling yet)
    assert why_not(cfg, 2, 8, Runs(admission="continuous", placement="split")).key == "rl.filter_groups"
    assert why_not(cfg, 2, 8, Runs(admission="continuous", placement="colocated")) is None
    cont = cfg_of("rl.filter_groups=zero_variance", "rollout.admission=continuous", "pipeline.staleness=1")
    assert why_not(cont, 2, 8) is None
    assert why_not(cfg_of(), 2, 8, Runs(admission="continuous", group_sizes=(8,), gen_tensor=2)) is None
    # a split in whole processes: generation on the first, training on the others
    assert why_not(cfg_of(), 2, 8, Runs(placement="split", group_sizes=(4, 4), gen_tensor=2)) is None
    assert why_not(cfg_of(), 4, 8, Runs(placement="split", group_sizes=(2, 6), gen_tensor=2)) is None
    assert why_not(cfg_of(), 4, 8, Runs(placement="split", group_sizes=(2, 6), gen_tensor=4)).key == "pipeline.plan"
    assert why_not(cfg_of(), 4, 8, Runs(placement="split", group_sizes=(2, 4))).key == "pipeline.plan"  # idle process
    assert (
        why_not(cfg_of(), 2, 8, Runs(admission="step", placement="colocated", group_sizes=(8,), gen_tensor=1)) is None
    )
    assert why_not(cfg_of(), 2, 8) is None  # nothing but the config judged
    # tensor-parallel decode inside a process (4 devices each) runs; a tensor group spanning both does not
    assert all(why_not(cfg_of(), 2, 8, Runs(gen_tensor=t)) is None for t in (1, 2, 4))
    assert why_not(cfg_of(), 2, 8, Runs(gen_tensor=8)).key == "pipeline.plan"
    assert why_not(cfg_of(), 4, 8, Runs(gen_tensor=4)).key == "pipeline.plan"


def _runtime_cfg(cfg, plan):
    return config_for_plan(cfg, plan)[0]


def test_check_plan_reads_the_plan_and_names_its_source(tmp_path):
    # A manual plan: the generation mesh comes from sharding.mesh, the groups from pipeline.placement.
    cfg = cfg_of("sharding.mesh={data: -1, tensor: 2}")
    plan = plan_from_config(cfg, 8)
    check_plan(cfg, plan, graph_for_plan(cfg, plan), 1)
    check_plan(cfg, plan, graph_for_plan(cfg, plan), 2)  # tensor groups inside each process's 4 devices
    cfg = cfg_of("sharding.mesh={data: -1, tensor: 4}")
    plan = plan_from_config(cfg, 8)
    check_plan(cfg, plan, graph_for_plan(cfg, plan), 2)
    with pytest.raises(NotRunnable, match=r"^config error: sharding.mesh=\{'data': -1, 'tensor': 4\}: generation "):
        check_plan(cfg, plan, graph_for_plan(cfg, plan), 4)  # 2 devices per process: a group spans two
    split = cfg_of("pipeline.placement=split", "pipeline.split_sizes=[4,4]", "pipeline.staleness=1")
    plan = plan_from_config(split, 8)
    check_plan(split, plan, graph_for_plan(split, plan), 2)  # one process generates, the other trains
    check_plan(split, plan, graph_for_plan(split, plan), 4)
    uneven = cfg_of("pipeline.placement=split", "pipeline.split_sizes=[2,6]", "pipeline.staleness=1")
    plan = plan_from_config(uneven, 8)
    check_plan(uneven, plan, graph_for_plan(uneven, plan), 4)
    with pytest.raises(NotRunnable, match=r"^config error: pipeline.split_sizes=\[2, 6\]: split groups of \[2, 6\]"):
        check_plan(uneven, plan, graph_for_plan(uneven, plan), 2)
    # A plan file whose stages sit on a sub-group: named by pipeline.plan=<the file>.
    cfg = cfg_of()
    plan = plan_from_config(cfg, 8)
    half = DeviceGroup("all", tuple(range(4)))
    path = str(tmp_path / "half.json")
    dataclasses.replace(
        plan,
        groups=(half, DeviceGroup("rest", tuple(range(4, 8)))),
        stages=tuple(dataclasses.replace(s, mesh={"data": 4, "fsdp": 1, "tensor": 1}) for s in plan.stages),
    ).save(path)
    file_cfg = cfg_of(f"pipeline.plan={path}")
    loaded = plan_for_config(file_cfg, 8)
    run_cfg = _runtime_cfg(file_cfg, loaded)
    check_plan(run_cfg, loaded, graph_for_plan(run_cfg, loaded), 1)
    with pytest.raises(NotRunnable, match=rf"^config error: pipeline.plan='{path}': a stage runs on a group of 4"):
        check_plan(run_cfg, loaded, graph_for_plan(run_cfg, loaded), 2)


def test_a_manual_plan_takes_generations_mesh_from_sharding_generate_mesh():
    # Tensor-parallel training with data-parallel generation on several processes, by hand.
    cfg = cfg_of("sharding.mesh={data: -1, tensor: 2}", "sharding.generate_mesh={data: -1}")
    plan = plan_from_config(cfg, 8)
    assert plan.stage("generate").mesh == {"data": 8, "fsdp": 1, "tensor": 1}
    assert plan.stage("actor_update").mesh == {"data": 4, "fsdp": 1, "tensor": 2}
    check_plan(cfg, plan, graph_for_plan(cfg, plan), 2)
    tp = cfg_of("sharding.generate_mesh={data: -1, tensor: 4}")
    plan = plan_from_config(tp, 8)
    assert plan.stage("generate").mesh == {"data": 2, "fsdp": 1, "tensor": 4}
    check_plan(tp, plan, graph_for_plan(tp, plan), 2)  # inside each process's 4 devices
    with pytest.raises(NotRunnable, match=r"^config error: sharding.generate_mesh=\{'data': -1, 'tensor': 4\}: "):
        check_plan(tp, plan, graph_for_plan(tp, plan), 4)
    with pytest.raises(ConfigError, match=r"^config error: sharding.generate_mesh=\{'data': 3\}: covers 3 devices"):
        plan_from_config(cfg_of("sharding.generate_mesh={data: 3}"), 8)


def test_a_plan_file_with_continuous_admission_runs_on_two_processes_and_filters_under_step_do_not(tmp_path):
    cfg = cfg_of("pipeline.staleness=1", "rollout.admission=continuous")
    path = str(tmp_path / "cont.json")
    plan_from_config(cfg, 8).save(path)
    file_cfg = cfg_of(f"pipeline.plan={path}", "rl.filter_groups=zero_variance")
    loaded = plan_for_config(file_cfg, 8)
    run_cfg = _runtime_cfg(file_cfg, loaded)
    assert run_cfg.rollout.admission == "continuous"  # the plan's setting, whatever the config said
    check_plan(run_cfg, loaded, graph_for_plan(run_cfg, loaded), 2)
    step = cfg_of("pipeline.staleness=1", "rl.filter_groups=zero_variance")
    plan = plan_from_config(step, 8)
    with pytest.raises(NotRunnable, match=r"^config error: rl.filter_groups='zero_variance': with 2 processes"):
        check_plan(step, plan, graph_for_plan(step, plan), 2)


def test_costmodel_processes_is_validated():
    with pytest.raises(ConfigError, match=r"costmodel.processes=0: must be >= 1"):
        load_config(None, ["costmodel.processes=0"])
    with pytest.raises(ConfigError, match=r"costmodel.processes=3: must divide num_devices=8"):
        load_config(None, ["costmodel.processes=3", "costmodel.num_devices=8"])
    assert load_config(None, ["costmodel.processes=2", "costmodel.num_devices=8"]).costmodel.processes == 2


def test_packed_updates_run_split_with_one_training_process():
    """bench R2-MP's split variant: 1 generating + 1 training process, packed updates."""
    cfg = cfg_of("train.pack_sequences=true")
    assert why_not(cfg, 2, 8, Runs(placement="split", group_sizes=(4, 4))) is None
    cfg = cfg_of("train.pack_sequences=true", "data.prompts_per_step=6")
    assert why_not(cfg, 4, 8, Runs(placement="split", group_sizes=(6, 2))) is None
    assert why_not(cfg, 4, 8, Runs(placement="split", group_sizes=(2, 6))).key == "train.pack_sequences"
