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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = BASE + ["train.steps=4"]

# The patch: signals sent from inside the target stage's call (CompiledStage.__call__), or between
# steps (the executor's end-of-step hook), and a marker of where the handler ran; then the launcher
# runs as a user would start it.
_DRIVER = textwrap.dedent("""
    import os, runpy, signal, sys, threading
    from rpeg_jax.graph import compile as C
    from rpeg_jax.runtime import executor as E, trainer as T
    point, step, sig = sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3])
    where = {"stage": None, "step": None, "fired": False}

    handle = T.StopSignals._handle
    def patched_handle(self, signum, frame):
        print(f"[driver] handled inside {where['stage']} of step {where['step']}", file=sys.stderr, flush=True)
        return handle(self, signum, frame)

    run_task = E.Executor._run_task
    def patched_run_task(self, task, threaded):
        where["step"] = task.step
        return run_task(self, task, threaded)

    call = C.CompiledStage.__call__
    def patched_call(self, inputs):
        where["stage"] = self.name
        target = where["step"] == step and not where["fired"] and (
            (point == "compile" and self.kernel.jittable) or (point == "generate" and self.name == "generate")
            or (point == "update" and "actor_update" in self.name))
        if target:
            where["fired"] = True
            if point == "compile":  # lands while the program traces and compiles (no compilation cache)
                threading.Timer(0.05, os.kill, (os.getpid(), sig)).start()
            else:
                os.kill(os.getpid(), sig)
        try:
            return call(self, inputs)
        finally:
            where["stage"] = None

    forget_before = E.Executor.forget_before
    def patched_forget_before(self, t):  # after step t's metrics (and checkpoint) are written
        if point == "between" and t + 1 == step and not where["fired"]:
            where["fired"] = True
            os.kill(os.getpid(), sig)
        return forget_before(self, t)

    T.StopSignals._handle, E.Executor._run_task = patched_handle, patched_run_task
    C.CompiledStage.__call__, E.Executor.forget_before = patched_call, patched_forget_before
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


# (point, step the signal is sent in, signal, staleness k, checkpoint_every, where the handler runs,
#  the step the checkpoint must be of)
CASES = [
    ("compile", 0, "SIGINT", 0, 0, "old_forward of step 0", 1),  # the first XLA compile: step 0 finishes first
    ("generate", 1, "SIGINT", 0, 0, "generate of step 1", 2),
    ("update", 2, "SIGTERM", 0, 0, "actor_update of step 2", 3),  # what SLURM sends before it kills a job
    ("between", 2, "SIGINT", 0, 0, "None of step", 2),  # after step 2's metrics: nothing of step 3 has run
    ("update", 1, "SIGINT", 0, 1, "actor_update of step 1", 2),  # step 2 is also a periodic checkpoint
    ("generate", 2, "SIGINT", 1, 0, "generate of step 2", 2),  # k = 1: slot 1 makes step 2's rollouts ahead
    ("update", 1, "SIGINT", 1, 1, "actor_update of step 1", 2),  # k = 1, periodic checkpoint, rollouts buffered
    ("between", 2, "SIGTERM", 1, 0, "None of step", 2),
]


# in the default run: the first compile, SLURM's SIGTERM in an update, k = 1 with a periodic checkpoint and
# SIGTERM between steps; the other four are `slow` (session 24's trim of the default run: ~9 s each)
SLOW_CASES = {1, 3, 4, 5}


@pytest.mark.parametrize(
    "point,step,signame,k,every,inside,stopped",
    [pytest.param(*c, marks=[pytest.mark.slow] if i in SLOW_CASES else []) for i, c in enumerate(CASES)],
    ids=[f"{c[0]}-k{c[3]}-every{c[4]}" for c in CASES],
)
def test_a_signal_stops_at_a_step_boundary_and_resumes_exactly(
    tmp_path, uninterrupted, point, step, signame, k, every, inside, stopped
):
    overrides = TINY + [f"pipeline.staleness={k}", f"train.checkpoint_every={every}", f"train.run_dir={tmp_path}"]
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"} if point == "compile" else None
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, point, str(step), signame, *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    handled = [line for line in proc.stderr.splitlines() if line.startswith("[driver] handled inside")]
    assert len(handled) == 1 and inside in handled[0], proc.stderr[-3000:]
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
    once = "        else:\n            os.kill(os.getpid(), sig)\n"
    assert once in _DRIVER
    driver = _DRIVER.replace(once, once + "            os.kill(os.getpid(), sig)\n")
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


# Continuous admission (k = 2) with sequences in flight across steps: the checkpoint a signal writes
# at a step the uninterrupted run does not checkpoint holds the engine's whole state (its groups,
# sequences and KV pools, runtime/rollout/continuous.snapshot), so the resumed run decodes on exactly
# as the uninterrupted one (it used to restart the groups in flight, which changed the run).
CONTINUOUS = [
    "pipeline.staleness=2",
    "rollout.admission=continuous",
    "rollout.max_new_tokens=16",
    "rollout.forced_lengths=[3,1.2,1,16]",  # a long tail: groups run across weight updates
    "rollout.chunk_steps=4",
    "rollout.min_chunk_steps=4",
    "train.steps=5",
    "train.checkpoint_every=2",
]


FILTER = ["plugins=[varying_reward]", "data.reward=varying_test_reward", "rl.filter_groups=zero_variance"]


@pytest.mark.parametrize(
    "extra", [[], pytest.param(FILTER, marks=pytest.mark.slow)], ids=["plain", "filter"]
)  # ~30 s each on 2 cores: the plain case runs by default
def test_ctrl_c_under_continuous_admission_resumes_exactly(tmp_path, extra):
    import jax
    import numpy as np

    common = BASE + CONTINUOUS + extra
    want = train(load_config(None, common + [f"train.run_dir={tmp_path / 'straight'}"]), keep_state=True)
    run_dir = tmp_path / "stopped"
    overrides = common + [f"train.run_dir={run_dir}"]
    proc = subprocess.run(  # SIGINT inside step 3's actor update (0-based 2): the checkpoint is of step 3
        [sys.executable, "-c", _DRIVER, "update", "2", "SIGINT", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])},  # the plugin
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "stopped by" in line]
    assert len(said) == 1 and "stopped by SIGINT after step 3:" in said[0], proc.stderr[-3000:]
    assert Checkpointer(str(run_dir / "checkpoints")).latest_step() == 3  # not a periodic one (every 2)
    got = train(load_config(None, overrides), keep_state=True)
    assert got["steps"] == 5 and not got["interrupted"]
    a = {r["step"]: r for r in read_metrics(str(tmp_path / "straight" / "metrics.jsonl"))}
    b = {r["step"]: r for r in read_metrics(str(run_dir / "metrics.jsonl"))}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    assert a[3]["rollout/in_flight"] > 0  # sequences were in flight at the signal's checkpoint
    if extra:
        assert sum(a[s]["rollout/filtered_groups"] for s in (4, 5)) > 0  # groups filtered after it
    for s in a:
        keys = [key for key in a[s] if not key.startswith(SKIP)]
        assert {key: a[s][key] for key in keys} == {key: b[s].get(key) for key in keys}, s
    for name, tree in want["state"].items():
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got["state"][name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
