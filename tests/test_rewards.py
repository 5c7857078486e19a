"""Rewards: task rewards against hand-worked scores, math_answer, the registry, errors in rewards."""

import math
import textwrap

import numpy as np
import pytest

from rpeg_jax.config import ConfigError, DataConfig, load_config
from rpeg_jax.data.pipeline import PromptBatch
from rpeg_jax.data.rewards import RewardError, Sample, get_reward, make_samples, register_reward, resolve_reward, score
from rpeg_jax.data.tokenizer import CharTokenizer


def _s(completion, answer, prompt="p"):
    return Sample(prompt=prompt, completion=completion, completion_ids=(), answer=answer)


# (reward, answer, completion, hand-computed score)
CASES = [
    ("reverse", "321", "321", 1.0),
    ("reverse", "321", "3x1", 2 / 3),  # positions 0 and 2 right
    ("reverse", "321", "12", 1 / 3),  # '1'!='3', '2'=='2', position 2 missing
    ("reverse", "321", "3219999", 1.0),  # text after the answer's length is ignored
    ("reverse", "321", "", 0.0),
    ("reverse", "4455", " 4455", 2 / 4),  # shifted: ' '/'4' no, '4'/'4' yes, '4'/'5' no, '5'/'5' yes
    ("sort", "0112", "0121", 2 / 4),
    ("copy", "907", "9o7", 2 / 3),
    ("add", "46", "46", 1.0),
    ("add", "46", "467", 1.0),  # "starts with the sum" (bench/WORKLOADS.md R1)
    ("add", "46", "4", 0.0),
    ("add", "46", " 46", 0.0),
    ("add", "100", "10", 0.0),
]


@pytest.mark.parametrize("name,answer,completion,want", CASES)
def test_task_rewards_by_hand(name, answer, completion, want):
    assert get_reward(name)(_s(completion, answer)) == pytest.approx(want, abs=1e-12)


MATH = [
    ("Half of 10 is 5.\n#### 5", "She has 5 left.\n#### 5", 1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("I get 1,000 in total", "#### 1000", 1.0),
    ("#### 999", "#### 1000", 0.0),
    ("nothing", "#### 3", 0.0),
]


@pytest.mark.parametrize("completion,answer,want", MATH)
def test_math_answer(completion, answer, want):
    assert get_reward("math_answer")(_s(completion, answer)) == want


def test_make_samples_groups_and_eos():
    tok = CharTokenizer()
    batch = PromptBatch(
        step=0,
        epoch=0.0,
        ids=("a", "b"),
        prompts=("r12=", "r34="),
        prompt_tokens=((1,), (1,)),
        answers=("21", "43"),
        records=({"task": "reverse"}, {"task": "reverse"}),
    )
    enc = tok.encode
    completions = [
        enc("21") + [2, 50, 50],
        enc("2") + [0, 0, 0, 0],  # prompt 0, G=2 ('0' pad ids dropped)
        enc("43") + [2] + [0, 0],
        enc("4x") + [49, 2, 0],
    ]  # prompt 1
    samples = make_samples(batch.prompts, batch.answers, batch.records, completions, tok, group_size=2)
    assert [s.prompt for s in samples] == ["r12=", "r12=", "r34=", "r34="]
    assert [s.completion for s in samples] == ["21", "2", "43", "4x1"]
    assert samples[0].completion_ids == (50, 49) and samples[2].record == {"task": "reverse"}
    rewards, errors = score(samples, "reverse")
    np.testing.assert_allclose(rewards, [1.0, 0.5, 1.0, 0.5])  # "2" vs "21": 1/2; "4x1" vs "43": 1/2
    assert rewards.dtype == np.float32 and errors == 0
    cut = make_samples(
        batch.prompts, batch.answers, batch.records, completions, tok, group_size=2, lengths=[1, 1, 2, 1]
    )
    assert [s.completion for s in cut] == ["2", "2", "43", "4"]
    with pytest.raises(ValueError, match="3 completions for 2 prompts x group 2"):
        make_samples(batch.prompts, batch.answers, batch.records, completions[:3], tok, group_size=2)


def _flaky(sample):
    if sample.completion == "boom":
        raise KeyError("boom")
    if sample.completion == "nan":
        return math.nan
    return 1.0


def test_score_counts_errors_or_stops():
    samples = [_s("ok", "1"), _s("boom", "1"), _s("nan", "1"), _s("ok", "1")]
    rewards, errors = score(samples, _flaky, on_error="zero")
    np.testing.assert_array_equal(rewards, [1.0, 0.0, 0.0, 1.0])
    assert errors == 2
    with pytest.raises(RewardError, match=r"reward 'flaky' failed on sample 1 .*KeyError"):
        score(samples, _flaky, on_error="stop", name="flaky")
    with pytest.raises(RewardError, match=r"sample 0 .*needs the record's answer"):
        score([_s("1", None)], "add", on_error="stop")


def test_registry_and_user_module(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"data.reward='revrse'.*did you mean 'reverse'"):
        get_reward("revrse")
    with pytest.raises(ConfigError, match=r"plugins='reverse'.*reward 'reverse' is registered twice: by rpeg_jax"):
        register_reward("reverse")(lambda s: 0.0)
    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent("""
        from rpeg_jax.data.rewards import register_reward

        @register_reward("test_length_reward")
        def length(sample):
            return len(sample.completion) / 10
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["plugins=[my_rewards_mod]", "data.reward=test_length_reward"])  # imported with the config
    name, fn = resolve_reward(cfg.data)
    assert name == "test_length_reward" and fn(_s("abcd", None)) == 0.4
    with pytest.raises(ConfigError, match=r"plugins\[0\]='no_such_mod_xyz'.*cannot import"):
        load_config(None, ["plugins=[no_such_mod_xyz]"])
    # a module:function reference needs no plugin entry
    assert get_reward("my_rewards_mod:length") is fn
    with pytest.raises(ConfigError, match=r"data.reward='my_rewards_mod:nope'.*cannot load"):
        get_reward("my_rewards_mod:nope")
    # the old keys name the new one
    for old in ("data.reward_modules=[my_rewards_mod]", "sharding.plugins=[my_rewards_mod]"):
        with pytest.raises(ConfigError, match=r"moved: list the modules in the top-level `plugins:`"):
            load_config(None, [old])


def test_default_reward_per_task():
    assert resolve_reward(DataConfig(task="sort"))[0] == "sort"
    assert resolve_reward(DataConfig(task="jsonl", path="x.jsonl"))[0] == "math_answer"
    assert resolve_reward(DataConfig(task="add", reward="math_answer"))[0] == "math_answer"
