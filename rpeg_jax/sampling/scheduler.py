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

Sharded pool (`ShardedPages` with D data shards; D = 1 is the plain pool): each shard has its own
slots and pages, so every rule above holds per shard. A group is admitted WHOLE into one shard (its
prompt is prefilled there once and forked within the shard); admission balances groups over shards
(the shard with the most free slots, then the most free pages, among those the group fits in); the
watermark, the chunk reservation and preemption (the youngest group of the shard that ran out) are
per shard. The chunk length k is the same for every shard (the smallest that every shard fits).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from rpeg_jax.sampling.allocator import ShardedPages
from rpeg_jax.shapes import admission as policy


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
    experts: Any = None  # MoE models: int16 [positions processed, S, k], each cached position's experts
    keep: bool = False  # pause instead of finishing: the slot and its KV stay (an episode's turn end:
    #                     Scheduler.resume appends the observation to it, Scheduler.release frees it)

    @property
    def pos(self) -> int:
        return len(self.prompt) + len(self.tokens) - 1

    def known(self) -> list[int]:
        return self.prompt + self.tokens

    def state(self, opts: int) -> dict:
        """JSON of the sequence (`opts`: the index of its request's settings in the snapshot); its
        tokens, logprobs and versions go into the snapshot's arrays (Sampler.snapshot)."""
        return {
            "request": self.request,
            "sample_index": self.sample_index,
            "prompt": list(self.prompt),
            "end": self.end,
            "opts": opts,
            "prompt_id": int(self.opts[1]),
            "generated": len(self.tokens),  # its tokens, logprobs and versions: in the snapshot's arrays
            "slot": self.slot,
            "preemptions": self.preemptions,
            "finish_reason": self.finish_reason,
            "keep": self.keep,
            # a MoE model's expert record (int16 [positions, S, k]) as its shape and flat values
            "experts": None if self.experts is None else [list(self.experts.shape), self.experts.ravel().tolist()],
        }

    @classmethod
    def from_state(cls, d: dict, opts: list, tokens: list, logprobs: list, versions: list) -> "Sequence":
        return cls(
            request=int(d["request"]),
            sample_index=int(d["sample_index"]),
            prompt=[int(t) for t in d["prompt"]],
            end=int(d["end"]),
            opts=(opts[int(d["opts"])], int(d["prompt_id"])),
            tokens=tokens,
            logprobs=logprobs,
            versions=versions,
            slot=int(d["slot"]),
            preemptions=int(d["preemptions"]),
            finish_reason=d["finish_reason"],
            keep=bool(d.get("keep", False)),
            experts=None
            if d.get("experts") is None
            else np.asarray(d["experts"][1], np.int16).reshape(d["experts"][0]),
        )


@dataclasses.dataclass(eq=False)
class Group:
    """An admission unit: sequences admitted, prefilled and preempted together, in one shard."""

    seqs: list[Sequence]
    order: int = -1  # admission counter (the largest is the youngest)
    shard: int = -1  # the pool shard its slots and pages are in (while running)

    @property
    def fresh(self) -> bool:
        return all(not s.tokens for s in self.seqs)


@dataclasses.dataclass
class AdmitPlan:
    rows: list[tuple[int, list[int]]]  # (slot, tokens to prefill at positions 0..)
    copies: list[tuple[int, int, int]]  # (shard, src_page, dst_page), local page ids
    groups: list[Group]
    appends: list[tuple[int, list[int], int]] = dataclasses.field(default_factory=list)  # (slot, tokens,
    #   start): a resumed sequence's tokens to prefill at positions start.. after its cached KV


class Scheduler:
    def __init__(self, alloc: ShardedPages, watermark_pages: int):
        self.alloc = alloc
        self.watermark_pages = watermark_pages  # per shard
        self.waiting: collections.deque[Group] = collections.deque()
        self.running: list[Group] = []
        self.free_slots = [list(alloc.shard_slots(d)) for d in range(alloc.num_shards)]
        self._order = 0
        self.num_preemptions = 0
        self.paused: list[Sequence] = []  # finished with keep: slot and pages held until resume/release
        self.resuming: collections.deque[tuple[Sequence, int]] = collections.deque()  # (sequence, start)

    # ---- snapshots ----------------------------------------------------------------------------
    def state(self, index: dict[int, int]) -> dict:
        """JSON of the queues and slots; sequences by `index[id(seq)]` (Sampler.snapshot)."""
        group = lambda g: {"seqs": [index[id(s)] for s in g.seqs], "order": g.order, "shard": g.shard}  # noqa: E731
        return {
            "waiting": [group(g) for g in self.waiting],
            "running": [group(g) for g in self.running],
            "paused": [index[id(s)] for s in self.paused],
            "resuming": [[index[id(s)], start] for s, start in self.resuming],
            "free_slots": [list(f) for f in self.free_slots],
            "order": self._order,
            "preemptions": self.num_preemptions,
        }

    def load(self, state: dict, seqs: list[Sequence]) -> None:
        group = lambda d: Group([seqs[int(i)] for i in d["seqs"]], int(d["order"]), int(d["shard"]))  # noqa: E731
        self.waiting = collections.deque(group(d) for d in state["waiting"])
        self.running = [group(d) for d in state["running"]]
        self.paused = [seqs[int(i)] for i in state.get("paused", [])]
        self.resuming = collections.deque((seqs[int(i)], int(start)) for i, start in state.get("resuming", []))
        self.free_slots = [[int(x) for x in f] for f in state["free_slots"]]
        self._order, self.num_preemptions = int(state["order"]), int(state["preemptions"])

    # ---- queries ------------------------------------------------------------------------------
    def running_seqs(self, shard: int | None = None) -> list[Sequence]:
        return [s for g in self.running if shard is None or g.shard == shard for s in g.seqs if s.slot >= 0]

    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.resuming

    def _held(self, shard: int) -> bool:
        """Whether paused or resuming sequences hold slots (and pages) in `shard`."""
        held = [*self.paused, *(s for s, _ in self.resuming)]
        return any(s.slot >= 0 and self.alloc.shard(s.slot) == shard for s in held)

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

    def _running_need(self, k: int, shard: int) -> int:
        return sum(self.alloc.need(s.slot, min(s.pos + k, s.end - 1)) for s in self.running_seqs(shard))

    def _fits(self, k: int) -> bool:
        return all(self._running_need(k, d) <= self.alloc.num_free(d) for d in range(self.alloc.num_shards))

    # ---- submission and admission ---------------------------------------------------------------
    def submit(self, seqs: list[Sequence], front: bool = False) -> None:
        """Queue sequences as groups of at most one shard's slots (a larger n is split)."""
        cap = self.alloc.slots_per_shard
        groups = [Group(seqs[i : i + cap]) for i in range(0, len(seqs), cap)]
        if front:
            self.waiting.extendleft(reversed(groups))
        else:
            self.waiting.extend(groups)

    def admit(self, k: int) -> AdmitPlan:
        """Place resumed sequences (in their own slots), then waiting groups (FIFO) while slots and pages
        allow; allocates prefill/fork pages."""
        plan = AdmitPlan([], [], [])
        shards = range(self.alloc.num_shards)
        budget = [self.alloc.num_free(d) - self._running_need(k, d) for d in shards]
        while self.resuming:
            s, start = self.resuming.popleft()
            d = self.alloc.shard(s.slot)
            if self.alloc.need(s.slot, s.pos) > budget[d]:  # its appended tokens' pages do not fit:
                self._release(s)  # its KV goes, it waits as a new request (prefilled from position 0)
                self.submit([s], front=True)
                continue
            budget[d] -= self.alloc.need(s.slot, min(s.pos + k, s.end - 1))
            self.alloc.grow(s.slot, s.pos)
            if s.pos > start:  # (nothing appended: the cache is complete, the last token decodes next)
                plan.appends.append((s.slot, s.prompt[start : s.pos], start))
            g = Group([s], self._order, d)
            self._order += 1
            self.running.append(g)
            plan.groups.append(g)
        while self.waiting:
            g = self.waiting[0]
            need = self._group_need(g, k)
            open_ = [d for d in shards if policy.admits(len(g.seqs), len(self.free_slots[d]))]
            if not open_:
                break
            # Balance: most free slots, then most free pages; prefer a shard the group fits in.
            d = max(
                open_, key=lambda d: (need + self.watermark_pages <= budget[d], len(self.free_slots[d]), budget[d], -d)
            )
            if need + self.watermark_pages > budget[d]:
                idle = [e for e in open_ if not any(x.shard == e for x in self.running)]
                if not idle:
                    break
                d = max(idle, key=lambda e: (budget[e], -e))  # alone in its shard: admit anyway
                if self._group_need(g, 1) > budget[d]:  # even one step does not fit: split the group
                    if self._held(d):  # paused sequences hold pages: they resume (or release them) first
                        break
                    if len(g.seqs) == 1:
                        raise RuntimeError("page pool too small for one sequence (checked at construction)")
                    half = len(g.seqs) // 2
                    self.waiting.popleft()
                    self.waiting.extendleft([Group(g.seqs[half:]), Group(g.seqs[:half])])
                    continue
            self.waiting.popleft()
            self._place(g, plan, d)
            budget[d] -= need
        return plan

    def _place(self, g: Group, plan: AdmitPlan, shard: int) -> None:
        free = self.free_slots[shard]
        free.sort()
        for s in g.seqs:
            s.slot = free.pop(0)
        g.order, self._order = self._order, self._order + 1
        g.shard = shard
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
        nothing runs. Shrinks k to fit every shard; preempts, in a shard where not even 1 step fits,
        that shard's youngest group until it does."""
        preempted: list[Sequence] = []
        for d in range(self.alloc.num_shards):
            while self.running_seqs(d) and self._running_need(1, d) > self.alloc.num_free(d):
                preempted += self.preempt_youngest(d)
        seqs = self.running_seqs()
        if not seqs:
            return 0, preempted
        lo, hi = 1, min(k_max, max(s.end - 1 - s.pos for s in seqs))
        while lo < hi:  # largest k in [1, hi] whose pages fit in every shard (need is monotone in k)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._fits(mid) else (lo, mid - 1)
        for s in seqs:
            self.alloc.grow(s.slot, min(s.pos + lo, s.end - 1))
        return lo, preempted

    def preempt_youngest(self, shard: int = 0) -> list[Sequence]:
        """Free the youngest group of `shard` (slots and pages) and requeue it at the front (tokens
        kept)."""
        mine = [g for g in self.running if g.shard == shard]
        g = max(mine, key=lambda g: g.order)
        live = [s for s in g.seqs if s.slot >= 0]
        if len(mine) == 1 and len(live) > 1:
            victims = [live[-1]]  # the shard's only group: shed its last member, keep the rest running
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
        """A sequence is done: its slot and pages are freed, or with `keep` (not aborted) it is paused:
        out of its group, slot and pages held for `resume` or `release`."""
        s.finish_reason = reason
        if s.keep and reason != "abort":
            for g in self.running:
                if s in g.seqs:
                    g.seqs.remove(s)
            self.paused.append(s)
        else:
            self._release(s)
        self.running = [g for g in self.running if any(x.slot >= 0 for x in g.seqs)]

    def resume(self, old: Sequence, new: Sequence) -> None:
        """`new` continues paused `old` in its slot: new.prompt is old.known() plus appended tokens
        (e.g. an episode's observation). The slot's cache holds positions < old.pos; positions
        old.pos .. new.pos - 1 (old's last token and the appended ones but the last) are prefilled at
        the next admission, ahead of the waiting groups (or, when their pages do not fit then, the
        slot is freed and `new` waits as a new request, prefilled from its start)."""
        if old not in self.paused:
            raise ValueError("resume: the sequence is not paused (submitted with keep, finished, not released)")
        if new.prompt[: len(old.prompt) + len(old.tokens)] != old.known() or new.pos < old.pos:
            raise ValueError("resume: the new sequence's prompt must extend the paused one's tokens")
        self.paused.remove(old)
        if old.slot < 0:  # its KV was dropped (drop_paused_kv): a new request, prefilled from its start
            self.submit([new], front=True)
            return
        new.slot, old.slot = old.slot, -1
        self.resuming.append((new, old.pos))

    def drop_paused_kv(self) -> None:
        """Free the slots and pages of paused and resuming sequences (the weights changed under their
        KV: on_weight_update=recompute); a paused one resumes as a new request, a resuming one waits
        as one now."""
        for s in self.paused:
            if s.slot >= 0:
                self._release(s)
        while self.resuming:
            s, _ = self.resuming.pop()
            self._release(s)
            self.submit([s], front=True)

    def release(self, s: Sequence) -> None:
        """A paused sequence's slot and pages go back (its episode is over)."""
        if s in self.paused:
            self.paused.remove(s)
            if s.slot >= 0:  # (drop_paused_kv may have freed it already)
                self._release(s)

    def abort(self, seqs: list[Sequence]) -> None:
        """Remove sequences: running ones free their slot and pages, queued ones leave the queue."""
        gone = {id(s) for s in seqs}
        for s in seqs:
            if s.slot >= 0:
                self.finish(s, "abort")
            else:
                s.finish_reason = "abort"
        for g in list(self.waiting):
            g.seqs = [s for s in g.seqs if id(s) not in gone]
        self.waiting = collections.deque(g for g in self.waiting if g.seqs)
        self.resuming = collections.deque((s, start) for s, start in self.resuming if id(s) not in gone)

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
        self.drop_paused_kv()
        return out

    def _release(self, s: Sequence) -> None:
        self.alloc.release(s.slot)
        self.free_slots[self.alloc.shard(s.slot)].append(s.slot)
        s.slot = -1
