"""The environment interface: an Environment starts an Episode from a data record; the episode
receives each assistant turn and answers with observation messages, a reward and done.

    env = make_environment(cfg.env, cfg.data)          # built-in name or module:Class; rewards resolved
    ep = env.start(record)                             # record: data/pipeline.PromptBatch.record(i)
    res = ep.step(Turn(text, ids, "call"))             # StepResult(observations, reward, done, info)
    ...                                                # until res.done
    ep.total_reward, ep.stats                          # the return, EpisodeStats (turns, tool calls, ...)

Everything here is text and messages; env/session.py turns turns and observations into tokens for
the engine. An Environment is built once per run and shared by threads; an Episode is one
sequence's state and is stepped by one thread at a time.

An environment of your own (docs/agentic.md has a worked example):

    class Guess(Environment):                           # my_envs.py; env.name=my_envs:Guess
        def start(self, record):
            return GuessEpisode(record, self.prompt_messages(record))

    class GuessEpisode(Episode):
        def respond(self, turn):
            if turn.text.strip() == self.record["answer"]:
                return StepResult(reward=1.0, done=True)
            return StepResult(observations=({"role": "user", "content": "No, try again."},))

Called by: env/session.py and env/runner.py (the engine's side), tests.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Literal

from rpeg_jax.config.data import DataConfig
from rpeg_jax.config.env import EnvConfig
from rpeg_jax.data.pipeline import other_fields
from rpeg_jax.data.rewards import RewardFn, Sample, resolve_reward, score
from rpeg_jax.env.parsers import ToolParser

TurnEnd = Literal["stop", "call", "length"]  # an eos/stop id; the parser's call close; the token budget


@dataclass(frozen=True)
class Turn:
    """One assistant turn as the policy wrote it."""

    text: str  # decoded, cut at the first eos/stop id (the call close, a stop string, stays in)
    ids: tuple[int, ...]  # its token ids, cut the same way (what a reward's Sample.completion_ids are)
    end: TurnEnd = "stop"


@dataclass(frozen=True)
class StepResult:
    observations: tuple[dict[str, Any], ...] = ()  # messages appended after the turn: {"role": "tool",
    #   "name", "content"} results, or {"role": "user", "content"} feedback; rendered by the chat template
    reward: float = 0.0  # this turn's reward (the return is their sum)
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class EpisodeStats:
    """Counters the runtime's env/* metrics are computed from (env/runner.episode_metrics)."""

    turns: int = 0  # assistant turns taken
    tool_calls: int = 0  # calls attempted (a malformed block counts)
    tool_errors: int = 0  # calls that failed, any kind
    errors: collections.Counter = field(default_factory=collections.Counter)  # kind -> count
    tool_s: float = 0.0  # wall seconds spent in tool calls
    truncated: bool = False  # ended by a limit (max_turns, max_tool_calls, the token budget), not the policy
    reward_errors: int = 0  # rewards that raised or were not finite (scored 0: data.reward_on_error=zero)

    def error(self, kind: str) -> None:
        self.tool_errors += 1
        self.errors[kind] += 1


@dataclass(frozen=True)
class Reward:
    """The run's reward function (data.reward) as an environment scores a completion with it: the
    same Sample today's reward stage builds (data/rewards.make_samples) from the record's columns."""

    name: str
    fn: RewardFn
    on_error: str = "zero"  # data.reward_on_error

    def sample(self, record: dict[str, Any], turn: Turn) -> Sample:
        return Sample(
            prompt=record.get("prompt", ""),
            completion=turn.text,
            completion_ids=tuple(turn.ids),
            answer=record.get("answer"),
            record=other_fields(record),
        )

    def __call__(self, record: dict[str, Any], turn: Turn) -> tuple[float, int]:
        """(reward, 1 if it raised or was not finite else 0); raises RewardError with on_error=stop."""
        rewards, errors = score([self.sample(record, turn)], self.fn, self.on_error, self.name)
        return float(rewards[0]), errors


class Episode:
    """One episode's state: the conversation so far (`messages`), the tool schemas the template shows
    (`tools`, None for none), per-turn rewards and counters. Subclasses implement `respond`."""

    def __init__(self, record: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict] | None = None):
        self.record = record
        self.messages = list(messages)
        self.tools = tools
        self.stats = EpisodeStats()
        self.rewards: list[float] = []
        self.done = False

    def step(self, turn: Turn) -> StepResult:
        """Take the policy's turn: record it, let the episode respond, keep its observations."""
        if self.done:
            raise RuntimeError("step() on an episode that is done")
        self.stats.turns += 1
        self.messages.append({"role": "assistant", "content": turn.text})
        res = self.respond(turn)
        self.rewards.append(float(res.reward))
        self.messages.extend(res.observations)
        self.done = bool(res.done)
        return res

    def respond(self, turn: Turn) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode holds (called once it is done or abandoned)."""

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))


class Environment:
    """Starts episodes. Built once per run as `cls(settings, reward, parser)`: settings is the env
    section, reward the run's Reward (data.reward), parser the chat template's tool-call parser
    (env/parsers.py; None when the run has no template or none recognised)."""

    def __init__(self, settings: EnvConfig, reward: Reward, parser: ToolParser | None = None):
        self.settings = settings
        self.reward = reward
        self.parser = parser

    def start(self, record: dict[str, Any]) -> Episode:
        raise NotImplementedError

    def tool_schemas(self) -> list[dict] | None:
        """Schemas of the tools every episode may call (the session renders the first prompt with them)."""
        return None

    @staticmethod
    def prompt_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
        """The record's conversation: its messages when the prompt was a list of them (chat template and
        system prompt applied by the data pipeline), else the prompt text as one user message."""
        msgs = record.get("prompt_messages")
        return [dict(m) for m in msgs] if msgs else [{"role": "user", "content": record.get("prompt", "")}]

    def close(self) -> None:
        """Release what the environment holds (end of the run)."""


def reward_of(cfg: DataConfig) -> Reward:
    """The run's reward as an environment uses it (data.reward, data.reward_on_error; the run's plugins
    were imported with the config)."""
    name, fn = resolve_reward(cfg)
    return Reward(name, fn, cfg.reward_on_error)
