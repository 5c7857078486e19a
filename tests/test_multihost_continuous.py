"""Continuous admission (k = 2) on 2 local processes (gloo, 2 CPU devices each): every process runs
its engine on its own data shard, and a checkpoint holds every engine's whole state (each
process's groups, sequences, scheduler and page allocator in the meta item, its KV pools as its
row of a [processes, ...] array). SIGINT in the middle of a step (process 0's actor update; the
processes agree on the step to stop after), then the same command: the metrics of every step and
the final parameters are those of the run nobody interrupted; also with dynamic sampling
(rl.filter_groups=zero_variance) on 2 processes x 4 devices."""

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import SKIP, TINY, checkpoint_actor, records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH = os.path.join(ROOT, "launch", "multihost.py")
CONTINUOUS = [
    "pipeline.staleness=2",
    "rollout.admission=continuous",
    "rollout.max_new_tokens=16",
    "rollout.forced_lengths=[3,1.2,1,16]",
    "rollout.chunk_steps=4",
    "rollout.min_chunk_steps=4",
    "train.steps=5",
    "train.checkpoint_every=2",
    "plugins=[interrupt_plugin]",
]
FILTER = [
    "plugins=[interrupt_plugin,varying_reward]",
    "data.reward=varying_test_reward",
    "rl.filter_groups=zero_variance",
]


def launch(run_dir, overrides, signal_at=None, devices=2):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([ROOT, HERE]),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    env.pop("RPEG_TEST_SIGNAL", None)
    if signal_at:
        env["RPEG_TEST_SIGNAL"] = signal_at
    cmd = [sys.executable, LAUNCH, "--local-processes", "2", "--local-devices", str(devices), *overrides]
    return subprocess.run(cmd + [f"train.run_dir={run_dir}"], capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.multihost
@pytest.mark.slow  # three 2-process runs: ~4 min of CPU on 2 cores
@pytest.mark.parametrize("extra,devices", [([], 2), (FILTER, 4)], ids=["plain-2x2", "filter-2x4"])
def test_ctrl_c_on_two_processes_resumes_exactly(tmp_path, extra, devices):
    common = TINY + CONTINUOUS + extra
    straight = launch(tmp_path / "straight", common, devices=devices)
    assert straight.returncode == 0, straight.stderr[-3000:]
    stopped = launch(tmp_path / "stopped", common, signal_at="2:SIGINT", devices=devices)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "stopped by SIGINT after step 3:" in stopped.stderr, stopped.stderr[-3000:]
    assert sorted(records(tmp_path / "stopped")) == [1, 2, 3]
    resumed = launch(tmp_path / "stopped", common, devices=devices)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = records(tmp_path / "straight"), records(tmp_path / "stopped")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    assert a[3]["rollout/in_flight"] > 0  # sequences were in flight at the signal's checkpoint
    if extra:
        assert sum(a[s]["rollout/filtered_groups"] for s in (4, 5)) > 0
    for s in a:
        keys = [k for k in a[s] if not k.startswith(SKIP)]
        assert {k: a[s][k] for k in keys} == {k: b[s].get(k) for k in keys}, s
    want, got = checkpoint_actor(tmp_path / "straight", 5), checkpoint_actor(tmp_path / "stopped", 5)
    assert want.keys() == got.keys() and want
    for k in want:
        np.testing.assert_array_equal(want[k], got[k], err_msg=k)


@pytest.mark.multihost
@pytest.mark.slow  # one 2-process run to its first step
def test_filter_exhausted_on_one_process_ends_every_process_with_one_line(tmp_path):
    """Dynamic sampling runs out on process 1's shard only (its rewards are all equal): both processes
    end the run with the same FilterExhausted line naming process 1, not process 0 waiting on a
    collective its peer never reaches until the launcher calls process 1 lost."""
    overrides = [
        *TINY,
        *CONTINUOUS,
        "plugins=[process_one_equal_reward]",
        "data.reward=process_one_equal_reward",
        "rl.filter_groups=zero_variance",
        "rl.filter_max_rounds=1",
    ]
    run = launch(tmp_path / "run", overrides)
    assert run.returncode == 1, run.stderr[-3000:]
    line = "FilterExhausted: step 1: on process 1: rl.filter_groups: more than "
    for p in (0, 1):
        assert f"rpeg: process {p}: {line}" in run.stderr, run.stderr[-3000:]
    assert "lost" not in run.stderr.lower(), run.stderr[-3000:]
