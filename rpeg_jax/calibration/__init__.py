"""Calibration: measure this machine and fit a hardware profile to it (`rpeg calibrate`).

This package measures (it runs JAX); the fits are pure Python in the cost model, which imports no
JAX: costmodel/microfit.py fits the micro-benchmarks and the synthetic decoder, costmodel/fit.py
fits stage points of the real code. `rpeg calibrate` runs the three in order and saves the result:

    micro.measure          matmul, memory, dispatch, layer, loop, all-reduce, KV attend rates
      -> microfit.fit      peaks, tables, overheads, link
    micro.bench_stages     a synthetic dense decoder (forward, train) at a few shapes
      -> microfit.fit_stages   matmul scale, elementwise, layer and backward factors
    stages.measure_set     the real model, update and sampler on the CALIBRATION configurations
      -> fit.fit_points    every free factor of the profile, on log time (microfit.fit_saved_points)

The stage points are written beside the profile (<profile>.points.json, what a later `--points` or
bench/costmodel_validate.py --refit fits again); bench/costmodel_validate.py measures the held-out
VALIDATION configurations against the saved profile and never fits them.
"""

from __future__ import annotations

import dataclasses
import json
import os

from rpeg_jax.calibration.micro import CLOCKS, bench_stages, measure, set_clock
from rpeg_jax.costmodel.hardware import HardwareProfile
from rpeg_jax.costmodel.microfit import STAGE_SHAPES, fit, fit_saved_points, fit_stages

__all__ = ["CLOCKS", "calibrate", "measure_stage_points", "save_points", "fit_saved_points"]


def calibrate(base: HardwareProfile, quick: bool, stages: bool = True, clock: str = "wall") -> HardwareProfile:
    """Micro-benchmarks -> fitted profile, then the stage-level fit on the synthetic decoder."""
    set_clock(clock)
    if clock == "cpu":  # core-seconds: one core's rate, overheads not divided among cores
        base = dataclasses.replace(base, host_cores=1)
    meas = measure("float32" if base.kind == "cpu" else "bfloat16", quick, accelerator=base.kind != "cpu")
    prof = fit(base, meas)
    prof = dataclasses.replace(prof, calibrated={**prof.calibrated, "clock_cpu": float(clock == "cpu")})
    if stages:
        shapes = STAGE_SHAPES[1::2] if quick else STAGE_SHAPES
        prof, resid = fit_stages(prof, bench_stages(3 if quick else 5, shapes))
        prof = dataclasses.replace(prof, calibrated={**prof.calibrated, **resid})
    return prof


def stage_configs(kind: str, quick: bool) -> list[tuple]:
    """The real-code configurations `rpeg calibrate` measures on a `kind` ("cpu" or an accelerator)
    profile: calibration sets only (stages.py keeps them disjoint from the validation sets)."""
    from rpeg_jax.calibration import stages as CS

    if kind == "cpu":
        return list(CS.QUICK_CALIBRATION if quick else CS.CALIBRATION)
    return list(CS.GPU_CALIBRATION[:3] if quick else CS.GPU_CALIBRATION)


def measure_stage_points(kind: str, quick: bool, clock: str, log=print) -> list[dict]:
    """Stage points (costmodel/fit.py's format) of the real model, update and sampler, measured now."""
    from rpeg_jax.calibration import stages as CS

    return CS.measure_set(stage_configs(kind, quick), 2 if quick else 5, CLOCKS[clock], log=log)


def save_points(path: str, clock: str, points: list[dict], load: list[float] | None = None) -> str:
    """Write <profile>.points.json atomically; whole-step and generation-memory points an earlier
    bench run saved there (bench/costmodel_validate.py --calibrate-steps / --gen-memory) are kept
    when they were measured on the same clock."""
    old = {}
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("clock", clock) != clock:
            old = {}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = {
        "clock": clock,
        "points": points,
        "steps": old.get("steps", []),
        "gen_memory": old.get("gen_memory", []),
        "load": load or [],
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    return path
