"""Optimizer section: optax AdamW with warmup + schedule, global-norm clipping, update dtypes.

Read by `rpeg_jax.rl.optimizer.make_optimizer`. Step counts are optimizer steps: one RL step
takes rl.ppo_epochs × rl.minibatches of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-4  # η, peak learning rate
    schedule: Literal["constant", "cosine", "linear"] = "constant"  # shape after warmup
    warmup_steps: int = 0  # linear warmup to lr over this many optimizer steps (step t uses lr·(t+1)/warmup)
    decay_steps: int | None = None  # total schedule length incl. warmup (optimizer steps); None -> whole run
    min_lr_ratio: float = 0.0  # final lr / peak lr for cosine/linear
    weight_decay: float = 0.0  # λ_wd, decoupled weight decay (AdamW), applied to all parameters
    b1: float = 0.9  # β1, Adam first-moment decay
    b2: float = 0.999  # β2, Adam second-moment decay
    eps: float = 1e-8  # ε, Adam denominator
    grad_clip: float | None = 1.0  # clip by global norm; None disables
    grad_dtype: Literal["float32", "bfloat16"] = "float32"  # dtype micro-batch gradients are summed in
    mu_dtype: Literal["float32", "bfloat16"] | None = None  # Adam first moment; None -> the parameter dtype

    def validate(self, path: str) -> None:
        check(self.lr > 0, key(path, "lr"), self.lr, "must be > 0")
        check(self.warmup_steps >= 0, key(path, "warmup_steps"), self.warmup_steps, "must be >= 0")
        if self.decay_steps is not None:
            check(self.decay_steps >= 1, key(path, "decay_steps"), self.decay_steps, "must be >= 1")
            if self.schedule != "constant":
                check(
                    self.decay_steps > self.warmup_steps,
                    key(path, "decay_steps"),
                    self.decay_steps,
                    f"must exceed warmup_steps={self.warmup_steps}",
                )
        check(0.0 <= self.min_lr_ratio <= 1.0, key(path, "min_lr_ratio"), self.min_lr_ratio, "must be in [0, 1]")
        check(self.weight_decay >= 0, key(path, "weight_decay"), self.weight_decay, "must be >= 0")
        check(0.0 <= self.b1 < 1.0, key(path, "b1"), self.b1, "must be in [0, 1)")
        check(0.0 <= self.b2 < 1.0, key(path, "b2"), self.b2, "must be in [0, 1)")
        check(self.eps > 0, key(path, "eps"), self.eps, "must be > 0")
        if self.grad_clip is not None:
            check(self.grad_clip > 0, key(path, "grad_clip"), self.grad_clip, "must be > 0")
