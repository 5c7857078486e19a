"""Data section: prompt source (built-in task or JSONL), batching, reward function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    task: str = "reverse"  # built-in task name ("reverse", "add", ...) or "jsonl"
    path: str | None = None  # JSONL file (task=jsonl)
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    tokenizer: str | None = None  # tokenizer.json path; None -> the built-in character tokenizer
    reward: str | None = None  # registered reward name; None -> the task's own reward
    reward_on_error: Literal["zero", "stop"] = "zero"  # a reward that raises scores 0 (counted) or stops
    on_bad_record: Literal["error", "skip"] = "error"  # bad JSONL lines: fail naming file:line, or skip+count
    shuffle: bool = True
    seed: int = 0
    num_epochs: int | None = None  # None: repeat forever
    prompts_per_step: int = 16  # prompts per RL step (each sampled G times)
    num_examples: int = 4096  # size of a built-in task's generated dataset
    min_digits: int = 3  # built-in tasks: operand/string length range
    max_digits: int = 5
    max_prompt_len: int = 32  # tokens; longer prompts are an error (or skipped)

    def validate(self, path: str) -> None:
        check(self.prompts_per_step >= 1, key(path, "prompts_per_step"), self.prompts_per_step, "must be >= 1")
        check(self.num_examples >= 1, key(path, "num_examples"), self.num_examples, "must be >= 1")
        check(1 <= self.min_digits <= self.max_digits, key(path, "min_digits"), self.min_digits,
              f"must be in [1, max_digits={self.max_digits}]")
        check(self.max_prompt_len >= 1, key(path, "max_prompt_len"), self.max_prompt_len, "must be >= 1")
        if self.num_epochs is not None:
            check(self.num_epochs >= 1, key(path, "num_epochs"), self.num_epochs, "must be >= 1")
        if self.task == "jsonl":
            check(self.path is not None, key(path, "path"), self.path, "is required when data.task=jsonl")
