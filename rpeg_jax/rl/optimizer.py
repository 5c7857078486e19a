"""optax optimizer from an OptimConfig: global-norm clipping, then AdamW on a warmup+decay schedule.

Called by the runtime when it builds the actor/critic states:
    tx = make_optimizer(cfg.optim, total_steps=optimizer_steps(cfg.train.steps, cfg.rl))
    opt_state = tx.init(params)
The learning rate is wrapped in `optax.inject_hyperparams`, so the update step can report the rate
it used (`actor/lr`) by reading `learning_rate` from the optimizer state (`current_lr`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax
import optax.tree_utils as otu

from rpeg_jax.config.optim import OptimConfig
from rpeg_jax.config.rl import RLConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def optimizer_steps(rl_steps: int, rl_cfg: RLConfig) -> int:
    """Optimizer steps in a run of `rl_steps` RL steps (each: ppo_epochs × minibatches updates)."""
    return max(1, rl_steps * rl_cfg.ppo_epochs * rl_cfg.minibatches)


def make_schedule(cfg: OptimConfig, total_steps: int | None = None):
    """lr(t) for optimizer step t (0-based): linear warmup lr·(t+1)/W for t < W, then constant, or
    cosine / linear decay to lr·min_lr_ratio at t = decay_steps (default total_steps), flat after."""
    warmup = cfg.warmup_steps
    decay = cfg.decay_steps if cfg.decay_steps is not None else (total_steps or warmup + 1)
    span = max(decay - warmup, 1)
    lo = cfg.min_lr_ratio

    def schedule(count):
        t = jnp.asarray(count, jnp.float32)
        warm = jnp.minimum(1.0, (t + 1.0) / warmup) if warmup > 0 else 1.0
        p = jnp.clip((t - warmup) / span, 0.0, 1.0)
        if cfg.schedule == "cosine":
            frac = lo + (1.0 - lo) * 0.5 * (1.0 + jnp.cos(math.pi * p))
        elif cfg.schedule == "linear":
            frac = 1.0 - (1.0 - lo) * p
        else:
            frac = 1.0
        return cfg.lr * warm * frac

    return schedule


def make_optimizer(cfg: OptimConfig, total_steps: int | None = None) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) -> AdamW(schedule, b1, b2, eps, weight_decay, mu_dtype)."""
    mu_dtype = _DTYPES[cfg.mu_dtype] if cfg.mu_dtype is not None else None
    # float32 hyperparameters: inferred from bfloat16 params, b2 = 0.999 would round to 1.0.
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mu_dtype",), hyperparam_dtype=jnp.float32)(
        learning_rate=make_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mu_dtype=mu_dtype,
    )
    if cfg.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)


def grad_dtype(cfg: OptimConfig):
    """The jnp dtype micro-batch gradients are accumulated in (OptimConfig.grad_dtype)."""
    return _DTYPES[cfg.grad_dtype]


def current_lr(opt_state):
    """The learning rate of the last step, if the optimizer was built by make_optimizer; else NaN."""
    # hyperparams["learning_rate"] is the value; hyperparams_states["learning_rate"] the schedule state.
    lr = otu.tree_get(opt_state, "learning_rate", default=None, filtering=lambda _, v: hasattr(v, "dtype"))
    return jnp.asarray(jnp.nan if lr is None else lr, jnp.float32)
