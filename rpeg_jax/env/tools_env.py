"""`env.name=tools`: the policy calls tools by name in its chat template's format; each turn's calls
run (in order) and their results come back as `tool` messages, until a turn makes no call (its final
answer) or a limit ends the episode.

A turn is handled as follows (settings: the env section):
  - it ran out of tokens (end "length"): done, truncated; its calls are not run;
  - it makes no call (no call block in its text): done;
  - it is turn env.max_turns: done, truncated (the last turn is not answered);
  - its calls would bring the episode past env.max_tool_calls: done, truncated, none of them run;
  - else every call block runs, in order: a malformed block (bad JSON, not {"name", "arguments"}, not
    closed), an unknown tool, arguments that do not fit the tool's schema, a tool that raises, times
    out or fails becomes an error result, "Error: ..." in the tool message the policy reads, counted
    by kind in EpisodeStats.errors (env/tool_errors). Results longer than env.max_tool_output_chars
    are cut. At most env.max_concurrent_tools calls run at once across all episodes.
The reward comes when the episode is done: the run's reward function (data.reward) on the LAST turn
(its text and ids, with the record's prompt and answer), e.g. math_answer on the final answer; 0 for
every other turn.

The tools an episode may call: every tool of env.tools, or the record's own "tools" field (a list of
tool names, or of schemas whose function names are among env.tools; a schema given there is what the
template shows the model).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.env import EnvConfig
from rpeg_jax.env.base import Environment, Episode, EpisodeStats, Reward, StepResult, Turn
from rpeg_jax.env.parsers import CallError, ToolCall, ToolParser
from rpeg_jax.env.tools import Tool, make_tools
from rpeg_jax.env.tools.base import BAD_ARGUMENTS, EXCEPTION, UNKNOWN_TOOL, ToolResult, check_arguments


def cut(text: str, limit: int) -> str:
    """text, or its first `limit` characters and a note of how many were cut."""
    return text if len(text) <= limit else f"{text[:limit]}\n[... {len(text) - limit} more characters cut]"


def schema_name(schema: dict[str, Any]) -> str | None:
    fn = schema.get("function", schema)
    return fn.get("name") if isinstance(fn, dict) else None


def at_limit(cfg: EnvConfig, stats: EpisodeStats, calls: int) -> bool:
    """Whether a turn making `calls` calls ends the episode unanswered: it is turn env.max_turns, or its
    calls would bring the episode past env.max_tool_calls."""
    return stats.turns >= cfg.max_turns or stats.tool_calls + calls > cfg.max_tool_calls


class ToolEpisode(Episode):
    def __init__(self, record: dict[str, Any], env: "ToolEnv", schemas: list[dict], allowed: set[str]):
        super().__init__(record, env.prompt_messages(record), schemas)
        self.env, self.allowed = env, allowed

    def respond(self, turn: Turn) -> StepResult:
        items = self.env.parser.parse(turn.text).items
        if turn.end == "length" or not items:
            return self.finish(turn, truncated=turn.end == "length")
        if at_limit(self.env.settings, self.stats, len(items)):
            return self.finish(turn, truncated=True)
        return StepResult(observations=tuple(self.call(item) for item in items))

    def finish(self, turn: Turn, truncated: bool = False) -> StepResult:
        reward, errors = self.env.reward(self.record, turn)
        self.stats.reward_errors += errors
        self.stats.truncated = truncated
        return StepResult(reward=reward, done=True)

    def call(self, item: ToolCall | CallError) -> dict[str, Any]:
        """Run one call block; its tool message (an error result for anything that went wrong)."""
        self.stats.tool_calls += 1
        name = item.name
        if isinstance(item, CallError):
            res = ToolResult(f"Error: {item.message}", item.kind)
        elif name not in self.allowed:
            known = ", ".join(sorted(self.allowed)) or "none"
            res = ToolResult(f"Error: unknown tool {name!r}; the tools are: {known}", UNKNOWN_TOOL)
        else:
            res = self.run(self.env.tools[name], item.arguments)
        if res.error is not None:
            self.stats.error(res.error)
        msg = {"role": "tool", "content": cut(res.content, self.env.settings.max_tool_output_chars)}
        return {**msg, "name": name} if name else msg

    def run(self, tool: Tool, arguments: dict[str, Any]) -> ToolResult:
        why = check_arguments(tool.parameters, arguments)
        if why is not None:
            return ToolResult(f"Error: bad arguments for {tool.name}: {why}", BAD_ARGUMENTS)
        with self.env.slots:
            t0 = time.perf_counter()
            try:
                res = tool.run(arguments)
            except Exception as e:  # a tool's failure is the policy's observation, never the run's end
                res = ToolResult(f"Error: the tool {tool.name} failed: {type(e).__name__}: {e}", EXCEPTION)
            finally:
                self.stats.tool_s += time.perf_counter() - t0
        return res


class ToolEnv(Environment):
    def __init__(self, settings: EnvConfig, reward: Reward, parser: ToolParser | None = None):
        super().__init__(settings, reward, parser)
        if parser is None:
            raise ConfigError("env.tool_parser", settings.tool_parser, "env.name=tools needs a tool-call parser")
        self.tools = make_tools(settings)
        self.slots = threading.BoundedSemaphore(settings.max_concurrent_tools)

    def tool_schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def start(self, record: dict[str, Any]) -> Episode:
        offered = record.get("tools")
        if offered is None:
            return ToolEpisode(record, self, self.tool_schemas(), set(self.tools))
        schemas = []
        for t in offered:
            name = t if isinstance(t, str) else schema_name(t) if isinstance(t, dict) else None
            if name not in self.tools:
                raise ValueError(
                    f"record {record.get('id')!r}: tool {t!r} is not among env.tools ({', '.join(self.tools)})"
                )
            schemas.append(self.tools[name].schema() if isinstance(t, str) else t)
        return ToolEpisode(record, self, schemas, {schema_name(s) for s in schemas})
