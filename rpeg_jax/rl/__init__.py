"""rpeg_jax.rl: the learner, as pure JAX functions over response-aligned [B, R] arrays.

The runtime calls:
  compute_advantages(batch, rl_cfg) -> ({advantages_BxR, returns_BxR}, metrics)   advantage stage
  make_optimizer(optim_cfg, total_steps) -> optax transformation; tx.init(params)
  make_actor_update / make_critic_update / make_actor_critic_update(fn, tx, rl_cfg,
                                                                    accum_dtype=grad_dtype(optim_cfg))
      -> update(params, opt_state, batch, rng=None) -> (params, opt_state, metrics)
  make_critic_values_update(fn, tx, rl_cfg) -> update(...) -> (params, opt_state, metrics, {values_BxR})
  batch_metrics(batch, version=...) -> reward/*, response_length/*, ... metrics
rl imports no model code: the forward is a function handed in (see rl.update).
"""

from rpeg_jax.rl.advantages import (
    compute_advantages,
    gae,
    grpo_advantages,
    last_token_mask,
    rloo_advantages,
    token_rewards,
)
from rpeg_jax.rl.kl import KL_ESTIMATORS, kl_estimate
from rpeg_jax.rl.losses import (
    actor_objective,
    agg_weights,
    behaviour_weights,
    critic_objective,
    overlong_mask,
    ppo_token_loss,
    value_token_loss,
)
from rpeg_jax.rl.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rpeg_jax.rl.metrics import batch_metrics
from rpeg_jax.rl.optimizer import current_lr, grad_dtype, make_optimizer, make_schedule, optimizer_steps
from rpeg_jax.rl.update import (
    ACTOR_KEYS,
    CRITIC_KEYS,
    check_batch,
    make_actor_critic_update,
    make_actor_update,
    make_critic_update,
    make_critic_values_update,
    make_update,
)

__all__ = [
    "overlong_mask",
    "compute_advantages",
    "gae",
    "grpo_advantages",
    "last_token_mask",
    "rloo_advantages",
    "token_rewards",
    "KL_ESTIMATORS",
    "kl_estimate",
    "actor_objective",
    "agg_weights",
    "behaviour_weights",
    "critic_objective",
    "ppo_token_loss",
    "value_token_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "batch_metrics",
    "current_lr",
    "grad_dtype",
    "make_optimizer",
    "make_schedule",
    "optimizer_steps",
    "ACTOR_KEYS",
    "CRITIC_KEYS",
    "check_batch",
    "make_actor_critic_update",
    "make_actor_update",
    "make_critic_update",
    "make_critic_values_update",
    "make_update",
]
