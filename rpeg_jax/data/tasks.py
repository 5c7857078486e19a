"""Built-in tasks that need no download, generated deterministically from data.seed.

A record is a plain dict: {"id", "prompt", "answer", "task", ...task fields}. Each task also
scores a completion (the text before the first eos) against the record's answer, in [0, 1].

- add     (bench/WORKLOADS.md R1): "a+b=" with operands of min_digits..max_digits digits (R1 uses 2);
          reward 1.0 when the completion starts with the decimal sum, else 0.
- copy    "c<digits>="  -> the same digits.
- reverse "r<digits>="  -> the digits reversed (the default task).
- sort    "s<digits>="  -> the digits in ascending order.

Why reverse with per-position credit learns from random initialization (the default run).
A random model T samples ~uniformly over 128 tokens, so an all-or-nothing reward is nonzero
with probability ~(1/128)^n and GRPO's group-normalised advantage (r - mean_G) / std_G is zero
for almost every group: no gradient. Scoring each position separately, credit = (1/n) Σ_i
[c_i = t_i], makes every correct character count, so a group of G = 8 has some variance early.
Reverse then offers a ladder of sub-skills: (1) emit digits at all; (2) the first answer digit
is the token just before "=" (a previous-token lookup, the easiest attention pattern); (3)
answer position k sits at the fixed offset 2k+1 behind the token being predicted. Text after
the n-th character is ignored (like R1's "starts with"), so the model is paid for digits before
it learns to stop. Short strings matter: with 1-3 digits the first-position skill alone is
worth mean(1, 1/2, 1/3) = 0.61, with 3-5 digits only 0.26, and the rest is the hard part.

Measured (a minimal GRPO loop on model T, 16 prompts x G=8, 8 new tokens, AdamW, no KL; CPU
shared with other jobs, so times are loose), mean reward of the first tenth of steps -> the
last tenth: 1-3 digits, lr 3e-4, 150 steps: 0.014 -> 0.39; same, other seeds, 200 steps:
0.021 -> 0.41; 1-3 digits, lr 1e-4, 150 steps: 0.009 -> 0.37; 3-5 digits, lr 3e-4, 200 steps:
0.025 -> 0.27 (short of +0.3). With lr 1e-3 (1-3 or 3-5 digits) the policy collapsed to one
repeated digit ("22222222") and plateaued near 0.2. Hence the defaults data.min_digits=1,
data.max_digits=3 (with lr <= 3e-4); raise them to make the task harder.

Called by: data/pipeline.py (records), data/rewards.py (registers each task's reward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from rpeg_jax.config.data import DataConfig, builtin_prompt_chars

SPLITS = {"train": 0, "eval": 1}  # independent streams from the same data.seed


def digit_credit(completion: str, target: str) -> float:
    """Per-position partial credit: the fraction of target positions i with completion[i] == target[i]."""
    if not target:
        return 0.0
    hits = sum(1 for c, t in zip(completion, target) if c == t)
    return hits / len(target)


def starts_with_credit(completion: str, target: str) -> float:
    """1.0 when the completion starts with the target (bench/WORKLOADS.md R1), else 0.0."""
    return 1.0 if target and completion.startswith(target) else 0.0


def _digits(rng: np.random.Generator, n: int) -> str:
    return "".join(str(d) for d in rng.integers(0, 10, size=n))


def _number(rng: np.random.Generator, n: int) -> int:
    """A uniformly drawn integer with exactly n digits (0..9 when n == 1)."""
    lo = 0 if n == 1 else 10 ** (n - 1)
    return int(rng.integers(lo, 10**n))


def _make_string_task(letter: str, transform: Callable[[str], str]):
    def make(rng: np.random.Generator, n: int) -> dict:
        s = _digits(rng, n)
        return {"prompt": f"{letter}{s}=", "answer": transform(s), "digits": s}

    return make


def _make_add(rng: np.random.Generator, n: int) -> dict:
    a, b = _number(rng, n), _number(rng, n)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b), "a": a, "b": b}


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[np.random.Generator, int], dict]  # (rng, digits) -> record fields
    credit: Callable[[str, str], float]  # (completion text, answer) -> reward in [0, 1]
    doc: str

    def max_prompt_chars(self, max_digits: int) -> int:
        """Longest prompt in characters (the character tokenizer's token count, bos excluded)."""
        return builtin_prompt_chars(self.name, max_digits)


TASKS: dict[str, Task] = {
    "add": Task("add", _make_add, starts_with_credit, "a+b= -> the sum; 1 when the completion starts with it"),
    "copy": Task("copy", _make_string_task("c", lambda s: s), digit_credit, "c123= -> 123; per-position credit"),
    "reverse": Task(
        "reverse", _make_string_task("r", lambda s: s[::-1]), digit_credit, "r123= -> 321; per-position credit"
    ),
    "sort": Task(
        "sort", _make_string_task("s", lambda s: "".join(sorted(s))), digit_credit, "s312= -> 123; per-position credit"
    ),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise KeyError(f"unknown built-in task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]


def make_records(cfg: DataConfig, split: str = "train") -> list[dict]:
    """cfg.num_examples records of the built-in task cfg.task, a pure function of (cfg.seed, split).

    The digit count of each record is uniform in [cfg.min_digits, cfg.max_digits].
    """
    task = get_task(cfg.task)
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, SPLITS[split]]))
    records = []
    for i in range(cfg.num_examples):
        n = int(rng.integers(cfg.min_digits, cfg.max_digits + 1))
        rec = task.make(rng, n)
        records.append({"id": f"{task.name}/{split}/{i}", "task": task.name, **rec})
    return records
