"""Host-side KV page allocator: a free stack plus per-page reference counts (NumPy, no JAX).

The sampler's scheduler (`sampling/scheduler.py`) calls it between device calls only, so nothing
allocates inside jit. Pages for the next decode chunk are reserved (`grow`) before the chunk starts.

Conventions
- Page 0 is the null page: it is never handed out, and unused page-table entries point at it so
  device gathers stay in range (its contents are masked out by attention anyway).
- A slot holds an ordered list of pages; token t of the slot lives in page `pages[t // page_size]`
  at offset `t % page_size`.
- `fork(parent, children, n_tokens)` shares the parent's *full* pages (n_tokens // page_size of
  them) by reference count and gives each child a fresh page for the partial last page, returning
  the (src, dst) copies the device must make. Shared pages are therefore always full and
  immutable: a slot only writes at positions >= n_tokens, which lie in its own pages.
- Invariants (`check()`; tests verify them independently): the refcount of a page equals the
  number of slot lists that hold it; free pages have refcount 0 and appear once in the free stack;
  free + used = num_pages - 1; a page held by two slots sits in both slots' shared prefix.
- `ShardedPages`: the pool split over D data shards, one `PageAllocator` per shard (its own local
  page ids, null page and slots); D = 1 is the plain pool. The scheduler uses this interface always.
"""

from __future__ import annotations

import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, debug: bool = False):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need >= 2 (page 0 is the reserved null page)")
        if page_size < 1 or max_slots < 1:
            raise ValueError(f"page_size={page_size}, max_slots={max_slots}: both must be >= 1")
        self.num_pages, self.page_size, self.max_slots, self.debug = num_pages, page_size, max_slots, debug
        self.refcount = np.zeros(num_pages, np.int32)
        # Pop from the end: low page ids are handed out first (reproducible tables in tests).
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self.slot_pages: list[list[int]] = [[] for _ in range(max_slots)]
        self.shared_prefix = np.zeros(max_slots, np.int64)  # leading pages that may be shared

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    def need(self, slot: int, num_tokens: int) -> int:
        """New pages `grow(slot, num_tokens)` would take."""
        return max(0, self.pages_for(num_tokens) - len(self.slot_pages[slot]))

    def table(self, slots, width: int) -> np.ndarray:
        """int32 [len(slots), width] page table; entries past a slot's pages are the null page."""
        out = np.full((len(slots), width), NULL_PAGE, np.int32)
        for row, s in enumerate(slots):
            pages = self.slot_pages[s][:width]
            out[row, : len(pages)] = pages
        return out

    # ---- mutations ----------------------------------------------------------------------------
    def _alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages - 1}")
        out = [self._free.pop() for _ in range(n)]
        self.refcount[out] = 1
        return out

    def grow(self, slot: int, num_tokens: int) -> list[int]:
        """Make `slot` hold pages for its first `num_tokens` tokens; returns the new pages.
        All or nothing: raises OutOfPages without allocating when too few are free."""
        new = self._alloc(self.need(slot, num_tokens))
        self.slot_pages[slot].extend(new)
        self._maybe_check()
        return new

    def fork(self, parent: int, children, num_tokens: int) -> list[tuple[int, int]]:
        """Give each (empty) child the parent's first `num_tokens` tokens: full pages shared,
        partial last page copied. Returns the (src_page, dst_page) copies to make on device."""
        full, partial = divmod(int(num_tokens), self.page_size)
        src = self.slot_pages[parent]
        if len(src) < full + (partial > 0):
            raise ValueError(f"fork: parent slot {parent} holds {len(src)} pages < {num_tokens} tokens")
        children = list(children)
        for c in children:
            if self.slot_pages[c] or c == parent:
                raise ValueError(f"fork: child slot {c} is not empty")
        fresh = self._alloc(len(children) if partial else 0)  # all or nothing
        copies = []
        for i, c in enumerate(children):
            self.slot_pages[c] = list(src[:full])
            self.refcount[src[:full]] += 1
            self.shared_prefix[c] = full
            if partial:
                self.slot_pages[c].append(fresh[i])
                copies.append((src[full], fresh[i]))
        self.shared_prefix[parent] = max(self.shared_prefix[parent], full)
        self._maybe_check()
        return copies

    def release(self, slot: int) -> list[int]:
        """Drop the slot's references; returns the pages that became free."""
        freed = []
        for p in self.slot_pages[slot]:
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                freed.append(p)
        # Push in reverse so the next allocations reuse low ids first (deterministic tables).
        self._free.extend(sorted(freed, reverse=True))
        self.slot_pages[slot] = []
        self.shared_prefix[slot] = 0
        self._maybe_check()
        return freed

    # ---- snapshots ----------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON of every page's owner and the free stack in its order (the next pages handed out)."""
        return {
            "refcount": self.refcount.tolist(),
            "free": list(self._free),
            "slot_pages": [list(p) for p in self.slot_pages],
            "shared_prefix": self.shared_prefix.tolist(),
        }

    def load(self, state: dict) -> None:
        if len(state["refcount"]) != self.num_pages or len(state["slot_pages"]) != self.max_slots:
            raise ValueError(
                f"page allocator snapshot of {len(state['refcount'])} pages x {len(state['slot_pages'])} slots, "
                f"this pool has {self.num_pages} x {self.max_slots}"
            )
        self.refcount = np.asarray(state["refcount"], np.int32)
        self._free = [int(p) for p in state["free"]]
        self.slot_pages = [[int(p) for p in pages] for pages in state["slot_pages"]]
        self.shared_prefix = np.asarray(state["shared_prefix"], np.int64)
        self.check()

    # ---- invariants ---------------------------------------------------------------------------
    def _maybe_check(self) -> None:
        if self.debug:
            self.check()

    def check(self) -> None:
        """Raise AssertionError if an invariant of the module docstring is broken."""
        count = np.zeros(self.num_pages, np.int64)
        for s, pages in enumerate(self.slot_pages):
            assert len(set(pages)) == len(pages), f"slot {s} holds a page twice: {pages}"
            assert NULL_PAGE not in pages, f"slot {s} holds the null page"
            count[pages] += 1
        assert (count == self.refcount).all(), "refcounts differ from the slots' page lists"
        free = set(self._free)
        assert len(free) == len(self._free), "free stack holds a page twice"
        assert NULL_PAGE not in free and all(self.refcount[p] == 0 for p in free), "bad free page"
        assert len(free) + int((count > 0).sum()) == self.num_pages - 1, "pages leaked"
        for s, pages in enumerate(self.slot_pages):
            for i, p in enumerate(pages):
                assert count[p] == 1 or i < self.shared_prefix[s], (
                    f"page {p} is shared but writable by slot {s} (index {i} >= prefix {self.shared_prefix[s]})"
                )


class ShardedPages:
    """The page pool split over D data shards: one `PageAllocator` per shard, each over its own
    `pages_per_shard` local page ids (local page 0 is that shard's null page) and its own
    `max_slots / D` slots. Global slot b belongs to shard b // (max_slots / D) (the slot axis is
    data-sharded contiguously on device) and is local slot b % (max_slots / D) there; page tables hold
    LOCAL page ids. D = 1 is the unsharded pool (one allocator, global = local).

    The scheduler (`sampling/scheduler.py`) keeps every sequence of a group in one shard, so a fork
    shares and copies pages within that shard only. Pages of different shards live in different
    device memories, so no page is ever owned across shards; `check()` checks each allocator."""

    def __init__(self, num_shards: int, pages_per_shard: int, page_size: int, max_slots: int, debug: bool = False):
        if num_shards < 1 or max_slots % num_shards:
            raise ValueError(f"num_shards={num_shards}: must be >= 1 and divide max_slots={max_slots}")
        self.num_shards, self.page_size, self.max_slots = num_shards, page_size, max_slots
        self.slots_per_shard = max_slots // num_shards
        self.pages_per_shard = pages_per_shard
        self.allocs = [
            PageAllocator(pages_per_shard, page_size, self.slots_per_shard, debug) for _ in range(num_shards)
        ]

    # ---- slot -> shard ------------------------------------------------------------------------
    def shard(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def _local(self, slot: int) -> tuple[PageAllocator, int]:
        d, i = divmod(slot, self.slots_per_shard)
        return self.allocs[d], i

    def shard_slots(self, shard: int) -> range:
        return range(shard * self.slots_per_shard, (shard + 1) * self.slots_per_shard)

    # ---- queries ------------------------------------------------------------------------------
    def num_free(self, shard: int) -> int:
        return self.allocs[shard].num_free

    @property
    def num_used(self) -> int:
        return sum(a.num_used for a in self.allocs)

    def used_per_shard(self) -> list[int]:
        return [a.num_used for a in self.allocs]

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    def need(self, slot: int, num_tokens: int) -> int:
        a, i = self._local(slot)
        return a.need(i, num_tokens)

    def table(self, slots, width: int) -> np.ndarray:
        """int32 [len(slots), width] of LOCAL page ids (each row in its slot's shard)."""
        out = np.full((len(slots), width), NULL_PAGE, np.int32)
        for row, s in enumerate(slots):
            a, i = self._local(s)
            pages = a.slot_pages[i][:width]
            out[row, : len(pages)] = pages
        return out

    def pages(self, slot: int) -> list[int]:
        a, i = self._local(slot)
        return list(a.slot_pages[i])

    # ---- mutations (as PageAllocator's, on global slots) --------------------------------------
    def grow(self, slot: int, num_tokens: int) -> list[int]:
        a, i = self._local(slot)
        return a.grow(i, num_tokens)

    def fork(self, parent: int, children, num_tokens: int) -> list[tuple[int, int, int]]:
        """As `PageAllocator.fork`; every child must be in the parent's shard. Returns
        (shard, src_page, dst_page) copies in local page ids."""
        d = self.shard(parent)
        children = list(children)
        for c in children:
            if self.shard(c) != d:
                raise ValueError(f"fork: child slot {c} is in shard {self.shard(c)}, parent slot {parent} in {d}")
        base = d * self.slots_per_shard
        copies = self.allocs[d].fork(parent - base, [c - base for c in children], num_tokens)
        return [(d, src, dst) for src, dst in copies]

    def release(self, slot: int) -> list[int]:
        a, i = self._local(slot)
        return a.release(i)

    def check(self) -> None:
        for a in self.allocs:
            a.check()

    def state(self) -> dict:
        return {"shards": [a.state() for a in self.allocs]}

    def load(self, state: dict) -> None:
        if len(state["shards"]) != self.num_shards:
            raise ValueError(f"page pool snapshot of {len(state['shards'])} shards, this pool has {self.num_shards}")
        for a, st in zip(self.allocs, state["shards"]):
            a.load(st)
