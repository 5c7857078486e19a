"""R1 of bench/WORKLOADS.md: seconds per RL step (generate, reward, logprobs, advantages,
update, weight handoff), the synchronous unfused baseline against the rewritten pipeline, and the
step's FLOPs over this machine's matmul rate measured in the same run.

    python bench/rl_step.py --json out.json [--workloads R1-a,R1-b,R1-c] [--variants baseline,optimized]
                            [--steps 5] [--warmup 2] [--hardware cpu|h200|PROFILE.yaml]

Workloads: R1-a GRPO without KL, R1-b GRPO with KL 0.04 to a reference model, R1-c PPO with a
critic; all on model T, task "a+b=" (2-digit operands), 16 prompts x group 8, 32 new tokens at
temperature 1.0, one AdamW step (lr 1e-4) per batch. Variants: "baseline" = the pipeline defaults
(synchronous, unfused, π_old recomputed by an old_forward pass); "optimized" = the rewrites on
(the sampler's logprobs serve as π_old, forwards fused, advantages folded into the update; R1-c:
also the critic's values for GAE from the critic update's own forward, values_from_critic_update);
"shared" (R1-c only) = optimized + actor-critic sharing (one backbone with policy and value heads;
its values, advantages and returns from the shared update's own forward);
"async" = bounded asynchrony k = 1 (generation of step t+1 beside the training of step t) with
π_prox from the actor update's own forward (proximal_from_update; no old_forward), forwards and
advantage fused (R1-c: values_from_critic_update too), on a split placement [1, 1] (one device
generates, one trains) when the process has >= 2 devices, else colocated on one.

Devices: on a CPU host every core is a JAX device (as in bench/generate.py; XLA_FLAGS with
--xla_force_host_platform_device_count overrides). "baseline" plans for ONE device (device 0; the
others idle). "optimized" and "shared" train on device 0 too, but GENERATE on a data mesh of every
device (graph/plan.widen_generation: a plan whose generation group nests the training group; at
staleness 0 the stages still run one after the other): one device program's small decode GEMMs do not fill the
cores, two side by side do (R1-a's generate call on 2 cores, interleaved, 10 calls each,
2026-12-01: 479 -> 322 ms median); the update stays on one device, whose products already use every
core (on a data=2 mesh it was 1.35 s against 0.74 s, 2026-12-01). "async" runs on a split placement [1, 1] (one device
generates, one trains, overlapping) when there are >= 2 devices, else colocated on one; both
devices share this machine's cores, so it measures the overlap of two device programs on the same
CPUs. The recorded `devices` field is the number of devices the plan uses.

Method (the machine is shared and noisy): every (workload, variant) pipeline is built and compiled
first and runs `--warmup` steps; then the measured steps are interleaved round by round
(a-base, a-opt, b-base, ...), with the matmul rate measured between rounds. Reported per pipeline:
the median seconds per step (spread = max/min), the median of every stage (timing_s/*, as the
executor times them, each stage synchronised), and the compile step's seconds.

Step FLOPs (the useful work; runtime/rollout/stats.py): real tokens only (no padding), prompt logits
never, the shared prompt of a group once in generation, no second forward where the sampler's
logprobs serve, no proximal or values forward where the update takes one optimizer step (its own
forward serves: rollouts.step_flops); so every variant of a workload has the same FLOPs:
    R1-a: generation + 3 actor passes (update: forward + backward)
    R1-b: + 1 reference pass (ref logprobs)
    R1-c: + 3 critic passes (critic update), without LM head
limit_s = step FLOPs / matmul rate (the best rate seen in the run: JAX float32 matmuls of a few
sizes, best of several); limit_fraction = median limit_s / median seconds per step. Also recorded:
limit_fraction_paired, each step against the rate measured next to it (less sensitive to load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rpeg_jax.costmodel.devices import force_cpu_devices  # noqa: E402 (imports no JAX)

force_cpu_devices(os.cpu_count() or 1)  # the host's cores as CPU devices (generation uses them)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rpeg_jax.config import load_config  # noqa: E402
from rpeg_jax.graph.compile import compile_graph  # noqa: E402
from rpeg_jax.graph.plan import graph_for_plan, plan_for_config, widen_generation  # noqa: E402
from rpeg_jax.runtime.executor import Executor  # noqa: E402
from rpeg_jax.runtime.kernels import default_registry  # noqa: E402
from rpeg_jax.runtime.rollout import stats as rollouts  # noqa: E402
from rpeg_jax.runtime.setup import build  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import best_time  # noqa: E402  (its device-count setup is the same as this script's)
from workloads import R1, WORKLOADS  # noqa: E402 (bench/: R1 and R2 as overrides)

R1_NAMES = ("R1-a", "R1-b", "R1-c")
VARIANTS = {
    "baseline": [],
    "optimized": ["pipeline.elide_old_forward=true", "pipeline.fuse=[forwards,advantage]"],
    # PPO only: the optimized pipeline with actor-critic sharing (one backbone, policy and
    # value heads; the paper's structural choice). A different model than R1-c's separate
    # critic, so it is reported beside "optimized", not as it.
    "shared": [
        "pipeline.elide_old_forward=true",
        "pipeline.fuse=[forwards,advantage]",
        "pipeline.share_actor_critic=true",
    ],
    # k = 1; π_prox = sg(π_θ) of the update's own forward (exact with one optimizer step).
    "async": ["pipeline.staleness=1", "pipeline.proximal_from_update=true", "pipeline.fuse=[forwards,advantage]"],
    # R2: the same stages in all three (no π_old pass: the sampler's logprobs at k = 0, the update's
    # own forward at k >= 1), on one device; k >= 1 with continuous admission (runtime/rollout/continuous.py).
    "sync": ["pipeline.elide_old_forward=true", "pipeline.fuse=[forwards,advantage]"],
    "async-k1": [
        "pipeline.staleness=1",
        "rollout.admission=continuous",
        "pipeline.proximal_from_update=true",
        "pipeline.fuse=[forwards,advantage]",
    ],
    "async-k2": [
        "pipeline.staleness=2",
        "rollout.admission=continuous",
        "pipeline.proximal_from_update=true",
        "pipeline.fuse=[forwards,advantage]",
    ],
}
R2_VARIANTS = ("sync", "async-k1", "async-k2")
# variants that apply to some workloads only
ONLY = {"shared": {"R1-c"}, **{v: {"R2"} for v in R2_VARIANTS}}
ONLY.update({v: set(R1_NAMES) for v in ("baseline", "optimized", "async")})
# With a separate critic: V for GAE from the critic update's own forward (one optimizer step).
EXTRA = {("R1-c", v): ["pipeline.values_from_critic_update=true"] for v in ("optimized", "shared", "async")}
SPLIT = ["pipeline.placement=split", "pipeline.split_sizes=[1,1]"]
WIDE_GEN = ("optimized", "shared")  # variants that generate on a data mesh of every device (widen_generation)


# ---- the machine's limit -----------------------------------------------------------------------
class MatmulRate:
    """float32 matmul FLOP/s through JAX: square 1024 and 2048, and the model's own GEMM shapes
    (5120 tokens x 256 x 768 and back); the best size's best time."""

    SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (5120, 256, 768), (5120, 768, 256))

    def __init__(self, reps: int = 5):
        rng = np.random.default_rng(0)
        self.reps = reps
        self.cases = [
            (
                2.0 * m * k * n,
                jnp.asarray(rng.standard_normal((m, k)), jnp.float32),
                jnp.asarray(rng.standard_normal((k, n)), jnp.float32),
            )
            for m, k, n in self.SHAPES
        ]
        self.fn = jax.jit(lambda a, b: a @ b)
        self.samples: list[float] = []

    def measure(self) -> float:
        rate = max(flops / best_time(self.fn, a, b, reps=self.reps) for flops, a, b in self.cases)
        self.samples.append(rate)
        return rate


# ---- one pipeline ------------------------------------------------------------------------------
def step_flops(cfg, stats: dict, staleness: int) -> float:
    """The workload's useful FLOPs for this step's rollouts (rollouts.step_flops; see the module docstring)."""
    return rollouts.step_flops(cfg, stats, staleness)


class Pipeline:
    """One (workload, variant): its compiled program and executor, stepped one slot at a time."""

    def __init__(self, workload: str, variant: str, run_dir: str, steps: int, extra: list[str]):
        self.workload, self.variant = workload, variant
        split = variant == "async" and jax.device_count() >= 2
        self.overrides = (
            R1
            + WORKLOADS[workload]
            + VARIANTS[variant]
            + EXTRA.get((workload, variant), [])
            + (SPLIT if split else [])
            + extra
            + [f"train.steps={steps}", f"train.run_dir={run_dir}"]
        )
        self.cfg = load_config(None, self.overrides)
        self.devices = 2 if split else 1
        plan = plan_for_config(self.cfg, self.devices)  # pipeline.plan=manual: the knobs above
        plan = dataclasses.replace(plan, num_devices=jax.device_count())  # devices beyond the plan idle
        graph = graph_for_plan(self.cfg, plan)
        if variant in WIDE_GEN and jax.device_count() > 1 and jax.default_backend() == "cpu":
            plan = widen_generation(plan, graph, self.cfg, tuple(range(jax.device_count())))
            self.devices = jax.device_count()
        self.plan = plan
        self.ctx, self.store = build(self.cfg, graph, plan)
        self.executor = Executor(compile_graph(graph, plan, default_registry(), self.ctx), self.store)
        self.stages = [cs.name for cs in self.executor.program.stages]
        self.t = 0
        self.records: list[dict] = []

    def step(self) -> dict:
        t0 = time.perf_counter()
        self.executor.run_slot(self.t)
        wall = time.perf_counter() - t0
        m = jax.device_get(self.executor.metrics.pop(self.t, {}))
        stats = rollouts.token_stats(self.store.get_data("completions", self.t))
        staleness = self.t - stats["min_version"] if stats["resp"] else 0.0
        self.executor.forget_before(self.t)
        self.t += 1
        timing = {k.split("/", 1)[1]: float(v) for k, v in m.items() if k.startswith("timing_s/")}
        rec = {
            "wall_s": wall,
            "step_s": timing.pop("step", wall),
            "stages_s": timing,
            "flops": step_flops(self.cfg, stats, self.executor.graph.staleness),
            "tokens": stats["seq"],
            "response_tokens": stats["resp"],
            "reward": float(np.asarray(m.get("reward/mean", np.nan))),
            "staleness_max": float(staleness),  # from the tokens' version tags, not the metric
            "occupancy": float(np.asarray(m.get("rollout/occupancy", np.nan))),
            "requeued": float(np.asarray(m.get("rollout/requeued", 0.0))),
            "dropped": float(np.asarray(m.get("rollout/dropped", 0.0))),
            "decode_steps": float(np.asarray(m.get("rollout/decode_steps", np.nan))),
        }
        return rec


# ---- the run -----------------------------------------------------------------------------------
def summarise(p: Pipeline, compile_s: float, rate_best: float, rates_paired: list[float]) -> dict:
    steps = p.records
    secs = [r["step_s"] for r in steps]
    med = statistics.median(secs)
    limit = [r["flops"] / rate_best for r in steps]
    paired = [r["flops"] / rate / r["step_s"] for r, rate in zip(steps, rates_paired)]
    stage_names = sorted({k for r in steps for k in r["stages_s"]})
    stages = {k: statistics.median(r["stages_s"].get(k, 0.0) for r in steps) for k in stage_names}
    return dict(
        workload=p.workload,
        variant=p.variant,
        seconds_per_step=med,
        limit_fraction=statistics.median(limit) / med,
        limit_fraction_paired=statistics.median(paired),
        limit_s=statistics.median(limit),
        flops_per_step=statistics.median(r["flops"] for r in steps),
        matmul_flops_per_s=rate_best,
        step_s=secs,
        spread=max(secs) / min(secs),
        stages_s=stages,
        gen_share=stages.get("gen", 0.0) / med,
        compile_step_s=compile_s,
        tokens_per_step=statistics.median(r["tokens"] for r in steps),
        response_tokens_per_step=statistics.median(r["response_tokens"] for r in steps),
        staleness_max=max(r["staleness_max"] for r in steps),
        occupancy=statistics.median(r["occupancy"] for r in steps),
        requeued=sum(r["requeued"] for r in steps),
        decode_steps_per_step=statistics.median(r["decode_steps"] for r in steps),
        dropped=sum(r["dropped"] for r in steps),
        stages=p.stages,
        overrides=[o for o in p.overrides if not o.startswith("train.run_dir")],
        device=jax.devices()[0].device_kind,
        devices=p.devices,
        steps_measured=len(steps),
        plan=p.plan.describe(),
    )


def r2_ceiling(r2: dict[str, dict]) -> dict:
    """What this machine allows R2's asynchrony (the issue's definition): the sync step with its
    generation priced at full occupancy (the same decode steps' price, occupancy x as many of them),
    everything else as measured. And the per-token bound's window: with continuous admission the
    tokens step t consumes come from the k + 1 generation windows t-k..t, so a sequence longer than
    about (k + 1) x the decode steps per window cannot enter the batch (it is re-queued)."""
    s = r2["sync"]
    gen = s["stages_s"].get("gen", 0.0)
    full = s["seconds_per_step"] - gen * (1.0 - s["occupancy"])
    windows = {}
    for v, r in r2.items():
        k = {"async-k1": 1, "async-k2": 2}.get(v)
        if k is not None and r.get("decode_steps_per_step"):
            windows[v] = (r["decode_steps_per_step"], (k + 1) * r["decode_steps_per_step"])
    return {"ceiling": s["seconds_per_step"] / full, "windows": windows}


def calibrated_profile(profile: str = "cpu", max_age_h: float = 12.0) -> str:
    """The calibrated profile R2's predictions use: the cached one (`rpeg calibrate` saved it) when it
    is at most `max_age_h` hours old, else this machine is calibrated now, in a subprocess (it forces
    its own CPU devices), and cached. The age limit: this shared machine's rates drift from day to
    day (2026-12-02 vs 12-03: matmul peak 265 vs 383 GFLOP/s, a 64 MB pass 3.8 vs 9.4 GB/s), and the
    day-old profile priced R2's sync generation at 1.6x the sampler's measured time."""
    from rpeg_jax.costmodel.hardware import calibrated_path

    path = calibrated_path(profile)
    age_h = (time.time() - os.path.getmtime(path)) / 3600.0 if os.path.exists(path) else None
    if age_h is None or age_h > max_age_h:
        why = f"no calibrated {profile} profile at {path}" if age_h is None else f"{path} is {age_h:.1f} h old"
        # micro-benchmarks and the synthetic fit, then the stage points saved beside the profile (if
        # any) refitted, as before `rpeg calibrate` measured the real stages itself (~10 min)
        cmd = ["calibrate", "--profile", profile, "--no-real-stages"]
        print(f"{why}: running `rpeg {' '.join(cmd)}` (about a minute)", flush=True)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        subprocess.run([sys.executable, "-m", "rpeg_jax.cli", *cmd], cwd=root, check=True)
    return path


def profile_drift(profile: str) -> float | None:
    """The matmul peak measured now, as `rpeg calibrate` measures it (calibration/micro.bench_matmul, its CPU
    sizes from 512 up), against the profile's calibrated.matmul_peak_measured, as a fraction (+0.2:
    the machine is 20% faster now than when the profile was made); None when the profile carries no
    calibration. On this shared machine the rate moves 25-50% within a day (2026-12-03: 383 GFLOP/s at
    06:10, 290-320 at 11:00; 2026-12-04 03:30: 179), and a profile of another state misprices every
    stage by about as much. Recorded, not acted on: measured in this process minutes after the
    calibration subprocess it still reads -8% to +18% (2026-12-04): a record to read, not a trigger.
    (This bench's own MatmulRate uses other shapes: not comparable.)"""
    from rpeg_jax.calibration.micro import bench_matmul
    from rpeg_jax.costmodel.hardware import load_hardware

    peak = (getattr(load_hardware(profile), "calibrated", None) or {}).get("matmul_peak_measured")
    if not peak:
        return None
    import jax

    gpu = jax.default_backend() != "cpu"  # as calibrate.measure: bf16 at accelerator sizes there
    sizes = (1024, 4096) if gpu else (512, 1024, 2048)
    now = max(r for _, r in bench_matmul("bfloat16" if gpu else "float32", sizes, repeats=3, accelerator=gpu))
    return float(now / peak - 1.0)


def predicted_step_s(p: "Pipeline", profile: str) -> tuple[float, dict[str, float]]:
    """The cost model's seconds per step for the same run (its config, one device, its admission mode
    and slots), and its seconds per stage: costmodel.pricing.predict_run with the calibrated profile."""
    from rpeg_jax.costmodel.pricing import predict_run

    pred = predict_run(p.cfg, profile, 1)
    return float(pred.step_time_s), {k: float(v) for k, v in pred.stage_times_s.items()}


def print_table(records: list[dict]) -> None:
    print(
        f"\n{'workload':8s} {'variant':10s} {'s/step':>7s} {'spread':>6s} {'limit_s':>7s} {'frac':>5s} "
        f"{'paired':>6s} {'GFLOP':>6s} {'compile':>7s}  stages (median s)"
    )
    for r in records:
        st = " ".join(f"{k}={v:.3f}" for k, v in r["stages_s"].items() if v >= 0.0005)
        print(
            f"{r['workload']:8s} {r['variant']:10s} {r['seconds_per_step']:7.3f} {r['spread']:6.2f} "
            f"{r['limit_s']:7.3f} {r['limit_fraction']:5.2f} {r['limit_fraction_paired']:6.2f} "
            f"{r['flops_per_step'] / 1e9:6.1f} {r['compile_step_s']:7.1f}  {st}"
        )
    by = {(r["workload"], r["variant"]): r["seconds_per_step"] for r in records}
    for w in sorted({r["workload"] for r in records}):
        for base, v in [("baseline", v) for v in ("optimized", "shared", "async")] + [
            ("sync", "async-k1"),
            ("sync", "async-k2"),
            ("async-k1", "async-k2"),
        ]:
            if (w, base) in by and (w, v) in by:
                print(f"{w}: {base} / {v} = {by[(w, base)] / by[(w, v)]:.2f}x")
    r2 = {r["variant"]: r for r in records if r["workload"] == "R2"}
    if "sync" in r2:
        c = r2_ceiling(r2)
        print(
            f"R2 ceiling (sync's decode steps at full occupancy, the rest as measured): {c['ceiling']:.2f}x; "
            + " ".join(
                f"{v}: window {w:.0f} decode steps -> longest consumable ~{m:.0f}" for v, (w, m) in c["windows"].items()
            )
        )
    for r in records:
        if r["workload"] == "R2":
            pred = r.get("predicted_seconds_per_step")
            stages = " ".join(f"{k}={v:.3f}" for k, v in r.get("predicted_stages_s", {}).items() if v >= 0.0005)
            print(
                f"R2 {r['variant']:9s} staleness_max {r['staleness_max']:.0f} occupancy {r['occupancy']:.2f} "
                f"requeued {r['requeued']:.0f} dropped {r['dropped']:.0f} response tokens/step "
                f"{r['response_tokens_per_step']:.0f} GFLOP/step {r['flops_per_step'] / 1e9:.1f}"
                + (f" predicted {pred:.3f}s ({r['prediction_error']:+.0%}: {stages})" if pred is not None else "")
            )
    for a, b in (("sync", "async-k1"), ("sync", "async-k2")):
        if a in r2 and b in r2 and r2[a].get("predicted_seconds_per_step"):
            meas = r2[a]["seconds_per_step"] / r2[b]["seconds_per_step"]
            pred = r2[a]["predicted_seconds_per_step"] / r2[b]["predicted_seconds_per_step"]
            print(f"R2 {a}/{b}: measured {meas:.2f}x, predicted {pred:.2f}x ({pred / meas - 1:+.0%})")
    if "async-k1" in r2 and "async-k2" in r2:  # k2 consumes longer responses (fewer re-queued): more work
        k1, k2 = r2["async-k1"], r2["async-k2"]
        per = [r["seconds_per_step"] / r["flops_per_step"] * 1e9 for r in (k1, k2)]
        print(
            f"R2 async-k1/async-k2: {k1['seconds_per_step'] / k2['seconds_per_step']:.2f}x per step, "
            f"{per[0] / per[1]:.2f}x per GFLOP of the step ({per[0] * 1e3:.1f} / {per[1] * 1e3:.1f} ms per GFLOP)"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the records (a JSON list) here")
    ap.add_argument("--workloads", default=",".join(R1_NAMES), help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="those that apply to each workload run")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per pipeline (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (the first compiles)")
    ap.add_argument("--run-dir", default="/tmp/rpeg_bench_r1")
    ap.add_argument("--override", action="append", default=[], help="extra key=value for every pipeline")
    ap.add_argument(
        "--hardware",
        default=None,
        help="R2's cost-model profile: a YAML path (used as is) or a profile name (its calibrated copy, "
        "calibrated now when missing); default cpu on a CPU, h200 on a GPU",
    )
    ap.add_argument(
        "--profile-max-age-h",
        type=float,
        default=12.0,
        help="R2 with a profile name: recalibrate its cached copy when older than this (hours; 0 = always)",
    )
    args = ap.parse_args(argv)
    workloads, variants = args.workloads.split(","), args.variants.split(",")
    for name, known in ((workloads, WORKLOADS), (variants, VARIANTS)):
        bad = [n for n in name if n not in known]
        if bad:
            raise SystemExit(f"unknown {bad}; known: {', '.join(known)}")
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("--steps and --warmup must be >= 1 (the first step compiles)")
    hw = args.hardware or ("h200" if jax.default_backend() == "gpu" else "cpu")
    if hw.endswith((".yaml", ".yml")) and not os.path.isfile(hw):
        raise SystemExit(f"--hardware {hw}: file not found")
    profile = None
    if "R2" in workloads:  # first: calibrating loads the machine
        profile = hw if hw.endswith((".yaml", ".yml")) else calibrated_profile(hw, args.profile_max_age_h)
    rate = MatmulRate()
    print(
        f"matmul rate {rate.measure() / 1e9:.1f} GFLOP/s on {jax.devices()[0].device_kind}; "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    pipes, compile_s = [], {}
    for w in workloads:
        for v in variants:
            if v in ONLY and w not in ONLY[v]:
                continue
            t0 = time.perf_counter()
            p = Pipeline(w, v, os.path.join(args.run_dir, f"{w}-{v}"), args.warmup + args.steps, args.override)
            for i in range(args.warmup):
                rec = p.step()
                if i == 0:
                    compile_s[(w, v)] = rec["wall_s"]
            print(
                f"built {w} {v}: {time.perf_counter() - t0:.1f}s (first step {compile_s[(w, v)]:.1f}s), "
                f"stages {p.stages}",
                flush=True,
            )
            pipes.append(p)
    paired: dict[tuple, list[float]] = {(p.workload, p.variant): [] for p in pipes}
    loads = []
    for i in range(args.steps):
        r = rate.measure()
        loads.append(os.getloadavg()[0])
        for p in pipes:
            rec = p.step()
            p.records.append(rec)
            paired[(p.workload, p.variant)].append(r)
            print(
                f"round {i + 1}: {p.workload} {p.variant:9s} {rec['step_s']:.3f}s "
                f"({rec['flops'] / rec['step_s'] / 1e9:.1f} GFLOP/s useful; matmul {r / 1e9:.1f})",
                flush=True,
            )
    rate.measure()
    best = max(rate.samples)
    records = [summarise(p, compile_s[(p.workload, p.variant)], best, paired[(p.workload, p.variant)]) for p in pipes]
    if profile is not None:
        drift = profile_drift(profile)
        for p, rec in zip(pipes, records):
            if p.workload == "R2":
                rec["predicted_seconds_per_step"], rec["predicted_stages_s"] = predicted_step_s(p, profile)
                rec["prediction_error"] = rec["predicted_seconds_per_step"] / rec["seconds_per_step"] - 1.0
                rec["profile_matmul_drift"] = drift
    for rec in records:
        rec.update(matmul_samples=rate.samples, load_avg=loads)
    print(
        f"matmul rate: best {best / 1e9:.1f} GFLOP/s, median {statistics.median(rate.samples) / 1e9:.1f} "
        f"(samples {[round(s / 1e9, 1) for s in rate.samples]}); load average {loads}"
    )
    print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
