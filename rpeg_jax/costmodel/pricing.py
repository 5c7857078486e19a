"""Pricing given plans: the best plan of every device-group option, and the model's prediction
for a Plan chosen elsewhere (a saved planner plan, a runner-up, a validation candidate).

    alts = best_by_groups(cfg, n, hardware, processes)   # [Prediction], best first
    pred = price(cfg, plan, hardware, processes)         # Prediction of that exact plan
    pred = predict_run(cfg, "cpu", 1)                    # the run cfg describes (bench/rl_step.py)

Callers: bench/costmodel_validate.py (step-level candidates, re-pricing measured plans after a
recalibration), tests. No JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rpeg_jax.config.run import RunConfig
from rpeg_jax.costmodel.candidates import REMATS, consumed_side
from rpeg_jax.costmodel.context import make_context, roles_of
from rpeg_jax.costmodel.devices import resolve
from rpeg_jax.costmodel.scoring import (
    EXPERT_RULES,
    GEN_SIDE,
    TRAIN_SIDE,
    engine_staleness,
    family_table,
    option_graphs,
    periods,
    predict,
)
from rpeg_jax.costmodel.space import families, structural_options
from rpeg_jax.costmodel.stages import continuous_stage
from rpeg_jax.costmodel.table import Table, TrainSide
from rpeg_jax.costmodel.types import Prediction
from rpeg_jax.graph.algorithms import build_graph
from rpeg_jax.graph.ir import GraphError
from rpeg_jax.graph.passes import apply_pipeline
from rpeg_jax.graph.plan import Plan


def best_by_groups(
    cfg: RunConfig, num_devices: int | None = None, hardware=None, processes: int | None = None
) -> list[Prediction]:
    """The best plan of every device-group option (placement, n_gen, n_train), best first: the
    alternatives the search weighed, for validation and for explaining why the chosen groups win."""
    hw, n, procs = resolve(cfg, num_devices, hardware, processes)
    ctx = make_context(cfg, n, hw, procs)
    cache: dict = {}
    best: dict[tuple, tuple] = {}
    for placement, share in families(ctx):
        pairs = option_graphs(ctx, structural_options(ctx, placement, share))
        tab = family_table(ctx, pairs[0][1], placement, cache) if pairs else None
        if tab is None:
            continue
        groups = np.stack([tab.n_gen, tab.n_train], axis=1)
        for pipe, g in pairs:
            period, _ = periods(ctx, g, tab)
            for key in {tuple(r) for r in groups.tolist()}:
                sel = np.nonzero((groups[:, 0] == key[0]) & (groups[:, 1] == key[1]) & np.isfinite(period))[0]
                if len(sel):
                    i = int(sel[np.argmin(period[sel])])
                    k = (placement, *key)
                    if k not in best or period[i] < best[k][0]:
                        best[k] = (float(period[i]), pipe, g, i, tab)
    out = [
        predict(ctx, g, pipe, tab, i, f"best {k[0]} {k[1]}+{k[2]}" if k[0] == "split" else f"best {k[0]} {k[1]}")
        for k, (_, pipe, g, i, tab) in sorted(best.items(), key=lambda kv: kv[1][0])
    ]
    return out


def price(cfg: RunConfig, plan: Plan, hardware=None, processes: int | None = None) -> Prediction:
    """The model's prediction for `plan` (its groups, stage meshes, knobs and planner settings)."""
    pipe = plan.pipeline_config(cfg.pipeline)
    return price_layout(cfg, plan.knobs, _layout_of(plan, pipe, cfg), plan.num_devices, hardware, processes)


def price_layout(
    cfg: RunConfig, knobs: dict, layout: dict, num_devices: int, hardware=None, processes: int | None = None
) -> Prediction:
    """The prediction for a plan given as knobs + layout (Prediction.layout's format: groups,
    generate {tensor, admission}, train {data, fsdp, tensor, micro_batches, remat}, forward {data,
    fsdp, tensor}): the table row with those groups and layouts, simulated under the knobs' graph
    (with generate.admission, default the config's rollout.admission)."""
    hw, n, procs = resolve(cfg, num_devices, hardware, processes)
    pipe = Plan(num_devices=n, groups=(), stages=(), knobs=knobs).pipeline_config(cfg.pipeline)
    admission = layout["generate"].get("admission", cfg.rollout.admission)
    if pipe.staleness > cfg.costmodel.max_staleness:  # the tables price k up to max_staleness
        cfg = dataclasses.replace(cfg, costmodel=dataclasses.replace(cfg.costmodel, max_staleness=pipe.staleness))
    ctx = make_context(cfg, n, hw, procs)
    g = apply_pipeline(ctx.base, pipe, admission, layout["generate"].get("decode_ahead", cfg.rollout.decode_ahead))
    gr, tr, fw = layout["groups"], layout["train"], layout["forward"]
    ng, nt = gr.get("gen", gr.get("all")), gr.get("train", gr.get("all"))
    fixed = None  # a layout with its settings (a plan's, or a manual config's) is priced with them
    if "micro_batches" in tr and "remat" in tr:
        fixed = (int(tr["micro_batches"]), str(tr["remat"]), int(fw.get("micro_batches", cfg.rl.forward_micro_batches)))
    tab = family_table(ctx, g, pipe.placement, {}, [(ng, nt)], ours=False, settings=fixed)  # any layout
    want = {
        "n_gen": ng,
        "n_train": nt,
        "t_g": layout["generate"]["tensor"],
        "d": tr["data"],
        "f": tr["fsdp"],
        "t": tr["tensor"],
        "fd": fw["data"],
        "ff": fw["fsdp"],
        "ft": fw["tensor"],
        "e": tr.get("experts", 1),
        "fe": fw.get("experts", 1),
    }
    if tab is None:
        raise GraphError("plan", f"no candidate of the model matches the layout {want}")
    sel = np.ones(len(tab), bool)
    for k, v in want.items():
        sel &= getattr(tab, k) == v
    exact = sel & (tab.micro == tr.get("micro_batches", -1)) & (tab.remat == REMATS.index(tr.get("remat", "none")))
    idx = np.nonzero(exact if exact.any() else sel)[0]
    if not len(idx):
        raise GraphError("plan", f"no candidate of the model matches the layout {want}")
    sub = tab.take(idx)
    if admission == "continuous" and layout["generate"].get("slots"):
        sub = _continuous_at(ctx, g, sub, int(layout["generate"]["slots"]))
    period, _ = periods(ctx, g, sub)
    return predict(ctx, g, pipe, sub, int(np.argmin(period)), f"priced {pipe.placement}")


def _continuous_at(ctx, g, sub: Table, slots: int) -> Table:
    """Rows with the continuous engine priced at exactly `slots` slots per replica (a run's
    rollout.max_slots) instead of the best count the table chose."""
    k, st, eff = engine_staleness(g), ctx.st, ctx.hw.efficiency
    roles = roles_of(ctx, g)
    actor = roles.actor
    old = sub.continuous[k]
    col, sl = old.t_gen.copy(), old.slots.copy()
    for ng in set(sub.n_gen.tolist()):
        sel = sub.n_gen == ng
        s_k, b_k = continuous_stage(
            st,
            actor,
            n_gen=int(ng),
            t=sub.t_g[sel],
            slots=np.full(int(sel.sum()), slots),
            ks=(k,),
            recompute=st.recompute_kv,
            exact=True,
        )
        col[sel] = np.where(np.isfinite(col[sel]), s_k[k] + st.B * eff.host_seq_s + eff.host_step_s, np.inf)
        sl[sel] = b_k[k]
    # the training stages on the consumed batches of that engine (candidates.consumed_side)
    upd = {n: v.copy() for n, v in old.train.t_upd.items()}
    fwd = {n: v.copy() for n, v in old.train.t_fwd.items()}
    adv = old.train.t_adv.copy()
    for nt in set(sub.n_train.tolist()):
        sel = np.nonzero(sub.n_train == nt)[0]
        side = consumed_side(st, roles, int(nt), sub.take(sel), k, sl[sel])
        for n, v in side.t_upd.items():
            upd[n][sel] = v
        for n, v in side.t_fwd.items():
            fwd[n][sel] = v
        adv[sel] = side.t_adv
    new = dataclasses.replace(old, t_gen=col, slots=sl, train=TrainSide(t_upd=upd, t_fwd=fwd, t_adv=adv))
    return sub.replace(continuous={**sub.continuous, k: new})


def predict_run(cfg: RunConfig, hardware=None, num_devices: int | None = None, processes: int = 1) -> Prediction:
    """The model's prediction for the run `cfg` describes, as it would run: the planner's choice
    under pipeline.plan=auto, else the config's own (manual) plan priced with its knobs, its
    rollout.admission and its sampler slots (rollout.max_slots, default one step's batch).
    `hardware`: a profile name (its calibrated copy with costmodel.calibration=cached), path or
    HardwareProfile; default costmodel.hardware. Called by bench/rl_step.py (predicted seconds per
    step: `predict_run(cfg, "cpu", 1).step_time_s`)."""
    hw, n, procs = resolve(cfg, num_devices, hardware, processes)
    if cfg.pipeline.plan == "auto":
        from rpeg_jax.costmodel.planner import search

        return search(cfg, n, hw, procs).chosen
    if cfg.pipeline.plan != "manual":
        return price(cfg, Plan.load(cfg.pipeline.plan), hw, procs)
    from rpeg_jax.graph.plan import plan_from_config

    plan = plan_from_config(cfg, n)
    pipe = plan.pipeline_config(cfg.pipeline)
    layout = _layout_of(plan, pipe, cfg)
    slots = cfg.rollout.max_slots or cfg.data.prompts_per_step * cfg.rl.group_size // procs
    reps = max(layout["groups"].get("gen", layout["groups"].get("all", 1)) // layout["generate"].get("tensor", 1), 1)
    layout["generate"]["slots"] = -(-slots * procs // reps)
    return price_layout(cfg, plan.knobs, layout, plan.num_devices, hw, procs)


def _layout_of(plan: Plan, pipe, cfg: RunConfig) -> dict:
    """A planner-format layout from a Plan's groups, stage meshes and settings."""
    other = sorted({sp.group for sp in plan.stages} - {"all", "gen", "train"})
    if other:  # e.g. graph.plan.widen_generation's nested group: the tables have no such option
        raise GraphError(
            other[0],
            "the cost model prices the placements it plans (one group 'all', or "
            "'gen' and 'train'); this plan's stages also run on other groups",
        )
    graph = apply_pipeline(build_graph(cfg), pipe)
    s = plan.settings
    out = {
        "groups": {},
        "generate": {
            "admission": s.get("rollout.admission", cfg.rollout.admission),
            "decode_ahead": s.get("rollout.decode_ahead", cfg.rollout.decode_ahead),
        },
        "train": {
            "micro_batches": s.get("rl.micro_batches", cfg.rl.micro_batches),
            "remat": s.get("model.remat", cfg.model.remat),
        },
        "forward": {"micro_batches": s.get("rl.forward_micro_batches", cfg.rl.forward_micro_batches)},
    }
    for st in graph.stages():
        kinds = {p.kind for p in (st.parts or (st,))}
        sp = plan.stage(st.name)
        m = {k: sp.mesh.get(k, 1) for k in ("data", "fsdp", "tensor")}
        if sp.rules in EXPERT_RULES and cfg.model.num_experts:  # expert parallelism over fsdp
            m["experts"] = m["fsdp"]
        out["groups"][sp.group] = plan.group(sp.group).size
        if kinds <= GEN_SIDE:
            out["generate"]["tensor"] = m["tensor"]
        elif kinds & {k for k in TRAIN_SIDE if "update" in k.value}:
            out["train"].update(m)
        elif not kinds & TRAIN_SIDE:
            out["forward"].update(m)
    if "data" not in out["forward"]:  # no separate scoring forward: the training mesh
        out["forward"].update({k: out["train"][k] for k in ("data", "fsdp", "tensor", "experts") if k in out["train"]})
    return out
