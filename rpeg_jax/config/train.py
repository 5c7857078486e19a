"""Train section: the run loop's knobs (steps, seed, run directory, checkpoints, logging, host offload)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    mode: Literal["rl", "sft", "sft_then_rl"] = "rl"  # rl: RL steps; sft: supervised fine-tuning on chat
    #   transcripts (the sft section; runtime/sft.py); sft_then_rl: SFT into <run_dir>/sft, its policy
    #   exported to <run_dir>/sft/model, then RL from it (model.path) in <run_dir>/rl
    steps: int = 100  # RL steps (one batch of rollouts each)
    seed: int = 0
    run_dir: str = "runs/default"  # metrics.jsonl, checkpoints/, trace.json, plots go here
    resume: Literal["auto", "never"] = "auto"
    checkpoint_every: int = 50  # steps; 0 disables periodic checkpoints (a final one is still written)
    keep_checkpoints: int = 2  # retention: newest N committed (sealed) steps kept; older ones are deleted
    #   only after a newer save has committed, so a failed save never costs the last good step
    log_every: int = 1  # steps between console/TensorBoard records (metrics.jsonl keeps every step)
    progress: bool = True  # progress bar with ETA on process 0
    tensorboard: bool = True
    offload: Literal["none", "optimizer", "optimizer+reference"] = "none"  # state kept in host memory
    #   (pinned_host) between steps and moved to the device inside the programs that use it
    #   (runtime/offload.py): the optimizer states (actor, critic), and with "+reference" the
    #   reference model's weights too (an error with rl.kl_coef = 0: there is no reference then)
    pack_sequences: bool = False  # the updates (actor, critic) run over packed rows: each micro-batch's
    #   sequences (prompt + response, no padding) first-fit-decreasing into rows of P + R tokens, a
    #   segment each (rl/packing.py); the same losses, metrics and optimizer steps as padded, to float32
    #   rounding. Turns the shared-prompt pass (models/prefix.py) off in the updates; the scoring
    #   forwards stay padded. Not with sharding.axis_types=explicit

    def validate(self, path: str) -> None:
        check(self.steps >= 0, key(path, "steps"), self.steps, "must be >= 0")
        check(self.checkpoint_every >= 0, key(path, "checkpoint_every"), self.checkpoint_every, "must be >= 0")
        check(self.keep_checkpoints >= 1, key(path, "keep_checkpoints"), self.keep_checkpoints, "must be >= 1")
        check(self.log_every >= 1, key(path, "log_every"), self.log_every, "must be >= 1")
        check(bool(self.run_dir), key(path, "run_dir"), self.run_dir, "must not be empty")
