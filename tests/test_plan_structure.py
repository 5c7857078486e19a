"""The plan is the run's structure, whatever its source: a plan file saved by one run and loaded
under another config runs with the plan's knobs, and the run's config.yaml says so."""

import dataclasses
import json
import os

import jax
import pytest
import yaml
from helpers import TINY as HELPER_TINY

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.graph.plan import config_for_plan, graph_for_plan, plan_for_config, plan_from_config
from rpeg_jax.runtime.metrics import read_metrics
from rpeg_jax.runtime.trainer import choose_plan, train

TINY = [o for o in HELPER_TINY if not o.startswith("pipeline.plan=")]  # each test says where its plan comes from


def test_a_saved_k1_plan_runs_at_k1_under_the_default_config(tmp_path):
    first = load_config(
        None,
        TINY + ["pipeline.plan=manual", "pipeline.staleness=1", "train.steps=1", f"train.run_dir={tmp_path / 'k1'}"],
    )
    train(first)
    saved = tmp_path / "k1" / "plan.json"
    # The default config (pipeline.staleness = 0), told only where the plan is.
    cfg = load_config(None, TINY + [f"pipeline.plan={saved}", "train.steps=3", f"train.run_dir={tmp_path / 'again'}"])
    assert cfg.pipeline.staleness == 0
    out = train(cfg, keep_state=True)
    metrics = read_metrics(os.path.join(out["run_dir"], "metrics.jsonl"))
    assert [r["staleness/max"] for r in metrics] == [0.0, 1.0, 1.0]  # step 1 reads version 0 either way
    assert [r["rollout/weights_version"] for r in metrics] == [0.0, 0.0, 1.0]
    assert out["consumed"][("generate", 2, 0)]["rollout_weights"] == 1  # t - k
    ran = yaml.safe_load((tmp_path / "again" / "config.yaml").read_text())
    assert ran["pipeline"]["staleness"] == 1 and ran["pipeline"]["plan"] == str(saved)


def test_config_for_plan_reports_each_value_the_plan_changes():
    base = load_config(None, TINY)
    plan = plan_from_config(load_config(None, TINY + ["pipeline.staleness=2", "pipeline.fuse=[advantage]"]), 1)
    cfg, changed = config_for_plan(base, plan)
    assert changed == {"pipeline.staleness": (0, 2), "pipeline.fuse": ((), ("advantage",))}
    assert cfg.pipeline.staleness == 2 and graph_for_plan(cfg).staleness == 2
    same, nothing = config_for_plan(cfg, plan)
    assert nothing == {} and same == cfg
    # A planner's settings outside the pipeline section come along too, checked by name.
    tuned = dataclasses.replace(plan, settings={"rl.micro_batches": 2})
    assert config_for_plan(base, tuned)[0].rl.micro_batches == 2
    with pytest.raises(ConfigError, match="optim.lr"):
        config_for_plan(base, dataclasses.replace(plan, settings={"optim.lr": 1.0}))


def test_choose_plan_applies_a_plan_file_and_a_given_plan_alike(tmp_path):
    k1 = plan_from_config(load_config(None, TINY + ["pipeline.staleness=1"]), jax.device_count())
    path = tmp_path / "plan.json"
    k1.save(str(path))
    from_file, _ = choose_plan(load_config(None, TINY + [f"pipeline.plan={path}"]))
    given, _ = choose_plan(load_config(None, TINY), k1)
    assert from_file.pipeline.staleness == given.pipeline.staleness == 1


def test_a_plan_file_for_other_devices_is_a_config_error(tmp_path):
    plan = plan_from_config(load_config(None, TINY), jax.device_count() + 1)
    plan.save(str(tmp_path / "plan.json"))
    with pytest.raises(ConfigError, match="pipeline.plan"):
        plan_for_config(load_config(None, TINY + [f"pipeline.plan={tmp_path / 'plan.json'}"]), jax.device_count())


def test_resuming_under_another_staleness_names_the_key(tmp_path):
    common = TINY + ["pipeline.plan=manual", f"train.run_dir={tmp_path}"]
    train(load_config(None, common + ["pipeline.staleness=1", "train.steps=1"]))
    with pytest.raises(ConfigError, match="pipeline.staleness"):
        train(load_config(None, common + ["train.steps=2"]))


def test_a_plan_file_with_an_unknown_knob_or_other_pieces_is_refused(tmp_path):
    good = plan_from_config(load_config(None, TINY), jax.device_count())
    for name, plan in (
        ("typo", dataclasses.replace(good, knobs={**good.knobs, "stalenes": 1})),
        (
            "pieces",
            dataclasses.replace(good, stages=(dataclasses.replace(good.stages[0], pieces=4),) + good.stages[1:]),
        ),
    ):
        path = tmp_path / f"{name}.json"
        path.write_text(plan.to_json())
        with pytest.raises(ConfigError, match="pipeline.plan"):
            plan_for_config(load_config(None, TINY + [f"pipeline.plan={path}"]), jax.device_count())


def test_a_resume_under_another_structure_is_a_config_error_naming_the_knob(tmp_path):
    common = HELPER_TINY + ["rl.algorithm=ppo", f"train.run_dir={tmp_path}"]
    train(load_config(None, common + ["train.steps=1"]))
    with pytest.raises(ConfigError, match="pipeline.share_actor_critic"):
        train(load_config(None, common + ["train.steps=2", "pipeline.share_actor_critic=true"]))


def test_an_auto_plan_resumes_with_the_runs_own_plan(tmp_path, monkeypatch):
    import rpeg_jax.runtime.trainer as trainer

    common = TINY + ["pipeline.plan=auto", "costmodel.hardware=cpu", f"train.run_dir={tmp_path}"]
    train(load_config(None, common + ["train.steps=1"]))
    first = (tmp_path / "plan.json").read_text()

    def no_planning(*a, **k):
        raise AssertionError("a resumed auto run planned again")

    monkeypatch.setattr(trainer, "cost_model_planner", no_planning)
    out = train(load_config(None, common + ["train.steps=2"]))
    assert out["steps"] == 2
    again = json.loads((tmp_path / "plan.json").read_text())
    assert again["knobs"] == json.loads(first)["knobs"] and again["stages"] == json.loads(first)["stages"]


def test_an_auto_run_whose_plan_json_is_unreadable_plans_again_and_resumes(tmp_path, caplog):
    """An empty plan.json (what a crash in the middle of a plain write left before run files were
    written atomically) is reported and planned again; the checkpoint's structure check decides."""
    common = TINY + ["pipeline.plan=auto", "costmodel.hardware=cpu", f"train.run_dir={tmp_path}"]
    train(load_config(None, common + ["train.steps=1"]))
    first = json.loads((tmp_path / "plan.json").read_text())
    (tmp_path / "plan.json").write_text("")
    with caplog.at_level("INFO", logger="rpeg_jax"):
        out = train(load_config(None, common + ["train.steps=2"]))
    assert out["steps"] == 2
    assert f"the run's {tmp_path / 'plan.json'} is unreadable" in caplog.text and "planning again" in caplog.text
    assert "resumed from step 1" in caplog.text
    assert json.loads((tmp_path / "plan.json").read_text())["knobs"] == first["knobs"]
