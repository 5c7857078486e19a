"""Rewards: Python callables registered by name, run on the host, never evaluating model output.

A reward takes one `Sample` and returns a float (sequence-level reward r):

    from rpeg_jax.data.rewards import register_reward, Sample

    @register_reward("ends_with_period")          # in your own module, e.g. my_rewards.py
    def ends_with_period(sample: Sample) -> float:
        return float(sample.completion.rstrip().endswith("."))

and the run config names it: `data.reward=ends_with_period plugins=[my_rewards]`
(the run config's plugins are imported when it is loaded; they must be importable, e.g. on
PYTHONPATH), or `data.reward=my_rewards:ends_with_period` without a plugin entry. Built-ins: each
task's reward ("add", "copy", "reverse", "sort") and "math_answer" (exact match of answers
extracted from GSM8K/MATH-style text).

`score(samples, fn, on_error)` runs a reward over a batch. A reward that raises or returns a
non-finite value is counted; with on_error="zero" it scores 0.0, with "stop" a RewardError
names the reward and the sample index.

Called by: the runtime's reward stage (resolve_reward at start-up, before anything compiles;
make_samples + score every step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from rpeg_jax.config.data import DataConfig
from rpeg_jax.config.registry import Registry
from rpeg_jax.data.answers import answers_match, extract_answer
from rpeg_jax.data.tasks import TASKS
from rpeg_jax.data.tokenizer import Tokenizer, completion_ids

RewardFn = Callable[["Sample"], float]
REWARDS = Registry("reward", key="data.reward")  # name -> fn(sample) -> float (config/registry.py)


class RewardError(RuntimeError):
    """A reward raised (or returned a non-finite value) and data.reward_on_error is "stop"."""


@dataclass(frozen=True)
class Sample:
    """One completion to score: its prompt, the completion (text before the first eos) and ids,
    and the prompt record's answer and other fields."""

    prompt: str
    completion: str
    completion_ids: tuple[int, ...]
    answer: str | None = None
    record: dict[str, Any] = field(default_factory=dict)  # the record's other fields (task, operands, ...)


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn(sample) -> float` under `name` (REWARDS, config/registry.py's rules)."""
    return REWARDS.register(name, overwrite=overwrite)


def registered_rewards() -> list[str]:
    return sorted(REWARDS)


def get_reward(name: str) -> RewardFn:
    """A registered reward's function, or the function a `module:function` reference names."""
    return REWARDS.get(name)


def resolve_reward(cfg: DataConfig) -> tuple[str, RewardFn]:
    """(name, fn) of the reward a data config asks for: data.reward (a registered name, the run's
    `plugins:` imported with the config, or module:function); by default the built-in task's own
    reward, or math_answer for JSONL."""
    name = cfg.reward or (cfg.task if cfg.task in TASKS else "math_answer")
    return name, get_reward(name)


def text_stop_ids(end_ids: Sequence[int], stop_token_ids: Sequence[int] = ()) -> tuple[int, ...]:
    """Where a completion's text ends for its reward: the model's end ids (model.end_ids), then
    rollout.stop_token_ids. The reward stage and the environments' turns (env/session.py) cut here."""
    return (*end_ids, *stop_token_ids)


def make_samples(
    prompts: Sequence[str],
    answers: Sequence[Any],
    records: Sequence[dict],
    completions: Sequence[Sequence[int]],
    tokenizer: Tokenizer,
    group_size: int = 1,
    stop_ids: Sequence[int] = (),
    lengths: Sequence[int] | None = None,
) -> list[Sample]:
    """Samples for the B = len(prompts) * group_size completions of prompts with their answers and
    records (a PromptBatch's columns), grouped by prompt: row b belongs to prompt b // group_size
    (the runtime's group_ids). Each completion row (e.g. tokens_BxS[:, P:]) is first cut to
    lengths[b] when given (response_mask_BxR.sum(1)), then at its first eos or stop id, then
    decoded. Every scorer (the reward stage, dynamic sampling, evaluation) builds its samples here."""
    if len(completions) != len(prompts) * group_size:
        raise ValueError(f"{len(completions)} completions for {len(prompts)} prompts x group {group_size}")
    out = []
    for b, ids in enumerate(completions):
        i = b // group_size
        if lengths is not None:
            ids = ids[: int(lengths[b])]
        cut = completion_ids(ids, tokenizer.eos_id, stop_ids)
        out.append(
            Sample(
                prompt=prompts[i],
                completion=tokenizer.decode(cut),
                completion_ids=tuple(cut),
                answer=answers[i],
                record=records[i],
            )
        )
    return out


def score(
    samples: Sequence[Sample], fn: RewardFn | str, on_error: str = "zero", name: str | None = None
) -> tuple[np.ndarray, int]:
    """(rewards float32 [B], number of samples whose reward raised or was not finite)."""
    if isinstance(fn, str):
        name, fn = fn, get_reward(fn)
    name = name or getattr(fn, "__name__", "reward")
    if on_error not in ("zero", "stop"):
        raise ValueError(f"on_error must be 'zero' or 'stop', not {on_error!r}")
    rewards = np.zeros(len(samples), np.float32)
    errors = 0
    for b, sample in enumerate(samples):
        try:
            r = float(fn(sample))
            if not math.isfinite(r):
                raise ValueError(f"returned {r}")
        except Exception as e:  # a user reward may raise anything; it must not kill the run silently
            if on_error == "stop":
                raise RewardError(
                    f"reward {name!r} failed on sample {b} (prompt {sample.prompt!r}): {type(e).__name__}: {e}"
                ) from e
            errors += 1
            r = 0.0
        rewards[b] = r
    return rewards, errors


def truncated(last_tokens: np.ndarray, lengths: np.ndarray, max_len: int, stop_ids: Sequence[int]) -> np.ndarray:
    """Responses cut by the length cap: `max_len` tokens long and not ending in an eos/stop id (bool [B]).
    last_tokens[b] is row b's last response token (any value for an empty row)."""
    lengths = np.asarray(lengths)
    return (lengths >= max_len) & ~np.isin(np.asarray(last_tokens), np.asarray(list(stop_ids), np.int64))


def overlong_penalty(lengths: np.ndarray, max_len: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu 2025 eq. 13), added to the reward of a response of |y|
    tokens with L_max = max_len and L_cache = buffer: 0 while |y| <= L_max - L_cache, then
    (L_max - L_cache - |y|) / L_cache · factor, down to -factor at the cap (and beyond). float32 [B]."""
    excess = np.asarray(lengths, np.float64) - (max_len - buffer)
    return np.clip(-excess / buffer * factor, -factor, 0.0).astype(np.float32)


# ---- built-ins ---------------------------------------------------------------------------------


def _task_reward(task_name: str) -> RewardFn:
    credit = TASKS[task_name].credit

    def reward(sample: Sample) -> float:
        if sample.answer is None:
            raise ValueError(f"the {task_name} reward needs the record's answer")
        return credit(sample.completion, sample.answer)

    reward.__name__ = f"{task_name}_reward"
    return reward


for _name in TASKS:
    register_reward(_name)(_task_reward(_name))


@register_reward("math_answer")
def math_answer(sample: Sample) -> float:
    """1.0 when the completion's final answer (GSM8K "####", \\boxed, last number) equals the reference:
    the record's answer as is, or the final answer of it when it is a full solution ("####", \\boxed)."""
    if sample.answer is None:
        raise ValueError("math_answer needs the record's answer (data.answer_field)")
    gold = sample.answer
    if "####" in gold or "\\boxed" in gold or "\\fbox" in gold:  # a full solution: take its final answer
        gold = extract_answer(gold)
    return 1.0 if answers_match(extract_answer(sample.completion), gold) else 0.0
