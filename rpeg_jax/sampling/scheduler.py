"""Host scheduler of the paged sampler: slots, group admission, chunk page reservation, preemption.

Pure Python/NumPy (no JAX); `Sampler` (sampling/sampler.py) drives it between device calls:

    plan = sched.admit(k)         # whole groups into free slots while the free-page watermark holds
    ... device: prefill plan.rows, then copy plan.copies (GRPO fork of the partial last page)
    k, preempted = sched.reserve(k)   # pages for the next k decode steps of every running slot
    ... device: decode chunk of up to k steps
    sched.finish(seq)             # a finished sequence frees its slot and pages

Sequence state: `known` = prompt + generated tokens; the slot's cache holds positions < pos =
len(known) - 1 and the last token (at pos) is the next decode step's input. A fresh group prefills
prompt[:-1] once into its first slot and forks it into the others; a group resumed after preemption
prefills each member's known[:-1] (recompute: tokens, logprobs and versions are kept).

Running out of pages is defined behaviour: admission keeps `watermark_pages` free (and counts the
running slots' next chunk); `reserve` shrinks the chunk to what fits; if not even one step fits,
the youngest group is preempted (the last member of it when it is the only group left) and requeued
at the front. The Sampler rejects at construction a pool that cannot hold one maximal sequence, so
one sequence alone always makes progress.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from rpeg_jax.sampling.allocator import PageAllocator


@dataclasses.dataclass(eq=False)
class Sequence:
    request: int  # index of the prompt in the caller's list
    sample_index: int  # index within the prompt's n completions
    prompt: list[int]
    end: int  # stop once len(known) reaches this (prompt + max_new_tokens)
    opts: Any = None  # the Sampler's per-request settings (sampling params, stop ids, key ids)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    preemptions: int = 0
    finish_reason: str | None = None

    @property
    def pos(self) -> int:
        return len(self.prompt) + len(self.tokens) - 1

    def known(self) -> list[int]:
        return self.prompt + self.tokens


@dataclasses.dataclass(eq=False)
class Group:
    """An admission unit: sequences admitted, prefilled and preempted together."""

    seqs: list[Sequence]
    order: int = -1  # admission counter (the largest is the youngest)

    @property
    def fresh(self) -> bool:
        return all(not s.tokens for s in self.seqs)


@dataclasses.dataclass
class AdmitPlan:
    rows: list[tuple[int, list[int]]]  # (slot, tokens to prefill at positions 0..)
    copies: list[tuple[int, int]]  # (src_page, dst_page)
    groups: list[Group]


class Scheduler:
    def __init__(self, alloc: PageAllocator, watermark_pages: int):
        self.alloc = alloc
        self.watermark_pages = watermark_pages
        self.waiting: collections.deque[Group] = collections.deque()
        self.running: list[Group] = []
        self.free_slots = list(range(alloc.max_slots))
        self._order = 0
        self.num_preemptions = 0

    # ---- queries ------------------------------------------------------------------------------
    def running_seqs(self) -> list[Sequence]:
        return [s for g in self.running for s in g.seqs if s.slot >= 0]

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _pf(self, n: int) -> int:
        return self.alloc.pages_for(n)

    def _group_need(self, g: Group, k: int) -> int:
        """Pages the group takes for its prefill, fork and first k decode steps."""
        if g.fresh:
            s0 = g.seqs[0]
            base, grown = self._pf(s0.pos), self._pf(min(s0.pos + k, s0.end - 1))
            partial = 1 if s0.pos % self.alloc.page_size else 0
            return base + (len(g.seqs) - 1) * partial + len(g.seqs) * (grown - base)
        return sum(self._pf(min(s.pos + k, s.end - 1)) for s in g.seqs)

    def _running_need(self, k: int) -> int:
        return sum(self.alloc.need(s.slot, min(s.pos + k, s.end - 1)) for s in self.running_seqs())

    # ---- submission and admission ---------------------------------------------------------------
    def submit(self, seqs: list[Sequence], front: bool = False) -> None:
        """Queue sequences as groups of at most max_slots (a larger n is split)."""
        cap = self.alloc.max_slots
        groups = [Group(seqs[i:i + cap]) for i in range(0, len(seqs), cap)]
        if front:
            self.waiting.extendleft(reversed(groups))
        else:
            self.waiting.extend(groups)

    def admit(self, k: int) -> AdmitPlan:
        """Place waiting groups (FIFO) while slots and pages allow; allocates prefill/fork pages."""
        plan = AdmitPlan([], [], [])
        budget = self.alloc.num_free - self._running_need(k)
        while self.waiting and len(self.waiting[0].seqs) <= len(self.free_slots):
            g = self.waiting[0]
            need = self._group_need(g, k)
            alone = not self.running
            if need + self.watermark_pages > budget:
                if not alone:
                    break
                if self._group_need(g, 1) > budget:  # even one step does not fit: split the group
                    if len(g.seqs) == 1:
                        raise RuntimeError("page pool too small for one sequence (checked at construction)")
                    half = len(g.seqs) // 2
                    self.waiting.popleft()
                    self.waiting.extendleft([Group(g.seqs[half:]), Group(g.seqs[:half])])
                    continue
            self.waiting.popleft()
            self._place(g, plan)
            budget -= need
        return plan

    def _place(self, g: Group, plan: AdmitPlan) -> None:
        self.free_slots.sort()
        for s in g.seqs:
            s.slot = self.free_slots.pop(0)
        g.order, self._order = self._order, self._order + 1
        if g.fresh:
            s0 = g.seqs[0]
            self.alloc.grow(s0.slot, s0.pos)
            if s0.pos > 0:
                plan.rows.append((s0.slot, s0.prompt[:-1]))
            plan.copies += self.alloc.fork(s0.slot, [s.slot for s in g.seqs[1:]], s0.pos)
        else:
            for s in g.seqs:
                self.alloc.grow(s.slot, s.pos)
                if s.pos > 0:
                    plan.rows.append((s.slot, s.known()[:-1]))
        self.running.append(g)
        plan.groups.append(g)

    # ---- chunk reservation and preemption -------------------------------------------------------
    def reserve(self, k_max: int) -> tuple[int, list[Sequence]]:
        """Reserve pages so every running slot can take k steps; returns (k, preempted). k = 0 when
        nothing runs. Shrinks k to fit; preempts the youngest group while not even 1 step fits."""
        preempted: list[Sequence] = []
        while self.running_seqs() and self._running_need(1) > self.alloc.num_free:
            preempted += self.preempt_youngest()
        seqs = self.running_seqs()
        if not seqs:
            return 0, preempted
        lo, hi = 1, min(k_max, max(s.end - 1 - s.pos for s in seqs))
        while lo < hi:  # largest k in [1, hi] whose pages fit (need is monotone in k)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._running_need(mid) <= self.alloc.num_free else (lo, mid - 1)
        for s in seqs:
            self.alloc.grow(s.slot, min(s.pos + lo, s.end - 1))
        return lo, preempted

    def preempt_youngest(self) -> list[Sequence]:
        """Free the youngest group's slots and pages and requeue it at the front (tokens kept)."""
        g = max(self.running, key=lambda g: g.order)
        live = [s for s in g.seqs if s.slot >= 0]
        if len(self.running) == 1 and len(live) > 1:
            victims = [live[-1]]  # the only group left: shed its last member, keep the rest running
            g.seqs.remove(live[-1])
        else:
            victims = live
            self.running.remove(g)
        for s in victims:
            self._release(s)
            s.preemptions += 1
        self.num_preemptions += len(victims)
        self.submit(victims, front=True)
        return victims

    def finish(self, s: Sequence, reason: str) -> None:
        s.finish_reason = reason
        self._release(s)
        self.running = [g for g in self.running if any(x.slot >= 0 for x in g.seqs)]

    def preempt_all(self) -> list[Sequence]:
        """Requeue every running sequence (weights changed under them: recompute policy)."""
        out = []
        for g in sorted(self.running, key=lambda g: g.order, reverse=True):
            live = [s for s in g.seqs if s.slot >= 0]
            for s in live:
                self._release(s)
                s.preemptions += 1
            self.submit(live, front=True)
            out += live
        self.running = []
        return out

    def _release(self, s: Sequence) -> None:
        self.alloc.release(s.slot)
        self.free_slots.append(s.slot)
        s.slot = -1
