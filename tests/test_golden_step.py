"""Golden steps: three GRPO and three PPO steps of the tiny model at train.seed=1, their losses,
KL, rewards, advantages and gradient norms per step and a checksum of the actor's parameters after
the last step, pinned.

Every refactor that is meant to leave the math alone must leave these numbers alone (the values
pinned now came out on JAX 0.10.2 / Python 3.11 on CPU, 2026-12-06, when the sampler's draw became
inversion; the values before them matched on JAX 0.10.2 and 0.11.2 alike).
When a change is MEANT to move them (a new default, a different loss reduction, another random
stream), say so in the commit, run

    RPEG_GOLDEN_PRINT=1 python -m pytest -q -s tests/test_golden_step.py

and paste the printed table over GOLDEN below. A change that moves them by accident is the bug
this file is for.
"""

import json
import os

import jax
import numpy as np
import pytest
from helpers import PPO, TINY, run

KEYS = (
    "actor/loss",
    "actor/kl",
    "actor/grad_norm",
    "reward/mean",
    "advantages/max",
    "response_length/mean",
    "critic/loss",
    "critic/grad_norm",
)
# train.seed=1: at seed 0 the inversion draw (2026-12-06) happens to earn no reward in three steps, so
# no gradient would be pinned; at seed 1 step 2 earns reward and step 3 adds the KL term.
CASES = {"grpo": TINY + ["rl.kl_coef=0.04", "train.seed=1"], "ppo": PPO + ["train.seed=1"]}
GOLDEN = {
    "grpo": {
        "params": {"abs_sum": 1765.423983875062, "cos_sum": 7.598621091986145},
        "steps": [
            {
                "actor/grad_norm": 0.0,
                "actor/kl": 0.0,
                "actor/loss": 0.0,
                "advantages/max": 0.0,
                "response_length/mean": 5.6875,
                "reward/mean": 0.0,
            },
            {
                "actor/grad_norm": 0.6299693584442139,
                "actor/kl": 0.0,
                "actor/loss": 7.450580596923828e-09,
                "advantages/max": 1.4999909400939941,
                "response_length/mean": 6.0,
                "reward/mean": 0.02083333395421505,
            },
            {
                "actor/grad_norm": 0.004076635930687189,
                "actor/kl": 0.0011664151679724455,
                "actor/loss": 4.66566052637063e-05,
                "advantages/max": 0.0,
                "response_length/mean": 6.0,
                "reward/mean": 0.0,
            },
        ],
    },
    "ppo": {
        "params": {"abs_sum": 1765.6987244802117, "cos_sum": 7.609168270935376},
        "steps": [
            {
                "actor/grad_norm": 0.0,
                "actor/kl": 0.0,
                "actor/loss": 0.0,
                "advantages/max": 0.0,
                "critic/grad_norm": 0.0,
                "critic/loss": 0.0,
                "response_length/mean": 5.6875,
                "reward/mean": 0.0,
            },
            {
                "actor/grad_norm": 0.11435377597808838,
                "actor/kl": 0.0,
                "actor/loss": -0.018396396189928055,
                "advantages/max": 0.3333333432674408,
                "critic/grad_norm": 0.10736744105815887,
                "critic/loss": 0.002728156978264451,
                "response_length/mean": 6.0,
                "reward/mean": 0.02083333395421505,
            },
            {
                "actor/grad_norm": 0.015539250336587429,
                "actor/kl": 0.0013314581010490656,
                "actor/loss": 0.009430021047592163,
                "advantages/max": 0.003973672166466713,
                "critic/grad_norm": 0.03841157257556915,
                "critic/loss": 6.0373462474672124e-05,
                "response_length/mean": 6.0,
                "reward/mean": 0.0,
            },
        ],
    },
}


def param_checksums(tree) -> dict[str, float]:
    """Two float64 sums over every parameter: of |p|, and of p weighted by cos(flat index), which a
    permutation, a sign flip or a change of one element moves."""
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
    return {
        "abs_sum": float(sum(np.abs(x).sum() for x in leaves)),
        "cos_sum": float(sum((x.ravel() * np.cos(np.arange(x.size))).sum() for x in leaves)),
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_steps(tmp_path, name):
    r = run(tmp_path, name, CASES[name], steps=3)
    got = {
        "steps": [{k: m[k] for k in KEYS if k in m} for m in r.metrics],
        "params": param_checksums(r.state["actor"]),
    }
    if os.environ.get("RPEG_GOLDEN_PRINT"):
        print(f"\n{name!r}: " + json.dumps(got, indent=4, sort_keys=True))
    want = GOLDEN[name]
    assert [sorted(s) for s in got["steps"]] == [sorted(s) for s in want["steps"]]
    for i, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), f"{name} step {i + 1} {k}"
    # float32 rounding moves the sums by ~3e-9 of abs_sum when the same run is laid out over 1 instead
    # of 8 devices; one element moved by 1e-4 moves them by up to 1e-4
    gp, wp = got["params"], want["params"]
    assert gp["abs_sum"] == pytest.approx(wp["abs_sum"], rel=1e-8), f"{name} params abs_sum"
    assert gp["cos_sum"] == pytest.approx(wp["cos_sum"], abs=2e-5), f"{name} params cos_sum"
