"""RL section: algorithm, advantage estimator, policy/value losses and their knobs (paper symbols).

Read by `rpeg_jax.rl` (advantage stage and update stages) and the graph builder. Symbols:
G group size, ε clip range, β KL coefficient, γ discount, λ GAE trace decay, c_v value-loss
weight, c_e entropy weight, C importance-weight caps. Papers: PPO (Schulman 2017), GAE
(Schulman 2016), GRPO (Shao 2024), Dr. GRPO (Liu 2025), RLOO (Ahmadian 2024), DAPO (Yu 2025),
dual-clip PPO (Ye 2020), GSPO (Zheng 2025), decoupled PPO (Fu 2025, AReaL), TIS (Yao 2025).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key

LOSS_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    algorithm: Literal["grpo", "ppo"] = "grpo"
    group_size: int = 8  # G: completions sampled per prompt (GRPO needs G >= 2)
    advantage: Literal["grpo", "rloo", "gae"] | None = None  # None -> grpo for GRPO, gae for PPO
    norm_adv_by_std: bool = True  # GRPO: divide by the group std (False = Dr. GRPO)
    adv_eps: float = 1e-6  # ε in (r - mean)/(std + ε) (GRPO) and in batch whitening
    whiten_advantages: bool = False  # batch-whiten advantages over response tokens (masked)
    gamma: float = 1.0  # γ, GAE discount (per token)
    lam: float = 0.95  # λ, GAE trace decay
    clip_eps: float = 0.2  # ε, PPO clip range (symmetric unless clip_eps_low/high are set)
    clip_eps_low: float | None = None  # ε_low (DAPO clip-higher): ratio floor 1-ε_low; None -> ε
    clip_eps_high: float | None = None  # ε_high (DAPO clip-higher): ratio ceiling 1+ε_high; None -> ε
    dual_clip: float | None = None  # c of dual-clip PPO (Ye 2020), c > 1: bounds the loss at -c·A for A<0
    policy_loss: Literal["ppo", "gspo"] = "ppo"  # gspo: sequence-level geometric-mean ratio (GSPO-token)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    loss_agg_norm: int | None = None  # tokens; Dr. GRPO's constant normaliser; None -> R (response length)
    kl_coef: float = 0.0  # β, KL to the reference policy (0 disables the reference model)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # Schulman's estimators of KL(π_θ || π_ref)
    kl_in_reward: bool = False  # True: -β·KL per token folded into the reward (PPO style), not the loss
    entropy_coef: float = 0.0  # c_e, entropy bonus coefficient
    vf_coef: float = 0.5  # c_v, value-loss weight (shared actor-critic: L = L_pg + c_v·L_v)
    value_clip: float | None = 0.2  # ε_v, value clipping range around the old values; None disables
    behav_weight_cap: float | None = 5.0  # decoupled PPO: drop tokens with π_prox/π_behav > C (None: keep all)
    tis_cap: float | None = None  # TIS: truncate the weight π_prox/π_behav at C (None: no truncation)
    ppo_epochs: int = 1  # passes over each batch
    minibatches: int = 1  # optimizer steps per epoch (batch split into this many minibatches)
    micro_batches: int = 1  # gradient accumulation: micro-batches per minibatch
    # scoring forwards (reference / old-policy / critic over the whole batch before the update):
    # run as a loop over this many micro-batches, each spread over all devices (peak activations
    # are one micro-batch's; same values). verl's log_prob_micro_batch_size_per_gpu, as a count.
    forward_micro_batches: int = 1
    on_nan: Literal["skip", "stop"] = "skip"  # a NaN/inf loss or grad skips the update (counted) or stops
    # DAPO (Yu 2025) dynamic sampling: a group whose rewards are all equal (zero advantage) is dropped
    # from the batch and more groups are generated until data.prompts_per_step groups remain
    filter_groups: Literal["none", "zero_variance"] = "none"
    filter_max_rounds: int = 10  # step admission: generation rounds per step at most (the first included);
    #   continuous: at most this many x prompts_per_step groups filtered per step; 0 = unbounded;
    #   exhausted: the step fails (FilterExhausted) rather than train on a short or zero-advantage batch
    overlong: Literal["none", "mask", "soft_penalty"] = "none"  # DAPO: truncated responses (cap, no eos)
    #   get zero policy-loss weight (mask), or a length penalty is added to every reward (soft_penalty)
    overlong_buffer: int = 0  # L_cache (tokens) of soft_penalty: the penalty ramps over the last L_cache
    #   tokens before rollout.max_new_tokens; required, 0 < L_cache < max_new_tokens
    overlong_penalty: float = 1.0  # soft_penalty's factor: the penalty at the cap (reward - factor)
    # Qwen3-MoE (model.num_experts > 0; models/moe.py):
    router_aux_loss: float = 0.0  # coefficient of the router's load-balancing loss (HF/Switch:
    #   X·Σ_x f_x·P_x over the update forward's real tokens, all sparse layers) added to the policy loss;
    #   logged as moe/aux_loss whatever the coefficient
    routing: Literal["recompute", "replay"] = "recompute"  # the trainer's forwards route each token by
    #   their own router (recompute) or impose the experts the sampler chose for it (replay; the gate
    #   weights still come from the trainer's router over those experts); moe/routing_agreement (the
    #   fraction of tokens whose top-k expert sets match the sampler's) is logged either way

    @property
    def advantage_estimator(self) -> str:
        if self.advantage is not None:
            return self.advantage
        return "gae" if self.algorithm == "ppo" else "grpo"

    @property
    def eps_low(self) -> float:
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    def validate(self, path: str) -> None:
        check(self.group_size >= 1, key(path, "group_size"), self.group_size, "must be >= 1")
        if self.algorithm == "grpo" or self.advantage_estimator in ("grpo", "rloo"):
            check(
                self.group_size >= 2,
                key(path, "group_size"),
                self.group_size,
                f"must be >= 2 for group-normalised advantages ({self.advantage_estimator})",
            )
        if self.advantage_estimator == "gae":
            check(
                self.algorithm == "ppo",
                key(path, "advantage"),
                self.advantage,
                "gae needs a critic: set rl.algorithm=ppo",
            )
        check(self.adv_eps > 0.0, key(path, "adv_eps"), self.adv_eps, "must be > 0")
        check(0.0 <= self.gamma <= 1.0, key(path, "gamma"), self.gamma, "must be in [0, 1]")
        check(0.0 <= self.lam <= 1.0, key(path, "lam"), self.lam, "must be in [0, 1]")
        check(0.0 < self.clip_eps < 1.0, key(path, "clip_eps"), self.clip_eps, "must be in (0, 1)")
        if self.clip_eps_low is not None:
            check(
                0.0 < self.clip_eps_low < 1.0,
                key(path, "clip_eps_low"),
                self.clip_eps_low,
                "must be in (0, 1) (the ratio floor 1-ε_low must stay positive)",
            )
        if self.clip_eps_high is not None:
            check(0.0 < self.clip_eps_high < 10.0, key(path, "clip_eps_high"), self.clip_eps_high, "must be in (0, 10)")
        if self.dual_clip is not None:
            check(self.dual_clip > 1.0, key(path, "dual_clip"), self.dual_clip, "must be > 1")
        if self.loss_agg_norm is not None:
            check(self.loss_agg_norm >= 1, key(path, "loss_agg_norm"), self.loss_agg_norm, "must be >= 1")
        check(self.kl_coef >= 0.0, key(path, "kl_coef"), self.kl_coef, "must be >= 0")
        check(self.entropy_coef >= 0.0, key(path, "entropy_coef"), self.entropy_coef, "must be >= 0")
        check(self.vf_coef >= 0.0, key(path, "vf_coef"), self.vf_coef, "must be >= 0")
        if self.value_clip is not None:
            check(self.value_clip > 0, key(path, "value_clip"), self.value_clip, "must be > 0")
        if self.behav_weight_cap is not None:
            check(self.behav_weight_cap >= 1.0, key(path, "behav_weight_cap"), self.behav_weight_cap, "must be >= 1")
        if self.tis_cap is not None:
            check(self.tis_cap >= 1.0, key(path, "tis_cap"), self.tis_cap, "must be >= 1")
        check(self.router_aux_loss >= 0.0, key(path, "router_aux_loss"), self.router_aux_loss, "must be >= 0")
        check(
            self.routing in ("recompute", "replay"),
            key(path, "routing"),
            self.routing,
            "must be 'recompute' or 'replay'",
        )
        for name in ("ppo_epochs", "minibatches", "micro_batches", "forward_micro_batches"):
            v = getattr(self, name)
            check(v >= 1, key(path, name), v, "must be >= 1")
        check(
            self.filter_groups in ("none", "zero_variance"),
            key(path, "filter_groups"),
            self.filter_groups,
            "must be 'none' or 'zero_variance'",
        )
        check(self.filter_max_rounds >= 0, key(path, "filter_max_rounds"), self.filter_max_rounds, "must be >= 0")
        if self.filter_groups != "none":
            check(
                self.group_size >= 2,
                key(path, "group_size"),
                self.group_size,
                "must be >= 2 for rl.filter_groups (a group of one always has zero variance)",
            )
        check(
            self.overlong in ("none", "mask", "soft_penalty"),
            key(path, "overlong"),
            self.overlong,
            "must be 'none', 'mask' or 'soft_penalty'",
        )
        if self.overlong == "soft_penalty":
            check(
                self.overlong_buffer > 0,
                key(path, "overlong_buffer"),
                self.overlong_buffer,
                "must be > 0 with rl.overlong=soft_penalty (DAPO's L_cache, in tokens)",
            )
            check(self.overlong_penalty >= 0.0, key(path, "overlong_penalty"), self.overlong_penalty, "must be >= 0")
