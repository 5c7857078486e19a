"""Validate the cost model against measurements on this CPU (8 forced XLA devices).

    python bench/costmodel_validate.py --calibrate          # measure both sets, fit on CALIBRATION, save
    python bench/costmodel_validate.py --calibrate-steps    # whole steps of a calibration config, refit
    python bench/costmodel_validate.py --refit              # refit the saved calibration points (no measuring)
    python bench/costmodel_validate.py --reuse ~/.cache/rpeg_jax/hardware/cpu.validation.json --json out.json
    python bench/costmodel_validate.py --json out.json [--step-level] [--quick]   # measure VALIDATION now
    python bench/costmodel_validate.py --no-stages --reprice old.json --json out.json  # old steps, new profile

Stage level: the VALIDATION configurations of rpeg_jax/calibration/stages.py (>= 20: model sizes,
batch sizes, lengths, meshes data x fsdp x tensor of 1-8 devices; forward, train, generate),
measured round-robin with medians, against the predictions of the saved `cpu` profile. That
profile is fitted on the disjoint CALIBRATION configurations only (`--calibrate` measures both
sets in one interleaved run so that both see the same machine load, writes the calibration
points next to the profile and fits them as `rpeg calibrate` does), never on these.

Step level (`--step-level`): candidate plans of the default config (configs/default.yaml) on
the 8 devices: the planner's chosen plan, runners-up, baselines and the best plan of each device-
group size; every plan runs whole RL steps in its own process (rpeg_jax.runtime.train under the
plan; a hung collective cannot stop the benchmark), `--rounds` times interleaved, and the median
step after warm-up is compared with the predicted steady-state step time. The runtime's host
costs around the sampler (per step, per sequence, per streamed piece) are fitted on whole steps
of two other configs, B=64 and B=192 (`--calibrate-steps`), never on the default config.

JSON: stages[...] (config, measured_s, predicted_s, error, memory measured/predicted),
mape_stage {kind: MAPE}, mape_stage_all, memory_error (mean |relative error|), and with
--step-level mape_step (the chosen plan), mape_step_all, spearman (predicted vs measured over the
plans), chosen_vs_best (measured chosen / best measured - 1), plans[...]; load (1-minute load
averages seen), clock, calibration residuals, git commit. `--clock cpu` (process CPU seconds)
is the default: the machine is shared and wall time depends on others' load; pair it with a
profile calibrated on the same clock (what --calibrate does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rpeg_jax.costmodel.devices import force_cpu_devices  # noqa: E402 (imports no JAX)

force_cpu_devices(8)

import numpy as np  # noqa: E402

from rpeg_jax.calibration import save_points  # noqa: E402
from rpeg_jax.calibration import stages as CS  # noqa: E402
from rpeg_jax.costmodel.fit import predict_point  # noqa: E402
from rpeg_jax.costmodel.hardware import calibrated_path, load_hardware, save_hardware  # noqa: E402
from rpeg_jax.costmodel.microfit import fit_saved_points  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOADS: list[float] = []


def note_load() -> float:
    load = os.getloadavg()[0]
    LOADS.append(load)
    return load


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


# ---- stage level -----------------------------------------------------------------------------
def interleave(cal: list, val: list) -> list:
    """One measuring order for both sets: kind by kind, the validation configurations spread evenly
    among the calibration ones (by fractional position), so that every batch of
    calibration/stages.measure_set holds both sets' configurations of the same kind and they see the
    same machine phase. (Why not zip the two lists: the generation configurations, last in both
    lists and 20 against 6, fall into different batches. Measured zipped on 2026-12-01 (bench/NOTES.md
    session 6), the calibration ones ran ~30% faster than the night before while the validation
    ones ran the same, and the fit under-predicted every validation generation point by ~21%.)"""
    out = []
    for kind in dict.fromkeys(c[0] for c in cal + val):
        c_k, v_k = [c for c in cal if c[0] == kind], [c for c in val if c[0] == kind]
        # calibration configurations at 0..1 (a kind starts and ends with one), validation in between
        tagged = [(i / max(len(c_k) - 1, 1), 0, c) for i, c in enumerate(c_k)]
        tagged += [((i + 1) / (len(v_k) + 1), 1, c) for i, c in enumerate(v_k)]
        out += [c for _, _, c in sorted(tagged, key=lambda x: (x[0], x[1]))]
    return out


def calibrate(args) -> int:
    """Measure CALIBRATION and VALIDATION in one run (interleaved, so both see the same machine
    load), fit the profile on the CALIBRATION points only, save the profile, the calibration points
    (<profile>.points.json, what `rpeg calibrate` refits) and the validation measurements
    (<profile>.validation.json, for `--reuse`; never fitted)."""
    mixed = interleave(CS.CALIBRATION, CS.VALIDATION)
    note_load()
    pts = CS.measure_set(mixed, args.repeats, CS.CLOCKS[args.clock])
    note_load()
    cal = [p for p, c in zip(pts, mixed) if c in CS.CALIBRATION]
    val = [p for p, c in zip(pts, mixed) if c in CS.VALIDATION]
    path = args.out or calibrated_path(args.hardware)
    points = save_points(os.path.splitext(path)[0] + ".points.json", args.clock, cal, LOADS)  # steps kept
    with open(os.path.splitext(path)[0] + ".validation.json", "w") as f:
        json.dump({"clock": args.clock, "stages": [{"point": p} for p in val], "load": LOADS}, f, indent=1)
    preset = load_hardware(args.hardware, calibrated=False)
    alt = dataclasses.replace(preset, host_cores=1) if args.clock == "cpu" else preset
    start = load_hardware(path) if os.path.isfile(path) else alt
    prof = fit_saved_points(start, points, args.clock, alt)
    prof = dataclasses.replace(prof, calibrated={**prof.calibrated, "clock_cpu": float(args.clock == "cpu")})
    save_hardware(prof, path)
    print(f"fitted {len(cal)} calibration points: {prof.calibrated} -> {path} (load {LOADS})")
    return 0


def refit(args) -> int:
    """Fit the profile again to the saved calibration points (stages, then whole steps if any),
    measuring nothing: after a change of the model's formulas. Validation points are not read."""
    path = args.out or calibrated_path(args.hardware)
    points = os.path.splitext(path)[0] + ".points.json"
    preset = load_hardware(args.hardware, calibrated=False)
    alt = dataclasses.replace(preset, host_cores=1) if args.clock == "cpu" else preset
    prof = fit_saved_points(alt, points, args.clock, alt)
    prof = dataclasses.replace(prof, calibrated={**prof.calibrated, "clock_cpu": float(args.clock == "cpu")})
    save_hardware(prof, path)
    print(f"refitted {points}: {prof.calibrated} -> {path}")
    return 0


def stage_rows(args, hw) -> list[dict]:
    configs = CS.QUICK if args.quick else CS.VALIDATION
    if args.only:
        configs = [c for c in configs if c[0] in args.only.split(",")]
    if args.reuse:
        with open(args.reuse) as f:
            data = json.load(f)
        pts = [r["point"] for r in data["stages"]]
        LOADS.extend(data.get("load", []))
    else:
        note_load()
        pts = CS.measure_set(configs, args.repeats, CS.CLOCKS[args.clock])
        note_load()
    rows = []
    for p in pts:
        sec, mem = predict_point(hw, p)
        m = p.get("memory")
        rows.append(
            {
                **{k: p[k] for k in CS.KEYS},
                "measured_s": p["seconds"],
                "predicted_s": sec,
                "error": (sec - p["seconds"]) / p["seconds"],
                "memory_measured": m,
                "memory_predicted": mem,
                "memory_error": (mem - m) / m if m else None,
                "point": p,
            }
        )
        r = rows[-1]
        print(
            f"{r['kind']:<8} {r['model']} B{r['B']:<3} S{r['P'] + r['R']:<4} mesh {tuple(r['mesh'])} mb{r['micro']} "
            f"{r['remat']:<4} measured {1e3 * r['measured_s']:8.2f} ms  predicted {1e3 * sec:8.2f} ms "
            f"({100 * r['error']:+6.1f}%)  mem {m or 0:>11.0f} vs {mem:>11.0f}",
            flush=True,
        )
    return rows


def stage_summary(rows: list[dict]) -> dict:
    kinds = sorted({r["kind"] for r in rows})
    mem = [abs(r["memory_error"]) for r in rows if r["memory_error"] is not None]
    return {
        "mape_stage": {k: float(np.mean([abs(r["error"]) for r in rows if r["kind"] == k])) for k in kinds},
        "mape_stage_all": float(np.mean([abs(r["error"]) for r in rows])),
        "memory_error": float(np.mean(mem)) if mem else None,
        "memory_error_max": float(np.max(mem)) if mem else None,
        "spearman_stage": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
    }


# ---- generation memory -------------------------------------------------------------------------
def gen_memory(args, hw) -> dict:
    """`--gen-memory [FILE]`: the sampler's peak bytes per device (the largest compiled memory
    analysis of its prefill / fork / decode programs, bench/calibration/stages.generation_memory) of
    GEN_MEMORY_CAL and GEN_MEMORY_VAL against stages.generate_memory; measured now and saved to
    FILE, or re-read from FILE when it exists. memory_error_generate is the held-out VAL set's mean
    |relative error| (no memory factor is fitted for generation; CAL is where the formula was read)."""
    path = args.gen_memory
    if path and os.path.isfile(path):
        with open(path) as f:
            pts = json.load(f)
    else:
        pts = [
            dict(CS.generation_memory(c), set=name)
            for name, cs in (("cal", CS.GEN_MEMORY_CAL), ("val", CS.GEN_MEMORY_VAL))
            for c in cs
        ]
        if path:
            with open(path, "w") as f:
                json.dump(pts, f, indent=1)
    rows = []
    for p in pts:
        mem = predict_point(hw, p)[1]
        rows.append(
            {
                "set": p["set"],
                **{k: p[k] for k in ("model", "B", "P", "R", "mesh", "G", "page_size")},
                "memory_measured": p["memory"],
                "memory_predicted": mem,
                "memory_error": (mem - p["memory"]) / p["memory"],
                "programs": p["programs"],
            }
        )
        r = rows[-1]
        print(
            f"gen memory {r['set']} {r['model']} B{r['B']:<3} S{r['P'] + r['R']:<4} t{r['mesh'][2]} "
            f"page {r['page_size']:<3} measured {r['memory_measured'] / 1e6:8.2f} MB  "
            f"predicted {mem / 1e6:8.2f} MB ({100 * r['memory_error']:+.1f}%)"
        )
    err = {s: [abs(r["memory_error"]) for r in rows if r["set"] == s] for s in ("cal", "val")}
    return {
        "memory_error_generate": float(np.mean(err["val"])) if err["val"] else None,
        "memory_error_generate_max": float(np.max(err["val"])) if err["val"] else None,
        "memory_error_generate_cal": float(np.mean(err["cal"])) if err["cal"] else None,
        "gen_memory": rows,
    }


# ---- one GPU (bench/gpu_check.sh) -------------------------------------------------------------
def gpu_validate(args) -> int:
    """`--gpu`: GPU_CALIBRATION and GPU_VALIDATION of bench/calibration/stages.py (1-device meshes,
    bfloat16 Qwen2 shapes; `--dry-run`: model T on a CPU) measured interleaved on the wall clock,
    each configuration built, warmed up and timed on its own (the GPU is not shared: no round-robin
    needed). A point is written as soon as it is measured and no configuration starts after
    `--budget-s`, so a time limit still leaves a result. The profile (`--start`, e.g. the output of
    `rpeg calibrate --profile h200`, else the `--hardware` preset) is fitted on the calibration half
    as `rpeg calibrate --points` does (saved to `--out`, the points beside it); the JSON reports the
    validation half's MAPE per kind for the preset, the start profile and the fitted one."""
    import itertools

    cal_set, val_set = (
        (CS.GPU_DRY_CALIBRATION, CS.GPU_DRY_VALIDATION) if args.dry_run else (CS.GPU_CALIBRATION, CS.GPU_VALIDATION)
    )
    mixed = [c for pair in itertools.zip_longest(cal_set, val_set) for c in pair if c is not None]
    preset = load_hardware(args.hardware, calibrated=False)
    start = load_hardware(args.start) if args.start else preset
    out_prof = args.out or os.path.join(tempfile.gettempdir(), f"{args.hardware}_gpu_stages.yaml")
    points_path = os.path.splitext(out_prof)[0] + ".points.json"
    t0, done, skipped = time.perf_counter(), [], []
    for c in mixed:
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(c)
            continue
        got = CS.measure_set([c], args.repeats, time.perf_counter, batch=1)
        if got:
            done.append((c, got[0]))
        _gpu_dump(args.json, {"partial": True, "points": [p for _, p in done], "skipped": [list(x) for x in skipped]})
    cal = [p for c, p in done if c in cal_set]
    val = [p for c, p in done if c in val_set]
    res = {
        "hardware": args.hardware,
        "start": args.start,
        "dry_run": args.dry_run,
        "clock": "wall",
        "measure_seconds": time.perf_counter() - t0,
        "skipped": [list(x) for x in skipped],
        "calibration_points": len(cal),
        "validation_points": len(val),
    }
    profiles = {"preset": preset, "start": start}
    if cal:
        os.makedirs(os.path.dirname(os.path.abspath(points_path)), exist_ok=True)
        with open(points_path, "w") as f:
            json.dump({"clock": "wall", "points": cal}, f, indent=1)
        fitted = fit_saved_points(start, points_path, "wall", preset)
        save_hardware(fitted, out_prof)
        profiles["fitted"] = fitted
        res.update(profile=out_prof, points=points_path, fit={k: float(v) for k, v in fitted.calibrated.items()})
    for name, hw in profiles.items():
        rows = [_gpu_row(hw, p) for p in val]
        res[name] = {**stage_summary(rows), "stages": rows} if rows else None
        res[f"calibration_fit_{name}"] = stage_summary([_gpu_row(hw, p) for p in cal]) if cal else None
    best = res.get("fitted") or res.get("start")
    for r in (best or {}).get("stages", []):
        print(
            f"validation {r['kind']:<8} {r['model']} B{r['B']:<3} S{r['P'] + r['R']:<4} mb{r['micro']} {r['remat']:<4} "
            f"measured {1e3 * r['measured_s']:9.2f} ms  predicted {1e3 * r['predicted_s']:9.2f} ms "
            f"({100 * r['error']:+6.1f}%)",
            flush=True,
        )
    for name in profiles:
        if res.get(name):
            print(
                f"GPU stage MAPE on the validation half ({name} profile): "
                + ", ".join(f"{k} {100 * v:.1f}%" for k, v in res[name]["mape_stage"].items())
                + f"; all {100 * res[name]['mape_stage_all']:.1f}%; memory error "
                + (f"{100 * res[name]['memory_error']:.1f}%" if res[name]["memory_error"] is not None else "n/a"),
                flush=True,
            )
    _gpu_dump(args.json, res)
    return 0 if val and cal else 1


def _gpu_row(hw, p: dict) -> dict:
    sec, mem = predict_point(hw, p)
    m = p.get("memory")
    return {
        **{k: p[k] for k in ("kind", "model", "B", "P", "R", "mesh", "micro", "remat")},
        "measured_s": p["seconds"],
        "predicted_s": sec,
        "error": (sec - p["seconds"]) / p["seconds"],
        "memory_measured": m,
        "memory_predicted": mem,
        "memory_error": (mem - m) / m if m else None,
        "point": p,
    }


def _gpu_dump(path, data) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


# ---- step level ------------------------------------------------------------------------------
def run_plan(plan_path: str, out: str, steps: int, warmup: int, clock: str, overrides=()) -> None:
    """(Child process) train the default config (+ overrides) under a saved plan; write per-step seconds."""
    from rpeg_jax.config import load_config
    from rpeg_jax.graph.plan import Plan, config_for_plan
    from rpeg_jax.runtime import train

    plan = Plan.load(plan_path)
    cfg, _ = config_for_plan(load_config(None, list(overrides)), plan)
    marks = []
    clk = time.process_time if clock == "cpu" else time.perf_counter
    probe = [matmul_rate(clk)]
    with tempfile.TemporaryDirectory() as d:
        tr = dataclasses.replace(
            cfg.train,
            steps=warmup + steps,
            run_dir=d,
            checkpoint_every=0,
            tensorboard=False,
            progress=False,
            resume="never",
        )
        marks.append(clk())
        train(dataclasses.replace(cfg, train=tr), plan=plan, on_step=lambda s, m: marks.append(clk()))
    probe.append(matmul_rate(clk))
    sec = np.diff(marks)[warmup:].tolist()
    with open(out, "w") as f:
        json.dump({"seconds": sec, "probe_flops": float(np.mean(probe))}, f)


def matmul_rate(clk, n: int = 384, reps: int = 8) -> float:
    """FLOP/s of a jitted f32 matmul chain on the step clock, median of `reps` calls (~0.1 s): the
    machine's state next to a plan's steps, for the probe-normalised statistic (`summarise`)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def chain(a, b):
        return jax.lax.fori_loop(0, 4, lambda i, x: jnp.tanh(x @ b), a)

    a = jnp.ones((n, n), jnp.float32) / n
    jax.block_until_ready(chain(a, a))
    times = []
    for _ in range(reps):
        t = clk()
        jax.block_until_ready(chain(a, a))
        times.append(clk() - t)
    return 4 * 2.0 * n**3 / max(float(np.median(times)), 1e-9)


def step_candidates(hw, n: int, cap: int = 12) -> list:
    """Up to `cap` distinct plans of the default config: the chosen plan, the baselines, then the
    best plan of device-group options spread over the predicted range, then runners-up."""
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel import planner as P
    from rpeg_jax.costmodel.pricing import best_by_groups

    cfg = load_config(None, ["costmodel.runners_up=8"])
    res = P.search(cfg, n, hw, 1)
    groups = best_by_groups(cfg, n, hw, 1)
    head = [res.chosen, *res.baselines.values()]
    spread = [groups[int(round(i))] for i in np.linspace(0, len(groups) - 1, min(len(groups), cap - len(head)))]
    seen, out = set(), []
    for p in [*head, *spread, *res.runners_up, *groups]:
        key = json.dumps(p.plan.to_dict()["stages"]) + json.dumps(p.knobs, sort_keys=True)
        if key not in seen and len(out) < cap:
            seen.add(key)
            out.append(p)
    return out


def reprice(args, hw) -> dict:
    """The step-level plans of an earlier --json, measured there, predicted by today's profile."""
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel.pricing import price_layout

    with open(args.reprice) as f:
        old = [p for p in json.load(f)["plans"] if p["measured_s"]]
    cfg = load_config(None, [])
    pred = [price_layout(cfg, p["knobs"], p["layout"], 8, hw, 1).step_time_s for p in old]
    out = summarise(
        old, pred, [p["measured_s"] for p in old], [p["runs_s"] for p in old], [p.get("probe_flops") for p in old]
    )
    # The plan today's profile would choose: one of the measured plans, or none of them.
    from rpeg_jax.costmodel import planner as P

    key = lambda kn, lay: json.dumps(json.loads(json.dumps([kn, lay])), sort_keys=True)  # noqa: E731
    now = P.search(cfg, 8, hw, 1).chosen
    hit = [i for i, p in enumerate(old) if key(p["knobs"], p["layout"]) == key(now.knobs, now.layout)]
    meas = [p["measured_s"] for p in old]
    out["chosen_now"] = {
        "predicted_s": now.step_time_s,
        "measured_plan": old[hit[0]]["label"] if hit else None,
        "chosen_vs_best": meas[hit[0]] / min(meas) - 1.0 if hit else None,
    }
    print(f"chosen by today's profile: {out['chosen_now']}")
    return out


def summarise(plans, pred, meas, runs, probes=None) -> dict:
    """mape_step (the first plan: the chosen one), mape_step_all, spearman, chosen_vs_best; with
    `probes` (per plan, the matmul FLOP/s of each of its processes, `run_plan`) the same four on
    probe-normalised times as `*_norm`: every process's step times x (its probe rate / the median
    rate over all processes of all plans), so that a slow phase of the machine (a round whose
    matmul rate was 1.5x lower) weighs on no plan more than on another; the median over a plan's
    normalised steps is `measured_norm_s`. Both statistics are always reported."""
    label = lambda p: p.label if hasattr(p, "label") else p["label"]  # noqa: E731
    for p, q, m in zip(plans, pred, meas):
        print(f"plan {label(p):<16} predicted {q:8.3f} s  measured {m:8.3f} s  ({100 * (q - m) / m:+.1f}%)")
    chosen = label(plans[0]) == "chosen"
    out = {
        **_rank_stats(pred, meas, chosen, ""),
        "plans": [
            {
                "label": label(p),
                "predicted_s": q,
                "measured_s": m,
                "runs_s": r,
                "knobs": p.knobs if hasattr(p, "knobs") else p["knobs"],
                "layout": p.layout if hasattr(p, "layout") else p["layout"],
            }
            for p, q, m, r in zip(plans, pred, meas, runs)
        ],
    }
    if probes and all(probes) and len(probes) == len(plans):
        ref = float(np.median([r for pr in probes for r in pr]))
        per = [len(r) // len(pr) for r, pr in zip(runs, probes)]  # steps per process
        norm = [
            float(np.median([x * pr[k // n] / ref for k, x in enumerate(r)])) for r, pr, n in zip(runs, probes, per)
        ]
        out.update(_rank_stats(pred, norm, chosen, "_norm"), probe_ref_flops=ref)
        for row, pr, m in zip(out["plans"], probes, norm):
            row.update(probe_flops=pr, measured_norm_s=m)
    return out


def _rank_stats(pred, meas, chosen: bool, suffix: str) -> dict:
    err = [abs(q - m) / m for q, m in zip(pred, meas)]
    return {
        f"mape_step{suffix}": err[0] if chosen else None,
        f"mape_step_all{suffix}": float(np.mean(err)),
        f"spearman{suffix}": spearman(pred, meas) if len(meas) > 2 else None,
        f"chosen_vs_best{suffix}": meas[0] / min(meas) - 1.0 if chosen else None,
    }


def measure_plans(plans: list, args, overrides=()) -> list[list[float]]:
    """Seconds per step of each plan, every plan in its own process, `args.rounds` interleaved rounds."""
    runs: list[list[float]] = [[] for _ in plans]
    probes: list[list[float]] = [[] for _ in plans]
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.path.join(tempfile.gettempdir(), "rpeg_cm_xla_cache")}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for i, p in enumerate(plans):
                path, out = os.path.join(d, f"plan{i}.json"), os.path.join(d, f"res{i}_{r}.json")
                p.plan.save(path)
                note_load()
                cmd = [
                    sys.executable,
                    __file__,
                    "--run-plan",
                    path,
                    "--out",
                    out,
                    "--steps",
                    str(args.steps),
                    "--clock",
                    args.clock,
                    *(["--overrides", *overrides] if overrides else []),
                ]
                try:
                    rc = subprocess.run(
                        cmd,
                        env=env,
                        cwd=ROOT,
                        timeout=args.plan_timeout,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    ).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
                if rc == 0:
                    with open(out) as f:
                        res = json.load(f)
                    runs[i] += res["seconds"]
                    probes[i].append(res["probe_flops"])
                print(
                    f"  round {r} {p.label:<16} rc={rc} steps {['%.2f' % x for x in runs[i]]} "
                    f"probe {['%.0f' % (x / 1e9) for x in probes[i]]} GFLOP/s",
                    flush=True,
                )
    return runs, probes


def step_level(args, hw) -> dict:
    plans = step_candidates(hw, 8)
    print(f"step level: {len(plans)} candidate plans of the default config", flush=True)
    runs, probes = measure_plans(plans, args)
    ok = [i for i, x in enumerate(runs) if x]
    out = summarise(
        [plans[i] for i in ok],
        [plans[i].step_time_s for i in ok],
        [float(np.median(runs[i])) for i in ok],
        [runs[i] for i in ok],
        [probes[i] for i in ok],
    )
    out["failed"] = [plans[i].label for i in range(len(plans)) if not runs[i]]
    return out


# Not the default config (B=128, R=8): B=64, R=12 and B=192, R=6, so that the runtime's
# per-sequence and per-step host costs separate.
STEP_CALIBRATIONS = (
    ["data.prompts_per_step=8", "rollout.max_new_tokens=12"],
    ["data.prompts_per_step=24", "rollout.max_new_tokens=6"],
)


def calibrate_steps(args) -> int:
    """Whole steps of the calibration configs (all, or `--step-config i`) under plans of several
    groups and piece counts; saved beside the stage points (replacing earlier steps of the same
    config, keeping the others), then the profile refitted."""
    configs = STEP_CALIBRATIONS if args.step_config is None else [STEP_CALIBRATIONS[args.step_config]]
    steps = [s for over in configs for s in measure_steps(args, over)]
    path = args.out or calibrated_path(args.hardware)
    points = os.path.splitext(path)[0] + ".points.json"
    with open(points) as f:
        data = json.load(f)
    data["steps"] = [s for s in data.get("steps", []) if s["overrides"] not in configs] + steps
    with open(points, "w") as f:
        json.dump(data, f, indent=1)
    preset = load_hardware(args.hardware, calibrated=False)
    alt = dataclasses.replace(preset, host_cores=1) if args.clock == "cpu" else preset
    prof = fit_saved_points(load_hardware(path), points, args.clock, alt)
    prof = dataclasses.replace(prof, calibrated={**prof.calibrated, "clock_cpu": float(args.clock == "cpu")})
    save_hardware(prof, path)
    print(f"fitted {len(data['steps'])} calibration steps: {prof.calibrated} -> {path}")
    return 0


def measure_steps(args, overrides: list[str]) -> list[dict]:
    """Step points of one calibration config: the best plan of 1 and 4 colocated devices and of
    split 1+1 and 2+2, and the two split ones streamed in 8 and 4 pieces."""
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel.pricing import best_by_groups, price_layout

    STEP_CALIBRATION = overrides
    hw = load_hardware(args.hardware, calibrated=True)
    cfg = load_config(None, STEP_CALIBRATION)
    alts = {p.label: p for p in best_by_groups(cfg, 8, hw, 1)}
    plans = [alts[k] for k in ("best colocated 1", "best colocated 4", "best split 1+1", "best split 2+2") if k in alts]
    for base, m in (("best split 1+1", 8), ("best split 2+2", 4)):
        if base in alts:
            kn = {**alts[base].knobs, "pieces": m}
            p = price_layout(cfg, kn, alts[base].layout, 8, hw, 1)
            p.label = f"{base} p{m}"
            plans.append(p)
    runs, probes = measure_plans(plans, args, STEP_CALIBRATION)
    note_load()
    return [
        {
            "overrides": STEP_CALIBRATION,
            "knobs": p.knobs,
            "layout": p.layout,
            "num_devices": 8,
            "label": p.label,
            "seconds": float(np.median(r)),
            "runs_s": r,
            "probe_flops": pr,
            "load": LOADS[-1],
        }
        for p, r, pr in zip(plans, runs, probes)
        if r
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5, help="round-robin rounds per stage configuration")
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    ap.add_argument("--only", default=None, help="comma-separated kinds (forward,train,generate)")
    ap.add_argument("--reuse", default=None, help="re-predict the stage measurements of an earlier --json")
    ap.add_argument("--no-stages", action="store_true", help="skip the stage level")
    ap.add_argument("--calibrate", action="store_true", help="measure CALIBRATION, fit and save the profile")
    ap.add_argument("--out", default=None, help="--calibrate: profile path (default the calibrated cache)")
    ap.add_argument("--step-level", action="store_true", help="also run whole RL steps of the candidate plans")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per plan and round (after 2 warm-up)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plan-timeout", type=int, default=900)
    ap.add_argument(
        "--reprice",
        default=None,
        help="re-predict the measured plans of an earlier --step-level "
        "--json with the current profile (after a recalibration)",
    )
    ap.add_argument(
        "--calibrate-steps",
        action="store_true",
        help="measure whole steps of a calibration config (not the default), fit the runtime's host costs",
    )
    ap.add_argument(
        "--refit",
        action="store_true",
        help="refit the profile to the saved calibration points (no measuring; after a change of the formulas)",
    )
    ap.add_argument(
        "--step-config",
        type=int,
        default=None,
        help="--calibrate-steps: only this calibration config (index into STEP_CALIBRATIONS)",
    )
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="one GPU: measure GPU_CALIBRATION + GPU_VALIDATION (1 device, "
        "wall clock), fit on the first, report MAPE on the second",
    )
    ap.add_argument("--dry-run", action="store_true", help="--gpu: the same plumbing with model T (on a CPU)")
    ap.add_argument("--start", default=None, help="--gpu: profile YAML to start the fit from (rpeg calibrate --out)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="--gpu: start no configuration after this")
    ap.add_argument(
        "--gen-memory",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="also validate generation memory (sampler programs' compiled peaks); FILE: "
        "re-read it when it exists, else measure and save there",
    )
    ap.add_argument("--run-plan", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_plan:
        run_plan(args.run_plan, args.out, args.steps, 2, args.clock, args.overrides)
        return 0
    if args.gpu:
        return gpu_validate(args)
    if args.calibrate:
        return calibrate(args)
    if args.calibrate_steps:
        return calibrate_steps(args)
    if args.refit:
        return refit(args)
    hw = load_hardware(args.hardware, calibrated=True)
    out = {
        "hardware": hw.name,
        "calibrated": dict(hw.calibrated),
        "clock": args.clock,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
    }
    if not args.no_stages:
        rows = stage_rows(args, hw)
        out.update(stages=rows, **stage_summary(rows))
    if args.gen_memory is not None:
        out.update(gen_memory(args, hw))
    if args.reprice:
        out.update(reprice(args, hw))
    elif args.step_level:
        out.update(step_level(args, hw))
    else:
        out.update(mape_step=None, spearman=None, chosen_vs_best=None, pending="run with --step-level")
    out["load"] = LOADS
    print(json.dumps({k: v for k, v in out.items() if k not in ("stages", "plans", "gen_memory")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
