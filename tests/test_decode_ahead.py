"""Decoding ahead (rollout.decode_ahead; issue 31 item 5): continuous admission under split placement
runs generation one step ahead, so the engine decodes step t+1's groups with the weights it has
(version t) while training runs step t's update on its own devices. On one process the two device
groups run in their own threads: the trace shows generate(t+1) running during actor_update(t). The
per-token bound k holds on every step (checked from the sampler's version tags), what generation read
is the executor's own record, and the run is a function of the seeds, data order and decode-chunk
counts: training slowed down, killed (kill -9) in the middle of an update or stopped by SIGINT, then
resumed by the same command, it gives every metric and parameter of the uninterrupted run. Whether
the engine's decisions under the lag are right is tests/test_admission_parity.py's (the engine against
the cost model's simulation)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import SKIP, TINY

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.runtime.metrics import read_metrics
from rpeg_jax.runtime.trainer import train

TAIL = [
    "rollout.max_new_tokens=30",
    "rollout.forced_lengths=[3,1.2,1,30]",
    "rollout.admission=continuous",
    "rollout.chunk_steps=4",
    "rollout.min_chunk_steps=4",
    "train.steps=6",
    "pipeline.placement=split",
    "pipeline.split_sizes=[4,4]",
]

# A run in a subprocess whose actor update sleeps (training slower than generation: other timing) and
# at step STOP (0-based) sends the process SIGNAL from inside the update (mid-step, with the engine
# decoding ahead in the other thread).
SIGNALLER = """
import os, signal, sys, time
from rpeg_jax.config import load_config
from rpeg_jax.graph import compile as C
from rpeg_jax.runtime.trainer import train
stop, name = int(sys.argv[1]), sys.argv[2]
call = C.CompiledStage.__call__
def slow(self, inputs):
    if "actor_update" in self.name:
        time.sleep(0.5)
        if int(inputs["_step"]) == stop and not getattr(slow, "fired", False):
            slow.fired = True
            os.kill(os.getpid(), getattr(signal, name))
    return call(self, inputs)
C.CompiledStage.__call__ = slow
train(load_config(None, sys.argv[3:]))
"""


def run(tmp_path, name, *extra):
    cfg = load_config(None, TINY + TAIL + [f"train.run_dir={tmp_path / name}", *extra])
    out = train(cfg, keep_state=True)
    return read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")), out


def spans(run_dir):
    """{(stage, step): (start, end)} from the run's trace (microseconds)."""
    with open(os.path.join(run_dir, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    return {(e["name"], e["args"]["step"]): (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"}


@pytest.mark.parametrize("k", [1, 2])
def test_generation_decodes_ahead_during_the_update_within_the_bound(tmp_path, k):
    metrics, out = run(tmp_path, f"k{k}", f"pipeline.staleness={k}")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6]
    for r in metrics:
        assert r["staleness/max"] <= k, r  # trainer version t minus every token's version tag
        assert r["rollout/weights_version"] == max(0, r["step"] - 2)  # step t's batch made with version t - 1
        assert r["timing_s/decode_ahead"] > 0, r
    assert max(r["staleness/max"] for r in metrics) == k
    # the executor's record: generate of step t read the sampler's weights of version t - 1
    assert all(out["consumed"][("generate", t, 0)]["rollout_weights"] == max(0, t - 1) for t in range(7))
    with open(os.path.join(out["run_dir"], "plan.json")) as f:
        assert json.load(f)["settings"]["rollout.decode_ahead"] is True  # null resolved: split + continuous
    # the overlap: generation of step t+1 ran while the update of step t did (their own threads), for
    # some t. Not for every t: under k = 2 generate(t+1) needs only update(t-1), and on a loaded machine
    # (CI's two workers) it can finish before update(t) starts (seen once: gen(t+1) entirely ahead).
    # Taking turns (decode_ahead=false, or a serial executor) overlaps for no t.
    assert overlapping_steps(out["run_dir"])


def overlapping_steps(run_dir):
    """The steps t whose update ran while generate(t+1) did, by the run's trace."""
    sp = spans(run_dir)
    steps = [t for t in range(6) if ("generate", t + 1) in sp and ("actor_update", t) in sp]
    assert len(steps) >= 4, sorted(sp)
    gen, upd = (lambda t: sp[("generate", t + 1)]), (lambda t: sp[("actor_update", t)])  # noqa: E731
    return [t for t in steps if gen(t)[0] < upd(t)[1] and gen(t)[1] > upd(t)[0]]


def test_decode_ahead_false_takes_turns(tmp_path):
    metrics, out = run(tmp_path, "off", "pipeline.staleness=1", "rollout.decode_ahead=false")
    assert all(out["consumed"][("generate", t, 0)]["rollout_weights"] == t for t in range(6))
    assert all("timing_s/decode_ahead" not in r and r["staleness/max"] <= 1 for r in metrics)
    with open(os.path.join(out["run_dir"], "plan.json")) as f:
        assert json.load(f)["settings"]["rollout.decode_ahead"] is False
    assert overlapping_steps(out["run_dir"]) == []  # what the overlap check above tells apart


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.decode_ahead=true", "pipeline.staleness=1"],  # admission step
        ["rollout.decode_ahead=true", "pipeline.staleness=1", "rollout.admission=continuous"],  # colocated
    ],
)
def test_decode_ahead_true_where_it_cannot_run_names_the_key(overrides):
    with pytest.raises(ConfigError, match=r"^config error: rollout\.decode_ahead=True: ") as e:
        load_config(None, TINY + overrides)
    assert "\n" not in str(e.value)


# 42 s; decoding ahead runs by default (..._within_the_bound), its resumes in test_multihost_split (slow) (slow:
# session 24's trim of the default run)
@pytest.mark.slow
def test_resume_after_kill_9_mid_update_and_sigint_is_exact(tmp_path):
    """Checkpoints every 2 steps at k = 2: kill -9 in the update of step 4 (resumed from step 2's
    checkpoint, whose batch of step 3 was made ahead and sequences are in flight) and SIGINT in the
    update of step 3 (a checkpoint the straight run never took); the killed and stopped runs train
    slower (their update sleeps), so the engine decodes more of the next batch during it."""
    common = TINY + TAIL + ["pipeline.staleness=2", "train.checkpoint_every=2"]
    want = train(load_config(None, common + [f"train.run_dir={tmp_path / 'straight'}"]), keep_state=True)
    a = {r["step"]: r for r in read_metrics(str(tmp_path / "straight" / "metrics.jsonl"))}
    assert sorted(a) == [1, 2, 3, 4, 5, 6]
    for name, stop, sig, left in (("killed", 3, "SIGKILL", [1, 2]), ("stopped", 2, "SIGINT", [1, 2, 3])):
        d = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-c", SIGNALLER, str(stop), sig, *common, f"train.run_dir={d}"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == (-9 if sig == "SIGKILL" else 0), proc.stderr[-3000:]
        assert sorted(r["step"] for r in read_metrics(str(d / "metrics.jsonl")) if r["step"] in left) == left, name
        got = train(load_config(None, common + [f"train.run_dir={d}"]), keep_state=True)
        b = {r["step"]: r for r in read_metrics(str(d / "metrics.jsonl"))}
        assert sorted(b) == sorted(a), name
        assert a[left[-1]]["rollout/in_flight"] > 0  # sequences were in flight at the resumed checkpoint
        for s in a:
            keys = [key for key in a[s] if not key.startswith(SKIP)]
            assert {key: a[s][key] for key in keys} == {key: b[s].get(key) for key in keys}, (name, s)
        for n, tree in want["state"].items():
            for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got["state"][n])):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{name} {n}")
