"""Stage measurements as data, the model's prediction for each, and a fit of the profile to them.

A point is a plain dict (JSON, written by `rpeg calibrate` and bench/costmodel_validate.py, which
run the real model, update and sampler code on a mesh: rpeg_jax/calibration/stages.py):

    {"kind": "forward" | "train" | "generate", "dims": {num_params, L, D, H, K, E, F, V,
     param_bytes_per, act_bytes_per, dtype}, "B", "P", "R", "mesh": [data, fsdp, tensor],
     "micro", "remat", "G", "seconds", "memory" (bytes per device or null)}

`predict_point(hw, p)` prices it with the same formulas the planner uses (stages.py);
`fit_points(profile, points)` fits the profile's free factors to a *calibration* set by least
squares on log(predicted / measured) with weak priors toward the starting values:

    peak FLOP/s, memory bandwidth, elementwise_factor, layer_s, backward_factor, update_streams,
    decode_step_s,
    decode_layer_s, kv_read_factor, dispatch_s, collective link bandwidth and latency, contention,
    matmul_size_exponent, decode_tp_factor, gen_seq_s
                                                           (continuous, log-space)
    fsdp_gather in {matrix, layer, model}, weight_copies, act_memory_factor, fwd_act_memory_factor
                                                           (memory: linear least squares per mode)

`fit_steps(profile, step_points)` then fits the runtime's host costs around the sampler
(piece_s, host_seq_s, host_step_s; the stage factors stay as the stage points fitted them) to
whole RL steps of calibration configs (not the default config);
`fit_gen_memory(profile, points)` fits gen_memory_factor to the sampler programs' compiled memory.
Validation points must never be passed here (bench/costmodel_validate.py keeps the two sets
disjoint). Callers: costmodel/microfit.fit_saved_points (`rpeg calibrate`), bench/, tests. No JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.hardware import HardwareProfile, with_nodes
from rpeg_jax.costmodel.lengths import LengthDist
from rpeg_jax.costmodel.shape import ModelShape, default_scanned

GATHERS = ("matrix", "layer", "model")
LOWER = {"kv_read_factor": 1.0, "decode_tp_factor": 1.0, "contention": 0.0, "matmul_size_exponent": 0.0}
UPPER = {"contention": 4.0, "matmul_size_exponent": 2.0}  # the profile's validated ranges
PRIOR = 0.02  # weight of log(factor / start) against one point's log error
# (section, field, floor): the continuous factors; floors let a zero start value move.
FACTORS = (
    ("device", "peak_flops", 1e6),
    ("device", "memory_bw", 1e6),
    ("efficiency", "elementwise_factor", 1e-3),
    ("efficiency", "layer_s", 1e-7),
    ("efficiency", "backward_factor", 0.1),
    ("efficiency", "update_streams", 1.0),
    ("efficiency", "decode_step_s", 1e-7),
    ("efficiency", "decode_layer_s", 1e-7),
    ("efficiency", "kv_read_factor", 1.0),
    ("efficiency", "dispatch_s", 1e-7),
    ("node", "link_bw", 1e6),
    ("node", "latency_s", 1e-7),
    ("efficiency", "contention", 0.0),
    ("efficiency", "matmul_size_exponent", 0.0),
    ("efficiency", "decode_tp_factor", 1.0),
    ("efficiency", "gen_seq_s", 1e-6),
)


def shape_of(dims: dict) -> ModelShape:
    """Points saved before ModelShape had `scanned` get the models' depth rule."""
    return ModelShape(**{"scanned": default_scanned(dims["L"]), **dims})


def setting(hw: HardwareProfile, p: dict) -> S.Setting:
    """The stage's fixed shapes: every response R tokens long (the benchmark ignores eos)."""
    return S.Setting(
        hw=hw,
        B=p["B"],
        P=p["P"],
        R=p["R"],
        G=p.get("G", 1),
        dist=LengthDist.fixed(p["R"]),
        causal_skip=False,
        dense_scores=True,
        packing=False,
        budget_bytes=hw.hbm_bytes,
        kv_replicated=True,
        page_size=p.get("page_size", 16),
    )  # the sampler's default page


def predict_point(hw: HardwareProfile, p: dict) -> tuple[float, float]:
    """(seconds, peak bytes per device) the model predicts for a measured stage point."""
    ms, st = shape_of(p["dims"]), setting(hw, p)
    d, f, t = p["mesh"]
    n = d * f * t
    if p["kind"] == "generate":  # the sampler's slots are global: B / (d·f) per data replica
        reps = n // t
        sec = S.generate_stage(st, ms, n_gen=n, t=[t], slots=[-(-p["B"] // reps)])[0][0]
        mem = S.generate_memory(st, ms, t, -(-p["B"] // reps), reps)
        return float(sec), float(mem)
    if p["kind"] == "forward":
        sec = S.forward_stage(st, ms, busy=n, d=d, f=f, t=t, micro=p["micro"])[0]
        mem = ms.weight_bytes(ms.param_bytes_per) / (f * t) + S.forward_memory(st, ms, d=d, f=f, t=t, micro=p["micro"])
        return float(sec), float(mem)
    sec = S.train_stage(st, ms, busy=n, d=d, f=f, t=t, micro=p["micro"], remat=p["remat"])[0]
    return float(sec), float(S.train_memory(st, ms, d=d, f=f, t=t, micro=p["micro"], remat=p["remat"]))


def _apply(hw: HardwareProfile, values: dict) -> HardwareProfile:
    """A copy of `hw` with {(section, field): value} set (both peaks move together)."""
    secs = {"device": hw.device, "efficiency": hw.efficiency, "node": hw.node}
    for (sec, name), v in values.items():
        kw = {name: float(v)}
        if name == "peak_flops":
            kw["peak_flops_fp32"] = float(v)
        secs[sec] = dataclasses.replace(secs[sec], **kw)
    return with_nodes(hw, device=secs["device"], efficiency=secs["efficiency"], node=secs["node"])


LINEAR = ("contention", "matmul_size_exponent")  # fitted as values (0 is allowed), the rest as logs


def _start(hw: HardwareProfile) -> np.ndarray:
    def value(sec, name, floor):
        v = getattr(getattr(hw, sec), name)
        v = hw.efficiency.layer_s if v is None else v  # decode_layer_s unset: starts at layer_s
        return v if name in LINEAR else np.log(max(v, floor))

    return np.array([value(sec, name, floor) for sec, name, floor in FACTORS])


def _bound(name: str, table: dict, default: float) -> float:
    if name not in table:
        return default
    return table[name] if name in LINEAR else np.log(table[name])


def fit_times(hw: HardwareProfile, points: list[dict], multistart: bool = True) -> tuple[HardwareProfile, dict]:
    """Least squares on log time ratios over the continuous factors (scipy, imported here)."""
    from scipy.optimize import least_squares

    x0 = _start(hw)
    meas = np.log([p["seconds"] for p in points])

    def profile(x):
        return _apply(hw, {(sec, name): (v if name in LINEAR else np.exp(v)) for (sec, name, _), v in zip(FACTORS, x)})

    def resid(x):
        prof = profile(x)
        pred = np.log([max(predict_point(prof, p)[0], 1e-12) for p in points])
        return np.concatenate([pred - meas, PRIOR * (x - x0)])

    lo = np.array([_bound(name, LOWER, -np.inf) for _, name, _ in FACTORS])
    hi = np.array([_bound(name, UPPER, np.inf) for _, name, _ in FACTORS])
    # The roofline's max() makes the problem non-convex (no gradient through the term that is not
    # the max): start also from large fixed costs and from lower memory bandwidths (a micro-
    # benchmark's cache-resident rate is far above what a stage streams), keep the best.
    names = [name for _, name, _ in FACTORS]
    starts = [x0]
    for i in (names.index(n) for n in ("layer_s", "decode_layer_s", "decode_step_s")):
        x = x0.copy()
        x[i] = np.log(1e-4)
        starts.append(x)
    for div in (4.0, 16.0, 64.0):
        x = x0.copy()
        x[names.index("memory_bw")] -= np.log(div)
        starts.append(x)
    sols = [
        least_squares(resid, np.clip(x, lo + 1e-9, hi - 1e-9), bounds=(lo, hi), method="trf", max_nfev=300)
        for x in (starts if multistart else starts[:1])
    ]
    sol = min(sols, key=lambda r: r.cost)
    out = profile(sol.x)
    errs = [abs(predict_point(out, p)[0] / p["seconds"] - 1.0) for p in points]
    return out, {"fit_time_mape": float(np.mean(errs)), "fit_points": float(len(points))}


def fit_memory(hw: HardwareProfile, points: list[dict]) -> tuple[HardwareProfile, dict]:
    """Memory: per FSDP gather mode, weight_copies, act_memory_factor (training steps) and
    fwd_act_memory_factor (forward passes), all >= 0, by linear least squares on relative error
    (predicted memory is linear in the three); the mode that fits best."""
    pts = [p for p in points if p.get("memory") and p["kind"] != "generate"]
    if not pts:
        return hw, {}

    def mem(mode, wc, af, ff):
        e = dataclasses.replace(
            hw.efficiency, fsdp_gather=mode, weight_copies=wc, act_memory_factor=af, fwd_act_memory_factor=ff
        )
        prof = with_nodes(hw, efficiency=e)
        return prof, np.array([predict_point(prof, p)[1] for p in pts])

    m = np.array([p["memory"] for p in pts], np.float64)
    best = None
    for mode in GATHERS:
        _, base = mem(mode, 0.0, 1.0, 1.0)
        cols = [
            mem(mode, 1.0, 1.0, 1.0)[1] - base,
            mem(mode, 0.0, 2.0, 1.0)[1] - base,
            mem(mode, 0.0, 1.0, 2.0)[1] - base,
        ]
        rest = base - cols[1] - cols[2]
        x = _nnls(np.stack([c / m for c in cols], axis=1), 1.0 - rest / m)
        prof, pred = mem(mode, float(x[0]), float(max(x[1], 1e-3)), float(max(x[2], 1e-3)))
        err = float(np.mean(np.abs(pred / m - 1.0)))
        if best is None or err < best[0]:
            best = (err, prof)
    return best[1], {"fit_memory_mape": best[0]}


def fit_gen_memory(hw: HardwareProfile, points: list[dict]) -> tuple[HardwareProfile, dict]:
    """gen_memory_factor (> 0) by least squares on relative error over generation memory points
    (calibration/stages.generation_memory of the GEN_MEMORY_CAL set): predicted memory is
    base + factor x unit, so the factor has a closed form."""
    if not points:
        return hw, {}

    def mem(f):
        prof = with_nodes(hw, efficiency=dataclasses.replace(hw.efficiency, gen_memory_factor=f))
        return prof, np.array([predict_point(prof, p)[1] for p in points])

    m = np.array([p["memory"] for p in points], np.float64)
    base = mem(1e-9)[1]
    unit = (mem(1.0)[1] - base) / m
    f = max(float(np.sum(unit * (1.0 - base / m)) / max(float(np.sum(unit * unit)), 1e-30)), 1e-3)
    prof, pred = mem(f)
    return prof, {"fit_gen_memory_mape": float(np.mean(np.abs(pred / m - 1.0))), "fit_gen_memory_points": float(len(m))}


def _nnls(A, b):
    from scipy.optimize import nnls

    return nnls(A, b)[0]


def fit_points(hw: HardwareProfile, points: list[dict], multistart: bool = True) -> tuple[HardwareProfile, dict]:
    """Times, then memory; returns the fitted profile and the fit's residuals."""
    if not points:
        raise ValueError("fit_points: no calibration points")
    prof, rt = fit_times(hw, points, multistart)
    prof, rm = fit_memory(prof, points)
    return prof, {**rt, **rm}


# ---- whole steps (the runtime's host costs) ----------------------------------------------------
# (name, unit the fit works in). Host costs only: a stage factor refitted on whole steps absorbs
# every other miss of the steps. When decode_tp_factor was refitted here too (until commit 1d2b422,
# 2026-12-01), calibration plans with B=64 that generated on tensor 2 AND trained on tensor 2 (the
# runtime's grouped-prompt update costs more on tensor meshes than the stage model prices) moved it
# from the stage fit's 12.7 to 109.8, pricing every tensor-parallel generation stage 5-9x too slow.
# Stage factors are fitted to the stage points alone.
STEP_FACTORS = (("piece_s", 1e-3), ("host_seq_s", 1e-5), ("host_step_s", 1e-3))


def predict_step(hw: HardwareProfile, sp: dict) -> float:
    """Predicted steady-state seconds of a measured step point: {"overrides": [config overrides],
    "knobs", "layout" (Prediction.layout), "num_devices", "seconds"}."""
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel.pricing import price_layout

    cfg = load_config(None, list(sp.get("overrides", [])))
    return price_layout(cfg, sp["knobs"], sp["layout"], sp["num_devices"], hw, 1).step_time_s


def fit_steps(hw: HardwareProfile, steps: list[dict]) -> tuple[HardwareProfile, dict]:
    """The runtime's per-piece, per-sequence and per-step host costs (piece_s, host_seq_s,
    host_step_s) fitted to whole steps of *calibration* configs (two batch sizes, so that the
    per-sequence and per-step costs separate), the stage factors fixed (least squares on log time;
    STEP_FACTORS says why no stage factor is refitted here)."""
    from scipy.optimize import least_squares

    meas = np.log([sp["seconds"] for sp in steps])
    factors = STEP_FACTORS
    # Linear in units (both start near 0, where a log parameter would have no gradient), >= 0.
    x0 = np.array([getattr(hw.efficiency, n) / unit for n, unit in factors])
    lo = np.array([LOWER.get(n, 0.0) / unit for n, unit in factors])

    def profile(x):
        return with_nodes(
            hw,
            efficiency=dataclasses.replace(hw.efficiency, **{n: float(v * unit) for (n, unit), v in zip(factors, x)}),
        )

    def resid(x):
        prof = profile(x)
        return np.concatenate([np.log([predict_step(prof, sp) for sp in steps]) - meas, 1e-5 * (x - x0)])

    # (started inside the bounds: TRF started on a bound at 0 stays there)
    sol = least_squares(resid, np.maximum(x0, lo + 1.0), bounds=(lo, np.inf), method="trf", max_nfev=100)
    out = profile(sol.x)
    errs = [abs(predict_step(out, sp) / sp["seconds"] - 1.0) for sp in steps]
    return out, {"fit_step_mape": float(np.mean(errs)), "fit_step_points": float(len(steps))}
