"""launch/multihost.py: config and initialisation errors are reported (one line, exit 2 / 3), and
`--local-processes 2` (4 CPU devices each) trains like one process with 8 devices."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import SKIP, load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch", "multihost.py")


def _launcher():
    return load_file("rpeg_launch_multihost", LAUNCH)


def _run(args, timeout=120, devices=8, **env_extra):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        **env_extra,
    )
    return subprocess.run([sys.executable, LAUNCH] + args, capture_output=True, text=True, timeout=timeout, env=env)


def test_config_error_is_one_line_exit_2():
    r = _run(["train.stepz=3"])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "config error: train.stepz=3: unknown key (did you mean 'steps'?)"
    r = _run(["distributed.process_id=5", "distributed.num_processes=2"])
    assert r.returncode == 2 and "distributed.process_id=5" in r.stderr and "Traceback" not in r.stderr


def test_initialize_failure_is_reported_exit_3():
    from rpeg_jax.runtime.distributed import free_port

    port = free_port()  # nobody listens there
    r = _run(
        [
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "distributed.initialization_timeout_s=1.5",
        ]
    )
    assert r.returncode == 3, r.stderr[-2000:]
    assert f"coordinator 127.0.0.1:{port} not reachable" in r.stderr and "process_id=1" in r.stderr
    r = _run(["--coordinator", "127.0.0.1:1"])
    assert r.returncode == 3 and "num_processes, process_id missing" in r.stderr


def test_child_command_drops_local_flags():
    import argparse

    from rpeg_jax.cli import train as rpeg_train

    p = argparse.ArgumentParser()
    rpeg_train.add_arguments(p)
    args = p.parse_args(["--config", "x.yaml", "--local-processes", "2", "--local-devices=4", "a.b=1"])
    assert rpeg_train.child_command(args)[1:] == ["-m", "rpeg_jax.cli", "train", "--config", "x.yaml", "a.b=1"]


def test_the_launcher_is_rpeg_train():
    """One training entry point: launch/multihost.py (make run) is `rpeg train` (no sys.path edits)."""
    m = _launcher()
    from rpeg_jax.cli import train as rpeg_train

    assert m.main is rpeg_train.main
    assert "sys.path" not in open(LAUNCH).read()


def _metrics(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # timings and what derives from them (throughput, predicted-vs-measured) differ run to run
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows]


@pytest.mark.multihost  # two training runs: ~1.5 min of CPU; in the default run (`make test`)
def test_two_local_processes_match_one_process(tmp_path):
    """A few steps of the default config: 2 processes x 4 CPU devices give the metrics of 1 x 8."""
    common = [
        "--config",
        os.path.join(ROOT, "configs", "default.yaml"),
        "train.steps=2",
        "train.progress=false",
        "train.tensorboard=false",
        "train.checkpoint_every=0",
    ]
    one = _run(common + [f"train.run_dir={tmp_path / 'one'}"], timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run(
        common + [f"train.run_dir={tmp_path / 'two'}", "--local-processes", "2", "--local-devices", "4"], timeout=600
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _metrics(tmp_path / "one" / "metrics.jsonl"), _metrics(tmp_path / "two" / "metrics.jsonl")
    assert len(a) == len(b) == 2 and a[0].keys() == b[0].keys()
    for ra, rb in zip(a, b):
        for k in ra:
            # float32 collectives over gloo sum in another order than in one process: 1e-5 relative
            np.testing.assert_allclose(rb[k], ra[k], rtol=1e-5, atol=1e-7, err_msg=f"step {ra['step']} {k}")


DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
QUIET = ["train.progress=false", "train.tensorboard=false", "train.checkpoint_every=0"]


@pytest.mark.multihost
@pytest.mark.slow  # four processes compiling on a shared 2-core machine: ~50 s warm, ~70 s cold XLA cache
def test_the_plan_for_four_processes_runs_on_four_local_processes(tmp_path):
    """`rpeg plan --processes 4` for a 4-process CPU cluster (2 devices each) chooses the plan that a
    run on `--local-processes 4` (pipeline.plan=auto, planned for jax.process_count()) makes and
    runs: plan.json equal. (Since split placement runs across processes the default config's plan
    is a split: generation tensor-parallel on processes 0-1, training FSDP on processes 2-3.)"""
    planned = tmp_path / "planned.json"
    args = ["--config", DEFAULT, "--hardware", "cpu", "--gpus", "8", "--processes", "4", "--quiet"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(
        [sys.executable, "-m", "rpeg_jax.cli", "plan", *args, "--save-plan", str(planned)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "run"
    four = _run(
        ["--config", DEFAULT, "train.steps=1", *QUIET, f"train.run_dir={run_dir}"]
        + ["--local-processes", "4", "--local-devices", "2"],
        timeout=900,
    )
    assert four.returncode == 0, four.stderr[-3000:]
    ran = json.loads((run_dir / "plan.json").read_text())
    assert ran == json.loads(planned.read_text())
    assert ran["predicted"]["processes"] == 4 and ran["settings"]["rollout.admission"] == "step"


def _illegal_plan(tmp_path, what):
    """A plan file that one process runs and two cannot, and the line the runtime refuses it with."""
    from rpeg_jax.config import load_config
    from rpeg_jax.graph.plan import plan_from_config

    path = str(tmp_path / f"{what}.json")
    # tensor-parallel generation whose tensor group (8 devices) spans both processes (4 each); a plan
    # with continuous admission runs on several processes now (tests/test_multihost_continuous.py)
    over, line = ["sharding.mesh={data: -1, tensor: 8}"], f"pipeline.plan={path!r}"
    plan_from_config(load_config(DEFAULT, ["pipeline.plan=manual", *over]), 8).save(path)
    return path, f"config error: {line}: "


def _refusal(path, processes):
    """The line graph/processes.check_plan refuses the plan file with, here in this process."""
    from rpeg_jax.config import load_config
    from rpeg_jax.graph.plan import config_for_plan, graph_for_plan, plan_for_config
    from rpeg_jax.graph.processes import NotRunnable, check_plan

    cfg = load_config(DEFAULT, [f"pipeline.plan={path}"])
    plan = plan_for_config(cfg, 8)
    cfg, _ = config_for_plan(cfg, plan)
    with pytest.raises(NotRunnable) as e:
        check_plan(cfg, plan, graph_for_plan(cfg, plan), processes)
    check_plan(cfg, plan, graph_for_plan(cfg, plan), 1)  # one process runs it
    return str(e.value)


@pytest.mark.multihost
@pytest.mark.parametrize("what", ["tensor"])
def test_a_plan_two_processes_cannot_run_is_refused_in_one_line(tmp_path, what):
    """pipeline.plan=<file> with tensor-parallel generation spanning processes under
    `--local-processes 2`: every process stops with the same one-line ConfigError naming the knob
    (exit 2), before anything compiles (JAX logs every compilation with JAX_LOG_COMPILES)."""
    path, line = _illegal_plan(tmp_path, what)
    r = _run(
        ["--config", DEFAULT, f"pipeline.plan={path}", "train.steps=1", *QUIET, f"train.run_dir={tmp_path / 'r'}"]
        + ["--local-processes", "2", "--local-devices", "4"],
        timeout=300,
        JAX_LOG_COMPILES="1",
    )
    assert r.returncode == 2, r.stderr[-3000:]
    want = _refusal(path, 2)
    assert want.startswith(line) and "\n" not in want
    # each process prints it once (the two processes' lines may interleave with the other's log lines)
    assert r.stderr.count(want) == 2 == r.stderr.count("config error"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Compiling" not in r.stderr, r.stderr[-3000:]
