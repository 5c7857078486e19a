"""Ctrl-C and SIGTERM stop a real training process at a step boundary, and its checkpoint resumes
to exactly the uninterrupted run.

Each case starts launch/multihost.py in a subprocess with a small patch that sends the process a
real signal at one point of one step: while the first stage program compiles, while the sampler
generates, while the actor update runs (the signal comes from a timer thread a few milliseconds
into the call), or between two steps. The process must exit 0, print one line saying where it
stopped (no traceback), and leave a checkpoint of the last whole step; `train` on the same run
directory must then reproduce the uninterrupted run's metrics step for step.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import SKIP
from helpers import TINY as BASE

from rpeg_jax.config import load_config
from rpeg_jax.runtime.checkpoint import Checkpointer
from rpeg_jax.runtime.metrics import read_metrics
from rpeg_jax.runtime.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = BASE + ["train.steps=4"]

# The patch: wraps the executor's task runner and step-end hook, then runs the launcher as a user would.
_DRIVER = textwrap.dedent("""
    import os, runpy, signal, sys, threading
    from rpeg_jax.runtime import executor as E
    point, step, sig = sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3])
    fired = []

    def fire(delay):
        fired.append(point)
        if delay:  # from another thread while the main thread is inside the call
            threading.Timer(delay, os.kill, (os.getpid(), sig)).start()
        else:
            os.kill(os.getpid(), sig)

    run_task = E.Executor._run_task
    def patched_run_task(self, task, threaded):
        name = task.stage.name
        hit = task.step == step and ((point == "compile" and task.stage.kernel.jittable)
                                     or (point == "generate" and name == "generate")
                                     or (point == "update" and "actor_update" in name))
        if hit and not fired:
            fire(0.02)
        return run_task(self, task, threaded)

    forget_before = E.Executor.forget_before
    def patched_forget_before(self, t):  # called after step t's metrics (and checkpoint) are written
        if point == "between" and t + 1 == step and not fired:
            fire(0)
        return forget_before(self, t)

    E.Executor._run_task, E.Executor.forget_before = patched_run_task, patched_forget_before
    sys.argv = ["launch/multihost.py"] + sys.argv[4:]
    runpy.run_path(os.path.join(ROOT, "launch", "multihost.py"), run_name="__main__")
""").replace("ROOT", repr(ROOT))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """k -> the metrics of each step of the run nobody interrupts."""
    out = {}
    for k in (0, 1):
        d = tmp_path_factory.mktemp(f"straight_k{k}")
        train(load_config(None, TINY + [f"pipeline.staleness={k}", f"train.run_dir={d}"]))
        out[k] = {r["step"]: r for r in read_metrics(str(d / "metrics.jsonl"))}
    return out


# (point, step the signal is sent in, signal, staleness k, the step the checkpoint must be of)
CASES = [
    ("compile", 0, "SIGINT", 0, 1),  # during the first XLA compile: step 0 finishes first
    ("generate", 1, "SIGINT", 0, 2),
    ("update", 2, "SIGTERM", 0, 3),  # what SLURM sends before it kills a job
    ("between", 2, "SIGINT", 0, 2),  # after step 2's metrics: nothing of step 3 has run
    ("generate", 2, "SIGINT", 1, 2),  # k = 1: slot 1 generates step 2 ahead; its rollouts are buffered
]


@pytest.mark.parametrize("point,step,signame,k,stopped", CASES, ids=[f"{c[0]}-k{c[3]}" for c in CASES])
def test_a_signal_stops_at_a_step_boundary_and_resumes_exactly(
    tmp_path, uninterrupted, point, step, signame, k, stopped
):
    overrides = TINY + [f"pipeline.staleness={k}", f"train.run_dir={tmp_path}"]
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, point, str(step), signame, *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "stopped by" in line]
    assert len(said) == 1 and f"stopped by {signame} after step {stopped}:" in said[0], proc.stderr[-3000:]
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == stopped
    before = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in before] == list(range(1, stopped + 1))  # no record of a step left unfinished

    out = train(load_config(None, overrides))  # the same command again: resumes
    assert out["steps"] == 4 and not out["interrupted"]
    got = {r["step"]: r for r in read_metrics(str(tmp_path / "metrics.jsonl"))}
    want = uninterrupted[k]
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for s, rec in want.items():
        keys = [key for key in rec if not key.startswith(SKIP)]
        assert len(keys) > 10
        assert {key: rec[key] for key in keys} == {key: got[s].get(key) for key in keys}, s


def test_a_second_ctrl_c_stops_at_once_without_a_new_checkpoint(tmp_path):
    """The impatient path: the first SIGINT asks for a stop at the boundary, the second one during
    the same step ends the process (exit 130 from the launcher, one line); the run directory keeps
    only checkpoints that were committed whole."""
    driver = _DRIVER.replace("fire(0.02)", "fire(0); os.kill(os.getpid(), sig)")
    overrides = TINY + ["train.checkpoint_every=1", f"train.run_dir={tmp_path}"]
    proc = subprocess.run(
        [sys.executable, "-c", driver, "generate", "2", "SIGINT", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 2  # the one of the last whole step
    out = train(load_config(None, overrides))
    assert out["steps"] == 4
