"""The engine's side of environments: sessions, and a bounded pool that runs turn ends (tool calls
included) on the host while other sequences keep decoding.

    runner = EnvRunner.build(cfg, tokenizer)               # once per run (ConfigErrors here, before compiling)
    runner.stop_strings, runner.stop_token_ids             # add to the sampler's stops (env.stop_at_call)
    s = runner.start(batch.record(i))                      # a Session per sequence (G per prompt)
    fut = runner.submit(s, turn_ids, "call")               # concurrent.futures.Future[Outcome]; never blocks
    ...                                                    # decode the others; between chunks:
    out = fut.result()                                     # .observation_ids to prefill, or .done
    runner.metrics([s.stats for s in finished])            # env/turns/mean, env/tool_calls/mean, env/tool_errors,
                                                           # env/truncated, timing_s/tools
At most env.max_concurrent_tools turn ends run at once (the pool's threads; tools also hold the tool
env's own semaphore). A turn end that raises (an environment's bug, a bad record) ends that episode
with reward 0 and info["error"], counted in stats.errors["env_exception"]; only a RewardError
(data.reward_on_error=stop) propagates, as it does from the reward stage today.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.env import EnvConfig
from rpeg_jax.config.registry import Registry
from rpeg_jax.data.chat import PromptFormat, load_prompt_format
from rpeg_jax.data.rewards import RewardError, text_stop_ids
from rpeg_jax.data.tokenizer import Tokenizer
from rpeg_jax.env.base import Environment, EpisodeStats, Reward, TurnEnd, reward_of
from rpeg_jax.env.parsers import ToolParser, get_parser
from rpeg_jax.env.session import Outcome, Session, TurnCodec
from rpeg_jax.env.single_turn import SingleTurn
from rpeg_jax.env.tools_env import ToolEnv

ENVIRONMENTS = Registry("environment", key="env.name", base=Environment)  # config/registry.py
ENVIRONMENTS.register("single_turn", SingleTurn)
ENVIRONMENTS.register("tools", ToolEnv)


def make_environment(cfg: EnvConfig, reward: Reward, parser: ToolParser | None = None) -> Environment:
    """The environment env.name asks for: a built-in, or module:Class (an Environment subclass)."""
    cls = ENVIRONMENTS.get(cfg.name)
    return cls(cfg, reward, parser)


def resolve_parser(cfg: EnvConfig, template_source: str | None) -> ToolParser | None:
    """env.tool_parser for this template; None where no tool calls are expected (single_turn) or auto
    recognises none for an environment of the user's (which may not call tools)."""
    if cfg.name == "single_turn":
        return None
    try:
        return get_parser(cfg.tool_parser, template_source)
    except ConfigError:
        if cfg.name == "tools" or cfg.tool_parser != "auto":
            raise
        return None


def episode_metrics(stats: Sequence[EpisodeStats], tools_s: float | None = None) -> dict[str, float]:
    """A step's env metrics over its finished episodes: mean turns and tool calls per episode, tool
    errors (a count), the fraction truncated, and timing_s/tools (`tools_s`, e.g. EnvRunner.busy_s:
    wall seconds with a turn end in flight, which overlaps decoding; default the sum of tool seconds)."""
    n = max(len(stats), 1)
    return {
        "env/turns/mean": sum(s.turns for s in stats) / n,
        "env/tool_calls/mean": sum(s.tool_calls for s in stats) / n,
        "env/tool_errors": float(sum(s.tool_errors for s in stats)),
        "env/truncated": sum(s.truncated for s in stats) / n,
        "timing_s/tools": float(tools_s if tools_s is not None else sum(s.tool_s for s in stats)),
    }


class EnvRunner:
    def __init__(self, env: Environment, codec: TurnCodec, max_concurrent: int):
        self.env, self.codec = env, codec
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="rpeg-env")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0

    @classmethod
    def build(cls, cfg, tokenizer: Tokenizer, prompt_format: PromptFormat | None = None) -> "EnvRunner":
        """The run's environment (cfg: the RunConfig) with its template, parser and reward."""
        fmt = prompt_format or load_prompt_format(cfg.data, model_path=cfg.model.path)
        template = fmt.template
        e = cfg.env
        if e.name == "tools" and template is None:
            raise ConfigError("env.name", e.name, "tool calls need a chat template; data.chat_template found none")
        parser = resolve_parser(e, template.text if template is not None else None)
        env = make_environment(e, reward_of(cfg.data), parser)
        stops = text_stop_ids(cfg.model.end_ids, cfg.rollout.stop_token_ids)
        codec = TurnCodec(template, tokenizer, stops, parser, e.stop_at_call)
        codec.check_tokens()
        return cls(env, codec, e.max_concurrent_tools)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.codec.stop_strings

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.codec.stop_token_ids

    def start(self, record: dict[str, Any]) -> Session:
        return Session(self.env.start(record), self.codec)

    def check_prompt_lengths(self, records: Sequence[dict[str, Any]], max_prompt_len: int, where: str) -> None:
        """ConfigError naming data.max_prompt_len when an episode's first prompt (the record's messages
        rendered with the episode's tool schemas, which the data pipeline's check did not see) is
        longer: the sampler's sequences are data.max_prompt_len + rollout.max_new_tokens long. Called at
        start-up, before anything compiles, on every training (and eval) record."""
        longest, worst = 0, None
        for r in records:
            ep = self.env.start(r)
            try:
                n = len(self.codec.prompt_ids(ep))
            finally:
                ep.close()
            if n > longest:
                longest, worst = n, r
        if longest > max_prompt_len:
            raise ConfigError(
                "data.max_prompt_len",
                max_prompt_len,
                f"episode prompts render the tool schemas: record {worst.get('id')!r} of {where} is "
                f"{longest} tokens (the longest of {len(records)}); set data.max_prompt_len >= {longest}",
            )

    def end_turn(self, session: Session, turn_ids: Sequence[int], end: TurnEnd) -> Outcome:
        """Session.end_turn, with a failing environment ending only its episode (module doc)."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
        try:
            return session.end_turn(turn_ids, end)
        except RewardError:
            raise
        except Exception as e:  # an environment's failure ends its episode, not the run
            ep = session.episode
            ep.stats.errors["env_exception"] += 1
            ep.stats.truncated = True
            ep.done = True
            ep.close()
            return Outcome((), True, 0.0, {"error": f"{type(e).__name__}: {e}"})
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._busy_s += time.perf_counter() - self._busy_since

    def submit(self, session: Session, turn_ids: Sequence[int], end: TurnEnd) -> Future:
        """end_turn on the pool: returns at once, the Future holds the Outcome."""
        return self.pool.submit(self.end_turn, session, list(turn_ids), end)

    def busy_s(self, reset: bool = False) -> float:
        """Wall seconds during which at least one turn end was in flight (since the last reset)."""
        with self._lock:
            now = time.perf_counter()
            out = self._busy_s + (now - self._busy_since if self._in_flight else 0.0)
            if reset:
                self._busy_s, self._busy_since = 0.0, now
        return out

    def metrics(self, stats: Sequence[EpisodeStats], reset: bool = True) -> dict[str, float]:
        return episode_metrics(stats, self.busy_s(reset=reset))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.env.close()
