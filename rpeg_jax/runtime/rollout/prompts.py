"""The prompt stream a run's steps draw from (StepPrompts: the data iterator's state node) and the
buffer of rollouts admitted ahead of their update under bounded asynchrony (RolloutBuffer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class StalenessError(RuntimeError):
    pass


@dataclass
class StepPrompts:
    """The data-iterator state node's value: one PromptBatch per step, fetched in step order.
    Remembers the pipeline state before each fetch, so a checkpoint can rewind to it.

    Under dynamic sampling with step admission (rl.filter_groups) a step draws prompts from the
    stream by `draw` instead: `cursor` is the stream's next (data step, index), `cursor_before[t]`
    where step t started drawing and `sources[t]` the (data step, index) of each group of its batch."""

    pipeline: Any
    cache: dict[int, Any] = field(default_factory=dict)
    before: dict[int, dict] = field(default_factory=dict)
    cursor: tuple[int, int] = (0, 0)
    cursor_before: dict[int, tuple[int, int]] = field(default_factory=dict)
    sources: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    filtered: dict[int, int] = field(default_factory=dict)  # groups dropped so far for step t

    def get(self, step: int):
        while step not in self.cache:
            state = self.pipeline.get_state()
            batch = next(self.pipeline)
            self.cache[batch.step], self.before[batch.step] = batch, state
            if batch.step > step:
                raise RuntimeError(f"data pipeline is at step {batch.step}, step {step} was asked for")
        for s in [s for s in self.cache if s < step - 1]:
            del self.cache[s]
        floor = min([step - 16] + [d for d, _ in self.cursor_before.values()])  # a checkpoint may rewind there
        for s in [s for s in self.before if s < floor]:
            del self.before[s]
        return self.cache[step]

    def draw(self, n: int) -> list[tuple[int, int, Any]]:
        """The stream's next n prompts as (data step, index, PromptBatch), advancing the cursor."""
        out = []
        d, i = self.cursor
        for _ in range(n):
            batch = self.get(d)
            out.append((d, i, batch))
            d, i = (d + 1, 0) if i + 1 == len(batch.prompt_tokens) else (d, i + 1)
        self.cursor = (d, i)
        return out

    def begin(self, step: int) -> None:
        """Step `step` starts drawing its groups (dynamic sampling), at its first piece."""
        self.cursor_before[step], self.sources[step], self.filtered[step] = self.cursor, [], 0
        for t in [t for t in self.cursor_before if t < step - 32]:
            for d in (self.cursor_before, self.sources, self.filtered):
                d.pop(t, None)

    def state(self) -> dict:
        return self.pipeline.get_state()

    def state_before(self, step: int) -> dict:
        """The pipeline state just before step `step`'s prompts were drawn."""
        return self.before[step]

    def state_at(self, cursor: tuple[int, int]) -> dict:
        """The pipeline state from which `draw` continues at `cursor` (its data step fetched again)."""
        d = cursor[0]
        return self.before[d] if d in self.before else self.pipeline.get_state()


@dataclass
class RolloutBuffer:
    """Rollouts admitted ahead of their update (bounded asynchrony): admission refuses a rollout
    for step t made with weights older than t - k (k = the graph's staleness). Survives resume
    through `admitted`."""

    staleness: int
    admitted: dict[int, int] = field(default_factory=dict)  # step -> weights version

    def admit(self, step: int, version: int) -> None:
        if step - version > self.staleness:
            raise StalenessError(
                f"rollout for step {step} with weights version {version} exceeds the staleness bound k={self.staleness}"
            )
        self.admitted[step] = version
        for s in [s for s in self.admitted if s < step - self.staleness - 1]:
            del self.admitted[s]
