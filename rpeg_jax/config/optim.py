"""Optimizer section: optax AdamW with warmup + schedule and global-norm clipping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-4  # peak learning rate
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0  # linear warmup from 0 to lr (optimizer steps)
    decay_steps: int | None = None  # cosine/linear decay length; None -> train.steps
    min_lr_ratio: float = 0.0  # final lr / peak lr for cosine/linear
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # clip by global norm; None disables

    def validate(self, path: str) -> None:
        check(self.lr > 0, key(path, "lr"), self.lr, "must be > 0")
        check(self.warmup_steps >= 0, key(path, "warmup_steps"), self.warmup_steps, "must be >= 0")
        if self.decay_steps is not None:
            check(self.decay_steps >= 1, key(path, "decay_steps"), self.decay_steps, "must be >= 1")
        check(0.0 <= self.min_lr_ratio <= 1.0, key(path, "min_lr_ratio"), self.min_lr_ratio, "must be in [0, 1]")
        check(self.weight_decay >= 0, key(path, "weight_decay"), self.weight_decay, "must be >= 0")
        check(0.0 <= self.b1 < 1.0, key(path, "b1"), self.b1, "must be in [0, 1)")
        check(0.0 <= self.b2 < 1.0, key(path, "b2"), self.b2, "must be in [0, 1)")
        check(self.eps > 0, key(path, "eps"), self.eps, "must be > 0")
        if self.grad_clip is not None:
            check(self.grad_clip > 0, key(path, "grad_clip"), self.grad_clip, "must be > 0")
