"""A training run on episodes (issue 32 items 4-5): env.name=tools with the calculator on the Qwen2.5 chat
template and tokenizer fixture, step admission, runs and logs the env metrics. (The random tiny model
rarely writes a well-formed call, so this checks the wiring; the masks and logprobs of multi-turn rows are
checked in test_episodes.py and test_episode_masks.py.) Episodes run under continuous admission too,
and a resume with episodes in flight is exact; dynamic sampling with episodes is refused with one line
naming env.name (not wired yet). Episode prompts (tool schemas rendered) are checked against
data.max_prompt_len before anything compiles."""

import json
import os
import subprocess
import sys

import jax
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


def test_dynamic_sampling_with_episodes_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="env.name"):
        load_config(None, overrides(tmp_path, "rl.filter_groups=zero_variance"))


def test_episode_prompts_with_tool_schemas_must_fit_max_prompt_len(tmp_path, monkeypatch):
    """The data pipeline checks each prompt as the chat template renders it without tools (~80 tokens
    here); an episode's first prompt renders the tool schemas too (~420 tokens). A data.max_prompt_len
    between the two is one line naming the key and the value, before the models are built (nothing
    compiled), for the training data and for the eval file."""
    import rpeg_jax.runtime.setup as setup
    from rpeg_jax.runtime.evaluation import Evaluator

    def no_models(*a, **k):
        raise AssertionError("the models were built before the episode prompts were checked")

    monkeypatch.setattr(setup, "build_models", no_models)
    why = r"config error: data.max_prompt_len=160: episode prompts render the tool schemas: record .* is \d+ tokens"
    with pytest.raises(ConfigError, match=why):
        run(tmp_path, "long", overrides(tmp_path, "data.max_prompt_len=160"), steps=1)
    cfg = load_config(None, overrides(tmp_path, "data.max_prompt_len=160", f"eval.path={data(tmp_path)}"))
    with pytest.raises(ConfigError, match=why):
        Evaluator.for_run(cfg)
    # the pipeline's own check passes: the records fit without the schemas
    from rpeg_jax.data.pipeline import build_pipeline

    build_pipeline(cfg, shard_index=0, shard_count=1)


class ThreeTurns(Environment):
    """Answers every turn with a user message until the third; reward: the third turn's length > 0."""

    def start(self, record):
        return ThreeTurnsEpisode(record, self.prompt_messages(record))


class ThreeTurnsEpisode(Episode):
    def respond(self, turn):
        if self.stats.turns >= 3:
            return StepResult(reward=float(len(turn.ids) % 2), done=True)
        return StepResult(observations=({"role": "user", "content": "Again."},))


# 3-turn episodes with a 160-token budget (sampled + observations). The random model ends a turn by
# sampling a stop id (~1 in 300 tokens): with 64 tokens all 16 episodes of a step were sometimes cut in
# their first turn (env/turns/mean 1.0, seen after the sampling stream changed); with 160, ~2e-4 a step.
THREE_TURNS = ["env.name=test_episode_train:ThreeTurns", "env.tools=[]", "rollout.max_new_tokens=160"]


# 22 s; test_a_run_on_tool_episodes_logs_env_metrics runs multi-turn episodes by default (slow: session 24's trim of
# the default run)
@pytest.mark.slow
def test_a_run_on_three_turn_episodes(tmp_path):
    r = run(
        tmp_path,
        "three",
        overrides(tmp_path, *THREE_TURNS),
        steps=2,
    )
    for m in r.metrics:
        # 3 turns unless the 160-token budget (sampled + observations) cut the episode short
        assert 1 < m["env/turns/mean"] <= 3 and m["env/turns/mean"] + m["env/truncated"] * 2 >= 3 - 1e-6, m
        assert np.isfinite(m["actor/pg_loss"])


CONTINUOUS = [
    *THREE_TURNS,
    "rollout.admission=continuous",
    "rollout.on_weight_update=continue",
    "pipeline.staleness=1",
    "rollout.chunk_steps=4",
    "rollout.min_chunk_steps=4",
]


# 39 s; episodes train by default in test_a_run_on_tool_episodes_logs_env_metrics (slow: session 24's trim of the
# default run)
@pytest.mark.slow
def test_continuous_admission_runs_episodes_and_resumes_exactly(tmp_path):
    """Episodes under rollout.admission=continuous (runtime/rollout/continuous.py: turn ends applied
    before the next decode chunk, observations appended to the paused KV): 3-turn episodes train, and
    2N steps straight equal N steps, kill -9, resume to 2N (the same metrics, env/* included, and
    parameters) with episodes in flight at the checkpoint (replayed through the environment on restore)."""
    from helpers import KILLER, SKIP

    from rpeg_jax.runtime.metrics import read_metrics
    from rpeg_jax.runtime.trainer import train

    n = 2
    common = overrides(tmp_path, *CONTINUOUS, f"train.steps={2 * n}", f"train.checkpoint_every={n}")
    want = train(load_config(None, common + [f"train.run_dir={tmp_path / 'straight'}"]), keep_state=True)
    crash = tmp_path / "crashed"
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(n), *common, f"train.run_dir={crash}"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    got = train(load_config(None, common + [f"train.run_dir={crash}"]), keep_state=True)
    a = {r["step"]: r for r in read_metrics(str(tmp_path / "straight" / "metrics.jsonl"))}
    b = {r["step"]: r for r in read_metrics(str(crash / "metrics.jsonl"))}
    assert a[n]["rollout/in_flight"] > 0  # episodes in flight at the checkpoint
    for s in range(1, 2 * n + 1):
        assert 1 < a[s]["env/turns/mean"] <= 3 and np.isfinite(a[s]["actor/pg_loss"]), a[s]
        keys = [k for k in a[s] if not k.startswith(SKIP)]
        assert {k: a[s][k] for k in keys} == {k: b[s].get(k) for k in keys}, s
    for name, tree in want["state"].items():
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got["state"][name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
