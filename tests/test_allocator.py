"""Property tests of the host page allocator (hypothesis), checked against an independent simulation:
every slot writes its own token values through its page table into a simulated pool, and must read
them all back unchanged after any sequence of grow/fork/write/release operations (a page owned by two
writers would corrupt one of them). Page accounting is checked from the public tables alone."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg_jax.sampling.allocator import NULL_PAGE, OutOfPages, PageAllocator


class Sim:
    """The test's own model of what each slot holds."""

    def __init__(self, num_pages, page_size, slots):
        self.a = PageAllocator(num_pages, page_size, slots)
        self.S, self.P = page_size, num_pages
        self.pool = np.full((num_pages, page_size), -1, np.int64)
        self.values = {s: [] for s in range(slots)}  # token values written by each slot, in order
        self.next_value = 0

    def pages(self, s):
        return [int(p) for p in self.a.table([s], 64)[0] if p != NULL_PAGE]

    def write(self, s, n):
        """Append n tokens to slot s (growing its pages first), writing through its table."""
        try:
            self.a.grow(s, len(self.values[s]) + n)
        except OutOfPages:
            return
        pages = self.pages(s)
        for _ in range(n):
            pos = len(self.values[s])
            self.pool[pages[pos // self.S], pos % self.S] = self.next_value
            self.values[s].append(self.next_value)
            self.next_value += 1

    def fork(self, parent, children):
        n = len(self.values[parent])
        try:
            copies = self.a.fork(parent, children, n)
        except OutOfPages:
            return
        for src, dst in copies:  # what the device does
            self.pool[dst] = self.pool[src]
        for c in children:
            self.values[c] = list(self.values[parent])

    def release(self, s):
        self.a.release(s)
        self.values[s] = []

    def verify(self):
        owners = {}
        for s, vals in self.values.items():
            pages = self.pages(s)
            assert len(pages) >= -(-len(vals) // self.S)
            for pos, v in enumerate(vals):  # every slot reads back exactly what it wrote
                assert self.pool[pages[pos // self.S], pos % self.S] == v, f"slot {s} pos {pos} corrupted"
            for p in pages:
                assert 0 < p < self.P
                owners.setdefault(p, []).append(s)
        # a page shared by several slots is full and lies inside every holder's written prefix
        for p, holders in owners.items():
            if len(holders) > 1:
                for s in holders:
                    idx = self.pages(s).index(p)
                    assert (idx + 1) * self.S <= len(self.values[s]), f"shared page {p} writable by slot {s}"
        assert self.a.num_free == self.P - 1 - len(owners), "free count disagrees with the tables (leak)"


ops = st.lists(
    st.tuples(
        st.sampled_from(["write", "fork", "release"]),
        st.integers(0, 5),
        st.integers(1, 20),
        st.lists(st.integers(0, 5), min_size=1, max_size=3),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 3, 4]), num_pages=st.integers(2, 40), ops=ops)
def test_random_operations_never_share_a_writable_page_and_never_leak(page_size, num_pages, ops):
    sim = Sim(num_pages, page_size, slots=6)
    for op, s, n, others in ops:
        if op == "write":
            sim.write(s, n)
        elif op == "fork":
            children = sorted({c for c in others if c != s and not sim.values[c] and not sim.pages(c)})
            if children and sim.values[s]:
                sim.fork(s, children)
        else:
            sim.release(s)
        sim.verify()
        sim.a.check()  # the allocator's own invariant check agrees
    for s in range(6):
        sim.release(s)
    assert sim.a.num_free == num_pages - 1 and (sim.a.refcount == 0).all()


def test_fork_shares_full_pages_and_copies_the_partial_page():
    a = PageAllocator(num_pages=64, page_size=4, max_slots=8)
    a.grow(0, 10)  # pages for 10 tokens: 2 full + 1 partial
    copies = a.fork(0, range(1, 8), 10)
    t = a.table(range(8), 4)
    assert (t[1:, :2] == t[0, :2]).all(), "full prompt pages are shared"
    assert len(set(t[:, 2])) == 8, "each slot has its own partial page"
    assert copies == [(int(t[0, 2]), int(t[c, 2])) for c in range(1, 8)]
    assert a.num_used == 2 + 8  # prompt_full_pages + G x partial
    for s in range(8):
        a.release(s)
    assert a.num_free == 63


def test_fork_of_page_aligned_prompt_copies_nothing_and_all_or_nothing_allocation():
    a = PageAllocator(num_pages=5, page_size=4, max_slots=4)
    a.grow(0, 8)
    assert a.fork(0, [1, 2], 8) == [] and a.num_used == 2
    with pytest.raises(OutOfPages):
        a.grow(3, 4 * 5)  # 5 pages > 2 free: nothing taken
    assert a.num_free == 2
    with pytest.raises(ValueError, match="not empty"):
        a.fork(0, [1], 8)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1, 4, 1)


def test_sharded_pages_map_slots_to_shards_with_local_page_ids():
    from rpeg_jax.sampling.allocator import ShardedPages

    sp = ShardedPages(num_shards=2, pages_per_shard=6, page_size=4, max_slots=4)  # slots 0-1 | 2-3
    assert [sp.shard(s) for s in range(4)] == [0, 0, 1, 1]
    sp.grow(0, 6)
    sp.grow(2, 6)
    assert sp.pages(0) == sp.pages(2) == [1, 2], "each shard hands out its own local ids from 1"
    assert sp.fork(2, [3], 6) == [(1, 2, 3)]  # (shard, src, dst): the partial page copied in shard 1
    with pytest.raises(ValueError, match="shard"):
        sp.fork(0, [3], 4)  # a child in another shard
    assert sp.used_per_shard() == [2, 3] and sp.num_used == 5 and sp.num_free(0) == 3
    with pytest.raises(OutOfPages):
        sp.grow(1, 4 * 4)  # 4 pages > 3 free in shard 0: nothing taken
    assert sp.num_free(0) == 3 and sp.num_free(1) == 2
    for s in range(4):
        sp.release(s)
    sp.check()
    assert sp.num_used == 0 and sp.table(range(4), 2).tolist() == [[0, 0]] * 4
    with pytest.raises(ValueError, match="divide"):
        ShardedPages(3, 6, 4, 4)
