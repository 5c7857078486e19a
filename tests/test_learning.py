"""The built-in default run learns: GRPO (configs/default.yaml) and PPO (configs/ppo.yaml) raise
the mean reward by >= 0.3 from the first to the last tenth of the steps, from random init.
Slow (each run is several minutes on 2 cores): `make test-all` or `pytest -m slow`."""

import os
import statistics

import pytest

from rpeg_jax.config import load_config
from rpeg_jax.runtime.metrics import read_metrics
from rpeg_jax.runtime.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["default.yaml", "ppo.yaml"])
def test_default_runs_learn(tmp_path, preset):
    cfg = load_config(
        os.path.join(ROOT, "configs", preset),
        [f"train.run_dir={tmp_path}", "train.progress=false", "train.tensorboard=false"],
    )
    train(cfg)
    rewards = [r["reward/mean"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))]
    assert len(rewards) == cfg.train.steps
    tenth = len(rewards) // 10
    first, last = statistics.mean(rewards[:tenth]), statistics.mean(rewards[-tenth:])
    assert last >= first + 0.3, f"mean reward {first:.3f} (first tenth) -> {last:.3f} (last tenth)"
