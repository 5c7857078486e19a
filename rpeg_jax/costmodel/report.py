"""Text and JSON renderings of a planner SearchResult (what `rpeg plan` prints and saves), and
the planner's explanation of its choice (`explain`, the "why:" lines).

JSON fields (stable; bench/ and CI read them): chosen.{step_time_s, latency_s,
memory_per_gpu_gb, utilization, stage_times_s, knobs, layout, plan}, runners_up[...],
baselines.{verl_like, real_like}.{...same}, ratios.{verl_like, real_like} (baseline step time /
chosen), asynchrony.{sync_step_s, asynchrony, rest} (the chosen layout priced at k = 0 with step
admission; speedup over verl-like = asynchrony x rest; null for a synchronous choice),
gains.{systems, algorithmic, total, equal_algorithm_step_s, algorithmic_searched, algorithmic_knobs}
(total = verl-like / chosen = systems x algorithmic; systems = verl-like / the best plan at the
synchronous algorithm, equal_algorithm; algorithmic = that / chosen, 1.0 for a chosen plan at k = 0
with separate models), equal_algorithm (that plan, the chosen one when it is such a plan),
search_seconds, evaluations, evaluations_per_s, hardware, num_devices, processes (P: the JAX processes
planned for, also in every plan's predicted.processes), notes. Every plan entry has
utilization (on the fixed reference work: the synchronous unfused graph's FLOPs) and
utilization_own_work (on the FLOPs its own graph runs).

asynchrony.asynchrony >= gains.algorithmic when the chosen plan's only algorithmic knob is k: the
first prices the chosen layout at k = 0, the second compares with the best k = 0 plan of any layout.
"""

from __future__ import annotations

from typing import Any

from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.hardware import GB
from rpeg_jax.costmodel.lengths import Admission
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.costmodel.types import Context, Prediction, SearchResult, clock_of
from rpeg_jax.graph.processes import sharers

BASELINES = ("verl_like", "real_like")  # null in the JSON when no plan of that family fits


def _entry(p: Prediction) -> dict[str, Any]:
    out = p.summary()
    out["label"] = p.label
    out["spans"] = {k: list(v) for k, v in p.spans.items()}
    out["plan"] = p.plan.to_dict() if p.plan is not None else None
    return out


def to_json_dict(res: SearchResult) -> dict[str, Any]:
    c = res.chosen.step_time_s
    return {
        "hardware": res.hardware,
        "num_devices": res.num_devices,
        "processes": res.processes,
        "search_seconds": res.search_seconds,
        "evaluations": res.evaluations,
        "plans_considered": res.plans_considered,
        "evaluations_per_s": res.evaluations / max(res.search_seconds, 1e-9),
        "chosen": _entry(res.chosen),
        "runners_up": [_entry(p) for p in res.runners_up],
        "baselines": {k: (_entry(res.baselines[k]) if k in res.baselines else None) for k in BASELINES},
        "ratios": {k: (res.baselines[k].step_time_s / c if k in res.baselines else None) for k in BASELINES},
        "asynchrony": res.asynchrony,
        "gains": dict(res.gains),
        "equal_algorithm": _entry(res.equal_algorithm) if res.equal_algorithm is not None else None,
        "notes": list(res.notes),
        "warnings": list(res.warnings),
    }


def _layout(p: Prediction) -> str:
    lay, k = p.layout, p.knobs
    groups = "+".join(f"{n}{v}" for n, v in lay["groups"].items())
    g, t, f = lay["generate"], lay["train"], lay["forward"]
    fuse = ",".join(k.get("fuse") or []) or "-"
    te, fe = (f"e{x['experts']}" if x.get("experts", 1) > 1 else "" for x in (t, f))  # expert parallelism
    return (
        f"{k['placement']:<9} {groups:<14} gen tp{g['tensor']}x{g['replicas']} slots {g['slots']:<4} "
        f"{g.get('admission', 'step'):<10} "
        f"train d{t['data']}f{t['fsdp']}t{t['tensor']}{te} mb{t['micro_batches']} {t['remat']:<4} "
        f"fwd d{f['data']}f{f['fsdp']}t{f['tensor']}{fe} mb{f.get('micro_batches', 1)}  "
        f"k={k['staleness']} share={int(bool(k['share_actor_critic']))} "
        f"fuse={fuse} elide={int(bool(k.get('elide_old_forward')))} pieces={k['pieces']}"
    )


LAYOUT_LEGEND = [
    "  util: the plan's own model FLOPs per second over the devices' peak (predicted); layout: placement,",
    "  device groups (all256 / gen128+train128), generation tp<tensor>x<replicas> with its sampler slots and",
    "  rollout.admission, the update's and the scoring forwards' meshes d<data>f<fsdp>t<tensor> (e<n>: a",
    "  mixture's experts over fsdp, expert-parallel) with their",
    "  micro-batches mb<n> and rematerialisation (none | dots | full), then the structural knobs: staleness k,",
    "  share (one actor-critic backbone), fuse, elide (sampler logprobs as pi_old), pieces (streamed generation)",
]


def _util(u: float) -> str:
    """A utilization for the table: above 100% only through a modelling error, shown as such."""
    return f"{100 * u:>5.1f}%" if u <= 1.0 else "  >100%?"


def render_text(res: SearchResult) -> str:
    c = res.chosen
    P = res.processes
    procs = f"{P} process{'es' if P > 1 else ''} ({res.num_devices // P} devices each)"
    lines = [
        f"rpeg plan: {res.num_devices} x {res.hardware} in {procs}; scored {res.evaluations} plans "
        f"({res.plans_considered} layout/micro-batch/remat combinations priced) in "
        f"{res.search_seconds:.2f} s ({res.evaluations / max(res.search_seconds, 1e-9):.0f} plans/s)",
        *(f"warning: {w}" for w in res.warnings),
        "",
    ]
    head = f"  {'plan':<12} {'step s':>9} {'vs chosen':>9} {'mem GB':>7} {'util':>6}  layout"
    lines.append(head)
    eq = res.equal_algorithm
    rows = [c, *res.runners_up, *([eq] if eq is not None and eq is not c else []), *res.baselines.values()]
    for p in rows:
        lines.append(
            f"  {p.label:<12} {p.step_time_s:>9.4g} {p.step_time_s / c.step_time_s:>8.2f}x "
            f"{p.memory_per_gpu_gb:>7.2f} {_util(p.utilization_own_work)}  {_layout(p)}"
        )
    lines += LAYOUT_LEGEND
    lines += ["", "per-stage seconds (steady-state step; spans are start..end within the step):"]
    for p in [c, *res.baselines.values()]:
        lines.append(f"  {p.label}: step {p.step_time_s:.4g} s, first-step latency {p.latency_s:.4g} s")
        for name, sec in p.stage_times_s.items():
            a, b = p.spans.get(name, (0.0, 0.0))
            lines.append(f"    {name:<36} {sec:>10.4g} s   [{a:.4g} .. {b:.4g}]")
    lines += ["", *gains_lines(res), "", "why:"] + [f"  - {n}" for n in res.notes]
    if c.plan is not None:
        lines += ["", c.plan.describe()]
    return "\n".join(lines) + "\n"


def _x(v) -> str:
    return f"{v:.2f}x" if v is not None else "n/a"


def algorithmic_knobs_text(knobs: dict) -> str:
    parts = []
    if knobs.get("staleness"):
        parts.append(f"staleness k={knobs['staleness']} (the learner trains on data up to k updates old)")
    if knobs.get("share_actor_critic"):
        parts.append("one shared actor-critic backbone (another model)")
    return ", ".join(parts) or "none"


def gains_lines(res: SearchResult) -> list[str]:
    """The gain over verl-like split by kind (res.gains; planner.gains_of)."""
    g = res.gains
    if not g:
        return []
    searched = "searched: costmodel.search_algorithmic" if g["algorithmic_searched"] else "off in the search"
    eq = g["equal_algorithm_step_s"]
    return [
        f"gains over verl_like: {_x(g['total'])} = systems {_x(g['systems'])} x algorithmic {_x(g['algorithmic'])}",
        "  systems: placement, layouts, fusion, elided passes, scheduling and overlap at the same algorithm "
        f"(k=0, separate models): the best such plan takes {eq:.4g} s/step"
        if eq is not None
        else "  systems: no plan at the synchronous algorithm fits",
        f"  algorithmic ({searched}): the chosen plan's {algorithmic_knobs_text(g['algorithmic_knobs'])}",
    ]


def admission_summary(ctx: Context, p: Prediction) -> Admission | None:
    """The simulated engine (lengths.admission) of a continuous-admission prediction."""
    g = p.layout["generate"]
    if g.get("admission") != "continuous":
        return None
    lag = int(bool(g.get("decode_ahead")))  # decoding ahead: every token one version older
    return S.continuous_admission(ctx.st, g["replicas"], g["slots"], p.knobs["staleness"], lag)


def weight_sync_note(ctx: Context, c: Prediction, seconds: float) -> str:
    """What the chosen plan's weight sync moves, over which link, and what its fixed costs are."""
    hw, eff = ctx.hw, ctx.hw.efficiency
    actor = next(
        m
        for s in ctx.base.stages()
        for p in (s.parts or (s,))
        for m in (p.workload.models if p.workload else ())
        if m.role == "actor"
    )
    nbytes = ModelShape.of(actor).weight_bytes()
    if c.knobs.get("placement") == "split":
        gen_nodes = -(-c.layout["groups"].get("gen", ctx.N) // hw.node.devices)
        link = (
            f"from the training group to the generation group over the {'network' if gen_nodes > 1 else 'node'} links"
        )
    else:
        link = "a reshard into the generation layout on the same devices"
    parts = [
        f"weight sync {seconds:.3g} s: {nbytes / 1e9:.3g} GB of rollout weights (the actor in the compute "
        f"dtype), {link}"
    ]
    if eff.sync_fixed_s or eff.sync_bucket_s:
        buckets = -(-nbytes // eff.sync_bucket_bytes) if eff.sync_bucket_bytes else 0
        parts.append(
            f"of which {eff.sync_fixed_s or 0:.3g} s fixed (the engine's pause and resume, the controller's round "
            f"trips) and {buckets:.0f} buckets x {eff.sync_bucket_s or 0:.3g} s (the profile's sync constants, from "
            "peers' logs)"
        )
    return "; ".join(parts)


def explain(ctx: Context, res: SearchResult) -> list[str]:
    """A few sentences on why the chosen plan wins."""
    c = res.chosen
    out = []
    busy: dict[str, float] = {}
    groups = c.plan.groups if c.plan else ()
    for g in groups:
        busy[g.name] = sum(
            v for k, v in c.stage_times_s.items() if c.plan.stage(k).group == g.name and not k.startswith("reward")
        )
    if len(busy) > 1:
        slow = max(busy, key=busy.get)
        out.append(
            f"split placement: the {slow!r} group sets the period (busy {busy[slow]:.3g} s per step; "
            + ", ".join(f"{k} {v:.3g} s" for k, v in busy.items() if k != slow)
            + ")"
            + (
                f"; staleness k={c.knobs['staleness']} overlaps generation with training"
                if c.knobs.get("staleness")
                else "; streamed pieces overlap the forwards with generation"
            )
        )
    else:
        top = sorted(c.stage_times_s.items(), key=lambda kv: -kv[1])[:2]
        out.append("colocated: stages run one after another; largest " + ", ".join(f"{k} {v:.3g} s" for k, v in top))
    used = sum(
        g.size for g in groups if not any(g.devices != o.devices and set(g.devices) < set(o.devices) for o in groups)
    )
    if ctx.hw.shared_host and ctx.N > 1:
        out.append(
            f"shared host: the {ctx.N} devices are slices of one machine's cores, so groups never run "
            f"faster side by side and every extra device adds a device program's overheads; "
            f"the plan uses {used} of them"
        )
    sync = {k: v for k, v in c.stage_times_s.items() if "weight_sync" in k}
    if sync and ctx.base is not None:
        out.append(weight_sync_note(ctx, c, sum(sync.values())))
    if c.knobs.get("elide_old_forward"):
        out.append(
            "elide_old_forward: on-policy (k=0) and the sampler's distribution is the trainer's, so its "
            "logprobs serve as pi_old and the old_forward pass is skipped"
        )
    if ctx.processes > 1:
        P, G, n = ctx.processes, ctx.cfg.rl.group_size, ctx.cfg.data.prompts_per_step
        s = sharers(n, G, P) or 1  # (a prompt count no colocated plan runs is refused before the search)
        share = (
            f"{s} processes per prompt, each sampling {G // s} of its {G} samples, under step admission, as "
            f"continuous admission keeps whole groups per process"
            if s > 1 and c.knobs.get("placement", "colocated") == "colocated"
            else "whole groups"
        )
        out.append(
            f"{P} processes: only plans the runtime runs with them are searched (graph/processes.py): "
            f"each generating process samples its share of the prompts on its own devices ({share}; tensor "
            f"groups inside a process, replicas across processes); the baselines keep their own engines' layouts"
        )
    for name, b in res.baselines.items():
        out.append(
            f"{name}: {b.step_time_s:.3g} s/step ({b.step_time_s / c.step_time_s:.2f}x the chosen plan); "
            f"its largest stage is {max(b.stage_times_s, key=b.stage_times_s.get)}"
        )
    a, verl = res.asynchrony, res.baselines.get("verl_like")
    if a is not None:
        adm = c.layout["generate"].get("admission", "step")
        line = (
            f"asynchrony (k={c.knobs['staleness']}, admission={adm}): {a['asynchrony']:.2f}x; the same layout "
            f"synchronous takes {a['sync_step_s']:.3g} s/step"
        )
        if a["rest"] is not None:
            line += (
                f"; of the {verl.step_time_s / c.step_time_s:.2f}x over verl_like, {a['asynchrony']:.2f}x is "
                f"asynchrony on this layout and {a['rest']:.2f}x the rest"
            )
        out.append(line)
        if adm == "continuous":
            ad = admission_summary(ctx, c)
            if ad is not None:
                out.append(
                    f"continuous admission: {ad.decode_steps:.0f} decode steps per step at occupancy "
                    f"{ad.occupancy:.2f}, staleness mean {ad.staleness_mean:.2f} (max {ad.staleness_max}), "
                    f"{ad.requeued:.1f} groups per step past the bound (requeued or dropped)"
                )
    g = res.gains
    if g and g.get("total") is not None:
        kn = g["algorithmic_knobs"]
        if kn["staleness"] or kn["share_actor_critic"]:
            out.append(
                f"gains by kind: systems {_x(g['systems'])} (the best plan at k=0 with separate models) x "
                f"algorithmic {_x(g['algorithmic'])} ({algorithmic_knobs_text(kn)})"
                + (
                    "; asynchrony on the chosen layout exceeds the algorithmic gain where another k=0 layout is faster"
                    if a is not None
                    and kn["staleness"]
                    and g["algorithmic"] is not None
                    and a["asynchrony"] > g["algorithmic"] * (1 + 1e-6)
                    else ""
                )
            )
        else:
            out.append(
                f"same algorithm as verl_like (k=0, separate models): all of the {_x(g['total'])} over verl_like is "
                f"systems (placement, layouts, fusion, elided passes, scheduling)"
                + ("" if g["algorithmic_searched"] else "; algorithmic knobs off (costmodel.search_algorithmic)")
            )
    for name in ("verl_like", "real_like"):
        if name not in res.baselines:
            out.append(f"{name}: no plan of that family fits (colocated, synchronous, batch divisible by its meshes)")
    cap = ctx.cfg.data.max_prompt_len
    if ctx.st.P != cap:
        src = "costmodel.prompt_len" if ctx.cfg.costmodel.prompt_len is not None else "the data's longest prompt"
        out.append(
            f"prompts priced at {ctx.st.P} columns ({src}, rounded up to the runtime's bucket), not "
            f"data.max_prompt_len={cap}; set costmodel.prompt_len for prompts longer than the data shows"
        )
    if clock_of(ctx.hw) == "cpu":
        out.append(
            "seconds are process CPU seconds (the profile was calibrated on the CPU clock, robust to "
            "other processes' load); wall time on an idle machine is lower where cores run in parallel"
        )
    out.append(
        f"memory: {c.memory_per_gpu_gb:.1f} GB of a {ctx.st.budget_bytes / GB:.1f} GB budget per device; "
        f"layouts that do not fit were rejected before simulation"
    )
    off = ctx.cfg.train.offload
    if off != "none":
        what = "the Adam moments" + (" and the reference's weights" if off == "optimizer+reference" else "")
        out.append(
            f"offload: train.offload={off}: {what} live in host memory between uses, moved over the "
            f"host link ({ctx.hw.name}) around the update (priced, not overlapped)"
        )
    return out
