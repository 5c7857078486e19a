"""Continuous admission (rollout.admission=continuous, runtime/rollout/continuous.py) end to end on a tiny
model, with response lengths forced into a long tail so that sequences run across several weight
updates: the staleness bound holds for every consumed token (checked from the version tags the
sampler gives each token), stale groups are re-queued or dropped and counted, the schedule is a
function of the seeds (two runs are identical), and bad settings are refused by name."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import KILLER, SKIP, TINY

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.runtime.metrics import read_metrics
from rpeg_jax.runtime.trainer import train

# A long tail: median 3 tokens, some up to 30, with max_new_tokens 30 (sigma 1.2 in log space).
TAIL = [
    "rollout.max_new_tokens=30",
    "rollout.forced_lengths=[3,1.2,1,30]",
    "rollout.admission=continuous",
    "rollout.on_weight_update=continue",
    "rollout.chunk_steps=4",
    "rollout.min_chunk_steps=4",
    "train.steps=6",
]


def run(tmp_path, name, *extra):
    cfg = load_config(None, TINY + TAIL + [f"train.run_dir={tmp_path / name}", *extra])
    out = train(cfg, keep_state=True)
    return read_metrics(os.path.join(out["run_dir"], "metrics.jsonl")), out


@pytest.mark.parametrize("k", [1, 2])
def test_every_consumed_token_is_within_the_bound_and_tails_cross_updates(tmp_path, k):
    metrics, out = run(tmp_path, f"k{k}", f"pipeline.staleness={k}")
    assert len(metrics) == 6
    for r in metrics:
        assert r["staleness/max"] <= k, r  # trainer version t minus every token's version tag
        assert r["rollout/weights_version"] == r["step"] - 1  # generation reads the newest weights
        assert 0 < r["rollout/occupancy"] <= 1 or r["rollout/decode_steps"] == 0  # 0: the batch was done already
    assert max(r["staleness/max"] for r in metrics) == k  # some groups did run across k updates
    assert sum(r["rollout/requeued"] for r in metrics) > 0  # and some tails could not make it
    assert all(r["rollout/dropped"] == 0 for r in metrics)
    assert any(r["rollout/in_flight"] > 0 for r in metrics)  # sequences outlive their step
    # generate at step t read the actor version t (no buffer ahead): the executor's own record
    assert all(out["consumed"][("generate", t, 0)]["rollout_weights"] == t for t in range(6))


def test_drop_counts_dropped_groups_and_the_schedule_is_reproducible(tmp_path):
    a, _ = run(tmp_path, "a", "pipeline.staleness=1", "rollout.stale_groups=drop")
    b, _ = run(tmp_path, "b", "pipeline.staleness=1", "rollout.stale_groups=drop")
    assert sum(r["rollout/dropped"] for r in a) > 0 and all(r["rollout/requeued"] == 0 for r in a)
    for ra, rb in zip(a, b):  # a function of the seeds and the decode-chunk count, never of timing
        keys = [k for k in ra if not k.startswith(SKIP)]
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["rollout.admission=continuous", "rollout.on_weight_update=continue"], "rollout.admission"),  # k = 0
        (
            ["rollout.admission=continuous", "pipeline.staleness=1", "rollout.on_weight_update=finish"],
            "rollout.on_weight_update",
        ),  # finish would never swap: the engine is never idle
        (
            [
                "rollout.admission=continuous",
                "rollout.on_weight_update=continue",
                "pipeline.staleness=1",
                "pipeline.pieces=2",
            ],
            "rollout.admission",
        ),
        (["rollout.forced_lengths=[3,1.0,1,99]"], "rollout.forced_lengths"),  # above max_new_tokens
    ],
)
def test_bad_continuous_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, TINY + overrides)


# 31 s; the engine's snapshot (test_engine_snapshot) and Ctrl-C under continuous admission (test_interrupts) run by
# default (slow: session 24's trim of the default run)
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_resume_with_sequences_in_flight_is_exact(tmp_path, k):
    """Train 2N steps straight vs N, kill -9, resume to 2N: the same metrics and parameters. The
    checkpoint holds the engine's state (its groups, sequences and the KV of those in flight:
    runtime/rollout/continuous.snapshot), so the resumed run decodes on as the straight one."""
    n = 3
    common = TINY + TAIL + [f"pipeline.staleness={k}", f"train.steps={2 * n}", f"train.checkpoint_every={n}"]
    want = train(load_config(None, common + [f"train.run_dir={tmp_path / 'straight'}"]), keep_state=True)
    crash = tmp_path / "crashed"
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(n), *common, f"train.run_dir={crash}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    got = train(load_config(None, common + [f"train.run_dir={crash}"]), keep_state=True)
    a = {r["step"]: r for r in read_metrics(str(tmp_path / "straight" / "metrics.jsonl"))}
    b = {r["step"]: r for r in read_metrics(str(crash / "metrics.jsonl"))}
    assert sum(a[s]["rollout/in_flight"] for s in a) > 0  # there were sequences in flight to lose
    for s in range(1, 2 * n + 1):
        keys = [key for key in a[s] if not key.startswith(SKIP)]
        assert {key: a[s][key] for key in keys} == {key: b[s].get(key) for key in keys}, s
    for name, tree in want["state"].items():
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got["state"][name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@pytest.mark.parametrize("admission", ["step", "continuous"])
def test_continuous_admission_lays_batches_out_at_the_response_cap(admission):
    """Under continuous admission R = rollout.max_new_tokens whatever the batch's longest response
    (one compiled shape for the training stages); step admission buckets the longest up to 8."""
    from types import SimpleNamespace

    from rpeg_jax.config import load_config
    from rpeg_jax.runtime.rollout.layout import lay_out

    extra = ["pipeline.staleness=1"] if admission == "continuous" else []
    cfg = load_config(None, ["rl.group_size=2", "rollout.max_new_tokens=40", f"rollout.admission={admission}"] + extra)
    ctx = SimpleNamespace(
        cfg=cfg, admission=admission, fixed_shapes=False, placement=SimpleNamespace(put_batch=lambda x: x, gen_count=1)
    )
    rows = [([1, 5, 6], [7] * n, [0.0] * n, [0] * n) for n in (3, 11)]
    host = {"prompt": ["p"], "answer": ["a"], "record": [{}]}
    comps, _, new = lay_out(ctx, rows, np.zeros(2, np.int32), host)
    assert new == 14
    assert comps["response_mask_BxR"].shape == (2, 40 if admission == "continuous" else 16)
