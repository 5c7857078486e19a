"""Split placement across processes (issue 31 item 3): 4 local processes x 2 CPU devices (gloo),
generation on processes 0-1 (devices 0-3), training on processes 2-3 (devices 4-7), continuous
admission with staleness k = 1. Taking turns (rollout.decode_ahead=false), the reference is the
colocated run on 2 processes x 2 devices: its
processes generate exactly what the split run's generating processes do (the same prompt shards,
engines and seeds on the same 2-device meshes) and train on a mesh of the same shape, so every
metric and the final parameters must be equal; the split run moves the trained weights to the
generating processes and the rollouts to the training processes (runtime/split.py) instead.
Decoding ahead (the default for split placement: the generating processes decode step t+1's groups
while the training processes run step t's update) is checked by the resume test: the bound per
token, and kill -9 / SIGINT then the same command equal to the uninterrupted run."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ATOL, SKIP, TINY, checkpoint_actor, records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH = os.path.join(ROOT, "launch", "multihost.py")
COMMON = [
    "pipeline.staleness=1",
    "rollout.admission=continuous",
    "rollout.max_new_tokens=16",
    "rollout.forced_lengths=[3,1.2,1,16]",
    "rollout.chunk_steps=4",
    "rollout.min_chunk_steps=4",
    "train.steps=6",
]
SPLIT = ["pipeline.placement=split", "pipeline.split_sizes=[4,4]"]


def launch(run_dir, processes, overrides):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    cmd = [sys.executable, LAUNCH, "--local-processes", str(processes), "--local-devices", "2", *overrides]
    return subprocess.run(cmd + [f"train.run_dir={run_dir}"], capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.multihost
@pytest.mark.slow  # a 2-process and a 4-process run
def test_split_on_four_processes_equals_colocated_on_two(tmp_path):
    coloc = launch(tmp_path / "coloc", 2, TINY + COMMON)
    assert coloc.returncode == 0, coloc.stderr[-3000:]
    split = launch(tmp_path / "split", 4, TINY + COMMON + SPLIT + ["rollout.decode_ahead=false"])
    assert split.returncode == 0, split.stderr[-3000:]
    a, b = records(tmp_path / "coloc"), records(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for s in b:
        assert b[s]["staleness/max"] <= 1, (s, b[s]["staleness/max"])
        assert b[s]["timing_s/update_weights"] > 0, s
    assert max(b[s]["staleness/max"] for s in b) == 1  # the bound was used, not trivially met
    for s in a:
        keys = [k for k in a[s] if not k.startswith(SKIP)]
        assert {k: a[s][k] for k in keys} == {k: b[s].get(k) for k in keys}, s
    want, got = checkpoint_actor(tmp_path / "coloc", 6), checkpoint_actor(tmp_path / "split", 6)
    assert want.keys() == got.keys() and want
    for k in want:
        np.testing.assert_array_equal(want[k], got[k], err_msg=k)


@pytest.mark.multihost
@pytest.mark.slow  # a 2-process and a 4-process run
def test_lora_split_on_four_processes_moves_adapters_and_equals_colocated(tmp_path):
    """model.lora with split placement across processes: the generating processes keep the base and
    each sync moves the adapters only (runtime/setup.AdapterSync), merged there; the run equals the
    colocated one on 2 processes, where the merge runs in the training layout and the merged model
    moves (metrics to float32 rounding: the merge runs on other meshes)."""
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2"]
    coloc = launch(tmp_path / "coloc", 2, TINY + COMMON + lora)
    assert coloc.returncode == 0, coloc.stderr[-3000:]
    split = launch(tmp_path / "split", 4, TINY + COMMON + SPLIT + lora + ["rollout.decode_ahead=false"])
    assert split.returncode == 0, split.stderr[-3000:]
    a, b = records(tmp_path / "coloc"), records(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert max(b[s]["staleness/max"] for s in b) == 1
    for s in a:
        for k in ("actor/pg_loss", "reward/mean", "actor/grad_norm"):
            assert b[s][k] == pytest.approx(a[s][k], rel=1e-4, abs=1e-6), (s, k)
    want, got = checkpoint_actor(tmp_path / "coloc", 6), checkpoint_actor(tmp_path / "split", 6)
    assert want.keys() == got.keys() and all("lora_" in k for k in want)
    assert any(np.abs(want[k]).max() > 0 for k in want if "lora_b" in k)  # the adapters trained
    for k in want:
        np.testing.assert_allclose(want[k], got[k], rtol=1e-4, atol=1e-6, err_msg=k)


def launch_signalled(run_dir, overrides, signal_at=None, process=2):
    """launch() on 4 processes with interrupt_plugin: `signal_at` = "<step>:<SIGNAME>" sent by
    process `process` (a training process: only they run the actor update) to itself."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    env.pop("RPEG_TEST_SIGNAL", None)
    if signal_at:
        env.update(RPEG_TEST_SIGNAL=signal_at, RPEG_TEST_SIGNAL_PROCESS=str(process))
        env["RPEG_TEST_SIGNAL_STAMP"] = str(run_dir) + ".signalled"
    cmd = [sys.executable, LAUNCH, "--local-processes", "4", "--local-devices", "2", *overrides]
    return subprocess.run(cmd + [f"train.run_dir={run_dir}"], capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.multihost
@pytest.mark.slow  # seven 4-process runs
def test_split_resumes_exactly_after_kill_9_and_ctrl_c(tmp_path):
    """Split 2+2 processes, continuous k = 1 decoding ahead, checkpoints every 2 steps: kill -9 of a training
    process in the middle of step 4 (the launcher ends the job; the resume starts from step 2's
    checkpoint, with sequences in flight on the generating processes and step 3's batch made ahead
    there), kill -9 of it at the boundary of steps 4 and 5 (step 4's checkpoint written or in flight:
    the resume starts from the newest committed one), and SIGINT in the middle of
    step 3 (the processes agree to stop after it and write a checkpoint the uninterrupted run never
    took); each time the same command finishes the run, and every metric and the final parameters
    equal the uninterrupted run's. The killed job ends within 60 s of the kill."""
    common = TINY + COMMON + SPLIT + ["train.checkpoint_every=2", "plugins=[interrupt_plugin]"]
    straight = launch_signalled(tmp_path / "straight", common)
    assert straight.returncode == 0, straight.stderr[-3000:]
    a = records(tmp_path / "straight")
    assert sorted(a) == [1, 2, 3, 4, 5, 6]
    for s in a:  # decoding ahead (the default here): generation overlapped the update, within the bound
        assert a[s]["staleness/max"] <= 1 and a[s]["timing_s/decode_ahead"] > 0, (s, a[s])
        assert a[s]["rollout/weights_version"] == max(0, s - 2) and a[s]["timing_s/update_weights"] > 0, s
    want = checkpoint_actor(tmp_path / "straight", 6)
    cases = (
        ("killed", "3:SIGKILL", [1, 2]),
        ("killed-between", "4:SIGKILL:boundary", [1, 2, 3]),
        ("stopped", "2:SIGINT", [1, 2, 3]),
    )
    for name, signal_at, left in cases:
        first = launch_signalled(tmp_path / name, common, signal_at=signal_at, process=3 if name == "stopped" else 2)
        if name.startswith("killed"):  # the job ends within 60 s of a lost process, naming it (item 6)
            assert first.returncode != 0 and "process 2 of 4 failed" in first.stderr, first.stderr[-3000:]
            with open(str(tmp_path / name) + ".signalled") as f:
                assert time.time() - float(f.read()) < 60
        else:
            said = "stopped by SIGINT (on process 3) after step 3"
            assert first.returncode == 0 and said in first.stderr, first.stderr[-3000:]
        assert sorted(s for s in records(tmp_path / name) if s in left) == left, name
        resumed = launch_signalled(tmp_path / name, common)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resumed from step" in resumed.stderr, resumed.stderr[-3000:]
        b = records(tmp_path / name)
        assert sorted(b) == sorted(a), name
        assert a[left[-1]]["rollout/in_flight"] > 0  # sequences were in flight at the resumed checkpoint
        for s in a:
            keys = [k for k in a[s] if not k.startswith(SKIP)]
            assert {k: a[s][k] for k in keys} == {k: b[s].get(k) for k in keys}, (name, s)
        got = checkpoint_actor(tmp_path / name, 6)
        assert want.keys() == got.keys() and want
        for k in want:
            np.testing.assert_array_equal(want[k], got[k], err_msg=f"{name} {k}")


@pytest.mark.multihost
@pytest.mark.slow  # two 2-process runs
def test_packed_updates_on_one_training_process_match_padded(tmp_path):
    """Split 1 + 1 processes (bench R2-MP's split variant) with packed updates (train.pack_sequences):
    decoding ahead, the batches of steps 1 and 2 are both made with the initial weights, so the two
    runs train on the same rollouts; the packed update's losses equal the padded one's to float32
    rounding (graph/processes.py allows packing with one training process only)."""
    common = TINY + COMMON + ["pipeline.placement=split", "pipeline.split_sizes=[2,2]", "train.steps=2"]
    runs = {}
    for name, pack in (("padded", "false"), ("packed", "true")):
        out = launch(tmp_path / name, 2, common + [f"train.pack_sequences={pack}"])
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = records(tmp_path / name)
    a, b = runs["padded"], runs["packed"]
    assert sorted(a) == sorted(b) == [1, 2] and "perf/actor_pack_fill" in b[1]
    for s in (1, 2):
        assert a[s]["rollout/weights_version"] == b[s]["rollout/weights_version"] == 0
        assert a[s]["reward/mean"] == b[s]["reward/mean"]  # the same rollouts
        for k in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
            assert b[s][k] == pytest.approx(a[s][k], rel=1e-4, abs=ATOL), (s, k)
