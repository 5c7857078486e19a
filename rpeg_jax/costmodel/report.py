"""Text and JSON renderings of a planner SearchResult (what `rpeg plan` prints and saves).

JSON fields (stable; bench/ and CI read them): chosen.{step_time_s, latency_s,
memory_per_gpu_gb, utilization, stage_times_s, knobs, layout, plan}, runners_up[...],
baselines.{verl_like, real_like}.{...same}, ratios.{verl_like, real_like} (baseline step time /
chosen), search_seconds, evaluations, evaluations_per_s, hardware, num_devices, notes.
"""

from __future__ import annotations

from typing import Any

from rpeg_jax.costmodel.planner import Prediction, SearchResult

BASELINES = ("verl_like", "real_like")  # null in the JSON when no plan of that family fits


def _entry(p: Prediction) -> dict[str, Any]:
    out = p.summary()
    out["label"] = p.label
    out["spans"] = {k: list(v) for k, v in p.spans.items()}
    out["plan"] = p.plan.to_dict() if p.plan is not None else None
    return out


def to_json_dict(res: SearchResult) -> dict[str, Any]:
    c = res.chosen.step_time_s
    return {"hardware": res.hardware, "num_devices": res.num_devices,
            "search_seconds": res.search_seconds, "evaluations": res.evaluations,
            "plans_considered": res.plans_considered,
            "evaluations_per_s": res.evaluations / max(res.search_seconds, 1e-9),
            "chosen": _entry(res.chosen), "runners_up": [_entry(p) for p in res.runners_up],
            "baselines": {k: (_entry(res.baselines[k]) if k in res.baselines else None) for k in BASELINES},
            "ratios": {k: (res.baselines[k].step_time_s / c if k in res.baselines else None) for k in BASELINES},
            "notes": list(res.notes)}


def _layout(p: Prediction) -> str:
    lay, k = p.layout, p.knobs
    groups = "+".join(f"{n}{v}" for n, v in lay["groups"].items())
    g, t, f = lay["generate"], lay["train"], lay["forward"]
    fuse = ",".join(k.get("fuse") or []) or "-"
    return (f"{k['placement']:<9} {groups:<14} gen tp{g['tensor']}x{g['replicas']} slots {g['slots']:<4} "
            f"train d{t['data']}f{t['fsdp']}t{t['tensor']} mb{t['micro_batches']} {t['remat']:<4} "
            f"fwd d{f['data']}f{f['fsdp']}t{f['tensor']}  k={k['staleness']} share={int(bool(k['share_actor_critic']))} "
            f"fuse={fuse} pieces={k['microbatches']}")


def render_text(res: SearchResult) -> str:
    c = res.chosen
    lines = [f"rpeg plan: {res.num_devices} x {res.hardware}; scored {res.evaluations} plans "
             f"({res.plans_considered} layout/micro-batch/remat combinations priced) in "
             f"{res.search_seconds:.2f} s ({res.evaluations / max(res.search_seconds, 1e-9):.0f} plans/s)", ""]
    head = f"  {'plan':<12} {'step s':>9} {'vs chosen':>9} {'mem GB':>7} {'util':>6}  layout"
    lines.append(head)
    rows = [c, *res.runners_up, *res.baselines.values()]
    for p in rows:
        lines.append(f"  {p.label:<12} {p.step_time_s:>9.4g} {p.step_time_s / c.step_time_s:>8.2f}x "
                     f"{p.memory_per_gpu_gb:>7.2f} {100 * p.utilization:>5.1f}%  {_layout(p)}")
    lines += ["", "per-stage seconds (steady-state step; spans are start..end within the step):"]
    for p in [c, *res.baselines.values()]:
        lines.append(f"  {p.label}: step {p.step_time_s:.4g} s, first-step latency {p.latency_s:.4g} s")
        for name, sec in p.stage_times_s.items():
            a, b = p.spans.get(name, (0.0, 0.0))
            lines.append(f"    {name:<36} {sec:>10.4g} s   [{a:.4g} .. {b:.4g}]")
    lines += ["", "why:"] + [f"  - {n}" for n in res.notes]
    if c.plan is not None:
        lines += ["", c.plan.describe()]
    return "\n".join(lines) + "\n"
