"""Environments, episodes and their tokens (rpeg_jax/env): the single-turn environment gives today's rewards
(the reward stage's scoring path, on the same completions); a tool-using episode's prompt, turns and
observations are exactly the chat template's rendering of the conversation (Qwen2.5 fixture); errors
become observations and are counted; limits end episodes; an environment of one's own plugs in by
module:Class; the runner runs turn ends concurrently, bounded, and its metrics have the runtime's names."""

import json
import os
import shutil
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.env import BUILTIN_ENVS, BUILTIN_PARSERS
from rpeg_jax.data.chat import load_prompt_format
from rpeg_jax.data.pipeline import build_pipeline
from rpeg_jax.data.rewards import RewardError, register_reward, resolve_reward
from rpeg_jax.data.tokenizer import HFTokenizer
from rpeg_jax.env import ENVIRONMENTS, Environment, EnvRunner, Episode, StepResult, Tool, ToolResult
from rpeg_jax.env.parsers import PARSERS
from rpeg_jax.env.session import SessionError, TurnCodec
from rpeg_jax.runtime.rollout.scoring import score_rows

QWEN = os.path.join(os.path.dirname(__file__), "fixtures", "chat", "qwen2_5")
METRICS = {"env/turns/mean", "env/tool_calls/mean", "env/tool_errors", "env/truncated", "timing_s/tools"}


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def qwen_cfg(*overrides):
    return load_config(
        None,
        [
            f"data.tokenizer={QWEN}/tokenizer.json",
            "data.task=jsonl",
            "data.path=unused.jsonl",
            "data.max_prompt_len=256",
            "rollout.max_new_tokens=128",
            "env.name=tools",
            "env.tools=[calculator, test_env_episodes:Echo, test_env_episodes:Boom]",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def qwen_tok():
    return HFTokenizer(os.path.join(QWEN, "tokenizer.json"))


def record(question="What is 6*7?", answer="42", **extra):
    return {"id": "r1", "prompt": question, "prompt_messages": [{"role": "user", "content": question}],
            "answer": answer, **extra}  # fmt: skip


class Echo(Tool):
    name = "echo"
    description = "Repeat the text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def run(self, arguments):
        return ToolResult(arguments["text"])


class Boom(Tool):
    name = "boom"
    description = "Always fails."

    def run(self, arguments):
        raise RuntimeError("kaboom")


class Slow(Tool):
    """Sleeps; records how many calls ran at once."""

    name = "slow"
    description = "Wait a moment."
    lock = threading.Lock()
    running = 0
    most = 0

    def run(self, arguments):
        with Slow.lock:
            Slow.running += 1
            Slow.most = max(Slow.most, Slow.running)
        time.sleep(0.3)
        with Slow.lock:
            Slow.running -= 1
        return ToolResult("done")


def test_built_in_names_are_the_configs():
    assert set(ENVIRONMENTS) == set(BUILTIN_ENVS)
    assert {"auto", *PARSERS} == set(BUILTIN_PARSERS)


# ---- single turn: today's rewards --------------------------------------------------------------------


@register_reward("test_env_record_reward", overwrite=True)
def record_reward(sample):
    """Depends on every field of the Sample, so a difference in any of them shows."""
    exact = float(sample.completion == sample.answer)
    extra = len(json.dumps(sample.record, sort_keys=True)) % 7 / 100 + len(sample.prompt) / 1000
    return exact + extra + len(sample.completion_ids) / 10000


@pytest.mark.parametrize("reward", [None, "test_env_record_reward"])
def test_single_turn_gives_the_rewards_of_todays_scoring_path(reward):
    overrides = ["rollout.max_new_tokens=8", "rollout.stop_token_ids=[10]", "data.prompts_per_step=4"]
    cfg = load_config(None, overrides + ([f"data.reward={reward}"] if reward else []))
    assert cfg.env.name == "single_turn"
    pipe = build_pipeline(cfg, shard_index=0, shard_count=1)
    tok, batch, G = pipe.tokenizer, next(pipe), 3
    R = cfg.rollout.max_new_tokens
    rows, lengths = [], []
    for b in range(len(batch) * G):
        answer = [ord(c) for c in batch.answers[b // G]]
        kind = b % G
        if kind == 0:  # the right answer, eos, junk after it
            ids = answer + [tok.eos_id] + [50] * R
        elif kind == 1:  # a wrong answer cut by the stop id 10 ("\n")
            ids = [ord("9")] + answer + [10] + answer
        else:  # the right answer then more digits, truncated by the length
            ids = answer + [ord("1")] * R
        rows.append((ids + [0] * R)[:R])
        lengths.append(min(len(ids), R))
    tokens, lengths = np.array(rows, np.int64), np.array(lengths)
    name, fn = resolve_reward(cfg.data)
    ctx = SimpleNamespace(cfg=cfg, tokenizer=tok, reward_fn=fn, reward_name=name)
    host = {
        "prompt": [batch.prompts[b // G] for b in range(len(rows))],
        "answer": [batch.answers[b // G] for b in range(len(rows))],
        "record": [batch.records[b // G] for b in range(len(rows))],
    }
    today, errors, _ = score_rows(ctx, tokens, lengths, host)

    runner = EnvRunner.build(cfg, tok)
    assert runner.stop_strings == () and runner.stop_token_ids == ()
    got = []
    for b in range(len(rows)):
        s = runner.start(batch.record(b // G))
        assert s.prompt_ids == list(batch.prompt_tokens[b // G])  # the pipeline's prompt, as today
        out = s.end_turn(tokens[b, : lengths[b]].tolist(), "length" if b % G == 2 else "stop")
        assert out.done and out.observation_ids == () and s.stats.turns == 1
        got.append(out.reward)
    runner.close()
    assert errors == 0
    np.testing.assert_array_equal(np.array(got, np.float32), today)
    assert len(set(today.tolist())) > 1  # not all equal: a mismatch in any row would show


# ---- a tool-using episode in tokens --------------------------------------------------------------------


def test_a_tool_episode_is_the_templates_rendering_of_its_conversation(qwen_tok):
    cfg = qwen_cfg()
    runner = EnvRunner.build(cfg, qwen_tok)
    assert runner.stop_strings == ("</tool_call>",)
    s = runner.start(record())
    fmt = load_prompt_format(cfg.data)
    schemas = s.episode.tools
    assert [t["function"]["name"] for t in schemas] == ["calculator", "echo", "boom"]
    first = [{"role": "user", "content": "What is 6*7?"}]
    assert s.prompt_ids == qwen_tok.encode(fmt.template.render(first, tools=schemas))
    assert "<tools>" in qwen_tok.decode(s.prompt_ids)

    turn1 = "I will compute.\n" + call("calculator", expression="6*7")  # ended at the call close
    out = runner.submit(s, qwen_tok.encode(turn1), "call").result()
    assert not out.done and out.reward == 0.0
    assert qwen_tok.decode(list(out.observation_ids)) == "\nuser\n<tool_response>\n42\n</tool_response>\nassistant\n"
    assert out.observation_ids[0] == qwen_tok.eos_id  # <|im_end|> closes the turn: written by the env
    turn2 = qwen_tok.encode("The answer is 42.") + [qwen_tok.eos_id]
    out = runner.submit(s, turn2, "stop").result()
    assert out.done and out.observation_ids == () and out.reward == 1.0 and s.total_reward == 1.0

    conversation = [
        *first,
        {"role": "assistant", "content": turn1},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
    ]
    whole = qwen_tok.encode(fmt.template.render(conversation, add_generation_prompt=False, tools=schemas))
    seq = s.prompt_ids + s.response_ids()
    assert seq == whole[: len(seq)] and qwen_tok.decode(whole[len(seq) :]) == "\n"  # all but the final newline
    mask = s.response_mask()
    assert len(mask) == len(s.response_ids()) and sum(mask) == len(qwen_tok.encode(turn1)) + len(turn2)
    assert mask[len(qwen_tok.encode(turn1))] == 0  # the first observation token is not trained on
    st = s.stats
    assert (st.turns, st.tool_calls, st.tool_errors, st.truncated) == (2, 1, 0, False)
    m = runner.metrics([st])
    assert set(m) == METRICS and m["env/turns/mean"] == 2 and m["env/tool_calls/mean"] == 1
    assert m["timing_s/tools"] > 0
    runner.close()


def test_a_tool_episode_equals_transformers_rendering_token_by_token(qwen_tok):
    """The independent reference: transformers' own apply_chat_template(..., tools=[calculator]) of
    the same conversation (tests/fixtures/make_tools_fixture.py -> chat/expected_tools.json): the
    prompt, every token of the episode (two calls in two turns, the tool's outputs, the answer) and
    the loss mask, which is 1 exactly on each assistant message's tokens in transformers'
    rendering (its header and the <|im_end|> after a call are the environment's; the final
    <|im_end|> is the model's eos)."""
    with open(os.path.join(os.path.dirname(__file__), "fixtures", "chat", "expected_tools.json")) as f:
        ref = json.load(f)
    runner = EnvRunner.build(qwen_cfg("env.tools=[calculator]"), qwen_tok)
    conv = ref["conversation"]
    s = runner.start(record(conv[0]["content"], "43"))
    assert s.episode.tools == ref["tools"]  # the schema the fixture rendered is the calculator's own
    assert s.prompt_ids == ref["prefix_gen"][0]
    turns = [m["content"] for m in conv if m["role"] == "assistant"]
    for i, text in enumerate(turns):
        last = i == len(turns) - 1
        out = runner.submit(s, qwen_tok.encode(text) + [qwen_tok.eos_id] * last, "stop" if last else "call").result()
        assert out.done == last
    assert out.reward == 1.0 and s.stats.tool_calls == 2 and s.stats.turns == 3
    seq, whole = s.prompt_ids + s.response_ids(), ref["prefix"][-1]
    assert seq == whole[: len(seq)] and qwen_tok.decode(whole[len(seq) :]) == "\n"  # all but the final newline
    want = [0] * len(whole)
    for k, m in enumerate(conv):
        if m["role"] == "assistant":
            start, end = len(ref["prefix_gen"][k - 1]), len(ref["prefix"][k]) - 2  # before "<|im_end|>\n"
            tail = ref["prefix"][k][end:]
            assert tail[0] == qwen_tok.eos_id and qwen_tok.decode(tail[1:]) == "\n"  # <|im_end|>, newline
            want[start : end + (k == len(conv) - 1)] = [1] * (end - start + (k == len(conv) - 1))
    got = [0] * len(s.prompt_ids) + list(s.response_mask())
    assert got == want[: len(seq)]
    assert sum(got) == sum(len(qwen_tok.encode(t)) for t in turns) + 1
    runner.close()


def test_a_turn_ended_by_eos_makes_every_call_and_eos_is_not_repeated(qwen_tok):
    runner = EnvRunner.build(qwen_cfg("env.stop_at_call=false"), qwen_tok)
    assert runner.stop_strings == () and runner.stop_token_ids == ()
    s = runner.start(record())
    text = "Two calls.\n" + call("calculator", expression="2+3") + "\n" + call("echo", text="hello")
    ids = qwen_tok.encode(text) + [qwen_tok.eos_id]
    out = runner.end_turn(s, ids, "stop")
    obs = qwen_tok.decode(list(out.observation_ids))
    assert obs == "\nuser\n<tool_response>\n5\n</tool_response>\n<tool_response>\nhello\n</tool_response>\nassistant\n"
    assert out.observation_ids[0] != qwen_tok.eos_id  # the policy sampled <|im_end|> already
    assert [m["role"] for m in s.episode.messages[-2:]] == ["tool", "tool"]
    assert s.stats.tool_calls == 2


def test_errors_become_observations_and_are_counted(qwen_tok):
    runner = EnvRunner.build(qwen_cfg("env.stop_at_call=false", "env.max_tool_calls=20"), qwen_tok)
    s = runner.start(record())
    text = (
        call("nope", x=1)  # unknown tool
        + call("calculator", expr="1")  # bad arguments
        + "<tool_call>\n{not json}\n</tool_call>"  # malformed JSON
        + call("boom")  # the tool raises
        + call("calculator", expression="1/0")  # the tool fails
        + '<tool_call>\n{"name": "calculator", "arguments": {"expr'  # unclosed: the turn ended inside a call
    )
    out = runner.end_turn(s, qwen_tok.encode(text) + [qwen_tok.eos_id], "stop")
    assert not out.done
    results = [m["content"] for m in s.episode.messages if m["role"] == "tool"]
    assert len(results) == 6 and all(r.startswith("Error: ") for r in results), results
    assert "unknown tool 'nope'; the tools are: boom, calculator, echo" in results[0]
    assert "missing required argument(s): expression" in results[1]
    assert "not valid JSON" in results[2] and "kaboom" in results[3] and "division by zero" in results[4]
    assert "not closed" in results[5]
    st = s.stats
    assert st.tool_calls == 6 and st.tool_errors == 6
    assert dict(st.errors) == {
        "unknown_tool": 1,
        "bad_arguments": 1,
        "malformed_json": 1,
        "exception": 1,
        "failed": 1,
        "unclosed": 1,
    }
    assert runner.metrics([st])["env/tool_errors"] == 6


def test_limits_end_episodes_as_truncated(qwen_tok):
    runner = EnvRunner.build(qwen_cfg("env.max_turns=2", "env.max_tool_calls=8"), qwen_tok)
    s = runner.start(record())
    turn = qwen_tok.encode(call("echo", text="x"))
    assert not runner.end_turn(s, turn, "call").done
    out = runner.end_turn(s, turn, "call")  # turn 2 of 2: not answered
    assert out.done and s.stats.truncated and s.stats.tool_calls == 1 and out.reward == 0.0

    runner = EnvRunner.build(qwen_cfg("env.max_tool_calls=1", "env.stop_at_call=false"), qwen_tok)
    s = runner.start(record())
    out = runner.end_turn(s, qwen_tok.encode(call("echo", text="a") + call("echo", text="b")), "stop")
    assert out.done and s.stats.truncated and s.stats.tool_calls == 0  # the calls would pass the budget: none ran

    s = runner.start(record())
    out = runner.end_turn(s, qwen_tok.encode("The answer is 42. " + call("echo", text="a")[:20]), "length")
    assert out.done and s.stats.truncated and s.stats.tool_calls == 0 and out.reward == 1.0  # scored as today
    assert runner.metrics([s.stats])["env/truncated"] == 1.0


def test_a_records_own_tools(qwen_tok):
    runner = EnvRunner.build(qwen_cfg(), qwen_tok)
    custom = {"type": "function", "function": {"name": "echo", "description": "Say it back.", "parameters": {}}}
    s = runner.start(record(tools=["calculator", custom]))
    assert s.episode.tools == [runner.env.tools["calculator"].schema(), custom]
    assert "Say it back." in qwen_tok.decode(s.prompt_ids)
    runner.end_turn(s, qwen_tok.encode(call("boom")), "call")  # configured, but not offered by this record
    assert s.stats.errors["unknown_tool"] == 1
    with pytest.raises(ValueError, match="not among env.tools"):
        runner.start(record(tools=["weather"]))


# ---- tokens of a tokenizer that has the call tags as tokens of their own ---------------------------------


def _tagged_tokenizer(tmp_path, special):
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(os.path.join(QWEN, "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.save(str(tmp_path / "tokenizer.json"))
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(QWEN, f), tmp_path)
    return HFTokenizer(str(tmp_path / "tokenizer.json"))


def test_the_call_close_as_one_token_is_a_stop_id(tmp_path, qwen_tok):
    tok = _tagged_tokenizer(tmp_path, special=False)  # Qwen2.5 and Qwen3 have them so
    close = tok.encode("</tool_call>")
    assert len(close) == 1
    runner = EnvRunner.build(qwen_cfg(f"data.tokenizer={tmp_path}/tokenizer.json"), tok)
    assert runner.stop_token_ids == tuple(close) and runner.stop_strings == ("</tool_call>",)
    s = runner.start(record())
    out = runner.end_turn(s, tok.encode(call("calculator", expression="2**5")), "call")
    assert "32" in tok.decode(list(out.observation_ids))


def test_call_tags_the_tokenizer_drops_are_refused(tmp_path):
    tok = _tagged_tokenizer(tmp_path, special=True)  # decode(skip_special_tokens) would hide every call
    with pytest.raises(SessionError, match="does not decode"):
        EnvRunner.build(qwen_cfg(f"data.tokenizer={tmp_path}/tokenizer.json"), tok)


# ---- environments of one's own, failures, the runner --------------------------------------------------


class Guess(Environment):
    """The docs' example (docs/agentic.md): guess the answer, told "try again" until right."""

    def start(self, record):
        return GuessEpisode(record, self.prompt_messages(record))


class GuessEpisode(Episode):
    def respond(self, turn):
        if turn.text.strip() == self.record["answer"]:
            return StepResult(reward=1.0, done=True)
        if self.stats.turns >= 3:
            return StepResult(done=True)
        return StepResult(observations=({"role": "user", "content": "No, try again."},))


class Broken(Environment):
    def start(self, record):
        return BrokenEpisode(record, self.prompt_messages(record))


class BrokenEpisode(Episode):
    def respond(self, turn):
        raise KeyError("a bug in the environment")


def test_an_environment_of_ones_own(qwen_tok):
    cfg = qwen_cfg("env.name=test_env_episodes:Guess", "env.tools=[]")
    runner = EnvRunner.build(cfg, qwen_tok)
    s = runner.start(record())
    assert s.episode.tools is None and s.prompt_ids == qwen_tok.encode(
        load_prompt_format(cfg.data).template.render([{"role": "user", "content": "What is 6*7?"}])
    )
    out = runner.end_turn(s, qwen_tok.encode("41") + [qwen_tok.eos_id], "stop")
    assert qwen_tok.decode(list(out.observation_ids)) == "\nuser\nNo, try again.\nassistant\n"
    out = runner.end_turn(s, qwen_tok.encode("42") + [qwen_tok.eos_id], "stop")
    assert out.done and s.rewards == [0.0, 1.0] and s.stats.turns == 2


def test_a_failing_environment_ends_only_its_episode(qwen_tok):
    runner = EnvRunner.build(qwen_cfg("env.name=test_env_episodes:Broken", "env.tools=[]"), qwen_tok)
    s = runner.start(record())
    out = runner.submit(s, qwen_tok.encode("hi"), "stop").result()
    assert out.done and out.reward == 0.0 and "a bug in the environment" in out.info["error"]
    assert s.stats.errors["env_exception"] == 1 and s.stats.truncated and s.done


def test_a_reward_that_must_stop_the_run_still_does(qwen_tok):
    @register_reward("test_env_failing_reward", overwrite=True)
    def failing(sample):
        raise ValueError("no")

    runner = EnvRunner.build(qwen_cfg("data.reward=test_env_failing_reward", "data.reward_on_error=stop"), qwen_tok)
    with pytest.raises(RewardError):
        runner.end_turn(runner.start(record()), qwen_tok.encode("42"), "stop")
    runner = EnvRunner.build(qwen_cfg("data.reward=test_env_failing_reward"), qwen_tok)
    s = runner.start(record())
    assert runner.end_turn(s, qwen_tok.encode("42"), "stop").reward == 0.0 and s.stats.reward_errors == 1


def test_the_runner_runs_turn_ends_concurrently_and_bounded(qwen_tok):
    Slow.most = 0
    cfg = qwen_cfg("env.tools=[test_env_episodes:Slow]", "env.max_concurrent_tools=2")
    runner = EnvRunner.build(cfg, qwen_tok)
    sessions = [runner.start(record()) for _ in range(6)]
    t0 = time.perf_counter()
    futures = [runner.submit(s, qwen_tok.encode(call("slow")), "call") for s in sessions]
    submitted = time.perf_counter() - t0
    outs = [f.result(timeout=30) for f in futures]
    wall = time.perf_counter() - t0
    assert submitted < 0.2  # submit never waits for a tool
    assert all(not o.done and "done" in qwen_tok.decode(list(o.observation_ids)) for o in outs)
    assert Slow.most == 2  # bounded by env.max_concurrent_tools, and used
    assert 0.85 <= wall < 1.8  # three waves of two 0.3 s calls
    m = runner.metrics([s.stats for s in sessions])
    assert set(m) == METRICS and m["env/tool_calls/mean"] == 1
    assert 0.85 <= m["timing_s/tools"] <= wall + 0.05  # wall time with a call in flight, not the 1.8 s sum
    assert runner.busy_s() == pytest.approx(0.0, abs=1e-6)  # metrics() reset it
    runner.close()


def test_tools_need_a_template_and_a_parser(qwen_tok):
    from rpeg_jax.data.tokenizer import CharTokenizer

    cfg = load_config(None, ["env.name=tools", "env.tools=[calculator]"])  # the built-in task: no template
    with pytest.raises(ConfigError, match="chat template"):
        EnvRunner.build(cfg, CharTokenizer())
    codec = TurnCodec(None, CharTokenizer(), (2,))
    assert codec.stop_strings == () and codec.stop_token_ids == ()
