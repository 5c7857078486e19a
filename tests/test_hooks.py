"""Trainer hooks (runtime/hooks.py): the user's callbacks run at their cadence with the step's
record and state; a metrics hook's numbers join the step's record in metrics.jsonl; the built-in
checkpoint and evaluation schedules are unchanged (their own tests: test_evaluation, test_interrupts)."""

import jax
import numpy as np
import pytest
from helpers import TINY, run

from rpeg_jax.runtime.hooks import Hook


def test_hooks_run_at_their_cadence_and_metrics_hooks_join_the_record(tmp_path):
    seen, probes = [], []

    def after(info):
        seen.append((info.step, info.last, "actor/loss" in info.metrics, info.chief))

    def probe(info):
        norm = float(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(info.state("actor"))))
        probes.append(norm)
        return {"my/param_sq": norm}

    # an entropy bonus: the parameters move every step even when no completion earns a reward
    r = run(
        tmp_path,
        "hooks",
        TINY + ["rl.entropy_coef=0.01"],
        steps=5,
        hooks=[Hook(after, every=2, at_end=True), Hook(probe, every=3, metrics=True)],
    )
    assert seen == [(2, False, True, True), (4, False, True, True), (5, True, True, True)]
    with_probe = {m["step"]: m["my/param_sq"] for m in r.metrics if "my/param_sq" in m}
    assert list(with_probe) == [3] and with_probe[3] == pytest.approx(probes[0])
    final = float(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(r.state["actor"])))
    assert probes[0] != pytest.approx(final)  # read at step 3, not the final parameters


def test_a_bad_cadence_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Hook my_hook: every=-1"):
        Hook(lambda info: None, every=-1, name="my_hook")
