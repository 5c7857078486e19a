"""The planner: search placements, per-stage layouts, micro-batches and the structural knobs;
predict step time and memory of every candidate; return the best plan, runners-up and baselines.

    plan = choose_plan(cfg, num_devices, hardware)     # a graph.plan.Plan, predictions inside
    result = search(cfg, num_devices, hardware)       # everything `rpeg plan` prints

Search, per placement family (colocated | split, actor-critic shared or not; costmodel/space.py
holds the search space: device-group options, structural options, mesh divisibility):
  1. candidates.build: every (groups, generation / training / forward layout) row with its best
     micro-batch and remat choice that fits in memory; base stage durations per row (vectorised).
  2. prune to the rows best by a serial and an overlapped proxy of the step;
  3. for every structural option (staleness k, fusion, streamed pieces), build the graph with
     the graph passes and simulate its schedule over all kept rows at once (schedule.py).
Baselines are the best plan of their own family on the same table (no straw men):
  verl-like: colocated, synchronous, unfused, one FSDP training layout (tensor = 1) for every
             training-side stage, rollout with its own tensor parallelism;
  ReaL-like: colocated, synchronous, unfused, per-stage layouts with parameter reallocation, or
             the scoring forwards concurrent on disjoint sub-meshes (real_concurrent); the better.
The gain over verl-like is split into systems x algorithmic (gains_of; docs/costmodel.md).
A cluster is planned as the P JAX processes that launch on it (costmodel/devices.resolve: one per
node unless told): every candidate above is one the runtime runs with P processes, filtered by the
rules the runtime refuses plans by (graph/processes.py, through space.runnable); a config no such
plan can serve is refused in one line naming the key (make_context). The baselines are other
systems with their own engines: not bound by those rules.
Nothing here imports JAX: planning a 256-GPU cluster runs on a laptop.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.config.rollout import RolloutConfig, resolve_attention
from rpeg_jax.config.run import RunConfig
from rpeg_jax.costmodel import candidates as C
from rpeg_jax.costmodel import offload as OFF
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.comm import reshard_time
from rpeg_jax.costmodel.devices import resolve
from rpeg_jax.costmodel.hardware import GB, HardwareProfile, describe_source
from rpeg_jax.costmodel.lengths import LengthDist
from rpeg_jax.costmodel.report import explain
from rpeg_jax.costmodel.schedule import simulate, stage_spans, unroll
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.costmodel.space import (  # noqa: F401
    admissions,
    allocations,
    continuous_searched,
    divisible,
    families,
    generation_tensor_sizes,
    is_algorithmic,
    sampler_is_trainer,
    structural_options,
)
from rpeg_jax.costmodel.types import Context, Prediction, SearchResult, clock_of
from rpeg_jax.graph.algorithms import build_graph
from rpeg_jax.graph.ir import Graph, GraphError, Op, StageKind
from rpeg_jax.graph.passes import apply_pipeline
from rpeg_jax.graph.plan import DeviceGroup, Plan, StagePlan, knobs_of, layout_rules
from rpeg_jax.graph.processes import Runs, why_not
from rpeg_jax.shapes import buckets

KEEP_ROWS = 256  # rows per family and proxy kept for schedule simulation


# ---- context -------------------------------------------------------------------------------
FORCED_SAMPLES = 4096  # draws standing for rollout.forced_lengths' distribution


def length_dist(cfg: RunConfig) -> LengthDist:
    """The response lengths the model prices: rollout.forced_lengths' when a benchmark forces them
    (the runtime's draw: lognormal (median, sigma) rounded and clipped, no shift; as samples), else
    the costmodel section's shifted lognormal."""
    c, r = cfg.costmodel, cfg.rollout.max_new_tokens
    if cfg.rollout.forced_lengths is not None:
        med, sigma, lo, hi = cfg.rollout.forced_lengths
        z = np.random.default_rng(0).standard_normal(FORCED_SAMPLES)
        draw = np.clip(np.round(np.exp(np.log(med) + sigma * z)), lo, hi).astype(np.int64)
        return LengthDist(max_len=r, min_len=int(lo), samples=tuple(int(x) for x in draw))
    lo = min(c.response_len_min, r)
    med = None if c.response_len_median is None else min(max(c.response_len_median, lo), r)
    return LengthDist(max_len=r, min_len=lo, median=med, sigma=c.response_len_sigma)


def prompt_len(cfg: RunConfig, length_bucket: int) -> int:
    """Prompt columns the runtime computes on: the expected longest prompt (costmodel.prompt_len, else
    the data's longest) rounded up to the runtime's bucket, at most data.max_prompt_len; with fixed
    shapes (length_bucket 1) always data.max_prompt_len; the window shapes/buckets.length_bucket
    gives, as runtime/rollout/layout.lay_out pads the longest prompt of a batch (never longer than
    data.max_prompt_len)."""
    cap = cfg.data.max_prompt_len
    if length_bucket <= 1:
        return cap
    p = cfg.costmodel.prompt_len if cfg.costmodel.prompt_len is not None else cfg.data.longest_prompt()
    return buckets.length_bucket(min(p, cap))


def kv_read_of(r: RolloutConfig, kind: str, head_dim: int) -> str:
    """Setting.kv_read of the run's decode attention on a profile of `kind`: "once" for "kernel"
    (auto on GPU) compiled for a GPU (pages read in place), "chunk" for the chunk attention (auto on
    CPU: pages copied once per chunk), else "copy" (gather / blocked copy the pages every step: the
    profile's kv_read_factor; the kernel through the interpreter is no GPU kernel)."""
    att = resolve_attention(r.attention, kind, page_size=r.page_size, head_dim=head_dim)
    if att == "kernel" and kind == "gpu" and not r.kernel_interpret:
        return "once"
    return "chunk" if att == "chunk" else "copy"


def attention_is_flash(attention: str, kind: str) -> bool:
    """Whether the training passes' attention (model.attention) skips the masked half and keeps no
    [T, T] scores: cudnn and pallas do; xla materialises them; auto is priced as flash on an
    accelerator profile (the runtime takes cuDNN there when the model fits it: bfloat16 / float16,
    head size a multiple of 8; a float32 model runs xla, and plan_warnings flags float32 on a GPU)."""
    if attention == "auto":
        return kind != "cpu"
    return attention in ("cudnn", "pallas")


def make_context(cfg: RunConfig, num_devices: int, hw: HardwareProfile, processes: int = 1) -> Context:
    if num_devices < 1:
        raise GraphError("num_devices", f"{num_devices} must be >= 1")
    # What the config asks of the runtime on `processes` processes (graph/processes.py), before any
    # candidate: the search itself offers only what the runtime runs (space.runnable).
    bad = why_not(cfg, processes, num_devices, Runs(admission=cfg.rollout.admission))
    if bad is not None:
        raise bad.error()
    c = cfg.costmodel
    flash = attention_is_flash(cfg.model.attention, hw.kind)
    base = build_graph(cfg)
    sz = base.sizes
    bucket = 1 if cfg.pipeline.pieces > 1 else buckets.LENGTH_BUCKET
    st = S.Setting(
        hw=hw,
        B=sz["B"],
        P=prompt_len(cfg, bucket),
        R=sz["R"],
        G=sz["G"],
        dist=length_dist(cfg),
        causal_skip=flash,
        dense_scores=not flash,
        packing=cfg.train.pack_sequences,  # the updates and scoring forwards pack their rows
        budget_bytes=c.memory_budget * hw.hbm_bytes,
        kv_replicated=cfg.rollout.kv_pool == "replicated",
        prompt_sharing=cfg.sharding.axis_types != "explicit",  # kernels: explicit keeps the plain pass
        page_size=cfg.rollout.page_size,
        # the runtime pads prompts and responses to its length bucket unless shapes are
        # fixed (pieces > 1)
        length_bucket=bucket,
        chunk_steps=cfg.rollout.chunk_steps,
        min_chunk_steps=cfg.rollout.min_chunk_steps,
        table_growth=cfg.rollout.table_width_growth,
        recompute_kv=cfg.rollout.on_weight_update == "recompute",
        static_rows=hw.kind == "cpu",
        kv_read=kv_read_of(cfg.rollout, hw.kind, cfg.model.head_size),
    )
    return Context(cfg, hw, num_devices, st, base, processes)


def roles_of(ctx: Context, graph: Graph) -> C.Roles:
    """Model shapes by role as the graph's stages use them (shared backbone included)."""
    models = {}
    for s in graph.stages():
        for p in s.parts or (s,):
            for m in p.workload.models if p.workload else ():
                models.setdefault(m.role, ModelShape.of(m))
    rl = ctx.cfg.rl
    return C.Roles(
        actor=models["actor"],
        critic=models.get("critic"),
        ref=models.get("reference"),
        epochs=rl.ppo_epochs,
        minibatches=rl.minibatches,
        offload=ctx.cfg.train.offload,
    )


def useful_flops(st: S.Setting, g: Graph) -> float:
    """FLOPs of one step's model work on the real (unpadded) tokens: generation (2N per token +
    attention), each forward, each update (3× forward), for the stages `g` has (a shared
    backbone does less work than a separate critic, and is not credited for the difference).
    Recomputation (remat) and padding are not useful work."""
    lens = st.dist.lengths(st.B).astype(np.float64)
    tok, scored, sq = float(np.sum(st.P + lens)), float(np.sum(lens)), float(np.sum((st.P + lens) ** 2))
    total = 0.0
    for p in (p for s in g.stages() for p in (s.parts or (s,))):  # fused stages count their parts
        w = p.workload
        if w is None or not w.models:
            continue
        fwd = float(ModelShape.of(w.models[0]).forward_flops(tok, scored, sq, causal_skip=True))
        if w.op in (Op.GENERATE, Op.FORWARD):
            total += fwd
        elif w.op == Op.TRAIN:
            total += 3.0 * fwd * w.epochs
    return total


def reference_graph(ctx: Context) -> Graph:
    """The graph of the fixed reference work: the config's algorithm synchronous and unfused, every
    forward a verl user's step runs (the verl-like baseline's graph: no elided or shared passes)."""
    return apply_pipeline(ctx.base, PipelineConfig(placement="colocated"))


def reference_flops(ctx: Context) -> float:
    """FLOPs of one step of the reference work (useful_flops of reference_graph): the numerator of
    every plan's `utilization`, so a plan that does less work for the same step scores higher."""
    return useful_flops(ctx.st, reference_graph(ctx))


# ---- durations of a graph's stages for a table of rows ------------------------------------------
def admission_of(graph: Graph) -> str:
    """rollout.admission of a planned graph (Graph.admission)."""
    return graph.admission


def _part_time(kind: StageKind, tab: dict, graph: Graph) -> np.ndarray:
    shared = bool(graph.attrs.get("shared"))
    # Under continuous admission generation is the engine's simulated steady state and the training
    # side runs on its (shorter) batches: the columns *_c{k} (costmodel/candidates.py).
    c = f"_c{graph.staleness}" if admission_of(graph) == "continuous" else ""
    if kind == StageKind.GENERATE:
        return tab[f"t_gen{c}"]
    if kind == StageKind.REWARD:
        return tab["t_reward"]
    if kind == StageKind.REF_FORWARD:
        return tab[f"t_fwd_ref{c}"]
    if kind == StageKind.OLD_FORWARD:
        return tab[f"t_fwd_actor{c}"] + tab["t_realloc_actor"]
    if kind == StageKind.CRITIC_FORWARD:
        if shared:
            return tab[f"t_fwd_actor{c}"] + tab["t_realloc_actor"]
        return tab[f"t_fwd_critic{c}"] + tab["t_realloc_critic"]
    if kind == StageKind.ADVANTAGE:
        return tab[f"t_adv{c}"]
    if kind == StageKind.ACTOR_UPDATE:
        return tab[f"t_upd_actor{c}"]
    if kind == StageKind.CRITIC_UPDATE:
        return tab[f"t_upd_critic{c}"]
    if kind == StageKind.WEIGHT_SYNC:
        return tab["t_sync"]
    raise GraphError(kind.value, "the cost model has no price for this stage kind")


def durations(ctx: Context, graph: Graph, tab: dict) -> tuple[dict, dict]:
    """Per-stage seconds for every row, and generation's per-piece seconds when streamed."""
    dur, pieces = {}, {}
    for s in graph.stages():
        parts = s.parts or (s,)
        t = sum(_part_time(p.kind, tab, graph) for p in parts)
        if len(parts) > 1:  # one jitted program instead of several dispatches
            t = t - (len(parts) - 1) * ctx.hw.efficiency.dispatch_s
        dur[s.name] = t
        m = s.pieces
        if not any(p.kind == StageKind.GENERATE for p in parts) or m == 1:
            continue
        if f"t_gen_p{m}" in tab:  # one generate call per piece (the runtime today)
            extra = t - _part_time(StageKind.GENERATE, tab, graph)
            per = tab[f"t_gen_p{m}"] + extra / m
            dur[s.name], pieces[s.name] = m * per, [per] * m
        elif not graph.staleness:  # pieces finishing along one batch (no per-piece columns)
            qs = [tab["gen_q"][:, (8 * j) // m - 1] for j in range(1, m)]
            marks = [np.zeros_like(t)] + qs + [tab["t_gen"]]
            extra = t - tab["t_gen"]
            pieces[s.name] = [marks[j + 1] - marks[j] + extra / m for j in range(m)]
    return dur, pieces


def take_rows(tab: dict, idx) -> dict:
    """The rows `idx` of a candidate table (every column indexed alike)."""
    return {k: v[idx] for k, v in tab.items()}


def _prune(tab: dict, ctx: Context, graph: Graph, keep: int) -> np.ndarray:
    """Row indices best by the serial step (colocated) and the overlapped one (split)."""
    dur, _ = durations(ctx, graph, tab)
    serial = sum(dur.values())
    gen = dur.get("generate", 0.0)
    with np.errstate(invalid="ignore"):
        overlapped = np.nan_to_num(np.maximum(gen, serial - gen), nan=np.inf)
    idx = set(np.argsort(serial, kind="stable")[:keep].tolist())
    idx |= set(np.argsort(overlapped, kind="stable")[:keep].tolist())
    idx |= set(np.argsort(tab["mem_peak"], kind="stable")[:4].tolist())
    return np.array(sorted(idx), dtype=np.int64)


# ---- search --------------------------------------------------------------------------------
@dataclass
class _Scored:
    period: np.ndarray
    latency: np.ndarray
    graph: Graph
    pipeline: PipelineConfig
    tab: dict


def option_graphs(ctx: Context, opts: list[PipelineConfig]) -> list[tuple[PipelineConfig, Graph]]:
    """(option, the config's graph after that option's passes) for every legal structural option and
    every admission mode it may run with (space.admissions; the graph says which: admission_of)."""
    out = []
    for o in opts:
        for adm in admissions(ctx, o):
            try:
                out.append((o, apply_pipeline(ctx.base, o, adm)))
            except GraphError:  # an illegal combination for this algorithm (e.g. nothing to fuse)
                continue
    return out


def family_table(
    ctx: Context, graph: Graph, placement: str, cache: dict, allocs=None, ours: bool = True, settings=None
) -> dict:
    """The candidate table of a placement family (cached), over `allocs` (default: every
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
            allocs,
            placement,
            c.tensor_sizes,
            max(c.max_staleness, ctx.cfg.pipeline.staleness),  # the config's own bound is priced too
            continuous_searched(ctx, ours),
            gen_t,
            settings,
        )
    return cache[key]


def periods(ctx: Context, graph: Graph, tab: dict):
    """(steady-state period, first-step latency) of every row under `graph`; rows whose meshes do
    not divide the batch dimensions they shard are infinite."""
    dur, pieces = durations(ctx, graph, tab)
    period, latency, _, _ = simulate(unroll(graph, shared_resource=ctx.hw.shared_host), dur, pieces)
    bad = ~divisible(ctx, graph, tab)
    return np.where(bad, np.inf, period), np.where(bad, np.inf, latency)


class NoPlanFits(GraphError, ConfigError):
    """No candidate plan fits in memory (or divides the batch). A GraphError for the planner's
    callers and a ConfigError for the commands: the config asks for more than the devices hold, so
    `rpeg plan`, `rpeg train` and launch/multihost.py print one line and exit 2."""

    def __init__(self, why: str):
        ConfigError.__init__(self, "pipeline.plan", "auto", f"no plan fits: {why}")
        self.node = "plan"


def no_plan_fits(ctx: Context) -> NoPlanFits:
    """The one-line error when nothing fits: the biggest stage's least need over every layout,
    micro-batch count and remat choice (priced with no memory limit), the budget, and the knob."""
    cfg, hw, budget = ctx.cfg, ctx.hw, ctx.st.budget_bytes
    of = f"costmodel.memory_budget={cfg.costmodel.memory_budget} of {hw.name}'s {hw.hbm_bytes / GB:.1f} GB"
    more = "free host RAM" if hw.kind == "cpu" else "plan for more devices"
    if ctx.processes > 1 and _fits_on_one_process(ctx):
        return NoPlanFits(
            f"nothing the runtime runs with costmodel.processes={ctx.processes} fits the budget of {budget / GB:.2f} "
            f"GB per device ({of}): each process generates on its own devices, a whole replica of the model per "
            f"device (graph/processes.py); one process would fit (tensor-parallel generation or a split); "
            f"{more} or use a smaller model"
        )
    roles = roles_of(ctx, ctx.base)
    state = sum(OFF.resident_bytes(roles.offload, m) for m in (roles.actor, roles.critic) if m is not None) / ctx.N
    if state > budget:
        return NoPlanFits(
            f"the parameters and Adam moments alone need {state / GB:.2f} GB per device even sharded over "
            f"all {ctx.N} device{'s' if ctx.N > 1 else ''}; the budget is {budget / GB:.2f} GB per device ({of}); "
            f"use a smaller model, {more}, or raise costmodel.memory_budget"
        )
    # The least need: the tables keep each layout's fastest micro-batch/remat choice that fits, so
    # with no limit at all they would report the fastest (micro = 1) need, not the least. Budgets
    # growing by 2x: the first that admits a row bounds the least need within 2x, and that row's
    # peak is what is reported.
    need, stage = np.inf, "training"
    for scale in (2.0**k for k in range(1, 16)):
        free = dataclasses.replace(ctx, st=dataclasses.replace(ctx.st, budget_bytes=budget * scale))
        for placement, share in families(free):
            pairs = option_graphs(free, structural_options(free, placement, share))
            tab = family_table(free, pairs[0][1], placement, {}) if pairs else {}
            if "mem_update" not in tab or not len(tab["mem_update"]):
                continue
            peak = np.maximum(tab["mem_update"], tab["mem_forward"])
            i = int(np.argmin(peak))
            if peak[i] < need:
                need = float(peak[i])
                stage = "the update" if tab["mem_update"][i] >= tab["mem_forward"][i] else "the scoring forwards"
        if np.isfinite(need):
            break
    B, R = ctx.st.B, cfg.rollout.max_new_tokens
    if need > budget:
        verb = "needs" if stage == "the update" else "need"
        return NoPlanFits(
            f"{stage} {verb} {need / GB:.2f} GB per device in the best layout (micro-batches and remat "
            f"searched); the budget is {budget / GB:.2f} GB per device ({of}); lower data.prompts_per_step "
            f"(B={B} sequences) or rollout.max_new_tokens={R}, {more}, or raise costmodel.memory_budget"
        )
    return NoPlanFits(
        f"training fits ({need / GB:.2f} GB of {budget / GB:.2f} GB per device, {of}) but no layout leaves the "
        f"sampler room for one sequence's KV pages or divides the batch of B={B} sequences; lower "
        f"rollout.max_new_tokens={R} or change data.prompts_per_step"
    )


def _fits_on_one_process(ctx: Context) -> bool:
    """Whether some plan of the same problem fits when one process owns all the devices (the
    planner's what-if behind no_plan_fits' message with several processes)."""
    for off in offload_options(ctx.cfg, ctx.hw):
        one = make_context(_with_offload(ctx.cfg, off), ctx.N, ctx.hw, 1)
        if _score(one, {})[0]:
            return True
    return False


def offload_options(cfg: RunConfig, hw: HardwareProfile) -> list[str]:
    """train.offload settings the search tries: the config's; on accelerators, when it is none, also
    offloading the optimizer (and the reference, when there is one). Offloading frees device memory
    for KV slots and larger layouts at the price of the host link's transfers. Not on a CPU, whose
    "host" memory is the same RAM: nothing to gain there."""
    options = [cfg.train.offload]
    if cfg.train.offload == "none" and hw.kind != "cpu":
        options += ["optimizer"] + (["optimizer+reference"] if cfg.rl.kl_coef > 0 else [])
    return options


def _score(ctx: Context, cache: dict, equal_algorithm: bool = False) -> tuple[list[_Scored], int, int]:
    """Every family's structural options simulated over its pruned table rows: (scored options,
    plans scored, combinations priced). `equal_algorithm`: only the synchronous algorithm's options
    (k = 0, separate models; space.structural_options)."""
    scored: list[_Scored] = []
    evaluations = considered = 0
    for placement, share in families(ctx, equal_algorithm):
        pairs = option_graphs(ctx, structural_options(ctx, placement, share, equal_algorithm))
        if not pairs:
            continue
        tab = family_table(ctx, pairs[0][1], placement, cache)
        if not tab:
            continue
        evaluations += len(tab["n_gen"])
        considered += int(tab["considered"][0])
        sub = take_rows(tab, _prune(tab, ctx, pairs[0][1], KEEP_ROWS))
        for pipe, g in pairs:
            rows = sub
            period, latency = periods(ctx, g, rows)
            if not np.isfinite(period).any():  # the kept rows do not divide this option's pieces
                ok = np.nonzero(divisible(ctx, g, tab))[0]
                if not len(ok):
                    continue
                part = take_rows(tab, ok)
                rows = take_rows(part, _prune(part, ctx, g, KEEP_ROWS))
                period, latency = periods(ctx, g, rows)
            evaluations += len(period)
            scored.append(_Scored(period, latency, g, pipe, rows))
    return scored, evaluations, considered


def _algorithmic(s: _Scored) -> bool:
    return is_algorithmic(s.pipeline.staleness, s.pipeline.share_actor_critic)


def search(cfg: RunConfig, num_devices: int | None = None, hardware=None, processes: int | None = None) -> SearchResult:
    """Score every candidate plan of `cfg` on `num_devices` devices of `hardware` owned by
    `processes` JAX processes (unset ones: costmodel section, else the devices JAX sees; see
    costmodel/devices.py)."""
    t0 = time.perf_counter()
    hw, n, procs = resolve(cfg, num_devices, hardware, processes)
    ctx0 = make_context(cfg, n, hw, procs)
    # train.offload is searched (offload_options); the plan carries the chosen value
    # (settings["train.offload"]).
    options = offload_options(cfg, hw)
    tried, evaluations, considered = [], 0, 0
    for off in options:
        c = ctx0 if off == cfg.train.offload else make_context(_with_offload(cfg, off), n, hw, procs)
        cache_o: dict = {}
        sc, ev, co = _score(c, cache_o)
        evaluations, considered = evaluations + ev, considered + co
        if sc:
            sc.sort(key=lambda s: float(np.min(s.period)))
            tried.append((float(np.min(sc[0].period)), len(tried), c, cache_o, sc))
    if not tried:
        raise no_plan_fits(ctx0)
    _, _, ctx, cache, scored = min(tried, key=lambda x: x[:2])  # ties keep the config's own value
    cfg = ctx.cfg
    best: list[Prediction] = []
    seen = set()
    for s in scored:  # runners-up differ in placement, staleness, sharing or layout, not only in fusion
        if len(best) > cfg.costmodel.runners_up:
            break
        i = int(np.argmin(s.period))
        key = (
            s.pipeline.placement,
            s.pipeline.staleness,
            admission_of(s.graph),
            s.pipeline.share_actor_critic,
            *(int(s.tab[c][i]) for c in ("n_gen", "n_train", "t_g", "d", "f", "t", "fd", "ff", "ft")),
        )
        if key not in seen:
            seen.add(key)
            best.append(predict(ctx, s.graph, s.pipeline, s.tab, i, "chosen" if not best else f"runner-up {len(best)}"))
    # The baselines under the config's own offload (verl's and ReaL's default: none), on the chosen
    # offload only where nothing fits without it.
    base_ctx, base_cache = (ctx0, {}) if ctx is not ctx0 else (ctx, cache)
    baselines = {
        name: b
        for name, b in ((nm, baseline(base_ctx, nm, base_cache)) for nm in ("verl_like", "real_like"))
        if b is not None
    }
    if not baselines and ctx is not ctx0:
        baselines = {
            name: b
            for name, b in ((nm, baseline(ctx, nm, cache)) for nm in ("verl_like", "real_like"))
            if b is not None
        }
    top = scored[0]
    sync_s = synchronous_period(ctx, top.pipeline, take_rows(top.tab, np.array([int(np.argmin(top.period))])))
    # The best plan at the synchronous algorithm (k = 0, separate models): the reference of the
    # systems gain; searched on its own when the config pins an algorithmic knob.
    # Over every offload option tried, as the chosen plan's.
    equals = []
    for _, _, c, cache_o, sc in tried:
        equal = [s for s in sc if not _algorithmic(s)]
        if not equal:
            equal, ev, _ = _score(c, cache_o, equal_algorithm=True)
            evaluations += ev
            equal.sort(key=lambda s: float(np.min(s.period)))
        if equal and np.isfinite(np.min(equal[0].period)):
            equals.append((float(np.min(equal[0].period)), len(equals), c, equal[0]))
    eq = None
    if equals:
        _, _, c, e = min(equals, key=lambda x: x[:2])
        eq = best[0] if e is top else predict(c, e.graph, e.pipeline, e.tab, int(np.argmin(e.period)), "equal-alg")
    res = SearchResult(
        chosen=best[0],
        runners_up=best[1:],
        baselines=baselines,
        search_seconds=time.perf_counter() - t0,
        evaluations=evaluations,
        plans_considered=considered,
        hardware=hw.name,
        num_devices=n,
        processes=procs,
    )
    res.equal_algorithm = eq
    res.gains = gains_of(cfg, best[0], eq, baselines.get("verl_like"))
    if top.pipeline.staleness:
        verl = baselines.get("verl_like")
        res.asynchrony = {
            "sync_step_s": sync_s,
            "asynchrony": sync_s / best[0].step_time_s,
            "rest": verl.step_time_s / sync_s if verl is not None else None,
        }
    res.notes = explain(ctx, res)
    res.warnings = plan_warnings(cfg, hw)
    return res


def plan_warnings(cfg: RunConfig, hw: HardwareProfile) -> list[str]:
    """What a user should fix before trusting the plan: float32 compute on an accelerator is priced
    at its fp32 peak (GH200: 67 of 989 TFLOP/s), which no GPU RL run uses."""
    out = []
    if hw.kind == "cpu" and not hw.calibrated:
        out.append(
            f"the {hw.name} profile is not calibrated on this machine (its rates are placeholders, "
            f"{hw.source or 'given'}): step times and util are rough; run `rpeg calibrate`, then plan with "
            "costmodel.calibration=cached"
        )
    if hw.kind != "cpu" and cfg.model.dtype == "float32":
        out.append(
            f"model.dtype=float32 on {hw.name}: priced at the fp32 peak ({hw.peak('float32') / 1e12:.0f} "
            f"TFLOP/s, not {hw.peak('bfloat16') / 1e12:.0f}); GPU RL runs compute in bfloat16 "
            f"(model.dtype=bfloat16, as configs/p1.yaml sets)"
        )
    return out


def _with_offload(cfg: RunConfig, offload: str) -> RunConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, offload=offload))


def gains_of(cfg: RunConfig, chosen: Prediction, eq: Prediction | None, verl: Prediction | None) -> dict:
    """The chosen plan's gain over the verl-like plan split by kind: total = systems x algorithmic.
    systems = verl-like / the best plan at the synchronous algorithm (placement, layouts, fusion,
    elision, scheduling and streamed overlap, k = 0 with separate models); algorithmic = that plan /
    the chosen one (staleness k >= 1, a shared actor-critic backbone: 1.0 unless the chosen plan uses
    them). None where a side has no plan."""
    k, share = int(chosen.knobs.get("staleness", 0)), bool(chosen.knobs.get("share_actor_critic"))
    e = eq.step_time_s if eq is not None else None
    return {
        "systems": verl.step_time_s / e if verl is not None and e else None,
        "algorithmic": e / chosen.step_time_s if e else None,
        "total": verl.step_time_s / chosen.step_time_s if verl is not None else None,
        "equal_algorithm_step_s": e,
        "algorithmic_searched": bool(cfg.costmodel.search_algorithmic),
        "algorithmic_knobs": {"staleness": k, "share_actor_critic": share},
    }


def synchronous_period(ctx: Context, pipe: PipelineConfig, row: dict) -> float:
    """Steady-state seconds of a table row under `pipe` without asynchrony (k = 0, step admission,
    the other knobs kept): what the chosen plan's layout, fusion and placement give on their own."""
    g = apply_pipeline(ctx.base, dataclasses.replace(pipe, staleness=0), "step")
    return float(periods(ctx, g, row)[0][0])


def baseline(ctx: Context, name: str, cache: dict) -> Prediction | None:
    """The best plan of a baseline family on the same hardware (see the module docstring). The
    baselines generate with their own engines (vLLM/SGLang-style: one KV pool per replica), so
    they are priced with a sharded pool whatever our sampler does (no straw men)."""
    if ctx.st.kv_replicated:
        ctx = dataclasses.replace(ctx, st=dataclasses.replace(ctx.st, kv_replicated=False))
        cache = cache.setdefault("baselines", {})
    pipe = PipelineConfig(placement="colocated")
    g = apply_pipeline(ctx.base, pipe)
    tab = family_table(ctx, g, "colocated", cache, ours=False)  # their own engines' layouts
    if not tab:
        return None
    mask = np.ones(len(tab["n_gen"]), bool)
    if name == "verl_like":  # FSDP training (no tensor axis), one layout for the forwards and the updates
        mask = (tab["t"] == 1) & (tab["d"] == tab["fd"]) & (tab["f"] == tab["ff"]) & (tab["t"] == tab["ft"])
    out = None
    if mask.any():
        sub = take_rows(tab, np.nonzero(mask)[0])
        period, _ = periods(ctx, g, sub)
        if np.isfinite(period).any():
            out = predict(ctx, g, pipe, sub, int(np.argmin(period)), name)
    if name == "real_like":  # ReaL's per-call sub-meshes: the scoring forwards side by side
        conc = real_concurrent(ctx, cache)
        if conc is not None:
            gc, rows, dur, nested, i, peak, calls = conc
            p = predict(ctx, gc, pipe, rows, i, name, concurrent=(dur, nested, peak, calls))
            if out is None or p.step_time_s < out.step_time_s:
                out = p
    return out


FORWARD_KINDS = (StageKind.REF_FORWARD, StageKind.OLD_FORWARD, StageKind.CRITIC_FORWARD)


def _partitions(n: int, m: int) -> list[tuple[int, ...]]:
    """Disjoint sub-mesh sizes for m concurrent calls on n devices (ReaL's per-call meshes, a few
    power-of-two shapes): halves for two; for three, thirds when n divides and every ordering of
    (n/2, n/4, n/4)."""
    if m == 2:
        return [(n // 2, n // 2)] if n % 2 == 0 and n >= 2 else []
    if m == 3:
        out = [(n // 3,) * 3] if n % 3 == 0 else []
        if n % 4 == 0:
            out += [(n // 2, n // 4, n // 4), (n // 4, n // 2, n // 4), (n // 4, n // 4, n // 2)]
        return out
    return []


def _sub_forward(ctx: Context, ms: ModelShape, n_sub: int, tab: dict, src_shards: np.ndarray):
    """Per table row, the best layout of one scoring forward on a sub-mesh of n_sub devices: its
    seconds (the forward plus the reallocation of the model's weights from their `src_shards`-way
    layout on all devices into it, as ReaL's parameter reallocation), peak bytes per device of the
    sub-mesh, and the layout (d, f, t)."""
    st, hw = ctx.st, ctx.hw
    lay = C.layouts(n_sub, st.B, ms, ctx.cfg.costmodel.tensor_sizes)
    rows = len(tab["n_gen"])
    if not len(lay):
        return np.full(rows, np.inf), np.full(rows, np.inf), np.zeros((rows, 3), np.int64)
    d, f, t = (lay[:, i].astype(np.float64) for i in range(3))
    fw = S.forward_stage(st, ms, n_sub, d, f, t, np.ones_like(d))[0]  # [L]
    trans = S.forward_memory(st, ms, d, f, t, np.ones_like(d))  # [L]
    shards = f * t
    rs = reshard_time(hw, ms.weight_bytes(), src_shards[:, None], shards[None, :], ctx.N)
    realloc = rs + ms.weight_bytes() / shards[None, :] / hw.device.memory_bw  # [rows, L]
    peak = tab["mem_resident"][:, None] + ms.weight_bytes() / shards[None, :] + trans[None, :]
    tot = np.where(peak <= st.budget_bytes, fw[None, :] + realloc, np.inf)
    j = np.argmin(tot, axis=1)
    r = np.arange(rows)
    return tot[r, j], peak[r, j], lay[j]


def real_concurrent(ctx: Context, cache: dict):
    """ReaL's per-call disjoint sub-meshes on the synchronous unfused graph: the scoring forwards
    (reference, old policy, critic), which depend only on the rollouts, run concurrently on
    disjoint parts of the devices, each in its own best layout, its weights reallocated into it;
    generation and the updates keep the row's layouts on all devices. Returns (graph, rows,
    durations, nested groups, per-row detail) of the best partition, or None when fewer than two
    forwards exist or no partition fits."""
    g0 = reference_graph(ctx)
    fwd = [s for s in g0.stages() if s.kind in FORWARD_KINDS]
    parts = _partitions(ctx.N, len(fwd))
    if len(fwd) < 2 or not parts or ctx.hw.shared_host:
        return None
    tab = family_table(ctx, g0, "colocated", cache, ours=False)
    if not tab:
        return None
    tab = take_rows(tab, _prune(tab, ctx, g0, KEEP_ROWS))
    roles = roles_of(ctx, g0)
    model_of = {
        StageKind.REF_FORWARD: roles.ref,
        StageKind.OLD_FORWARD: roles.actor,
        StageKind.CRITIC_FORWARD: roles.critic,
    }
    src = {  # where each model's weights live before the call: trained ones in the training layout
        StageKind.REF_FORWARD: tab["ff"] * tab["ft"],
        StageKind.OLD_FORWARD: tab["f"] * tab["t"],
        StageKind.CRITIC_FORWARD: tab["f"] * tab["t"],
    }
    g = g0.copy()
    names = [f"call{i}" for i in range(len(fwd))]
    for s, grp in zip(fwd, names):
        g.replace_node(dataclasses.replace(g.stage(s.name), placement=grp))
    nested = {"all": tuple(names)}
    prog = unroll(g, shared_resource=False, nested=nested)
    base_dur, pieces = durations(ctx, g0, tab)
    best = None
    for sizes in parts:
        dur = dict(base_dur)
        peak = np.maximum(tab["mem_update"], tab["mem_gen"])
        detail = {}
        for s, n_sub in zip(fwd, sizes):
            t_s, m_s, lay = _sub_forward(ctx, model_of[s.kind], n_sub, tab, src[s.kind])
            dur[s.name] = t_s
            peak = np.maximum(peak, m_s)
            detail[s.name] = (n_sub, lay)
        period = simulate(prog, dur, pieces)[0]
        period = np.where(divisible(ctx, g0, tab), period, np.inf)
        i = int(np.argmin(period))
        if np.isfinite(period[i]) and (best is None or period[i] < best[0]):
            best = (float(period[i]), i, sizes, dur, peak, detail)
    if best is None:
        return None
    _, i, sizes, dur, peak, detail = best
    calls = {
        name: {
            "group": grp,
            "devices": int(n_sub),
            "data": int(lay[i, 0]),
            "fsdp": int(lay[i, 1]),
            "tensor": int(lay[i, 2]),
        }
        for grp, (name, (n_sub, lay)) in zip(names, detail.items())
    }
    return g, tab, {k: np.asarray(v)[[i]] for k, v in dur.items()}, nested, i, float(peak[i]), calls


def predict(
    ctx: Context,
    graph: Graph,
    pipe: PipelineConfig,
    tab: dict,
    i: int,
    label: str,
    concurrent: tuple | None = None,
) -> Prediction:
    """Simulate one row of a table in detail and wrap it as a Prediction with its Plan.
    `concurrent`: (durations of the row, nested groups, peak bytes, calls) of a ReaL-like plan whose
    scoring forwards run on disjoint sub-meshes (real_concurrent)."""
    row = take_rows(tab, np.array([i]))
    dur, pieces = durations(ctx, graph, row)
    nested = None
    if concurrent is not None:
        dur, nested = concurrent[0], concurrent[1]
    prog = unroll(graph, shared_resource=ctx.hw.shared_host, nested=nested)
    period, latency, starts, ends = simulate(prog, dur, pieces, record=True)
    period, latency = float(period[0]), float(latency[0])
    # A shared host's devices are slices of one machine whose peak the profile holds.
    peak = ctx.hw.peak(roles_of(ctx, graph).actor.dtype) * (1 if ctx.hw.shared_host else ctx.N)
    # utilization: the fixed reference work (the synchronous unfused graph's FLOPs) per second of this
    # plan; utilization_own_work: the FLOPs this plan's own graph runs (lower for a plan that drops passes).
    util = reference_flops(ctx) / (period * peak) if period > 0 else 0.0
    util_own = useful_flops(ctx.st, graph) / (period * peak) if period > 0 else 0.0
    r = {k: v[0].item() if np.ndim(v[0]) == 0 else v[0] for k, v in row.items()}
    sync = not pipe.staleness
    cont = admission_of(graph) == "continuous"
    slots = int(r[f"slots_c{pipe.staleness}"]) if cont else min(int(r["slots"]), int(r["n_rep"]))
    layout = {
        "groups": {"gen": int(r["n_gen"]), "train": int(r["n_train"])}
        if pipe.placement == "split"
        else {"all": int(r["n_train"])},
        "generate": {
            "tensor": int(r["t_g"]),
            "replicas": int(r["n_gen"] // r["t_g"]),
            "slots": slots,
            "admission": admission_of(graph),
        },
        "train": {
            "data": int(r["d"]),
            "fsdp": int(r["f"]),
            "tensor": int(r["t"]),
            "micro_batches": int(r["micro"]),
            "remat": C.REMATS[int(r["remat"])],
        },
        "forward": {
            "data": int(r["fd"]),
            "fsdp": int(r["ff"]),
            "tensor": int(r["ft"]),
            "micro_batches": int(r["fmicro"]),
        },
    }
    mem = float(r[f"mem_peak_c{pipe.staleness}" if cont else "mem_peak_sync" if sync else "mem_peak"])
    if concurrent is not None:
        layout["concurrent"] = concurrent[3]
        mem = concurrent[2]
    if pipe.placement == "split":
        pipe = dataclasses.replace(pipe, split_sizes=(int(r["n_gen"]), int(r["n_train"])))
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
    # is the run's: kept, and the slots the prediction assumed recorded beside it.
    slots = lay["generate"]["slots"] * lay["generate"]["replicas"] // ctx.processes
    pinned = ctx.cfg.rollout.max_slots
    if pinned is not None and pinned != slots:
        predicted["slots_priced"] = slots
    settings = {
        "rl.micro_batches": lay["train"]["micro_batches"],
        "rl.forward_micro_batches": lay["forward"]["micro_batches"],
        "model.remat": lay["train"]["remat"],
        "rollout.max_slots": slots if pinned is None else pinned,
        "rollout.admission": admission_of(graph),
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


def choose_plan(cfg: RunConfig, num_devices: int | None = None, hardware=None, processes: int | None = None) -> Plan:
    """The planner entry point for the runtime (`pipeline.plan: auto`): the best Plan, with the
    predicted step time, memory, utilization and per-stage seconds in `plan.predicted`.
    `processes` defaults to jax.process_count() when JAX is running (costmodel/devices.py)."""
    return search(cfg, num_devices, hardware, processes).chosen.plan


def predicted_stage_times(plan: Plan) -> dict[str, float]:
    """Per-stage predicted seconds of a planner Plan (empty for manual plans)."""
    return dict(plan.predicted.get("stage_s", {}))
