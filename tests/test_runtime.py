"""End-to-end runtime tests on a tiny model: every rewrite against the plain synchronous graph,
bounded asynchrony checked by version tags, exact resume after SIGKILL (signals: test_interrupts.py)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import KILLER, PPO, SKIP, TINY, assert_rewritten, assert_same_run, run

from rpeg_jax.config import load_config
from rpeg_jax.graph.plan import graph_for_plan, plan_for_config, plan_from_config, widen_generation
from rpeg_jax.runtime.checkpoint import Checkpointer
from rpeg_jax.runtime.metrics import read_metrics
from rpeg_jax.runtime.trainer import train


@pytest.fixture(scope="module")
def ppo_reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ppo"), "plain", PPO)


FORWARDS = ("ref_forward", "old_forward", "critic_forward")
STREAMED = ("generate", "reward")  # a micro-batched generate streams its pieces to its consumers


@pytest.mark.parametrize(
    "rewrite,changes",
    [
        (
            ["pipeline.fuse=[forwards,advantage]"],
            dict(present={"forwards", "advantage+actor_update"}, absent={*FORWARDS, "advantage", "actor_update"}),
        ),
        pytest.param(  # slow (session 24's trim): the next case streams 2 pieces too
            ["pipeline.pieces=2"], dict(pieces=dict.fromkeys(STREAMED + FORWARDS, 2)), marks=pytest.mark.slow
        ),
        (
            ["pipeline.pieces=2", "pipeline.fuse=[forwards]"],
            dict(present={"forwards"}, absent=set(FORWARDS), pieces=dict.fromkeys(STREAMED + ("forwards",), 2)),
        ),
    ],
)
def test_rewrites_equal_the_plain_graph(tmp_path, ppo_reference, rewrite, changes):
    rewritten = run(tmp_path, "rewritten", PPO + rewrite)
    assert_rewritten(rewritten, ppo_reference, **changes)  # first: the knob changed what ran
    assert_same_run(ppo_reference, rewritten)


def test_elide_old_forward_equals_recomputed_old_logprobs(tmp_path):
    """The sampler's logprobs serve as π_old: same metrics and parameters as recomputing them."""
    grpo = TINY + ["rl.kl_coef=0.04"]
    recomputed, elided = (
        run(tmp_path, "recomputed", grpo),
        run(tmp_path, "elided", grpo + ["pipeline.elide_old_forward=true"]),
    )
    assert_rewritten(elided, recomputed, absent={"old_forward"})
    assert_same_run(recomputed, elided, atol=1e-4)


def test_split_placement_equals_colocated(tmp_path):
    """Generation on devices 0-3 and training on 4-7 (two threads, weights resharded across the
    groups every step) = every stage on devices 0-3. Both runs see the same mesh shapes, so the
    numbers agree exactly; only placement and concurrency differ."""
    assert len(jax.devices()) >= 8
    grpo = TINY + ["rl.kl_coef=0.04"]
    cfg = load_config(None, grpo + ["pipeline.placement=split", "pipeline.split_sizes=[4,4]"])
    split = plan_from_config(cfg, 8)
    assert {g.name: g.devices for g in split.groups} == {"gen": (0, 1, 2, 3), "train": (4, 5, 6, 7)}
    colocated = plan_from_config(load_config(None, grpo), 4)
    colocated = dataclasses.replace(colocated, num_devices=8)
    assert_same_run(
        run(tmp_path, "colocated", grpo, plan=colocated), run(tmp_path, "split", grpo, plan=split), atol=0.0
    )


def test_generation_on_a_wider_nested_group_equals_one_device(tmp_path):
    """Generation on a data mesh of devices 0-1 (widen_generation: the sampler's slots and page
    pool split over `data`) while training stays on device 0, the weights resharded into the wider
    group every step = every stage on device 0: same metrics and parameters."""
    grpo = TINY + ["pipeline.elide_old_forward=true", "pipeline.fuse=[forwards,advantage]"]
    cfg = load_config(None, grpo)
    one = dataclasses.replace(plan_from_config(cfg, 1), num_devices=2)
    wide = widen_generation(one, graph_for_plan(cfg, one), cfg, (0, 1))
    assert {g.name: g.devices for g in wide.groups} == {"all": (0,), "gen_wide": (0, 1)}
    for sp in wide.stages:
        gen = sp.stage == "generate"
        want = ("gen_wide", {"data": 2, "fsdp": 1, "tensor": 1}) if gen else ("all", one.stage(sp.stage).mesh)
        assert (sp.group, sp.mesh) == want, sp
    wide.save(str(tmp_path / "plan.json"))  # a nested plan reloads as a plan file
    back = plan_for_config(load_config(None, grpo + [f"pipeline.plan={tmp_path / 'plan.json'}"]), 2)
    assert (back.groups, back.stages) == (wide.groups, wide.stages)
    assert_same_run(run(tmp_path, "one", grpo, plan=one, steps=2), run(tmp_path, "wide", grpo, plan=wide, steps=2))


# 54 s; test_sharding_params checks explicit axis types' loss and gradients by default (slow: session 24's trim of the
# default run)
@pytest.mark.slow
def test_explicit_axis_types_train_like_auto(tmp_path):
    """Sharding in types (`sharding.axis_types=explicit`: the model gathers FSDP weights and states
    the layout of tensor-sharded contractions itself) trains like XLA's propagation (auto) on a
    (data 2, fsdp 2, tensor 2) mesh, PPO with a critic. (Without a KL term: with one, auto's
    reference and actor logprobs are bit-identical in the first step, explicit's differ by ~1e-7,
    and Adam's first step turns that noise-level gradient into +-lr: equal math, different runs.)"""
    assert len(jax.devices()) >= 8
    ppo = TINY + ["rl.algorithm=ppo", "rl.kl_coef=0", "sharding.mesh={data: 2, fsdp: 2, tensor: 2}"]
    assert_same_run(run(tmp_path, "auto", ppo), run(tmp_path, "explicit", ppo + ["sharding.axis_types=explicit"]))


def test_staleness_one_consumes_rollouts_exactly_one_version_behind(tmp_path):
    cfg = load_config(None, TINY + ["pipeline.staleness=1", "train.steps=4", f"train.run_dir={tmp_path}"])
    out = train(cfg, keep_state=True)
    metrics = read_metrics(os.path.join(out["run_dir"], "metrics.jsonl"))
    consumed = out["consumed"]
    for t in range(4):  # the executor's record of what each task read
        assert consumed[("generate", t, 0)]["rollout_weights"] == max(0, t - 1)
        assert consumed[("actor_update", t, 0)]["actor"] == t
        assert consumed[("actor_update", t, 0)]["completions"] == (t, "all")
    for r in metrics:
        t = r["step"] - 1  # the update of step t produces actor version t + 1
        assert r["rollout/weights_version"] == max(0, t - 1)
        expect = 0.0 if t == 0 else 1.0  # trainer version t minus the version tag of every token
        assert r["staleness/max"] == expect and r["staleness/mean"] == expect, r
        assert r["actor/version"] == t + 1


def test_staleness_zero_is_synchronous(tmp_path):
    metrics = run(tmp_path, "k0", TINY, steps=2).metrics
    assert all(r["staleness/max"] == 0.0 and r["rollout/weights_version"] == r["step"] - 1 for r in metrics)


@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.slow), 1])  # k = 1 by default (session 24's trim)
def test_resume_after_sigkill_is_exact(tmp_path, k):
    n = 2
    common = TINY + [f"pipeline.staleness={k}", f"train.steps={2 * n}", f"train.checkpoint_every={n}"]
    straight = load_config(None, common + [f"train.run_dir={tmp_path / 'straight'}"])
    want = train(straight, keep_state=True)
    crash_dir = tmp_path / "crashed"
    args = [sys.executable, "-c", KILLER, str(n)] + common + [f"train.run_dir={crash_dir}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert Checkpointer(str(crash_dir / "checkpoints")).latest_step() == n
    got = train(load_config(None, common + [f"train.run_dir={crash_dir}"]), keep_state=True)
    a = {r["step"]: r for r in read_metrics(str(tmp_path / "straight" / "metrics.jsonl"))}
    b = {r["step"]: r for r in read_metrics(str(crash_dir / "metrics.jsonl"))}
    for step in range(n + 1, 2 * n + 1):
        keys = [key for key in a[step] if not key.startswith(SKIP)]
        assert {key: a[step][key] for key in keys} == {key: b[step].get(key) for key in keys}, step
    for name, tree in want["state"].items():
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got["state"][name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def test_run_directory_outputs(tmp_path):
    cfg = load_config(None, TINY + ["train.steps=1", f"train.run_dir={tmp_path}", "train.tensorboard=true"])
    train(cfg)
    for name in ("metrics.jsonl", "plan.json", "config.yaml", "trace.json", "timeline.png"):
        assert (tmp_path / name).exists(), name
    assert os.listdir(tmp_path / "tensorboard")
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"generate", "reward", "old_forward", "advantage", "actor_update", "weight_sync"} <= names
    rec = read_metrics(str(tmp_path / "metrics.jsonl"))[0]
    for key in (
        "timing_s/step",
        "timing_s/gen",
        "timing_s/old_log_prob",
        "timing_s/adv",
        "timing_s/update_actor",
        "perf/tokens_per_s",
        "perf/tflops_per_device",
        "actor/pg_loss",
        "reward/mean",
    ):
        assert key in rec, key
    # the host's kernel time and page faults over the step (a CPU step that faults in fresh memory)
    assert rec["perf/host_sys_s"] >= 0 and rec["perf/host_page_faults"] >= 0
