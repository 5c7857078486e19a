"""Environments for agentic RL: episodes of several turns in which the policy calls tools (host-side
Python; no device code). docs/agentic.md is the guide; each module's docstring has the details.

    base.py         Environment, Episode, Turn, StepResult, EpisodeStats, Reward: the text-level interface
    single_turn.py  env.name=single_turn: today's behaviour (one turn, the run's reward)
    tools_env.py    env.name=tools: tool calls by name, results as tool messages, limits
    parsers.py      tool-call formats (hermes: <tool_call>{json}</tool_call>), never evaluating anything
    tools/          the Tool interface, calculator, python
    sandbox.py      the python tool's confined child process (sandbox_child.py: rlimits, Landlock, seccomp)
    session.py      episodes in tokens: the first prompt, a turn's ids -> observation ids to prefill
    runner.py       what the engine calls: EnvRunner (sessions, a bounded pool for turn ends, metrics)

One episode, as the engine will drive it:

    runner = EnvRunner.build(cfg, tokenizer)
    s = runner.start(batch.record(i))              # s.prompt_ids: prefill
    out = runner.submit(s, turn_ids, "call").result()
    while not out.done:                            # prefill out.observation_ids, sample the next turn
        out = runner.submit(s, next_turn_ids, end).result()
    s.total_reward, s.response_ids(), s.response_mask(), s.stats

Imports config, shapes and data only (tests/test_layers.py); the runtime imports it.
"""

from rpeg_jax.env.base import Environment, Episode, EpisodeStats, Reward, StepResult, Turn, reward_of
from rpeg_jax.env.parsers import CallError, HermesParser, ParsedTurn, ToolCall, ToolParser, get_parser
from rpeg_jax.env.runner import ENVIRONMENTS, EnvRunner, episode_metrics, make_environment
from rpeg_jax.env.session import Outcome, Session, TurnCodec
from rpeg_jax.env.single_turn import SingleTurn
from rpeg_jax.env.tools import TOOLS, Tool, ToolResult
from rpeg_jax.env.tools_env import ToolEnv

__all__ = [
    "CallError",
    "ENVIRONMENTS",
    "EnvRunner",
    "Environment",
    "Episode",
    "EpisodeStats",
    "HermesParser",
    "Outcome",
    "ParsedTurn",
    "Reward",
    "Session",
    "SingleTurn",
    "StepResult",
    "TOOLS",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolParser",
    "ToolResult",
    "Turn",
    "TurnCodec",
    "episode_metrics",
    "get_parser",
    "make_environment",
    "reward_of",
]
