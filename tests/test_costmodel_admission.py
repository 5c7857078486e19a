"""The cost model's engine admission (costmodel/lengths.admission) against a decode-step-by-step
reference written here, step admission against the existing schedule, and the planner's choice
of rollout.admission and k (with the asynchrony share of its gain)."""

import dataclasses
import heapq

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel import planner as P
from rpeg_jax.costmodel import scoring as SC
from rpeg_jax.costmodel import space as SP
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.costmodel.lengths import LengthDist, LengthStream, admission
from rpeg_jax.costmodel.pricing import predict_run, price_layout
from rpeg_jax.shapes.buckets import width_bucket

GH = load_hardware("gh200", calibrated=False)


def without_sync_costs(hw):
    """`hw` with the weight sync's fixed and per-bucket costs and the per-step framework cost at 0:
    for tests of how the tail of generation is hidden, which a multi-second sync (configs/hardware
    since session 12) would otherwise decide in favour of a split plan that hides the sync."""
    eff = dataclasses.replace(hw.efficiency, sync_fixed_s=0.0, sync_bucket_s=0.0, host_step_s=0.0)
    return dataclasses.replace(hw, efficiency=eff)


CPU = load_hardware("cpu", calibrated=False)


def reference(dist, slots, groups, group, k, mode, chunk, min_chunk, steps, warmup, seed=0, table=None):
    """The engine one decode step at a time, plain Python: per-slot [group, tokens left, made].
    `table` = (page_size, prompt, min_table_width, growth): the chunk is cut and its width read as
    the sampler does (Sampler._width / _align_chunk with shapes/buckets.width_bucket): k more steps
    of a sequence that has made m tokens of its m + left need its cache to hold min(m + k, m + left)
    - 1 tokens beyond the prompt's (the last token known is the next step's input)."""

    def pages(k_):  # Sampler._width over the running slots, capped at the widest sequence's pages
        page, prompt, lo, growth = table
        need = max(prompt - 1 + min(s[2] + k_, s[2] + s[1]) for s in slot if s is not None)
        return min(width_bucket(-(-need // page), lo, growth), -(-(prompt + dist.max_len) // page))

    stream = LengthStream(dist, group, seed)
    slot = [None] * slots
    info = {}  # gid -> {"len": [...], "left": members decoding, "oldest": version or None}
    waiting, flight, done = [], [], []
    next_gid = 0
    hist = []

    def submit():
        nonlocal next_gid
        info[next_gid] = {"len": [int(x) for x in stream.next()], "left": group, "oldest": None}
        waiting.append(next_gid)
        flight.append(next_gid)
        next_gid += 1

    for t in range(warmup + 8 * steps):
        rec = dict(decode=0, busy=0, ctx=0, width=0, batch_tokens=0, longest=0, stale=0, requeued=0, admitted=0, smax=0)
        rec["lengths"] = []
        if mode == "continuous":
            for g in list(done) + list(flight):
                if info[g]["oldest"] is not None and info[g]["oldest"] < t - k:
                    rec["requeued"] += 1
                    if g in done:
                        done.remove(g)
                    else:
                        flight.remove(g)
                        for i in range(slots):
                            if slot[i] is not None and slot[i][0] == g:
                                slot[i] = None
        else:
            for _ in range(groups):
                submit()
        while len(done) < groups:
            if mode == "continuous":
                while sum(info[g]["left"] for g in flight) <= slots:
                    submit()
            while waiting and sum(s is None for s in slot) >= group:
                g = waiting.pop(0)
                free = [i for i in range(slots) if slot[i] is None][:group]
                for i, length in zip(free, info[g]["len"]):
                    slot[i] = [g, length, 0]
                info[g]["oldest"] = t
                rec["admitted"] += 1
            limit = min(chunk, max(s[1] for s in slot if s is not None))
            if table is not None:  # Sampler._align_chunk, by a linear scan
                lo = min(limit, min_chunk)
                limit = max(j for j in range(lo, limit + 1) if pages(j) <= pages(lo))
                width = pages(limit) * table[0] - table[1]
            release = mode == "continuous" and bool(waiting)
            made = max(s[2] for s in slot if s is not None)  # the longest running sequence's tokens
            n, freed = 0, 0
            while n < limit and any(s is not None for s in slot):
                if release and n >= min_chunk and freed >= group:
                    break
                for i in range(slots):
                    if slot[i] is None:
                        continue
                    rec["busy"] += 1
                    rec["ctx"] += slot[i][2]
                    slot[i][1] -= 1
                    slot[i][2] += 1
                    if slot[i][1] == 0:
                        info[slot[i][0]]["left"] -= 1
                        slot[i] = None
                        freed += 1
                n += 1
            rec["decode"] += n
            # every step of the chunk reads the tables to its end's width (its bucket with `table`)
            rec["width"] += n * (width if table is not None else made + n)
            for g in [g for g in flight if info[g]["left"] == 0]:
                flight.remove(g)
                done.append(g)
        batch, done = done[:groups], done[groups:]
        for g in batch:
            rec["batch_tokens"] += sum(info[g]["len"])
            rec["lengths"] += info[g]["len"]
            rec["longest"] = max(rec["longest"], max(info[g]["len"]))
            rec["stale"] += t - info[g]["oldest"]
            rec["smax"] = max(rec["smax"], t - info[g]["oldest"])
        hist.append(rec)
    # Measured: from the first step after warmup that decodes to just before the first decoding step
    # at least `steps` later (a step may consume what an earlier one decoded; cycles stay whole).
    dec = [i for i in range(warmup, len(hist)) if hist[i]["decode"]]
    a = dec[0]
    b = next((i for i in dec if i >= a + steps), len(hist))
    win = hist[a:b]
    out = {key: sum(r[key] for r in win) / len(win) for key in win[0] if key != "lengths"}
    out["smax"] = max(r["smax"] for r in win)
    out["lengths"] = sorted(x for r in win for x in r["lengths"])
    return out


TAIL = LengthDist(max_len=40, min_len=1, median=4, sigma=1.2)
CASES = [  # (dist, slots, groups, group, k, mode, chunk, min_chunk)
    (LengthDist.fixed(5), 4, 2, 2, 1, "continuous", 1, 1),
    (LengthDist.fixed(5), 4, 3, 2, 1, "continuous", 4, 2),
    (LengthDist.fixed(6), 12, 2, 2, 2, "continuous", 8, 2),
    (TAIL, 12, 2, 2, 2, "continuous", 4, 2),
    (TAIL, 4, 2, 2, 1, "continuous", 1, 1),
    (TAIL, 4, 2, 2, 1, "continuous", 6, 2),
    (TAIL, 6, 3, 2, 2, "continuous", 8, 3),
    (TAIL, 8, 4, 4, 1, "continuous", 16, 8),
    (TAIL, 4, 2, 2, 1, "step", 1, 1),
    (TAIL, 4, 3, 2, 1, "step", 5, 2),
    (TAIL, 8, 2, 4, 1, "step", 64, 8),
]


TABLES = [None, (4, 3, 1, 2.0), (2, 0, 2, 1.5)]  # no buckets; the sampler's defaults on 4-token pages; others


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("case", CASES)
def test_admission_matches_a_decode_step_reference(case, table):
    dist, slots, groups, group, k, mode, chunk, min_chunk = case
    got = admission(dist, slots, groups, group, k, mode, chunk, min_chunk, steps=12, warmup=3, seed=5, table=table)
    ref = reference(dist, slots, groups, group, k, mode, chunk, min_chunk, steps=12, warmup=3, seed=5, table=table)
    assert got.decode_steps == pytest.approx(ref["decode"], rel=1e-12)
    assert got.tokens == pytest.approx(ref["busy"], rel=1e-12)
    assert got.occupancy == pytest.approx(ref["busy"] / (ref["decode"] * slots), rel=1e-12)
    assert got.ctx == pytest.approx(ref["ctx"] / ref["busy"], rel=1e-12)
    assert got.ctx_width == pytest.approx(ref["width"] / ref["decode"], rel=1e-12)
    assert got.ctx_width >= got.ctx
    assert got.batch_tokens == pytest.approx(ref["batch_tokens"], rel=1e-12)
    assert got.batch_longest == pytest.approx(ref["longest"], rel=1e-12)
    assert list(got.consumed) == ref["lengths"]
    assert got.staleness_mean == pytest.approx(ref["stale"] / groups, rel=1e-12, abs=1e-12)
    assert got.staleness_max == ref["smax"] <= (k if mode == "continuous" else 0)
    assert got.requeued == pytest.approx(ref["requeued"], abs=1e-12)
    assert got.admitted == pytest.approx(ref["admitted"], rel=1e-12)


def test_the_reference_sees_the_tail_and_the_bound():
    # The cases above are not vacuous: continuous admission keeps slots busier than step admission
    # on the tail, and groups cross weight updates (staleness reaches k) and some break the bound.
    cont = reference(TAIL, 4, 2, 2, 1, "continuous", 6, 2, steps=12, warmup=3, seed=5)
    step = reference(TAIL, 4, 2, 2, 1, "step", 6, 2, steps=12, warmup=3, seed=5)
    assert cont["busy"] / (cont["decode"] * 4) > step["busy"] / (step["decode"] * 4) + 0.1
    assert cont["smax"] == 1 and cont["requeued"] > 0


def test_width_buckets_widen_the_tables_and_cut_chunks():
    # The bucketed cases above are not the unbucketed ones: on the tail the tables are read wider
    # (up to the bucket above the longest sequence) and chunks are cut where a bucket grows.
    plain = admission(TAIL, 8, 4, 4, 1, "continuous", 4, 1, steps=12, warmup=3, seed=5)
    buck = admission(TAIL, 8, 4, 4, 1, "continuous", 4, 1, steps=12, warmup=3, seed=5, table=(4, 3, 1, 2.0))
    assert buck.ctx_width > 1.15 * plain.ctx_width  # 26.9 against 21.7 tokens
    assert buck.chunks > plain.chunks
    assert buck.decode_steps == pytest.approx(plain.decode_steps, rel=0.25)


def test_the_cost_model_uses_the_samplers_width_buckets():
    from rpeg_jax.config import load_config
    from rpeg_jax.runtime.setup import sampler_config
    from rpeg_jax.shapes.buckets import MIN_TABLE_WIDTH

    assert sampler_config(load_config(None, ["model.preset=tiny"])).min_table_width == MIN_TABLE_WIDTH
    for growth in (2.0, 1.25):
        cfg = load_config(None, ["model.preset=tiny", f"rollout.table_width_growth={growth}"])
        assert sampler_config(cfg).table_width_growth == growth  # the engine runs it
        assert CX.make_context(cfg, 1, CPU).st.table_growth == growth  # the cost model prices it


def test_finer_width_buckets_price_a_cheaper_continuous_generation():
    # R2's async-k2 on this CPU profile: the tail in flight keeps the tables at the bucket above the
    # longest sequence; growth 1.25 reads fewer columns than 2 (measured: -16% generation at k = 2;
    # this uncalibrated profile prices -9.5%, a 2026-12-04 calibration of this machine -32%).
    over = ["model.preset=tiny", "data.prompts_per_step=16", "rl.group_size=8", "rollout.max_new_tokens=256"]
    over += ["rollout.forced_lengths=[24,1.0,4,256]", "pipeline.staleness=2", "rollout.admission=continuous"]
    gen = {}
    for growth in (2.0, 1.25):
        cfg = load_config(None, over + ["pipeline.plan=manual", f"rollout.table_width_growth={growth}"])
        gen[growth] = predict_run(cfg, CPU, 1).stage_times_s["generate"]
    assert gen[1.25] < 0.95 * gen[2.0]


def test_step_admission_is_todays_schedule():
    # One decode step per chunk, groups of one: step admission refills a slot the step it frees,
    # as lengths._schedule does (a heap of free times), over the same lengths.
    dist = LengthDist(max_len=60, min_len=2, median=10, sigma=1.0)
    got = admission(dist, 5, 17, 1, 1, "step", 1, 1, steps=1, warmup=0, seed=3)
    stream = LengthStream(dist, 1, 3)
    lens = np.array([int(stream.next()[0]) for _ in range(17)])
    free = [0] * 5
    end = 0
    for ln in lens:
        s = heapq.heappop(free)
        heapq.heappush(free, s + int(ln))
        end = max(end, s + int(ln))
    assert got.decode_steps == end
    assert got.tokens == lens.sum()
    # Every slot holding the batch: the longest response sets the decode steps, whatever the chunks.
    for chunk in (1, 7, 64):
        a = admission(dist, 64, 8, 8, 1, "step", chunk, 1, steps=1, warmup=0, seed=3)
        stream = LengthStream(dist, 8, 3)
        lens = np.concatenate([stream.next() for _ in range(8)])
        assert a.decode_steps == lens.max() and a.occupancy == pytest.approx(lens.sum() / (64 * lens.max()))


R2 = [
    "data.task=add",
    "data.min_digits=2",
    "data.max_digits=2",
    "data.prompts_per_step=16",
    "rl.group_size=8",
    "rollout.max_new_tokens=256",
    "rollout.forced_lengths=[24,1.0,4,256]",
    "model.preset=tiny",
    "pipeline.plan=manual",
]


def test_predict_run_prices_the_runs_admission_and_slots():
    sync = predict_run(load_config(None, R2), CPU, 1)
    k1 = predict_run(load_config(None, [*R2, "pipeline.staleness=1", "rollout.admission=continuous"]), CPU, 1)
    assert sync.layout["generate"]["admission"] == "step" and k1.layout["generate"]["admission"] == "continuous"
    assert k1.layout["generate"]["slots"] == 128 and sync.knobs["staleness"] == 0 and k1.knobs["staleness"] == 1
    # On a CPU every decode step costs all its rows: the tail's ~256 steps cost more than the ~70
    # steps of the engine kept full.
    assert k1.stage_times_s["generate"] < 0.5 * sync.stage_times_s["generate"]
    more = predict_run(
        load_config(None, [*R2, "pipeline.staleness=1", "rollout.admission=continuous", "rollout.max_slots=192"]),
        CPU,
        1,
    )
    assert more.layout["generate"]["slots"] == 192
    assert more.stage_times_s["generate"] != pytest.approx(k1.stage_times_s["generate"])


def test_predict_run_prices_the_configs_remat_and_micro_batches():
    # A manual plan runs model.remat and rl.micro_batches as configured: its prediction prices
    # those, not the table's fastest option (which had priced remat=full at remat=none's memory).
    big = [*R2, "model.preset=smollm2-135m", "rollout.max_new_tokens=48", "rollout.forced_lengths=null"]
    pred = {r: predict_run(load_config(None, [*big, f"model.remat={r}"]), CPU, 1) for r in ("none", "dots", "full")}
    for r, p in pred.items():
        assert p.layout["train"]["remat"] == r
    none, dots, full = (pred[r] for r in ("none", "dots", "full"))
    assert none.memory_per_gpu_gb > dots.memory_per_gpu_gb > full.memory_per_gpu_gb
    assert full.stage_times_s["actor_update"] > none.stage_times_s["actor_update"]  # the recomputed forward
    mb = predict_run(load_config(None, [*big, "rl.micro_batches=4", "rl.forward_micro_batches=2"]), CPU, 1)
    assert mb.layout["train"]["micro_batches"] == 4 and mb.layout["forward"]["micro_batches"] == 2
    assert mb.memory_per_gpu_gb < none.memory_per_gpu_gb


def _search(sigma, n=16):
    cfg = load_config(
        None,
        [
            "model.preset=qwen2-1.5b",
            "model.dtype=bfloat16",
            "model.param_dtype=float32",
            "data.prompts_per_step=32",
            "rl.group_size=16",
            "data.max_prompt_len=512",
            "costmodel.prompt_len=512",
            "rollout.max_new_tokens=4096",
            "costmodel.response_len_min=256",
            "costmodel.response_len_median=1024",
            f"costmodel.response_len_sigma={sigma}",
            "train.pack_sequences=true",
            "costmodel.max_staleness=2",
            "costmodel.search_algorithmic=true",
        ],
    )
    return cfg, P.search(cfg, n, without_sync_costs(GH), processes=1)  # continuous admission: one process


def test_planner_searches_admission_and_splits_the_gain():
    cfg, tail = _search(1.0)
    c = tail.chosen
    assert c.layout["generate"]["admission"] == "continuous" and c.knobs["staleness"] >= 1
    assert c.plan.settings["rollout.admission"] == "continuous"
    a, verl = tail.asynchrony, tail.baselines["verl_like"]
    assert a["asynchrony"] > 1.0
    assert verl.step_time_s / c.step_time_s == pytest.approx(a["asynchrony"] * a["rest"], rel=1e-9)
    # The synchronous price of the chosen layout, by the pricing path (an independent route).
    knobs = {**c.knobs, "staleness": 0}
    lay = {**c.layout, "generate": {**c.layout["generate"], "admission": "step"}}
    assert price_layout(cfg, knobs, lay, 16, without_sync_costs(GH), 1).step_time_s == pytest.approx(
        a["sync_step_s"], rel=1e-9
    )
    assert any("asynchrony" in n for n in tail.notes)
    # Without a tail there is no tail to hide: what asynchrony still buys (the model's honest answer on
    # a memory-bound decode) is a decode batch larger than one step's, so it must gain less, and only
    # with more slots than one batch's share.
    _, flat = _search(0.0)
    f = flat.chosen
    if flat.asynchrony is not None:
        assert flat.asynchrony["asynchrony"] < a["asynchrony"]
        g = f.layout["generate"]
        assert g["admission"] == "step" or g["slots"] * g["replicas"] > 512
    one = admission(LengthDist.fixed(1024), 512, 32, 16, 2, "continuous", 64, 8)
    assert one.decode_steps == pytest.approx(1024) and one.occupancy == pytest.approx(1.0)


def test_user_admission_and_k_are_kept():
    cfg = load_config(None, ["pipeline.staleness=1", "rollout.admission=continuous"])
    ctx = CX.make_context(cfg, 1, CPU)
    for placement, share in SP.families(ctx):
        for pipe, g in SC.option_graphs(ctx, SP.structural_options(ctx, placement, share)):
            assert pipe.staleness == 1 and SC.admission_of(g) == "continuous"
    # Left to the planner: both modes at k >= 1, on one process and on several.
    ctx = CX.make_context(load_config(None, ["costmodel.max_staleness=1", "costmodel.search_algorithmic=true"]), 2, CPU)
    seen = {
        (p.staleness, SC.admission_of(g)) for p, g in SC.option_graphs(ctx, SP.structural_options(ctx, "split", False))
    }
    assert {(0, "step"), (1, "step"), (1, "continuous")} <= seen
    many = CX.make_context(
        load_config(None, ["costmodel.max_staleness=1", "costmodel.search_algorithmic=true"]), 2, CPU, processes=2
    )
    opts = SC.option_graphs(many, SP.structural_options(many, "colocated", False))
    assert {SC.admission_of(g) for _, g in opts} == {"step", "continuous"}


def test_p1_preset_loads_and_plans(tmp_path, capsys):
    import json

    from rpeg_jax.cli import main

    cfg = load_config("configs/p1.yaml", [])
    assert cfg.rl.group_size == 16 and cfg.data.prompts_per_step * cfg.rl.group_size == 512
    assert cfg.data.max_prompt_len == 512 and cfg.rollout.max_new_tokens == 16384
    assert cfg.model.num_layers == 28 and cfg.model.hidden_size == 3584  # qwen2-7b
    out = tmp_path / "p1.json"
    # one process (the model's what-if: continuous admission), so that there is an asynchrony share
    args = ["plan", "--config", "configs/p1.yaml", "--hardware", "gh200", "--gpus", "64", "--processes", "1"]
    assert main([*args, "--json", str(out)]) == 0
    assert "of the" in capsys.readouterr().out  # the asynchrony share in the explanation
    d = json.loads(out.read_text())
    a = d["asynchrony"]
    assert a is not None and d["ratios"]["verl_like"] == pytest.approx(a["asynchrony"] * a["rest"], rel=1e-9)
    assert d["chosen"]["step_time_s"] == pytest.approx(a["sync_step_s"] / a["asynchrony"], rel=1e-9)


def test_packed_updates_are_priced_on_the_consumed_batches():
    # Continuous admission at k = 1 re-queues sequences that outlive the bound, so the consumed
    # batches are biased short; a packed update computes on them (candidates.consumed_setting), a
    # padded one on R columns whatever the lengths.
    from rpeg_jax.config.model import model_preset
    from rpeg_jax.costmodel import stages as S
    from rpeg_jax.costmodel.candidates import Roles, consumed_setting, consumed_side
    from rpeg_jax.costmodel.shape import ModelShape
    from rpeg_jax.costmodel.table import Layouts
    from rpeg_jax.graph.algorithms import model_dims

    ms = ModelShape.of(model_dims(model_preset("tiny"), "actor"))
    dist = LengthDist(max_len=256, min_len=4, median=32, sigma=1.2)
    st = S.Setting(
        hw=CPU,
        B=128,
        P=16,
        R=256,
        G=8,
        dist=dist,
        causal_skip=False,
        dense_scores=True,
        packing=True,
        budget_bytes=CPU.hbm_bytes,
        chunk_steps=32,
    )
    a = S.continuous_admission(st, 1, 64, 1)
    assert a.requeued > 0 and len(a.consumed) % st.B == 0
    sc = consumed_setting(st, 1, 64, 1)
    assert sc.dist.samples == a.consumed and np.mean(a.consumed) < 0.95 * dist.mean()
    assert S.packed_per_seq(sc, st.B, 1)[0] < S.packed_per_seq(st, st.B, 1)[0]
    assert consumed_setting(dataclasses.replace(st, packing=False), 1, 64, 1).dist == dist
    one = np.array([1])
    row = Layouts(
        n_gen=one,
        n_train=one,
        t_g=one,
        d=one,
        f=one,
        t=one,
        fd=one,
        ff=one,
        ft=one,
        e=one,
        fe=one,
        micro=one,
        remat=np.array([0]),
        fmicro=one,
    )
    roles = Roles(actor=ms, critic=None, ref=None, epochs=1, minibatches=1, offload="none")
    side = consumed_side(st, roles, 1, row, 1, np.array([64]))
    want = S.train_stage(sc, ms, busy=1, d=one, f=one, t=one, micro=one, remat="none", epochs=1, minibatches=1)[0]
    assert side.t_upd["actor"] == pytest.approx(want, rel=1e-12)
    assert (
        side.t_upd["actor"][0]
        < S.train_stage(st, ms, busy=1, d=one, f=one, t=one, micro=one, remat="none", epochs=1, minibatches=1)[0][0]
    )
