"""A training run on episodes (issue 32 items 4-5): env.name=tools with the calculator on the Qwen2.5 chat
template and tokenizer fixture, step admission, runs and logs the env metrics. (The random tiny model
rarely writes a well-formed call, so this checks the wiring; the masks and logprobs of multi-turn rows are
checked in test_episodes.py and test_episode_masks.py.) Continuous admission with episodes is refused
with one line naming env.name (not wired yet)."""

import json
import os

import numpy as np
import pytest
from helpers import TINY, run

from rpeg_jax.config import load_config
from rpeg_jax.config.base import ConfigError
from rpeg_jax.env import Environment, Episode, StepResult

QWEN = os.path.join(os.path.dirname(__file__), "fixtures", "chat", "qwen2_5")


def data(tmp_path):
    p = tmp_path / "mul.jsonl"
    with open(p, "w") as f:
        for a, b in [(123, 456), (321, 654), (111, 222), (999, 101)]:
            q = f"What is {a}*{b}? Use the calculator."
            f.write(json.dumps({"prompt": q, "answer": str(a * b)}) + "\n")
    return str(p)


def overrides(tmp_path, *more):
    return [
        *TINY,
        f"data.tokenizer={QWEN}/tokenizer.json",
        "data.task=jsonl",
        f"data.path={data(tmp_path)}",
        "model.vocab_size=512",
        "model.max_position_embeddings=1024",
        "data.max_prompt_len=640",  # the prompt with the tool schemas rendered in: ~500 tokens here
        "rollout.max_new_tokens=48",
        "rollout.temperature=1.0",
        "env.name=tools",
        "env.tools=[calculator]",
        *more,
    ]


def test_a_run_on_tool_episodes_logs_env_metrics(tmp_path):
    r = run(tmp_path, "ep", overrides(tmp_path), steps=2)
    assert len(r.metrics) == 2
    for m in r.metrics:
        for k in ("env/turns/mean", "env/tool_calls/mean", "env/tool_errors", "env/truncated", "timing_s/tools"):
            assert np.isfinite(m[k]), (k, m)
        assert m["env/turns/mean"] >= 1


def test_continuous_admission_with_episodes_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="env.name"):
        load_config(None, overrides(tmp_path, "rollout.admission=continuous", "pipeline.staleness=1"))


class ThreeTurns(Environment):
    """Answers every turn with a user message until the third; reward: the third turn's length > 0."""

    def start(self, record):
        return ThreeTurnsEpisode(record, self.prompt_messages(record))


class ThreeTurnsEpisode(Episode):
    def respond(self, turn):
        if self.stats.turns >= 3:
            return StepResult(reward=float(len(turn.ids) % 2), done=True)
        return StepResult(observations=({"role": "user", "content": "Again."},))


def test_a_run_on_three_turn_episodes(tmp_path):
    r = run(
        tmp_path,
        "three",
        overrides(tmp_path, "env.name=test_episode_train:ThreeTurns", "env.tools=[]", "rollout.max_new_tokens=64"),
        steps=2,
    )
    for m in r.metrics:
        # 3 turns unless the 64-token budget (sampled + observations) cut the episode short
        assert 1 < m["env/turns/mean"] <= 3 and m["env/turns/mean"] + m["env/truncated"] * 2 >= 3 - 1e-6, m
        assert np.isfinite(m["actor/pg_loss"])
