"""The baselines every plan is compared with, and the gain split.

    verl-like: colocated, synchronous, unfused, one FSDP training layout (tensor = 1) for every
               training-side stage, rollout with its own tensor parallelism;
    ReaL-like: colocated, synchronous, unfused, per-stage layouts with parameter reallocation, or
               the scoring forwards concurrent on disjoint sub-meshes (real_concurrent); the better.

    b = baseline(ctx, "verl_like", cache)             # a Prediction, or None
    gains = gains_of(cfg, chosen, equal_alg, verl)    # systems x algorithmic = total

Each is the best plan of its own family on the same candidate table (no straw men); they run
their own engines, so they are not bound by this runtime's multi-process rules.
Callers: costmodel/planner.py, bench/costmodel_anchors.py, tests. No JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.config.run import RunConfig
from rpeg_jax.costmodel import candidates as C
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.comm import reshard_time
from rpeg_jax.costmodel.context import reference_graph, roles_of
from rpeg_jax.costmodel.schedule import simulate, unroll
from rpeg_jax.costmodel.scoring import KEEP_ROWS, durations, family_table, periods, predict, prune
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.costmodel.space import divisible
from rpeg_jax.costmodel.table import Table
from rpeg_jax.costmodel.types import Context, Prediction
from rpeg_jax.graph.ir import StageKind
from rpeg_jax.graph.passes import apply_pipeline


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


def synchronous_period(ctx: Context, pipe: PipelineConfig, row: Table) -> float:
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
    if tab is None:
        return None
    mask = (tab.e == 1) & (tab.fe == 1)  # no expert parallelism (verl's FSDP backend; ReaL has none)
    if name == "verl_like":  # FSDP training (no tensor axis), one layout for the forwards and the updates
        mask &= (tab.t == 1) & (tab.d == tab.fd) & (tab.f == tab.ff) & (tab.t == tab.ft)
    out = None
    if mask.any():
        sub = tab.take(np.nonzero(mask)[0])
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


def _sub_forward(ctx: Context, ms: ModelShape, n_sub: int, tab: Table, src_shards: np.ndarray):
    """Per table row, the best layout of one scoring forward on a sub-mesh of n_sub devices: its
    seconds (the forward plus the reallocation of the model's weights from their `src_shards`-way
    layout on all devices into it, as ReaL's parameter reallocation), peak bytes per device of the
    sub-mesh, and the layout (d, f, t)."""
    st, hw = ctx.st, ctx.hw
    lay = C.layouts(n_sub, st.B, ms, ctx.cfg.costmodel.tensor_sizes)
    lay = lay[lay[:, 3] == 1]  # no expert parallelism (as the baseline's other calls)
    rows = len(tab)
    if not len(lay):
        return np.full(rows, np.inf), np.full(rows, np.inf), np.zeros((rows, 3), np.int64)
    d, f, t = (lay[:, i].astype(np.float64) for i in range(3))
    fw = S.forward_stage(st, ms, busy=n_sub, d=d, f=f, t=t, micro=np.ones_like(d))[0]  # [L]
    trans = S.forward_memory(st, ms, d=d, f=f, t=t, micro=np.ones_like(d))  # [L]
    shards = f * t
    rs = reshard_time(hw, ms.weight_bytes(), src_shards[:, None], shards[None, :], ctx.N)
    realloc = rs + ms.weight_bytes() / shards[None, :] / hw.device.memory_bw  # [rows, L]
    peak = tab.mem_resident[:, None] + ms.weight_bytes() / shards[None, :] + trans[None, :]
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
    if tab is None:
        return None
    if (tab.e > 1).any() or (tab.fe > 1).any():  # no expert parallelism in ReaL's space
        tab = tab.take(np.nonzero((tab.e == 1) & (tab.fe == 1))[0])
    tab = tab.take(prune(tab, ctx, g0, KEEP_ROWS))
    roles = roles_of(ctx, g0)
    model_of = {
        StageKind.REF_FORWARD: roles.ref,
        StageKind.OLD_FORWARD: roles.actor,
        StageKind.CRITIC_FORWARD: roles.critic,
    }
    src = {  # where each model's weights live before the call: trained ones in the training layout
        StageKind.REF_FORWARD: tab.ff * tab.ft,
        StageKind.OLD_FORWARD: tab.f * tab.t,
        StageKind.CRITIC_FORWARD: tab.f * tab.t,
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
        peak = np.maximum(tab.mem_update, tab.mem_gen)
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
