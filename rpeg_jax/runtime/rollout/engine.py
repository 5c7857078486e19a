"""The rollout engine: what the rollout sources (runtime/rollout/sources.py, continuous.py) ask of
generation. sampling/sampler.Sampler is the engine today; this protocol is the seam where another
one plugs in (a tool-using multi-turn episode runner over the Sampler, or an external server), with
no change to the sources, the layout or the trainer.

Contract: sequences carry their tokens, the behaviour logprob and the policy version of every token
(`policy_versions` / `versions`); weights arrive as the actor's parameter tree in the rollout layout
with a version number; everything is a function of seeds and step counts, never of timing.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class RolloutEngine(Protocol):
    version: int  # the weights version serving new tokens
    cfg: Any  # the engine's settings (max_slots: the sequences it runs at once)

    def update_weights(self, params: Any, version: int | None = None) -> None:
        """Serve `params` as `version` from the next decode chunk (no recompile)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: Any, *, prompt_ids=None, lengths=None) -> list:
        """Sample every prompt's completions to the end (step admission); RequestOutputs in order."""

    def submit(self, prompts: Sequence[Sequence[int]], params: Any, *, prompt_ids=None, lengths=None) -> list:
        """Queue prompts' sequences without running them (continuous admission); returns them."""

    def step(self) -> list:
        """Admit queued sequences, run one decode chunk; returns the sequences that finished."""

    def abort(self, seqs: Sequence[Any]) -> None:
        """Take sequences out of the engine (their slots and KV freed)."""

    def stats(self) -> dict:
        """Counters (decode steps, busy slot-steps, tokens, preemptions) for the rollout metrics."""
