"""RL section: algorithm, advantage estimator, policy/value losses and their knobs (paper symbols)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    algorithm: Literal["grpo", "ppo"] = "grpo"
    group_size: int = 8  # G: completions sampled per prompt (GRPO needs G >= 2)
    advantage: Literal["grpo", "rloo", "gae"] | None = None  # None -> grpo for GRPO, gae for PPO
    norm_adv_by_std: bool = True  # GRPO: divide by the group std (False = Dr. GRPO)
    whiten_advantages: bool = False  # batch-whiten advantages (PPO/GAE default in many stacks)
    gamma: float = 1.0  # γ, GAE discount
    lam: float = 0.95  # λ, GAE trace decay
    clip_eps: float = 0.2  # ε, PPO clip range (symmetric unless clip_eps_high is set)
    clip_eps_low: float | None = None  # ε_low (DAPO clip-higher); None -> clip_eps
    clip_eps_high: float | None = None  # ε_high (DAPO clip-higher); None -> clip_eps
    dual_clip: float | None = None  # c of dual-clip PPO (c > 1); None disables
    policy_loss: Literal["ppo", "gspo"] = "ppo"  # gspo: sequence-level geometric-mean ratio
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    kl_coef: float = 0.0  # β, KL to the reference policy (0 disables the reference model)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False  # True: -β·KL per token folded into the reward (PPO style)
    entropy_coef: float = 0.0  # entropy bonus coefficient
    vf_coef: float = 0.5  # c_v, value-loss weight (shared actor-critic)
    value_clip: float | None = 0.2  # value-clipping range; None disables
    behav_weight_cap: float | None = 5.0  # decoupled PPO: cap on π_prox/π_behav (None: no cap)
    tis_cap: float | None = None  # truncated IS weight cap for sampler/trainer mismatch
    ppo_epochs: int = 1  # passes over each batch
    minibatches: int = 1  # optimizer steps per epoch
    micro_batches: int = 1  # gradient accumulation inside one optimizer step
    on_nan: Literal["skip", "stop"] = "skip"  # a NaN/inf loss or grad skips the update (counted) or stops

    @property
    def advantage_estimator(self) -> str:
        if self.advantage is not None:
            return self.advantage
        return "gae" if self.algorithm == "ppo" else "grpo"

    def validate(self, path: str) -> None:
        check(self.group_size >= 1, key(path, "group_size"), self.group_size, "must be >= 1")
        if self.algorithm == "grpo" or self.advantage_estimator in ("grpo", "rloo"):
            check(self.group_size >= 2, key(path, "group_size"), self.group_size,
                  f"must be >= 2 for group-normalised advantages ({self.advantage_estimator})")
        if self.advantage_estimator == "gae":
            check(self.algorithm == "ppo", key(path, "advantage"), self.advantage,
                  "gae needs a critic: set rl.algorithm=ppo")
        check(0.0 <= self.gamma <= 1.0, key(path, "gamma"), self.gamma, "must be in [0, 1]")
        check(0.0 <= self.lam <= 1.0, key(path, "lam"), self.lam, "must be in [0, 1]")
        check(0.0 < self.clip_eps < 1.0, key(path, "clip_eps"), self.clip_eps, "must be in (0, 1)")
        for name in ("clip_eps_low", "clip_eps_high"):
            v = getattr(self, name)
            if v is not None:
                check(0.0 < v < 10.0, key(path, name), v, "must be in (0, 10)")
        if self.dual_clip is not None:
            check(self.dual_clip > 1.0, key(path, "dual_clip"), self.dual_clip, "must be > 1")
        check(self.kl_coef >= 0.0, key(path, "kl_coef"), self.kl_coef, "must be >= 0")
        check(self.entropy_coef >= 0.0, key(path, "entropy_coef"), self.entropy_coef, "must be >= 0")
        check(self.vf_coef >= 0.0, key(path, "vf_coef"), self.vf_coef, "must be >= 0")
        if self.value_clip is not None:
            check(self.value_clip > 0, key(path, "value_clip"), self.value_clip, "must be > 0")
        if self.behav_weight_cap is not None:
            check(self.behav_weight_cap >= 1.0, key(path, "behav_weight_cap"), self.behav_weight_cap,
                  "must be >= 1")
        if self.tis_cap is not None:
            check(self.tis_cap >= 1.0, key(path, "tis_cap"), self.tis_cap, "must be >= 1")
        for name in ("ppo_epochs", "minibatches", "micro_batches"):
            v = getattr(self, name)
            check(v >= 1, key(path, name), v, "must be >= 1")
