"""The planner: search placements, per-stage layouts, micro-batches and the structural knobs;
predict step time and memory of every candidate; return the best plan, runners-up and baselines.

    plan = choose_plan(cfg, num_devices, hardware)     # a graph.plan.Plan, predictions inside
    result = search(cfg, num_devices, hardware)       # everything `rpeg plan` prints

The cost model's rooms, in the order a search uses them:
  context.py     make_context: the Setting every price is computed with, the roles, the reference work
  space.py       the search space: device-group options, structural options, mesh divisibility
  candidates.py  build: every (groups, generation / training / forward layout) row with its best
                 micro-batch and remat choice that fits in memory, its stage seconds (vectorised),
                 as a typed table (table.py)
  scoring.py     per-stage seconds of a graph over a table, the simulated schedule (schedule.py),
                 pruning to the rows best by a serial and an overlapped proxy, one row as a Prediction
  baselines.py   verl-like and ReaL-like, each the best plan of its own family on the same table
                 (no straw men), and the gain split systems x algorithmic (gains_of)
  planner.py     (here) the search over train.offload options and families, the runners-up, the
                 one-line error when nothing fits, the warnings
Per placement family (colocated | split, actor-critic shared or not), for every structural option
(staleness k and admission, fusion, streamed pieces) the graph passes build the graph and its
schedule is simulated over all kept rows at once.
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

import numpy as np

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.run import RunConfig
from rpeg_jax.costmodel import offload as OFF
from rpeg_jax.costmodel.baselines import baseline, gains_of, synchronous_period
from rpeg_jax.costmodel.context import make_context, roles_of
from rpeg_jax.costmodel.devices import resolve
from rpeg_jax.costmodel.hardware import GB, HardwareProfile
from rpeg_jax.costmodel.report import explain
from rpeg_jax.costmodel.scoring import Scored, admission_of, family_table, option_graphs, predict, score
from rpeg_jax.costmodel.space import families, is_algorithmic, structural_options
from rpeg_jax.costmodel.types import Context, Prediction, SearchResult
from rpeg_jax.graph.ir import GraphError
from rpeg_jax.graph.plan import Plan


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
            tab = family_table(free, pairs[0][1], placement, {}) if pairs else None
            if tab is None or not len(tab):
                continue
            peak = np.maximum(tab.mem_update, tab.mem_forward)
            i = int(np.argmin(peak))
            if peak[i] < need:
                need = float(peak[i])
                stage = "the update" if tab.mem_update[i] >= tab.mem_forward[i] else "the scoring forwards"
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
        if score(one, {})[0]:
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


def _algorithmic(s: Scored) -> bool:
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
        sc, ev, co = score(c, cache_o)
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
        if not np.isfinite(s.period[i]):  # no kept row of this option fits or divides: no plan
            continue
        key = (
            s.pipeline.placement,
            s.pipeline.staleness,
            admission_of(s.graph),
            s.pipeline.share_actor_critic,
            *s.tab.layout_key(i),
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
    sync_s = synchronous_period(ctx, top.pipeline, top.tab.take(np.array([int(np.argmin(top.period))])))
    # The best plan at the synchronous algorithm (k = 0, separate models): the reference of the
    # systems gain; searched on its own when the config pins an algorithmic knob.
    # Over every offload option tried, as the chosen plan's.
    equals = []
    for _, _, c, cache_o, sc in tried:
        equal = [s for s in sc if not _algorithmic(s)]
        if not equal:
            equal, ev, _ = score(c, cache_o, equal_algorithm=True)
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


def choose_plan(cfg: RunConfig, num_devices: int | None = None, hardware=None, processes: int | None = None) -> Plan:
    """The planner entry point for the runtime (`pipeline.plan: auto`): the best Plan, with the
    predicted step time, memory, utilization and per-stage seconds in `plan.predicted`.
    `processes` defaults to jax.process_count() when JAX is running (costmodel/devices.py)."""
    return search(cfg, num_devices, hardware, processes).chosen.plan


def predicted_stage_times(plan: Plan) -> dict[str, float]:
    """Per-stage predicted seconds of a planner Plan (empty for manual plans)."""
    return dict(plan.predicted.get("stage_s", {}))
