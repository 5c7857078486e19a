"""Golden steps: three GRPO and three PPO steps of the tiny model at the default seed, their losses,
KL, rewards, advantages and gradient norms per step and a checksum of the actor's parameters after
the last step, pinned.

Every refactor that is meant to leave the math alone must leave these numbers alone (the same
values came out on JAX 0.10.2 / Python 3.11 and JAX 0.11.2 / Python 3.12 on CPU, 2026-12-04).
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
CASES = {"grpo": TINY + ["rl.kl_coef=0.04"], "ppo": PPO}
GOLDEN = {
    "grpo": {
        "params": {"abs_sum": 1759.8042936528323, "cos_sum": 3.422307553244025},
        "steps": [
            {
                "actor/grad_norm": 0.0,
                "actor/kl": 0.0,
                "actor/loss": 0.0,
                "advantages/max": 0.0,
                "response_length/mean": 5.8125,
                "reward/mean": 0.0,
            },
            {
                "actor/grad_norm": 0.7304800748825073,
                "actor/kl": 0.0,
                "actor/loss": 0.0,
                "advantages/max": 1.499993920326233,
                "response_length/mean": 5.5,
                "reward/mean": 0.03125,
            },
            {
                "actor/grad_norm": 0.7377589344978333,
                "actor/kl": 0.002040197141468525,
                "actor/loss": 8.160043216776103e-05,
                "advantages/max": 1.499993920326233,
                "response_length/mean": 5.75,
                "reward/mean": 0.03125,
            },
        ],
    },
    "ppo": {
        "params": {"abs_sum": 1759.9018577557856, "cos_sum": 3.3091768340554077},
        "steps": [
            {
                "actor/grad_norm": 0.0,
                "actor/kl": 0.0,
                "actor/loss": 0.0,
                "advantages/max": 0.0,
                "critic/grad_norm": 0.0,
                "critic/loss": 0.0,
                "response_length/mean": 5.8125,
                "reward/mean": 0.0,
            },
            {
                "actor/grad_norm": 0.19279418885707855,
                "actor/kl": 0.0,
                "actor/loss": -0.03010319545865059,
                "advantages/max": 0.5,
                "critic/grad_norm": 0.1605250984430313,
                "critic/loss": 0.00669638579711318,
                "response_length/mean": 5.5,
                "reward/mean": 0.03125,
            },
            {
                "actor/grad_norm": 0.177965447306633,
                "actor/kl": 0.0024656166788190603,
                "actor/loss": -0.022651992738246918,
                "advantages/max": 0.5044072270393372,
                "critic/grad_norm": 0.15973080694675446,
                "critic/loss": 0.006521102041006088,
                "response_length/mean": 5.75,
                "reward/mean": 0.03125,
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
