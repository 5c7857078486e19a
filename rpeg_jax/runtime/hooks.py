"""Trainer hooks: what runs at step boundaries, each with its cadence (Levanter's `every=`).

    def log_lr(info):                                # after the step's record and checkpoint
        print(info.step, info.metrics["actor/lr"])
    def grad_probe(info):                            # before the record: its dict joins the record
        return {"my/param_norm": float(norm(info.state("actor")))}
    train(cfg, hooks=[Hook(log_lr, every=10), Hook(grad_probe, every=5, metrics=True)])

A hook with `metrics=True` runs before the step's record is written, and what it returns (a dict of
numbers, or None) joins that record (held-out evaluation is one: eval.every). The others run after
the record is written and the step's checkpoint, if any, has committed (checkpointing is one:
train.checkpoint_every). `every` counts completed steps: a hook with every=N runs after steps N, 2N,
...; `at_end` also after the run's last step. Hooks run on every process (a hook that writes files
should check `info.chief`), in the order given, built-in ones first; an exception stops the run
like any other failure. They must not change training state: what they read through `info.state`
is the newest version of a state (parameters, optimizer states) and is not to be written.

Called by: runtime/trainer.py (_loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class StepInfo:
    """A step boundary: `step` steps completed of `total`."""

    step: int
    total: int
    metrics: dict[str, Any]  # the step's record (with metrics=True hooks: so far)
    chief: bool  # process 0 (writes metrics, files)
    run_dir: str
    state: Callable[[str], Any]  # name -> newest value of a state ("actor", "actor_opt", ...)

    @property
    def last(self) -> bool:
        return self.step == self.total


@dataclass(frozen=True)
class Hook:
    fn: Callable[[StepInfo], dict | None]
    every: int = 1  # after every N completed steps (0: only at_end)
    metrics: bool = False  # run before the step's record is written; the dict it returns joins it
    at_end: bool = False  # also after the run's last step
    name: str = field(default="")

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"Hook {self.label}: every={self.every!r} must be an int >= 0")

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__name__", repr(self.fn))

    def due(self, step: int, total: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or (self.at_end and step == total)


def run_hooks(hooks, info: StepInfo, *, metrics: bool) -> None:
    """The hooks of one phase that are due after `info.step` (a metrics hook's dict joins the record)."""
    for h in hooks:
        if h.metrics == metrics and h.due(info.step, info.total):
            out = h.fn(info)
            if metrics and out:
                info.metrics.update(out)
