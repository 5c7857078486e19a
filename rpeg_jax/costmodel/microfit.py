"""The fit of micro-benchmark and synthetic-decoder measurements (rpeg_jax/calibration/micro.py
measures them) to a hardware profile. Pure Python and numpy: on a CPU profile the measured rates
replace the peaks; on an accelerator the nominal peak stays and the tables become measured /
nominal. `fit_stages` fits a matmul scale, `efficiency.elementwise_factor`, `efficiency.layer_s` and
`efficiency.backward_factor` to the synthetic decoder's forward and train times (STAGE_SHAPES;
`synthetic_shape` is its ModelShape). `fit_saved_points` refits a profile to stage points of the
real code (costmodel/fit.py) saved by `rpeg calibrate` or bench/costmodel_validate.py.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from rpeg_jax.costmodel.hardware import HardwareProfile, with_nodes

STAGE_SHAPES = [  # (kind, L, B, T, devices, D): depth, width and batch vary so the parts separate
    ("forward", 2, 8, 32, 1, 64),
    ("forward", 6, 8, 32, 1, 256),
    ("forward", 2, 32, 64, 8, 256),
    ("forward", 6, 16, 64, 8, 64),
    ("train", 2, 8, 32, 1, 256),
    ("train", 6, 8, 32, 1, 64),
    ("train", 2, 32, 64, 8, 64),
    ("train", 6, 16, 64, 8, 256),
    ("forward", 8, 1, 8, 1, 64),
    ("train", 8, 1, 8, 1, 64),  # tiny work: the per-layer cost shows
]
SYN = dict(H=4, V=512)  # heads, vocab; F = 3D
PRIOR = 0.01  # weight of the priors a = 1, b = 1 against one measurement's relative error


def synthetic_shape(L: int, D: int):
    """The synthetic decoder's ModelShape (MHA, SwiGLU, untied head, float32)."""
    from rpeg_jax.costmodel.shape import ModelShape

    H, F, V = SYN["H"], 3 * D, SYN["V"]
    layer = 4 * D * D + 3 * D * F + 2 * D
    return ModelShape(
        num_params=2 * V * D + L * layer + D,
        L=L,
        D=D,
        H=H,
        K=H,
        E=D // H,
        F=F,
        V=V,
        param_bytes_per=4,
        act_bytes_per=4,
        dtype="float32",
    )


def fit_stages(prof: HardwareProfile, stages: list[dict]) -> tuple[HardwareProfile, dict]:
    """Two least-squares fits on relative error. Forward points:
        t ≈ a·matmul + b·elementwise + c·(layers · overhead multiplier) + dispatch
    (a matmul scale, `elementwise_factor`, `layer_s`); then train points, with those fixed:
        t ≈ (1 + 2k)·(one forward, incl. its layer cost) + comm + optimizer + dispatch
    (k = `backward_factor`)."""
    import numpy as np

    from rpeg_jax.costmodel import stages as S

    def parts(hw, m):
        ms, st, n = _synthetic_setting(hw, m)
        if m["kind"] == "forward":
            return ms, S.forward_stage(st, ms, busy=n, d=n, f=1, t=1, micro=1)[1], float(S.rates(hw, "float32", n)[2])
        return (
            ms,
            S.train_stage(st, ms, busy=n, d=n, f=1, t=1, micro=1, remat="none")[1],
            float(S.rates(hw, "float32", n)[2]),
        )

    eff0 = dataclasses.replace(prof.efficiency, elementwise_factor=1.0, layer_s=0.0, backward_factor=1.0)
    base = dataclasses.replace(prof, efficiency=eff0)
    # On a shared host the matmul part is compute + memory (stages.roofline): only the compute
    # scales with `a`; the memory part is the same profile's with an unbounded FLOP rate.
    fast = with_nodes(
        base,
        device=dataclasses.replace(
            base.device, peak_flops=base.device.peak_flops * 1e9, peak_flops_fp32=base.device.peak_flops_fp32 * 1e9
        ),
    )
    fw = [m for m in stages if m["kind"] == "forward"]
    rows, ys = [], []
    for m in fw:
        ms, p, ovh = parts(base, m)
        mem = float(parts(fast, m)[1]["matmul"]) if prof.shared_host else 0.0
        rows.append([float(p["matmul"]) - mem, float(p["elementwise"]), ms.L * ovh])
        ys.append(m["seconds"] - base.efficiency.dispatch_s - mem)
    A, y = np.array(rows), np.array(ys)
    w = 1.0 / np.maximum(y, 1e-9)
    # Weak priors a ≈ 1 (the micro-benchmarks' matmul rate) and b ≈ 1 keep the fit well-posed
    # when the shapes cannot separate the parts (e.g. on a noisy machine).
    prior = np.array([[PRIOR, 0.0, 0.0], [0.0, PRIOR, 0.0]])
    a, b, c = _nnls(np.vstack([A * w[:, None], prior]), np.concatenate([y * w, [PRIOR, PRIOR]]))
    a = max(a, 0.05)
    eff = dataclasses.replace(prof.efficiency, elementwise_factor=max(float(b), 0.05), layer_s=float(c))
    if prof.kind == "cpu":  # the measured peak absorbs the matmul scale
        device = dataclasses.replace(
            prof.device,
            peak_flops=float(prof.device.peak_flops / a),
            peak_flops_fp32=float(prof.device.peak_flops_fp32 / a),
        )
    else:
        device = prof.device
        eff = dataclasses.replace(eff, matmul=_monotone_table([(sz, min(1.0, e / a)) for sz, e in eff.matmul]))
    fitted = with_nodes(prof, device=device, efficiency=eff)
    # Backward factor from the train points, the forward part now fitted.
    num = den = 0.0
    for m in (m for m in stages if m["kind"] == "train"):
        ms, p, ovh = parts(fitted, m)
        one = float(p["forward_core"]) + ms.L * fitted.efficiency.layer_s * ovh
        rest = float(p["comm"]) + float(p["optimizer"]) + fitted.efficiency.dispatch_s
        x, r = 2.0 * one / m["seconds"], (m["seconds"] - rest - one) / m["seconds"]
        num, den = num + x * r, den + x * x
    k = max(num / den, 0.1) if den > 0 else 1.0
    fitted = with_nodes(fitted, efficiency=dataclasses.replace(fitted.efficiency, backward_factor=float(k)))
    errs = [abs(_predict(fitted, m) - m["seconds"]) / m["seconds"] for m in stages]
    resid = {
        "stage_fit_mape": float(np.mean(errs)),
        "stage_fit_matmul_scale": float(a),
        "stage_fit_points": float(len(stages)),
    }
    return fitted, resid


def _synthetic_setting(hw: HardwareProfile, m: dict):
    """(shape, stage Setting, devices) of one synthetic-decoder measurement `m`: T tokens a row,
    no prompt, dense scores, no packing."""
    from rpeg_jax.costmodel import stages as S
    from rpeg_jax.costmodel.lengths import LengthDist

    st = S.Setting(
        hw=hw,
        B=m["B"],
        P=0,
        R=m["T"],
        G=1,
        dist=LengthDist.fixed(m["T"]),
        causal_skip=False,
        dense_scores=True,
        packing=False,
        budget_bytes=hw.hbm_bytes,
    )
    return synthetic_shape(m["L"], m["D"]), st, m["devices"]


def _predict(hw: HardwareProfile, m: dict) -> float:
    from rpeg_jax.costmodel import stages as S

    ms, st, n = _synthetic_setting(hw, m)
    if m["kind"] == "forward":
        return float(S.forward_stage(st, ms, busy=n, d=n, f=1, t=1, micro=1)[0])
    return float(S.train_stage(st, ms, busy=n, d=n, f=1, t=1, micro=1, remat="none")[0])


def _nnls(A, b, iters: int = 50):
    """Non-negative least squares for a few unknowns (active set by clipping and refitting)."""
    import numpy as np

    free = np.ones(A.shape[1], bool)
    x = np.zeros(A.shape[1])
    for _ in range(iters):
        x = np.zeros(A.shape[1])
        x[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
        if (x >= 0).all():
            return x
        free &= x > 0
    return np.maximum(x, 0.0)


def _monotone_table(points: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Sorted [size, eff] rows with eff in (0, 1], dropping rows that would make time non-monotone."""
    rows: list[tuple[float, float]] = []
    for size, eff in sorted(points):
        eff = min(max(eff, 1e-4), 1.0)
        if rows:
            s0, e0 = rows[-1]
            eff = min(eff, e0 * size / s0)
        rows.append((float(size), float(eff)))
    return tuple(rows)


def fit(base: HardwareProfile, meas: dict) -> HardwareProfile:
    """A copy of `base` with the measured peaks (CPU) and efficiency tables."""
    mm, mem, ov, ar = meas["matmul"], meas["memory"], meas["overheads"], meas["allreduce"]
    cpu = base.kind == "cpu"
    peak = max(r for _, r in mm) if cpu else base.device.peak_flops
    bw = max(r for _, r in mem) if cpu else base.device.memory_bw
    device = dataclasses.replace(
        base.device, peak_flops=peak, peak_flops_fp32=peak if cpu else base.device.peak_flops_fp32, memory_bw=bw
    )
    eff = dataclasses.replace(
        base.efficiency,
        matmul=_monotone_table([(s, r / peak) for s, r in mm]),
        memory=_monotone_table([(s, r / bw) for s, r in mem]),
        **ov,
    )
    node = base.node
    if ar:
        n = ar[0][2]
        busbw = [(s, 2.0 * (n - 1) / n * s / sec) for s, sec, _ in ar]
        link = max(b for _, b in busbw) if cpu else base.node.link_bw
        node = dataclasses.replace(base.node, link_bw=link, latency_s=min(sec for _, sec, _ in ar) / (2 * (n - 1)))
        eff = dataclasses.replace(
            eff, intra_node=_monotone_table([(s, b / float(base.node_bw(n) if not cpu else link)) for s, b in busbw])
        )
    if cpu and meas.get("kv_attend"):
        eff = dataclasses.replace(eff, kv_attend_bw=float(meas["kv_attend"]))
    calibrated = {
        "time": time.time(),
        "matmul_peak_measured": max(r for _, r in mm),
        "memory_bw_measured": max(r for _, r in mem),
    }
    return with_nodes(base, device=device, efficiency=eff, node=node, calibrated=calibrated)


def fit_saved_points(
    prof: HardwareProfile, path: str, clock: str, alt: HardwareProfile | None = None
) -> HardwareProfile:
    """`prof` refitted to saved stage points (costmodel/fit.py); they must use the same clock. With
    `alt` (the uncalibrated preset) the fit also starts from it and the better fit on the points
    is kept: micro-benchmark tables (cache-resident sizes) can shape the curves worse than the
    preset's for whole stages."""
    import json

    from rpeg_jax.costmodel import fit as F

    with open(path) as f:
        data = json.load(f)
    if data.get("clock", clock) != clock:
        print(f"rpeg calibrate: skipping {path}: measured on the {data['clock']} clock, not {clock}", file=sys.stderr)
        return prof
    fits = [F.fit_points(p, data["points"]) for p in ([prof] if alt is None else [prof, alt])]
    best, resid = min(fits, key=lambda pr: pr[1].get("fit_time_mape", 0.0))
    if data.get("gen_memory"):  # the sampler programs' compiled memory (calibration set only)
        best, rg = F.fit_gen_memory(best, data["gen_memory"])
        resid = {**resid, **rg}
    if data.get("steps"):  # whole steps of calibration configs: the runtime's host costs
        best, rs = F.fit_steps(best, data["steps"])
        resid = {**resid, **rs}
    return dataclasses.replace(
        best, calibrated={**prof.calibrated, **resid, "stage_points": float(len(data["points"]))}
    )
