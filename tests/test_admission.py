"""Continuous admission (rollout.admission=continuous, runtime/admission.py) end to end on a tiny
model, with response lengths forced into a long tail so that sequences run across several weight
updates: the staleness bound holds for every consumed token (checked from the version tags the
sampler gives each token), stale groups are re-queued or dropped and counted, the schedule is a
function of the seeds (two runs are identical), and bad settings are refused by name."""

import os

import pytest
from helpers import SKIP, TINY

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
                "pipeline.microbatches=2",
            ],
            "rollout.admission",
        ),
        (["rollout.forced_lengths=[3,1.0,1,99]"], "rollout.forced_lengths"),  # above max_new_tokens
    ],
)
def test_bad_continuous_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, TINY + overrides)
