"""Data section: prompt source (built-in task or JSONL), tokenizer, batching, reward function.

Read by rpeg_jax/data (pipeline, tokenizer, rewards). Pure Python: the task names below are
repeated from rpeg_jax/data/tasks.py (a test keeps the two in step) so that validating a config
never imports the data package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key, suggest

BUILTIN_TASKS = ("add", "copy", "reverse", "sort")  # rpeg_jax/data/tasks.py TASKS
MAX_DIGITS = 32  # longest operand/string a built-in task generates


def builtin_prompt_chars(task: str, max_digits: int) -> int:
    """Longest prompt of a built-in task in characters (the character tokenizer's tokens, bos
    excluded): "a+b=" has two operands, the string tasks ("r123=") one."""
    return 2 * max_digits + 2 if task == "add" else max_digits + 2


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    task: str = "reverse"  # built-in task name (BUILTIN_TASKS) or "jsonl"
    path: str | None = None  # JSONL file (task=jsonl)
    prompt_field: str = "prompt"  # JSONL key of the prompt: text or a list of {role, content} messages ("a.b" nests)
    answer_field: str | None = "answer"  # JSONL key of the reference answer; None: records carry none
    id_field: str | None = None  # JSONL key of a record id; None -> "<file>:<line>"
    tokenizer: str | None = None  # tokenizer.json path; None -> model.path's tokenizer.json when it has one,
    #   else the built-in character tokenizer
    bos_token: str | None = None  # tokenizer.json only; None -> tokenizer_config.json, then common names
    eos_token: str | None = None
    pad_token: str | None = None  # None -> found like bos/eos, else the eos token
    add_bos: bool = True  # prepend the tokenizer's bos token (when it has one) to raw-text prompts; a chat
    # template writes its own (data/chat.py)
    chat_template: str = "auto"  # auto | none | PATH (data/chat.py): auto = the checkpoint's chat_template.jinja,
    # else tokenizer_config.json's chat_template, beside data.tokenizer then in model.path; with a template every
    # prompt is rendered (a string as one user message), add_generation_prompt=True
    system_prompt: str | None = None  # prepended as a system message when a prompt has none; needs a template
    reward: str | None = None  # registered reward name; None -> the task's own (jsonl: math_answer)
    reward_on_error: Literal["zero", "stop"] = "zero"  # a reward that raises scores 0 (counted) or stops
    on_bad_record: Literal["error", "skip"] = "error"  # bad JSONL lines: fail naming file:line, or skip+count
    shuffle: bool = True
    seed: int = 0  # shuffle and built-in task generation seed (grain needs [0, 2^32))
    num_epochs: int | None = None  # None: repeat forever
    prompts_per_step: int = 16  # prompts per RL step over all processes (each sampled G times)
    num_examples: int = 4096  # size of a built-in task's generated dataset
    min_digits: int = 1  # built-in tasks: operand/string length range, the difficulty knob (data/tasks.py)
    max_digits: int = 3
    max_prompt_len: int = 32  # tokens incl. bos; longer prompts are an error (or skipped). Not given with
    #   task=jsonl: 512 (verl's default), fewer if the model's positions leave less beside max_new_tokens

    def longest_prompt(self) -> int:
        """Tokens of the longest prompt this source gives (bos included): a built-in task's under
        the character tokenizer, else data.max_prompt_len (a JSONL file is not read to know)."""
        if self.task in BUILTIN_TASKS and self.tokenizer is None:
            return min(self.max_prompt_len, builtin_prompt_chars(self.task, self.max_digits) + int(self.add_bos))
        return self.max_prompt_len

    def validate(self, path: str) -> None:
        tasks = (*BUILTIN_TASKS, "jsonl")
        check(
            self.task in tasks,
            key(path, "task"),
            self.task,
            f"unknown task; known: {', '.join(tasks)}" + suggest(self.task, list(tasks)),
        )
        check(self.prompts_per_step >= 1, key(path, "prompts_per_step"), self.prompts_per_step, "must be >= 1")
        check(self.num_examples >= 1, key(path, "num_examples"), self.num_examples, "must be >= 1")
        check(
            1 <= self.min_digits <= self.max_digits,
            key(path, "min_digits"),
            self.min_digits,
            f"must be in [1, max_digits={self.max_digits}]",
        )
        check(self.max_digits <= MAX_DIGITS, key(path, "max_digits"), self.max_digits, f"must be <= {MAX_DIGITS}")
        check(self.max_prompt_len >= 1, key(path, "max_prompt_len"), self.max_prompt_len, "must be >= 1")
        check(0 <= self.seed < 2**32, key(path, "seed"), self.seed, "must be in [0, 2^32)")
        if self.num_epochs is not None:
            check(self.num_epochs >= 1, key(path, "num_epochs"), self.num_epochs, "must be >= 1")
        if self.task == "jsonl":
            check(self.path is not None, key(path, "path"), self.path, "is required when data.task=jsonl")
        for name in ("prompt_field", "answer_field", "id_field"):
            v = getattr(self, name)
            if v is not None:
                check(bool(v) and all(v.split(".")), key(path, name), v, "must be a non-empty (dotted) key")
        check(bool(self.chat_template), key(path, "chat_template"), self.chat_template, "must be auto, none or a path")
        if self.system_prompt is not None:
            check(
                self.chat_template != "none",
                key(path, "system_prompt"),
                self.system_prompt,
                "needs a chat template; data.chat_template=none renders prompts as raw text",
            )
        if self.answer_field is not None:
            check(
                self.answer_field != self.prompt_field,
                key(path, "answer_field"),
                self.answer_field,
                "must differ from data.prompt_field",
            )
