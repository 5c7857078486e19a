"""The sampler's KV page pool split over the `data` mesh axis (SamplerConfig.kv_pool="sharded").

Against the single-device sampler (an independent engine shape: one pool, one allocator, no
shard_map): on a data=4 mesh ("chunk" attention) and a data=2 x tensor=2 mesh with tensor-sharded
parameters ("gather" attention), greedy and sampled GRPO groups (n=2, forked inside a shard) give the
same tokens and float32 logprobs within 1e-5 (the bound test_sampler_mesh uses for data-parallel
runs), also with a pool small enough that shards preempt. Each device holds [L, K/T, P/D, S, E] of
the pools, and the compiled decode chunk has no collective over the pool. A hypothesis test drives
the host scheduler over a simulated per-shard pool: groups stay in one shard, every sequence reads
back what it wrote (no page owned twice, within or across shards), and no page leaks."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import shard
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType

from rpeg_jax.models import load_hf
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams, engine
from rpeg_jax.sampling.allocator import NULL_PAGE, ShardedPages
from rpeg_jax.sampling.scheduler import Scheduler, Sequence

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
FIXED = dict(max_seq_len=32, min_prefill_len=32, min_prefill_rows=8, min_table_width=16)
BASE = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, **FIXED)
SAMPLED = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=14, seed=5)
GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=14)
LP_ATOL = 1e-5  # float32 logprobs of data-parallel vs single-device runs (as test_sampler_mesh)


@pytest.fixture(scope="module")
def llama():
    return load_hf(os.path.join(HF, "llama_tiny"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 128, size=n).tolist() for n in (7, 2, 10, 5, 9, 3)]


@pytest.fixture(scope="module")
def reference(llama, prompts):
    single = Sampler(llama, BASE)
    return [single.generate(prompts, p) for p in (SAMPLED, GREEDY)]


def mesh_of(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


def assert_same(outs, ref):
    for o, r in zip(outs, ref, strict=True):
        for c, d in zip(o.completions, r.completions, strict=True):
            assert c.tokens.tolist() == d.tokens.tolist()
            np.testing.assert_allclose(c.logprobs, d.logprobs, atol=LP_ATOL, rtol=0)


def assert_pool_shards(sampler, data, tensor):
    k_pool = sampler.pools[0]
    l, k, p, s, e = k_pool.shape
    assert p == sampler.num_pages and p % data == 0
    for sh in k_pool.addressable_shards:
        assert sh.data.shape == (l, k // tensor, p // data, s, e)


def run_both(sampler, prompts):
    return [sampler.generate(prompts, p) for p in (SAMPLED, GREEDY)]


def test_data4_chunk_attention_equals_single_device(llama, prompts, reference):
    sampler = Sampler(llama, BASE, mesh=mesh_of((4,), ("data",)))
    assert sampler.stats()["pool_shards"] == 4 and sampler.pages_per_shard * 4 == sampler.num_pages
    assert_pool_shards(sampler, data=4, tensor=1)
    for outs, ref in zip(run_both(sampler, prompts), reference):
        assert_same(outs, ref)
    st_ = sampler.stats()
    assert st_["page_copies"] > 0 and st_["pages_used"] == 0 and st_["shard_pages_used"] == [0] * 4
    assert st_["prefill_tokens"] == 2 * sum(len(p) - 1 for p in prompts), "one prefill per group"


def test_data2_tensor2_model_forward_gather_equals_single_device_and_no_pool_collective(llama, prompts, reference):
    mesh = mesh_of((2, 2), ("data", "tensor"))
    # The GPU defaults (the model's own forward, "gather" attention); the CPU defaults run on data=4.
    cfg = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, attention="gather", forward="model", **FIXED)
    sampler = Sampler(shard(llama, mesh), cfg)
    assert_pool_shards(sampler, data=2, tensor=2)
    for outs, ref in zip(run_both(sampler, prompts), reference):
        assert_same(outs, ref)
    # The compiled decode chunk: no collective carries KV pages, and none crosses data shards.
    sampler.submit(prompts[:2], SAMPLED)
    sampler._prefill(sampler.sched.admit(8))
    k, _ = sampler.sched.reserve(8)
    st_ = sampler._decode_state(sampler.sched.running_seqs(), k)
    hlo = (
        engine.decode_chunk.lower(
            sampler._fwd,
            sampler._weights,
            sampler.pools,
            st_,
            jnp.int32(k),
            chunk=8,
            attention="gather",
            block_pages=4,
            mesh=sampler.sharding.shard_mesh,
            heads_sharded=sampler.sharding.heads_sharded,
        )
        .compile()
        .as_text()
    )
    _, _, _, s, e = sampler.pools[0].shape
    op = re.compile(r"= .*?\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(")
    colls = [(ln[: m.start(1)], ln) for ln in hlo.splitlines() if (m := op.search(ln))]  # (result shapes, line)
    assert colls, "expected the tensor axis' collectives (the test would not see pool ones otherwise)"
    data_of = {i: i // 2 for i in range(4)}  # logical device (row-major over (data, tensor)) -> data index
    for shapes, ln in colls:  # pool [.., P(/D), S, E] and gathered pages [K, B, W, S, E] both end in S, E
        assert not re.search(rf"\[[\d,]*,{s},{e}\]", shapes), f"a collective over KV pages: {ln[:200]}"
        for group in device_groups(ln):  # every collective stays inside one data shard (tensor only)
            assert len({data_of[i] for i in group}) == 1, f"a collective across data shards: {ln[:200]}"


def device_groups(hlo_line):
    """Device groups of a collective: replica_groups as {{..},..} or iota [G,N]<=[dims]T(perm), or
    collective-permute source_target_pairs."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", hlo_line)
    if m:
        g, n = int(m[1]), int(m[2])
        ids = np.arange(int(np.prod([int(x) for x in m[3].split(",")]))).reshape([int(x) for x in m[3].split(",")])
        if m[4]:
            ids = ids.transpose([int(x) for x in m[4].split(",")])
        return ids.reshape(g, n).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,{}]*\})\}", hlo_line)
    assert m, f"cannot read the device groups of: {hlo_line[:200]}"
    return [[int(x) for x in grp.split(",")] for grp in re.findall(r"\{([\d,]+)\}", m[1])]


@pytest.mark.slow
@pytest.mark.parametrize("attention,forward", [("blocked", "split"), ("chunk", "model"), ("gather", "split_t")])
def test_other_attention_and_forward_kinds_on_data2_tensor2(llama, prompts, reference, attention, forward):
    mesh = mesh_of((2, 2), ("data", "tensor"))
    cfg = SamplerConfig(
        page_size=4, max_slots=8, chunk_steps=8, attention=attention, forward=forward, block_pages=2, **FIXED
    )
    sampler = Sampler(shard(llama, mesh), cfg)
    assert_pool_shards(sampler, data=2, tensor=2)
    for outs, ref in zip(run_both(sampler, prompts), reference):
        assert_same(outs, ref)


def test_preemption_inside_shards_keeps_outputs(llama, prompts, reference):
    # 2 shards x 9 pages (8 usable: one max_seq_len sequence) for 4 slots each: shards must preempt.
    cfg = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, num_pages=17, watermark=0.0, **FIXED)
    sampler = Sampler(llama, cfg, mesh=mesh_of((2,), ("data",)))
    assert sampler.pages_per_shard == 9 and sampler.num_pages == 18  # ceil(17 / 2) per shard
    outs = sampler.generate(prompts, SAMPLED)
    assert_same(outs, reference[0])
    st_ = sampler.stats()
    assert st_["preemptions"] > 0 and st_["pages_used"] == 0
    assert st_["shard_pages_peak"] <= 8
    assert sum(c.num_preemptions for o in outs for c in o.completions) == st_["preemptions"]


def test_pool_too_small_per_shard_is_rejected_before_compiling(llama):
    cfg = SamplerConfig(page_size=4, max_slots=8, num_pages=24, **FIXED)  # 6 per shard < 1 + 8
    with pytest.raises(ValueError, match=r"sampler.num_pages=24: .*6 per shard of the pool split over data=4\)"):
        Sampler(llama, cfg, mesh=mesh_of((4,), ("data",)))
    with pytest.raises(ValueError, match="kv_pool"):
        SamplerConfig(kv_pool="split").validate()
    replicated = Sampler(
        llama,
        SamplerConfig(kv_pool="replicated", page_size=4, max_slots=8, num_pages=24, **FIXED),
        mesh=mesh_of((4,), ("data",)),
    )
    assert replicated.stats()["pool_shards"] == 1 and replicated.pools[0].addressable_shards[0].data.shape[2] == 24


# ---- host side: scheduler + ShardedPages over a simulated per-shard pool -----------------------


class PoolSim:
    """What the device would hold: pool[shard][page, offset] = token written there."""

    def __init__(self, pages: ShardedPages):
        self.a = pages
        self.pool = np.full((pages.num_shards, pages.pages_per_shard, pages.page_size), -1, np.int64)

    def write(self, slot, tokens, start):
        d, table = self.a.shard(slot), self.a.pages(slot)
        for t, tok in enumerate(tokens, start=start):
            page = table[t // self.a.page_size]
            assert page != NULL_PAGE
            self.pool[d, page, t % self.a.page_size] = tok

    def read(self, slot, n):
        d, table = self.a.shard(slot), self.a.pages(slot)
        return [int(self.pool[d, table[t // self.a.page_size], t % self.a.page_size]) for t in range(n)]


@settings(max_examples=60, deadline=None)
@given(
    shards=st.sampled_from([1, 2, 4]),
    pages=st.integers(5, 14),
    page_size=st.sampled_from([1, 2, 4]),
    reqs=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4), st.integers(1, 8)), min_size=1, max_size=10),
    ks=st.lists(st.integers(1, 6), min_size=1, max_size=8),
)
def test_scheduler_keeps_groups_in_one_shard_never_double_owns_and_never_leaks(shards, pages, page_size, reqs, ks):
    slots = 8
    max_seq = 12
    if pages - 1 < -(-max_seq // page_size):
        pages = 1 + -(-max_seq // page_size)  # the Sampler rejects smaller pools at construction
    alloc = ShardedPages(shards, pages, page_size, slots, debug=True)
    sched, sim = Scheduler(alloc, watermark_pages=0), PoolSim(alloc)
    counter = iter(range(10_000, 10**9))
    all_seqs = []
    for i, (plen, n, new) in enumerate(reqs):
        prompt = list(range(100 * i, 100 * i + plen))
        seqs = [Sequence(request=i, sample_index=j, prompt=prompt, end=min(plen + new, max_seq)) for j in range(n)]
        sched.submit(seqs)
        all_seqs += seqs
    for step in range(200):
        if sched.idle():
            break
        plan = sched.admit(ks[step % len(ks)])
        for g in plan.groups:
            assert all(alloc.shard(s.slot) == g.shard for s in g.seqs), "a group spans shards"
        for slot, toks in plan.rows:
            sim.write(slot, toks, 0)
        for d, src, dst in plan.copies:
            sim.pool[d, dst] = sim.pool[d, src]
        shard_of = {id(s): alloc.shard(s.slot) for s in sched.running_seqs()}
        short = {d for d in range(shards) if sched._running_need(1, d) > alloc.num_free(d)}
        k, preempted = sched.reserve(ks[step % len(ks)])
        assert all(shard_of[id(s)] in short for s in preempted), "preempted in a shard that had pages"
        for s in sched.running_seqs():  # k decode steps: write known[pos] at pos, sample a token
            for _ in range(min(k, s.end - 1 - s.pos)):
                sim.write(s.slot, [s.known()[-1]], s.pos)
                s.tokens.append(next(counter))
        alloc.check()
        running = sched.running_seqs()
        assert len({s.slot for s in running}) == len(running)
        for s in running:
            assert sim.read(s.slot, s.pos) == s.known()[: s.pos], "a slot lost what it wrote"
            if len(s.prompt) + len(s.tokens) >= s.end:
                sched.finish(s, "length")
    assert sched.idle() and all(s.finish_reason == "length" for s in all_seqs)
    assert alloc.num_used == 0 and all(a.num_free == pages - 1 for a in alloc.allocs), "pages leaked"
    assert sorted(x for f in sched.free_slots for x in f) == list(range(slots))


def test_admission_balances_groups_over_shards():
    alloc = ShardedPages(4, 40, 4, 8)
    sched = Scheduler(alloc, watermark_pages=0)
    for i in range(4):
        sched.submit([Sequence(request=i, sample_index=j, prompt=[1, 2, 3, 4, 5, 6], end=12) for j in range(2)])
    plan = sched.admit(4)
    assert sorted(g.shard for g in plan.groups) == [0, 1, 2, 3]
    assert len(plan.rows) == 4 and all(d == g.shard for g, (d, _, _) in zip(plan.groups, plan.copies))
