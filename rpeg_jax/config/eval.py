"""Eval section: held-out evaluation during training and by `rpeg eval` (verl's val_before_train,
test_freq and val_kwargs).

The eval file is a JSONL with the training data's fields (data.prompt_field, data.answer_field,
data.id_field; chat templates and message prompts apply as to training prompts), scored by the
run's reward. Every eval prompt is sampled eval.n times by the policy of the step; the metrics are
verl's `val-core/<source>/reward/mean@N` and, for N > 1, `val-core/<source>/reward/pass@N`
(runtime/evaluation.py says exactly what they are).

Read by runtime/evaluation.py (and runtime/trainer.py for when to evaluate).
"""

from __future__ import annotations

from dataclasses import dataclass

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    path: str | None = None  # JSONL of held-out prompts with answers; None: no evaluation
    every: int = 0  # steps between evaluations (and one after the last step); 0 = never (verl: test_freq)
    before_train: bool = False  # evaluate the initial policy at step 0 of a fresh run (verl: val_before_train)
    n: int = 1  # N: completions sampled per eval prompt (verl: val_kwargs.n)
    temperature: float = 0.0  # T of evaluation sampling; 0 = greedy (the other sampling settings are rollout's)
    max_prompts: int | None = None  # evaluate only the file's first this many prompts; None = all
    pass_threshold: float = 1.0  # a sample solves its prompt when its reward >= this (pass@N); 1.0 = the
    #                              built-in rewards' full credit

    def validate(self, path: str) -> None:
        check(self.every >= 0, key(path, "every"), self.every, "must be >= 0 (0 = never)")
        check(self.n >= 1, key(path, "n"), self.n, "must be >= 1 (samples per eval prompt)")
        check(self.temperature >= 0, key(path, "temperature"), self.temperature, "must be >= 0 (0 = greedy)")
        if self.max_prompts is not None:
            check(self.max_prompts >= 1, key(path, "max_prompts"), self.max_prompts, "must be >= 1 (null = all)")
        if self.path is None:
            for name in ("every", "before_train"):
                v = getattr(self, name)
                check(not v, key(path, name), v, "evaluates nothing without eval.path (a JSONL of held-out prompts)")
        else:
            check(bool(self.path), key(path, "path"), self.path, "must not be empty (null = no evaluation)")

    @property
    def enabled(self) -> bool:
        return self.path is not None
