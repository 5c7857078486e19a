"""Pipeline section: the RPEG structural knobs (paper vocabulary) and the plan source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key

FUSIONS = ("forwards", "advantage")  # forwards: ref+old+critic forward as one pass; advantage: into update


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    staleness: int = 0  # k: generate at step t reads actor version t-k (0 = synchronous on-policy)
    share_actor_critic: bool = False  # one backbone with policy and value heads (PPO)
    fuse: tuple[str, ...] = ()  # subset of FUSIONS
    elide_old_forward: bool = False  # reuse the sampler's logprobs as π_old when they match the trainer's
    # One optimizer step per batch (rl.ppo_epochs = rl.minibatches = 1): the update's own first
    # forward runs at exactly the parameters a separate scoring pass would use, so that pass can go.
    proximal_from_update: bool = False  # π_prox (decoupled PPO) / π_old = stop_gradient(π_θ) of the
    #   actor update's own forward: old_forward is dropped; exact, also under staleness k >= 1
    values_from_critic_update: bool = False  # PPO: V_φ(s_t) for GAE = stop_gradient of the critic update's
    #   own forward (one fused program: values -> GAE -> value loss); critic_forward is dropped; exact
    pieces: int = 1  # pieces generation is split into for streaming to downstream stages
    placement: Literal["colocated", "split"] = "colocated"
    split_sizes: tuple[int, ...] = ()  # split: devices for (generation, training)
    plan: str = "manual"  # "auto" (planner), "manual" (from these knobs), or a plan JSON path

    def validate(self, path: str) -> None:
        check(0 <= self.staleness <= 16, key(path, "staleness"), self.staleness, "must be in [0, 16]")
        for f in self.fuse:
            check(f in FUSIONS, key(path, "fuse"), f, f"unknown fusion; known: {', '.join(FUSIONS)}")
        check(self.pieces >= 1, key(path, "pieces"), self.pieces, "must be >= 1")
        if self.placement == "split":
            check(
                len(self.split_sizes) == 2 and all(s >= 1 for s in self.split_sizes),
                key(path, "split_sizes"),
                list(self.split_sizes),
                "placement=split needs two positive sizes (generation, training)",
            )
