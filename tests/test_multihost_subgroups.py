"""Processes sharing GRPO groups (issue 31: P1's 32 prompts on 256 GH200's 64 processes): with more
processes than prompts, each prompt's group is shared by s = P / prompts processes, each generating
G / s of its samples under step admission (graph/processes.share_of; the sampler's sample_offset).
One prompt of group 4 on 2 local processes x 1 CPU device (2 samples each) against the one-process
run of the same config on 2 devices: every metric and the final parameters equal (the rule of
tests/test_launch.py), with the 2-process run stopped by SIGINT after step 2 and resumed by the same
command (the data cursor and the checkpoint of a run whose processes share their prompt)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import SKIP, TINY, checkpoint_actor, records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH = os.path.join(ROOT, "launch", "multihost.py")
SHARED = [
    "data.prompts_per_step=1",
    "rl.group_size=4",
    "train.steps=3",
    "train.checkpoint_every=3",
    "plugins=[interrupt_plugin,subgroup_reward]",
    "data.reward=subgroup_test_reward",
]
# a reward that differs between a group's samples (a function of the completion's tokens), so the
# advantages are not all 0 and a process generating another's samples would change every metric
REWARD = """
from rpeg_jax.data.rewards import Sample, register_reward


@register_reward("subgroup_test_reward", overwrite=True)
def subgroup_test_reward(sample: Sample) -> float:
    return float(sum((j + 1) * t for j, t in enumerate(sample.completion_ids)) % 13) / 13.0
"""


def launch(run_dir, processes, signal_at=None):
    devices = 2 // processes  # the same 2 devices: the same training mesh
    plugin = run_dir.parent / "plugins"
    plugin.mkdir(exist_ok=True)
    (plugin / "subgroup_reward.py").write_text(REWARD)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([ROOT, HERE, str(plugin)]),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    env.pop("RPEG_TEST_SIGNAL", None)
    if signal_at:
        env["RPEG_TEST_SIGNAL"] = signal_at
    local = ["--local-processes", str(processes), "--local-devices", str(devices)] if processes > 1 else []
    cmd = [sys.executable, LAUNCH, *local, *TINY, *SHARED, f"train.run_dir={run_dir}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.multihost
@pytest.mark.slow  # three runs (one of 2 processes resumed): ~2-3 min of CPU on 2 cores
def test_two_processes_sharing_one_prompts_group_train_as_one_process(tmp_path):
    one = launch(tmp_path / "one", 1)
    assert one.returncode == 0, one.stderr[-3000:]
    stopped = launch(tmp_path / "two", 2, signal_at="1:SIGINT")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "stopped by SIGINT after step 2:" in stopped.stderr, stopped.stderr[-3000:]
    assert sorted(records(tmp_path / "two")) == [1, 2]
    resumed = launch(tmp_path / "two", 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = records(tmp_path / "one"), records(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    # the group's 4 samples differ (so a process generating the other's samples would show)
    assert all(a[s]["reward/std"] > 0 for s in a), [a[s]["reward/std"] for s in a]
    for s in a:
        keys = sorted(k for k in a[s] if not k.startswith(SKIP))
        assert keys == sorted(k for k in b[s] if not k.startswith(SKIP)) and len(keys) > 10, s
        for k in keys:
            # float32 collectives over gloo sum in another order than in one process: 1e-5 relative
            np.testing.assert_allclose(b[s][k], a[s][k], rtol=1e-5, atol=1e-7, err_msg=f"step {s} {k}")
    want, got = checkpoint_actor(tmp_path / "one", 3), checkpoint_actor(tmp_path / "two", 3)
    assert want.keys() == got.keys() and want
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
