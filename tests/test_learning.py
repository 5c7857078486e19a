"""The built-in default run learns: GRPO (configs/default.yaml) and PPO (configs/ppo.yaml) raise
the mean reward by >= 0.3 from the first to the last tenth of the steps, from random init; GRPO with
LoRA adapters (configs/lora.yaml) by RISE["lora.yaml"]: on this random base the frozen embedding and
unembedding cap what the adapters can reach (bench/NOTES.md, 2026-12-05 session 20); the Qwen3-MoE
preset (configs/moe_tiny.yaml: 4 experts top-2, routing replay, an entropy bonus) by 0.3 as well; the agentic
preset (configs/agentic.yaml: SFT, then GRPO on calculator episodes) by >= 0.3 over its RL run
(SFT stops on sft.stop_loss, then GRPO with a 10-step warmup; bench/NOTES.md session 24).
Slow (each run is several minutes on 2 cores): `make test-all` or `pytest -m slow`."""

import os
import statistics

import pytest

from rpeg_jax.config import load_config
from rpeg_jax.runtime.metrics import read_metrics
from rpeg_jax.runtime.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


RISE = {"default.yaml": 0.3, "ppo.yaml": 0.3, "lora.yaml": 0.1, "moe_tiny.yaml": 0.3}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["default.yaml", "ppo.yaml", "lora.yaml", "moe_tiny.yaml"])
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
    assert last >= first + RISE[preset], f"mean reward {first:.3f} (first tenth) -> {last:.3f} (last tenth)"


@pytest.mark.slow
def test_agentic_preset_learns(tmp_path, monkeypatch):
    """configs/agentic.yaml as `make run` runs it (train.mode=sft_then_rl): SFT on the calculator
    transcripts, then GRPO on tool episodes from the exported SFT policy; the RL run's train reward rises
    by >= 0.3 from its first to its last tenth (issue 32's target), and its episodes call the tool."""
    from rpeg_jax.runtime import sft

    monkeypatch.chdir(ROOT)  # the preset's paths are relative to the repository
    cfg = load_config(
        os.path.join(ROOT, "configs", "agentic.yaml"),
        [f"train.run_dir={tmp_path}", "train.progress=false", "train.tensorboard=false"],
    )
    sft.sft_then_rl(cfg, train)
    rows = [r for r in read_metrics(str(tmp_path / "rl" / "metrics.jsonl")) if r["step"] >= 1]  # step 0: eval only
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == cfg.train.steps
    tenth = len(rewards) // 10
    first, last = statistics.mean(rewards[:tenth]), statistics.mean(rewards[-tenth:])
    assert last >= first + 0.3, f"mean reward {first:.3f} (first tenth) -> {last:.3f} (last tenth)"
    assert statistics.mean(r["env/tool_calls/mean"] for r in rows[-tenth:]) >= 0.9  # the answers use the tool
