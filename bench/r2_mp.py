"""R2-MP of bench/WORKLOADS.md: R2 on 2 JAX processes, each pinned to one core (taskset's affinity, set
for each child), one CPU device each, gloo collectives; seconds per step, staleness_max and the cost
model's prediction of every variant, in one run:

    python bench/r2_mp.py [--steps 8] [--warmup 3] [--json out.json] [--variants a,b,...] [--hardware PATH]

Variants (R2's work: model T, 16 prompts x group 8, lognormal lengths median 24 clipped to [4, 256],
packed updates, page-table widths x1.25):

    colocated-sync            k = 0, step admission; each process generates and trains its half
    colocated-continuous-k1   k = 1, continuous admission; each process's engine on its half
    split-continuous-k1       1 generating process + 1 training process, continuous k = 1, decoding
                              ahead (rollout.decode_ahead, the default for split): generation of step t+1
                              overlaps the update of step t
    split-continuous-k1-turns the same taking turns (rollout.decode_ahead=false): the ceiling's basis

The ceiling of the overlap (first): decoding ahead can at best hide the shorter of generation and training,
so from the turns variant's medians, ceiling_s = step - min(gen, train side); the overlapped variant's
target is >= 80% of it (ceiling_s / its seconds per step). Also from the overlapped run's own stage times
(its work differs: at k = 1 every token is one version older, so more groups are re-queued):
max(gen, train side) + the rest.

Predictions: costmodel.pricing.predict_run for the same config on 2 devices and 2 processes, with a
CPU profile of one core as a process uses it: `rpeg calibrate --devices 1` pinned to core 0 while the
same calibration runs on the other core (cached as ~/.cache/rpeg_jax/hardware/cpu-core.yaml; ~4 min
the first time), host_cores 1, process_hosts true (a process's devices share its own cores; groups
of different processes run side by side).

Method: the variants run one after another (each its own 2-process job: a variant's processes hold
the machine's 2 cores); seconds per step = the median of timing_s/step over the steps after
`--warmup` in which no process compiled (the trainer logs "step N: compiled ..."; a packed update
meets new row counts for many steps), with the median over all measured steps beside it. Report
the load average you ran at: on a loaded machine the pinned processes share their cores with others.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from workloads import R1, WORKLOADS  # noqa: E402 (imports no JAX)

R2 = R1 + WORKLOADS["R2"]  # bench/workloads.py: model T, task add, 16 x 8, the long tail, packed updates
SYNC = ["pipeline.elide_old_forward=true", "pipeline.fuse=[forwards,advantage]"]
K1 = [
    "pipeline.staleness=1",
    "rollout.admission=continuous",
    "pipeline.proximal_from_update=true",
    "pipeline.fuse=[forwards,advantage]",
]
SPLIT = ["pipeline.placement=split", "pipeline.split_sizes=[1,1]"]
VARIANTS = {
    "colocated-sync": SYNC,
    "colocated-continuous-k1": K1,
    "split-continuous-k1": K1 + SPLIT,
    "split-continuous-k1-turns": K1 + SPLIT + ["rollout.decode_ahead=false"],
}
GEN = ("gen", "reward_fn", "reward")  # timing_s/* of the generation side (generate, the reward stage)
NOT_STAGES = ("step", "decode_ahead", "reward_fn")


def load() -> float:
    return os.getloadavg()[0]


def launch(variant: str, run_dir: str, steps: int, timeout: int) -> dict:
    """One variant as 2 processes, process i pinned to core i % cores; returns its metrics by step."""
    from rpeg_jax.runtime.distributed import free_port

    overrides = R2 + VARIANTS[variant] + [f"train.steps={steps}", f"train.run_dir={run_dir}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=1"
    port = free_port()
    cores = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(2):
        core = cores[i % len(cores)]
        cmd = ["taskset", "-c", str(core)] if _has_taskset() else []
        cmd += [sys.executable, "-m", "rpeg_jax.cli", "train", *overrides]
        cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
        pre = None if _has_taskset() else (lambda c=core: os.sched_setaffinity(0, {c}))
        log = open(os.path.join(run_dir + f".p{i}.log"), "w")
        child = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pre)
        procs.append((child, log))
    deadline = time.monotonic() + timeout
    for p, log in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            raise RuntimeError(f"{variant}: over {timeout} s") from None
        finally:
            log.close()
    bad = [i for i, (p, _) in enumerate(procs) if p.returncode]
    if bad:
        with open(run_dir + f".p{bad[0]}.log") as f:
            raise RuntimeError(f"{variant}: process {bad[0]} exited {procs[bad[0]][0].returncode}:\n{f.read()[-3000:]}")
    compiled = set()  # steps in which a process compiled a program (a shape not seen before: the trainer's line)
    for i in range(2):
        with open(run_dir + f".p{i}.log") as f:
            compiled |= {int(m) for m in re.findall(r"step (\d+): compiled ", f.read())}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = {r["step"]: r for r in map(json.loads, filter(str.strip, f))}
    for s in recs:
        recs[s]["compiled"] = s in compiled
    return recs


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


def summarise(variant: str, recs: dict, warmup: int) -> dict:
    """Medians over the measured steps in which no process compiled (a packed update of a new row count
    compiles again: ~50 s on one loaded core), all measured steps when every one compiled."""
    measured = [recs[s] for s in sorted(recs) if s > warmup]
    steps = [r for r in measured if not r["compiled"]] or measured
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steps)  # noqa: E731
    stages = sorted({k.split("/", 1)[1] for r in steps for k in r if k.startswith("timing_s/")})
    stage_s = {k: med(f"timing_s/{k}") for k in stages}
    gen = sum(v for k, v in stage_s.items() if k in GEN and k != "reward_fn")
    train = sum(v for k, v in stage_s.items() if k not in GEN and k not in NOT_STAGES)
    return {
        "variant": variant,
        "seconds_per_step": med("timing_s/step"),
        "spread": max(r["timing_s/step"] for r in steps) / min(r["timing_s/step"] for r in steps),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in steps),
        "requeued_per_step": med("rollout/requeued"),
        "gen_s": gen,
        "train_s": train,
        "stages_s": stage_s,
        "steps": len(steps),
        "steps_compiling": len(measured) - len(steps) if len(steps) < len(measured) else 0,
        "seconds_per_step_all": statistics.median(r["timing_s/step"] for r in measured),
    }


def one_core_profile(out_dir: str, profile: str | None) -> str:
    """A CPU profile of one core as a process of the run uses it (module docstring): `profile` made
    one core per process, else the cached `cpu-core` calibration, else a new one (written there).

    A new one is `rpeg calibrate --profile cpu --devices 1` pinned to core 0 while the same
    calibration runs pinned on every other core: each process of the run has a core of its own while
    the others are busy. (Dividing the 8-device fit's rates by host_cores, as this script first did,
    priced every variant 34-53% high: one pinned core runs the R2 stages ~1.3x faster than half of
    the shared 8-device host; bench/NOTES.md, session 24.)"""
    import yaml

    from rpeg_jax.costmodel.hardware import calibrated_path

    path = profile or calibrated_path("cpu-core")
    if profile is None and not os.path.exists(path):
        cores = sorted(os.sched_getaffinity(0))
        print(f"no one-core profile at {path}: `rpeg calibrate --devices 1` on each of cores {cores} (~4 min)")
        cmd = [sys.executable, "-m", "rpeg_jax.cli", "calibrate", "--profile", "cpu", "--devices", "1"]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        outs = [path] + [os.path.join(out_dir, f"cpu-core{c}.yaml") for c in cores[1:]]
        procs = [
            subprocess.Popen(["taskset", "-c", str(c), *cmd, "--out", o], cwd=ROOT, stdout=subprocess.DEVNULL)
            for c, o in zip(cores, outs)
        ]
        if any(p.wait() for p in procs):
            raise SystemExit("rpeg calibrate failed (see its output above)")
    with open(path) as f:
        hw = yaml.safe_load(f)
    n = int(hw.get("host_cores", 1))
    if profile is not None and not hw.get("process_hosts"):  # a whole-host fit given by hand: its rates / cores
        for k in ("peak_flops", "peak_flops_fp32", "memory_bw"):
            hw["device"][k] = float(hw["device"][k]) / n
    hw.update(host_cores=1, process_hosts=True, name=f"{hw['name']}-core")
    out = os.path.join(out_dir, "cpu_core.yaml")
    with open(out, "w") as f:
        yaml.safe_dump(hw, f)
    return out


def predict(variant: str, profile: str, steps: int, run_dir: str) -> float:
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel.pricing import predict_run

    cfg = load_config(None, R2 + VARIANTS[variant] + [f"train.steps={steps}", f"train.run_dir={run_dir}"])
    return float(predict_run(cfg, profile, 2, processes=2).step_time_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--hardware", default=None, help="a CPU profile YAML (default: the cached one-core fit, made when missing)"
    )
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per variant")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    work = tempfile.mkdtemp(prefix="r2_mp_")
    total = args.warmup + args.steps
    profile = one_core_profile(work, args.hardware)
    print(f"R2-MP: {len(variants)} variants x {total} steps, 2 processes pinned to one core each; load {load():.2f}")
    out = []
    for v in variants:
        before = load()
        t0 = time.time()
        recs = launch(v, os.path.join(work, v), total, args.timeout)
        rec = summarise(v, recs, args.warmup)
        rec.update(wall_s=time.time() - t0, load_before=before, load_after=load())
        rec["predicted_s"] = predict(v, profile, total, os.path.join(work, v + "-pred"))
        out.append(rec)
        err = rec["predicted_s"] / rec["seconds_per_step"] - 1
        print(
            f"{v:26s} {rec['seconds_per_step']:7.3f} s/step (spread {rec['spread']:.2f}) staleness_max "
            f"{rec['staleness_max']:.0f} requeued {rec['requeued_per_step']:.1f}  gen {rec['gen_s']:.3f} train "
            f"{rec['train_s']:.3f}  predicted {rec['predicted_s']:.3f} ({err:+.0%})"
            f"  load {before:.1f}->{rec['load_after']:.1f}",
            flush=True,
        )
    by = {r["variant"]: r for r in out}
    report = {"records": out, "load_end": load(), "profile": profile}
    turns, ahead = by.get("split-continuous-k1-turns"), by.get("split-continuous-k1")
    if turns is not None:
        ceiling = turns["seconds_per_step"] - min(turns["gen_s"], turns["train_s"])
        report["ceiling_s"] = ceiling
        print(f"ceiling (turns' step {turns['seconds_per_step']:.3f} - min(gen, train)): {ceiling:.3f} s/step")
        if ahead is not None:
            frac = ceiling / ahead["seconds_per_step"]
            own = ahead["seconds_per_step"] - ahead["gen_s"] - ahead["train_s"] + max(ahead["gen_s"], ahead["train_s"])
            report.update(ceiling_fraction=frac, own_ceiling_s=own)
            print(f"split-continuous-k1 at {frac:.0%} of the ceiling (target >= 80%); its own work's bound {own:.3f} s")
    if ahead is not None and "colocated-sync" in by:
        x = by["colocated-sync"]["seconds_per_step"] / ahead["seconds_per_step"]
        report["split_over_colocated_sync"] = x
        print(f"split-continuous-k1 vs colocated-sync: {x:.2f}x (target >= 1.3x unless the ceiling says otherwise)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
