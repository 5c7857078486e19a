"""Scoring candidate tables under structural options: per-stage seconds of a graph for every row,
the schedule's steady-state period and first-step latency, pruning, and one row in detail as a
Prediction with its Plan.

    tab = family_table(ctx, graph, placement, cache)     # costmodel/table.Table (candidates.build)
    period, latency = periods(ctx, graph, tab)           # [rows] each
    scored, evaluations, considered = score(ctx, cache)  # every family's options over its kept rows
    pred = predict(ctx, graph, pipe, tab, i, "chosen")   # a types.Prediction, .plan inside

Callers: costmodel/planner.py (search), baselines.py, pricing.py, tests. No JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.costmodel import candidates as C
from rpeg_jax.costmodel.context import reference_flops, roles_of, useful_flops
from rpeg_jax.costmodel.hardware import GB, describe_source
from rpeg_jax.costmodel.schedule import simulate, stage_spans, unroll
from rpeg_jax.costmodel.space import (
    admissions,
    allocations,
    continuous_searched,
    divisible,
    families,
    generation_tensor_sizes,
    structural_options,
)
from rpeg_jax.costmodel.table import Layouts, Table
from rpeg_jax.costmodel.types import Context, Prediction, clock_of
from rpeg_jax.graph.ir import Graph, GraphError, StageKind
from rpeg_jax.graph.passes import apply_pipeline
from rpeg_jax.graph.plan import DeviceGroup, Plan, StagePlan, decode_ahead_setting, knobs_of, layout_rules

KEEP_ROWS = 256  # rows per family and proxy kept for schedule simulation


def admission_of(graph: Graph) -> str:
    """rollout.admission of a planned graph (Graph.admission)."""
    return graph.admission


def shared_resource(ctx: Context) -> bool:
    """Whether every device group runs on the same cores (a shared-host profile, the schedule then
    serialises them): not when each of several processes has cores of its own (process_hosts)."""
    return ctx.hw.shared_host and not (ctx.hw.process_hosts and ctx.processes > 1)


def engine_staleness(graph: Graph) -> int:
    """The k whose engine simulation (Table.continuous[k]) prices this graph's continuous generation.
    Decoding ahead (Graph.decode_ahead) the engine makes step t's batch with version t - 1 weights, so a
    group straddles one step boundary fewer than at k: its decisions are the engine's at k - 1 (every
    token one version older; lengths.admission's staleness + 1)."""
    return graph.staleness - int(graph.decode_ahead)


def stage_seconds(kind: StageKind, tab: Table, graph: Graph) -> np.ndarray:
    """Seconds of one stage kind for every row of `tab` under `graph`. Under continuous admission
    generation is the engine's simulated steady state and the training side runs on its (shorter)
    batches (Table.continuous[k], costmodel/candidates.py)."""
    shared = bool(graph.attrs.get("shared"))
    side = tab.admitted(engine_staleness(graph) if admission_of(graph) == "continuous" else None)
    fwd, upd = side.train.t_fwd, side.train.t_upd
    if kind == StageKind.GENERATE:
        return side.t_gen
    if kind == StageKind.REWARD:
        return tab.t_reward
    if kind == StageKind.REF_FORWARD:
        return fwd["ref"]
    if kind == StageKind.OLD_FORWARD or (kind == StageKind.CRITIC_FORWARD and shared):
        return fwd["actor"] + tab.t_realloc["actor"]
    if kind == StageKind.CRITIC_FORWARD:
        return fwd["critic"] + tab.t_realloc["critic"]
    if kind == StageKind.ADVANTAGE:
        return side.train.t_adv
    if kind == StageKind.ACTOR_UPDATE:
        return upd["actor"]
    if kind == StageKind.CRITIC_UPDATE:
        return upd["critic"]
    if kind == StageKind.WEIGHT_SYNC:
        return tab.t_sync
    raise GraphError(kind.value, "the cost model has no price for this stage kind")


def durations(ctx: Context, graph: Graph, tab: Table) -> tuple[dict, dict]:
    """Per-stage seconds for every row, and generation's per-piece seconds when streamed."""
    dur, pieces = {}, {}
    for s in graph.stages():
        parts = s.parts or (s,)
        t = sum(stage_seconds(p.kind, tab, graph) for p in parts)
        if len(parts) > 1:  # one jitted program instead of several dispatches
            t = t - (len(parts) - 1) * ctx.hw.efficiency.dispatch_s
        dur[s.name] = t
        m = s.pieces
        if not any(p.kind == StageKind.GENERATE for p in parts) or m == 1:
            continue
        if m in tab.t_gen_pieces:  # one generate call per piece (the runtime today)
            extra = t - stage_seconds(StageKind.GENERATE, tab, graph)
            per = tab.t_gen_pieces[m] + extra / m
            dur[s.name], pieces[s.name] = m * per, [per] * m
        elif not graph.staleness:  # pieces finishing along one batch (no per-piece columns)
            qs = [tab.gen_q[:, (8 * j) // m - 1] for j in range(1, m)]
            marks = [np.zeros_like(t)] + qs + [tab.t_gen]
            extra = t - tab.t_gen
            pieces[s.name] = [marks[j + 1] - marks[j] + extra / m for j in range(m)]
    return dur, pieces


def prune(tab: Table, ctx: Context, graph: Graph, keep: int) -> np.ndarray:
    """Row indices best by the serial step (colocated) and the overlapped one (split)."""
    dur, _ = durations(ctx, graph, tab)
    serial = sum(dur.values())
    gen = dur.get("generate", 0.0)
    with np.errstate(invalid="ignore"):
        overlapped = np.nan_to_num(np.maximum(gen, serial - gen), nan=np.inf)
    idx = set(np.argsort(serial, kind="stable")[:keep].tolist())
    idx |= set(np.argsort(overlapped, kind="stable")[:keep].tolist())
    idx |= set(np.argsort(tab.mem_peak, kind="stable")[:4].tolist())
    return np.array(sorted(idx), dtype=np.int64)


@dataclass
class Scored:
    period: np.ndarray
    latency: np.ndarray
    graph: Graph
    pipeline: PipelineConfig
    tab: Table


def option_graphs(ctx: Context, opts: list[PipelineConfig]) -> list[tuple[PipelineConfig, Graph]]:
    """(option, the config's graph after that option's passes) for every legal structural option and
    every admission mode it may run with (space.admissions; the graph says which: admission_of)."""
    out = []
    given = ctx.cfg.rollout.decode_ahead
    for o in opts:
        for adm in admissions(ctx, o):
            # rollout.decode_ahead left null: a split plan under continuous admission is priced both
            # decoding ahead and taking turns (on one shared host the overlap buys nothing and every token
            # is a version older), and the plan records the choice (graph/plan.decode_ahead_setting)
            both = given is None and o.placement == "split" and adm == "continuous"
            for ahead in (True, False) if both else (given,):
                try:
                    out.append((o, apply_pipeline(ctx.base, o, adm, ahead)))
                except GraphError:  # an illegal combination for this algorithm (e.g. nothing to fuse)
                    continue
    return out


def family_table(
    ctx: Context, graph: Graph, placement: str, cache: dict, allocs=None, ours: bool = True, settings=None
) -> Table | None:
    """The candidate table of a placement family (cached; None when no row fits), over `allocs` (default: every
    device-group option of the family). `ours`: only what the runtime runs with the context's
    processes (space.runnable: device groups, generation's tensor degree, continuous admission);
    else every option of the model (the baselines' own engines, pricing a given layout).
    `settings`: (micro_batches, remat, forward_micro_batches) of a given plan, else searched."""
    allocs = allocations(ctx, placement, ours) if allocs is None else allocs
    gen_t = generation_tensor_sizes(ctx, ours)
    key = (placement, bool(graph.attrs.get("shared")), tuple(allocs), gen_t, settings)
    if key not in cache:
        c = ctx.cfg.costmodel
        cache[key] = C.build(
            ctx.st,
            roles_of(ctx, graph),
            allocs=allocs,
            placement=placement,
            tensor_sizes=c.tensor_sizes,
            max_staleness=max(c.max_staleness, ctx.cfg.pipeline.staleness),  # the config's own bound is priced too
            continuous=continuous_searched(ctx, ours, placement),
            gen_tensor_sizes=gen_t,
            settings=settings,
        )
    return cache[key]


def periods(ctx: Context, graph: Graph, tab: Table):
    """(steady-state period, first-step latency) of every row under `graph`; rows whose meshes do
    not divide the batch dimensions they shard are infinite."""
    dur, pieces = durations(ctx, graph, tab)
    period, latency, _, _ = simulate(unroll(graph, shared_resource=shared_resource(ctx)), dur, pieces)
    bad = ~divisible(ctx, graph, tab)
    return np.where(bad, np.inf, period), np.where(bad, np.inf, latency)


def score(ctx: Context, cache: dict, equal_algorithm: bool = False) -> tuple[list[Scored], int, int]:
    """Every family's structural options simulated over its pruned table rows: (scored options,
    plans scored, combinations priced). `equal_algorithm`: only the synchronous algorithm's options
    (k = 0, separate models; space.structural_options)."""
    scored: list[Scored] = []
    evaluations = considered = 0
    for placement, share in families(ctx, equal_algorithm):
        pairs = option_graphs(ctx, structural_options(ctx, placement, share, equal_algorithm))
        if not pairs:
            continue
        tab = family_table(ctx, pairs[0][1], placement, cache)
        if tab is None:
            continue
        evaluations += len(tab)
        considered += tab.considered
        sub = tab.take(prune(tab, ctx, pairs[0][1], KEEP_ROWS))
        for pipe, g in pairs:
            rows = sub
            period, latency = periods(ctx, g, rows)
            if not np.isfinite(period).any():  # the kept rows do not divide this option's pieces
                ok = np.nonzero(divisible(ctx, g, tab))[0]
                if not len(ok):
                    continue
                part = tab.take(ok)
                rows = part.take(prune(part, ctx, g, KEEP_ROWS))
                period, latency = periods(ctx, g, rows)
            evaluations += len(period)
            scored.append(Scored(period, latency, g, pipe, rows))
    return scored, evaluations, considered


def predict(
    ctx: Context,
    graph: Graph,
    pipe: PipelineConfig,
    tab: Table,
    i: int,
    label: str,
    concurrent: tuple | None = None,
) -> Prediction:
    """Simulate one row of a table in detail and wrap it as a Prediction with its Plan.
    `concurrent`: (durations of the row, nested groups, peak bytes, calls) of a ReaL-like plan whose
    scoring forwards run on disjoint sub-meshes (real_concurrent)."""
    row = tab.take(np.array([i]))
    dur, pieces = durations(ctx, graph, row)
    nested = None
    if concurrent is not None:
        dur, nested = concurrent[0], concurrent[1]
    prog = unroll(graph, shared_resource=shared_resource(ctx), nested=nested)
    period, latency, starts, ends = simulate(prog, dur, pieces, record=True)
    period, latency = float(period[0]), float(latency[0])
    # A shared host's devices are slices of one machine whose peak the profile holds.
    peak = ctx.hw.peak(roles_of(ctx, graph).actor.dtype) * (1 if ctx.hw.shared_host else ctx.N)
    # utilization: the fixed reference work (the synchronous unfused graph's FLOPs) per second of this
    # plan; utilization_own_work: the FLOPs this plan's own graph runs (lower for a plan that drops passes).
    util = reference_flops(ctx) / (period * peak) if period > 0 else 0.0
    util_own = useful_flops(ctx.st, graph) / (period * peak) if period > 0 else 0.0
    r = {f.name: int(getattr(tab, f.name)[i]) for f in dataclasses.fields(Layouts)}
    sync = not pipe.staleness
    cont = admission_of(graph) == "continuous"
    slots = int(tab.continuous[engine_staleness(graph)].slots[i]) if cont else min(int(tab.slots[i]), int(tab.n_rep[i]))
    layout = {
        "groups": {"gen": r["n_gen"], "train": r["n_train"]} if pipe.placement == "split" else {"all": r["n_train"]},
        "generate": {
            "tensor": r["t_g"],
            "replicas": r["n_gen"] // r["t_g"],
            "slots": slots,
            "admission": admission_of(graph),
            "decode_ahead": graph.decode_ahead,
        },
        "train": {
            "data": r["d"],
            "fsdp": r["f"],
            "tensor": r["t"],
            "micro_batches": r["micro"],
            "remat": C.REMATS[r["remat"]],
        },
        "forward": {"data": r["fd"], "fsdp": r["ff"], "tensor": r["ft"], "micro_batches": r["fmicro"]},
    }
    if roles_of(ctx, graph).actor.X:  # a mixture of experts: the expert degrees (1: none)
        layout["train"]["experts"], layout["forward"]["experts"] = r["e"], r["fe"]
    mem = float(
        tab.continuous[engine_staleness(graph)].mem_peak[i]
        if cont
        else tab.mem_peak_sync[i]
        if sync
        else tab.mem_peak[i]
    )
    if concurrent is not None:
        layout["concurrent"] = concurrent[3]
        mem = concurrent[2]
    if pipe.placement == "split":
        pipe = dataclasses.replace(pipe, split_sizes=(r["n_gen"], r["n_train"]))
    pred = Prediction(
        label=label,
        step_time_s=period,
        latency_s=latency,
        memory_per_gpu_gb=mem / GB,
        utilization=util,
        utilization_own_work=util_own,
        stage_times_s={k: float(np.asarray(v).ravel()[0]) for k, v in dur.items()},
        spans=stage_spans(prog, starts, ends),
        knobs=knobs_of(pipe),
        layout=layout,
    )
    pred.plan = to_plan(ctx, graph, pipe, pred)
    return pred


def _mesh(part: dict) -> dict[str, int]:
    if "replicas" in part:
        return {"data": part["replicas"], "fsdp": 1, "tensor": part["tensor"]}
    return {"data": part["data"], "fsdp": part["fsdp"], "tensor": part["tensor"]}


# rule presets of an expert-parallel stage (config/sharding.py): without / with a tensor axis
EXPERT_RULES = ("fsdp_expert", "fsdp_expert_tensor")
TRAIN_SIDE = {StageKind.ACTOR_UPDATE, StageKind.CRITIC_UPDATE, StageKind.ADVANTAGE, StageKind.WEIGHT_SYNC}
GEN_SIDE = {StageKind.GENERATE, StageKind.REWARD}


def to_plan(ctx: Context, graph: Graph, pipe: PipelineConfig, pred: Prediction) -> Plan:
    """The graph package's Plan for a prediction (meshes per stage, groups, knobs, settings)."""
    lay = pred.layout
    if pipe.placement == "split":
        ng, nt = lay["groups"]["gen"], lay["groups"]["train"]
        groups = (DeviceGroup("gen", tuple(range(ng))), DeviceGroup("train", tuple(range(ng, ng + nt))))
    else:
        groups = (DeviceGroup("all", tuple(range(lay["groups"]["all"]))),)
    calls = lay.get("concurrent", {})
    at = 0
    for c in calls.values():  # ReaL-like: disjoint sub-meshes of "all", one per concurrent call
        groups += (DeviceGroup(c["group"], tuple(range(at, at + c["devices"]))),)
        at += c["devices"]
    entries = []
    for s in graph.stages():
        kinds = {p.kind for p in (s.parts or (s,))}
        part = lay["generate"] if kinds <= GEN_SIDE else lay["train"] if kinds & TRAIN_SIDE else lay["forward"]
        part = calls.get(s.name, part)
        mesh = _mesh(part)
        rules = layout_rules(s, ctx.cfg, mesh, priced=True)
        if part.get("experts", 1) > 1:  # the experts over fsdp (the runtime's expert-parallel dispatch)
            rules = EXPERT_RULES[mesh["tensor"] > 1]
        entries.append(StagePlan(s.name, s.placement, mesh, rules, s.pieces))
    predicted = {
        "step_time_s": pred.step_time_s,
        "latency_s": pred.latency_s,
        "memory_per_gpu_gb": pred.memory_per_gpu_gb,
        "utilization": pred.utilization,
        "utilization_own_work": pred.utilization_own_work,
        "stage_s": pred.stage_times_s,
        "hardware": ctx.hw.name,
        "hardware_source": describe_source(ctx.hw),  # the profile file (shipped, calibrated: with its date)
        "processes": ctx.processes,
        "clock": clock_of(ctx.hw),
    }
    # Config values the run takes from the plan (graph/plan.config_for_plan). The sampler's max_slots
    # is per process over its replicas (slots per replica x replicas); the admission mode is the
    # one the plan was priced with (searched like k, space.admissions). A max_slots the config sets
    # is the run's: kept, and the slots the prediction assumed recorded beside it. A split across
    # processes generates on the processes owning its generation group (runtime/split.py).
    gen_procs = ctx.processes
    if "gen" in lay["groups"] and ctx.processes > 1:
        gen_procs = max(1, lay["groups"]["gen"] * ctx.processes // ctx.N)
    slots = lay["generate"]["slots"] * lay["generate"]["replicas"] // gen_procs
    pinned = ctx.cfg.rollout.max_slots
    if pinned is not None and pinned != slots:
        predicted["slots_priced"] = slots
    settings = {
        "rl.micro_batches": lay["train"]["micro_batches"],
        "rl.forward_micro_batches": lay["forward"]["micro_batches"],
        "model.remat": lay["train"]["remat"],
        "rollout.max_slots": slots if pinned is None else pinned,
        "rollout.admission": admission_of(graph),
        **decode_ahead_setting(graph),
        "train.offload": ctx.cfg.train.offload,
    }
    return Plan(
        num_devices=ctx.N,
        groups=groups,
        stages=tuple(entries),
        knobs=knobs_of(pipe),
        settings=settings,
        source="planner",
        predicted=predicted,
    ).check(graph)
