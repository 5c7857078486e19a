"""The Plan value: manual plans from the config, JSON save/reload, checks that name the stage."""

import dataclasses

import pytest

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.graph.ir import GraphError
from rpeg_jax.graph.plan import DeviceGroup, Plan, StagePlan, graph_for_plan, plan_for_config, plan_from_config

SIZES = ["data.prompts_per_step=4", "rl.group_size=2"]


def cfg_of(*over):
    return load_config(None, [*SIZES, *over])


def test_colocated_plan_puts_every_stage_on_all_devices():
    cfg = cfg_of("rl.algorithm=ppo", "sharding.mesh={data: -1, fsdp: 2, tensor: 1}")
    plan = plan_from_config(cfg, 8)
    assert plan.groups == (DeviceGroup("all", tuple(range(8))),)
    graph = graph_for_plan(cfg, plan)
    assert [s.stage for s in plan.stages] == graph.topo_order()
    for s in plan.stages:
        assert s.group == "all" and s.mesh == {"data": 4, "fsdp": 2, "tensor": 1}
    assert plan.stage("generate").rules == "data"  # `auto` on this mesh (whole weights per replica)
    assert plan.stage("actor_update").rules == "fsdp"
    assert plan.stage("reward").rules == "host"


def test_split_plan_gives_generation_the_first_devices():
    cfg = cfg_of("pipeline.placement=split", "pipeline.split_sizes=[3,5]", "pipeline.pieces=2", "pipeline.staleness=1")
    plan = plan_from_config(cfg, 8)
    assert plan.devices_for("generate") == (0, 1, 2) and plan.devices_for("actor_update") == (3, 4, 5, 6, 7)
    assert plan.stage("generate").mesh == {"data": 3, "fsdp": 1, "tensor": 1}
    assert plan.stage("old_forward").mesh == {"data": 5, "fsdp": 1, "tensor": 1}
    assert plan.stage("generate").pieces == 2 and plan.stage("actor_update").pieces == 1
    assert plan.knobs["staleness"] == 1 and plan.knobs["split_sizes"] == [3, 5]


@pytest.mark.parametrize(
    "over, n, key",
    [
        (["pipeline.placement=split", "pipeline.split_sizes=[3,3]"], 8, "pipeline.split_sizes"),
        (["sharding.mesh={data: -1, tensor: 3}"], 8, "sharding.mesh"),
        (["sharding.mesh={data: 2, tensor: 2}"], 8, "sharding.mesh"),
    ],
)
def test_manual_plan_errors_name_the_key(over, n, key):
    with pytest.raises(ConfigError) as e:
        plan_from_config(cfg_of(*over), n)
    assert e.value.key == key


def test_plan_json_round_trip_and_file(tmp_path):
    cfg = cfg_of(
        "rl.algorithm=ppo",
        "rl.kl_coef=0.1",
        "pipeline.fuse=[forwards]",
        "pipeline.placement=split",
        "pipeline.split_sizes=[2,6]",
    )
    plan = dataclasses.replace(plan_from_config(cfg, 8), predicted={"step_time_s": 1.25})
    assert Plan.from_json(plan.to_json()) == plan
    path = tmp_path / "plans" / "p.json"
    plan.save(str(path))
    loaded = Plan.load(str(path))
    assert dataclasses.replace(loaded, source="manual") == plan and loaded.source == str(path)
    text = plan.describe()
    for s in plan.stages:
        assert s.stage in text
    assert "gen" in text and "0-1" in text and "2-7" in text and "step_time_s=1.25" in text


def test_a_plan_written_before_the_pieces_rename_is_one_line_naming_it():
    import json

    d = json.loads(plan_from_config(cfg_of(), 8).to_json())
    d["stages"][0]["microbatches"] = d["stages"][0].pop("pieces")
    with pytest.raises(GraphError, match="renamed pipeline.pieces") as err:
        Plan.from_dict(d)
    assert "\n" not in str(err.value)


def test_plan_file_from_config_rebuilds_the_graph_of_its_knobs(tmp_path):
    made = cfg_of("pipeline.fuse=[advantage]", "pipeline.pieces=2")
    path = str(tmp_path / "plan.json")
    plan_from_config(made, 4).save(path)
    cfg = cfg_of(f"pipeline.plan={path}")  # the config's own knobs differ; the plan's win
    plan = plan_for_config(cfg, 4)
    assert plan.source == path
    assert "advantage+actor_update" in graph_for_plan(cfg, plan).stage_names()
    with pytest.raises(ConfigError, match="made for 4 devices"):
        plan_for_config(cfg, 8)
    with pytest.raises(ConfigError, match="planner"):
        plan_for_config(cfg_of("pipeline.plan=auto"), 4)
    seen = []
    assert plan_for_config(cfg_of("pipeline.plan=auto"), 4, planner=lambda c, n: seen.append(n) or plan) is plan
    assert seen == [4]
    with pytest.raises(ConfigError, match="pipeline.plan"):
        plan_for_config(cfg_of(f"pipeline.plan={tmp_path}/missing.json"), 4)


def test_plan_check_names_the_stage_or_group():
    cfg = cfg_of()
    plan = plan_from_config(cfg, 4)
    graph = graph_for_plan(cfg)
    short = dataclasses.replace(plan, stages=plan.stages[:-1])
    with pytest.raises(GraphError, match="no plan entry") as e:
        short.check(graph)
    assert e.value.node == "weight_sync"
    bad_mesh = dataclasses.replace(
        plan, stages=(dataclasses.replace(plan.stages[0], mesh={"data": 3}),) + plan.stages[1:]
    )
    with pytest.raises(GraphError, match="does not cover") as e:
        bad_mesh.check()
    assert e.value.node == plan.stages[0].stage
    overlap = dataclasses.replace(
        plan,
        groups=(DeviceGroup("a", (0, 1, 2)), DeviceGroup("b", (2, 3))),
        stages=(StagePlan("generate", "a", {"data": 3}, "data"),),
    )
    with pytest.raises(GraphError, match="partially"):
        overlap.check()
    out_of_range = dataclasses.replace(plan, groups=(DeviceGroup("all", (0, 1, 2, 4)),))
    with pytest.raises(GraphError, match="outside"):
        out_of_range.check()
    with pytest.raises(GraphError, match="not an rpeg-plan"):
        Plan.from_json('{"format": "x"}')


def test_pipeline_config_from_plan_knobs():
    cfg = cfg_of("pipeline.staleness=2", "pipeline.fuse=[forwards]")
    p = plan_from_config(cfg, 2).pipeline_config()
    assert p.staleness == 2 and p.fuse == ("forwards",)


def test_auto_rules_put_every_mesh_axis_to_work_and_explicit_presets_stand():
    """sharding.*_rules default `auto`: on a (data 2, fsdp 2, tensor 2) mesh training gets
    fsdp_tensor and generation tensor (fixed fsdp / data presets would replicate the update over
    `tensor`); a preset the user names is kept as given."""
    over = ["sharding.mesh={data: 2, fsdp: 2, tensor: 2}"]
    plan = plan_from_config(load_config(None, over), 8)
    rules = {s.stage: s.rules for s in plan.stages}
    assert rules["actor_update"] == "fsdp_tensor" and rules["generate"] == "tensor" and rules["reward"] == "host"
    plan = plan_from_config(load_config(None, ["sharding.mesh={data: 8}"]), 8)
    assert {s.stage: s.rules for s in plan.stages}["actor_update"] == "fsdp"
    own = plan_from_config(load_config(None, over + ["sharding.train_rules=fsdp"]), 8)
    assert {s.stage: s.rules for s in own.stages}["actor_update"] == "fsdp"


def test_auto_rules_resolve_in_layouts_built_from_the_config():
    from rpeg_jax.sharding import stage_layout

    cfg = load_config(None, ["sharding.mesh={fsdp: 2, tensor: 4}"]).sharding
    assert stage_layout(cfg, "train", num_devices=8).rules.name == "fsdp_tensor"
    assert stage_layout(cfg, "generate", num_devices=8).rules.name == "tensor"
    cfg = load_config(None, ["sharding.mesh={data: -1}"]).sharding
    assert stage_layout(cfg, "train", num_devices=8).rules.name == "fsdp"
    assert stage_layout(cfg, "generate", num_devices=8).rules.name == "data"


def test_a_custom_preset_may_not_be_called_auto():
    with pytest.raises(ConfigError, match=r"sharding\.rules\.auto"):
        load_config(None, ["sharding.rules.auto=[[batch, data]]"])
