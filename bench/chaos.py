"""Chaos trials of checkpoints and resumes: N runs interrupted at random times (kill -9, SIGINT,
SIGTERM), some with their newest checkpoint then damaged at random (one flipped bit, a truncated
or removed data file, a truncated meta item or manifest), each resumed with the same command, and
compared with one run nobody interrupted.

    python bench/chaos.py --trials 20                      # the default config, 12 steps, a checkpoint every 2
    python bench/chaos.py --trials 5 --seed 1 model.num_layers=2   # overrides go to every run

Counts printed at the end (bench/NOTES.md has a run):
  resumable     the resume exited 0 having run every step (after a damaged newest checkpoint too)
  identical     its metrics.jsonl holds each step once, every step's values (not timings) equal to the
                uninterrupted run's, and the final checkpoint's arrays equal bit for bit
  fallback used the resume reported a damaged checkpoint and resumed from the one before
  lost steps    committed steps the resume did not start from: the newest intact checkpoint's step
                minus the step it resumed from, summed over the trials (must be 0)
Also counted: tracebacks printed on SIGINT / SIGTERM, and SIGINT / SIGTERM exits with no line
(the signal's default action). Damage is done only when the run has two or more checkpoints
(with one there is nothing to fall back to: that is a one-line CheckpointCorrupt, exercised by
tests/test_run_dir.py).

Not a test (minutes, random): run it by hand. Every run is `python launch/multihost.py` in a
subprocess, as a user starts it; the XLA compilation cache is shared between them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BASE = [
    "train.steps=12",
    "train.checkpoint_every=2",
    "train.tensorboard=false",
    "train.progress=false",
]
NOT_RESULTS = ("timing_s/", "perf/", "predicted_s/", "pred_error/")
KINDS = ("kill9", "sigint", "sigterm")
DAMAGE = ("bitflip", "truncate", "remove", "meta", "manifest")


def launch(run_dir: str, overrides: list[str], env: dict) -> subprocess.Popen:
    cmd = [sys.executable, os.path.join(ROOT, "launch", "multihost.py"), *BASE, *overrides, f"train.run_dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def steps_of(run_dir: str) -> list[int]:
    d = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def records(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def results(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith(NOT_RESULTS)}


def final_arrays(run_dir: str, step: int):
    """The final checkpoint's arrays (verified first), as numpy, by path."""
    import warnings

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from rpeg_jax.runtime.checkpoint import Checkpointer

    ck = Checkpointer(os.path.join(run_dir, "checkpoints"), async_save=False)
    ck.check(step)
    with warnings.catch_warnings():  # "sharding info not provided": the run's own (one device), read back
        warnings.simplefilter("ignore", UserWarning)
        tree = ocp.PyTreeCheckpointer().restore(os.path.join(run_dir, "checkpoints", str(step), "train"))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def damage(run_dir: str, step: int, how: str, rng: random.Random) -> str:
    """Damage checkpoint `step` of `run_dir` as `how` says; returns what was done."""
    from rpeg_jax.runtime.checkpoint import MANIFEST

    step_dir = os.path.join(run_dir, "checkpoints", str(step))
    with open(os.path.join(step_dir, MANIFEST)) as f:
        files = json.load(f)
    data = sorted(r for r in files if "/d/" in r)
    target = os.path.join(step_dir, rng.choice(data))
    if how == "bitflip":
        size = os.path.getsize(target)
        at, bit = rng.randrange(size), rng.randrange(8)
        with open(target, "r+b") as f:
            f.seek(at)
            b = f.read(1)[0] ^ (1 << bit)
            f.seek(at)
            f.write(bytes([b]))
        return f"bit {bit} of byte {at} of {os.path.relpath(target, step_dir)}"
    if how == "truncate":
        size = os.path.getsize(target)
        os.truncate(target, rng.randrange(size))
        return f"{os.path.relpath(target, step_dir)} truncated"
    if how == "remove":
        os.remove(target)
        return f"{os.path.relpath(target, step_dir)} removed"
    path = os.path.join(step_dir, "meta", "metadata") if how == "meta" else os.path.join(step_dir, MANIFEST)
    os.truncate(path, os.path.getsize(path) // 2)
    return f"{os.path.relpath(path, step_dir)} truncated"


def trial(i: int, rng: random.Random, work: str, overrides: list[str], env: dict, ref: dict) -> dict:
    run_dir = os.path.join(work, f"trial{i:02d}")
    kind = rng.choice(KINDS)
    at = rng.uniform(0.5, ref["wall_s"] * 0.95)
    p = launch(run_dir, overrides, env)
    time.sleep(at)
    p.send_signal({"kill9": signal.SIGKILL, "sigint": signal.SIGINT, "sigterm": signal.SIGTERM}[kind])
    _, err = p.communicate()
    out = {"trial": i, "kind": kind, "at_s": round(at, 1), "rc": p.returncode, "committed": steps_of(run_dir)}
    if kind != "kill9" and "Traceback" in err:
        out["traceback"] = err[-2000:]
    if kind != "kill9" and p.returncode < 0:  # ended by the signal's default action: no line said so
        out["silent"] = True
    intact = out["committed"][-1] if out["committed"] else 0
    if len(out["committed"]) >= 2 and rng.random() < 0.5:
        how = rng.choice(DAMAGE)
        out["damage"] = f"{how}: step {intact}: " + damage(run_dir, intact, how, rng)
        intact = out["committed"][-2]
    r = launch(run_dir, overrides, env)
    _, err = r.communicate()
    m = re.search(r"resumed from step (\d+)", err)
    resumed = int(m[1]) if m else 0
    recs = records(run_dir)
    steps = [rec["step"] for rec in recs]
    want_steps = sorted(ref["records"])
    out.update(
        resume_rc=r.returncode,
        resumed_from=resumed,
        fallback="is damaged" in err,
        lost=max(0, intact - resumed),
        resumable=r.returncode == 0 and steps_of(run_dir)[-1:] == [want_steps[-1]],
    )
    same = out["resumable"] and steps == want_steps
    if same:
        same = all(results(rec) == results(ref["records"][rec["step"]]) for rec in recs)
    if same:
        import numpy as np

        got = final_arrays(run_dir, want_steps[-1])
        same = got.keys() == ref["arrays"].keys() and all(np.array_equal(got[k], ref["arrays"][k]) for k in got)
    out["identical"] = bool(same)
    if r.returncode != 0:
        out["resume_error"] = err.strip().splitlines()[-1] if err.strip() else ""
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="where the runs go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write every trial's record here")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="rpeg_chaos_")
    os.makedirs(work, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "xla_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "RPEG_CACHE": os.path.join(work, "rpeg_cache"),  # the shipped hardware profile, whatever ~/.cache holds
    }
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    ref_dir = os.path.join(work, "uninterrupted")
    shutil.rmtree(ref_dir, ignore_errors=True)
    launch(ref_dir, args.overrides, env).communicate()  # fills the compilation cache
    shutil.rmtree(ref_dir)
    t1 = time.perf_counter()
    r = launch(ref_dir, args.overrides, env)
    _, err = r.communicate()
    if r.returncode != 0:
        print(err[-3000:], file=sys.stderr)
        return 1
    wall = time.perf_counter() - t1
    last = steps_of(ref_dir)[-1]
    ref = {
        "wall_s": wall,
        "records": {rec["step"]: rec for rec in records(ref_dir)},
        "arrays": final_arrays(ref_dir, last),
    }
    print(f"uninterrupted: {last} steps in {wall:.1f} s (warm compilation cache); {args.trials} trials", flush=True)
    trials = []
    for i in range(args.trials):
        t = trial(i, rng, work, args.overrides, env, ref)
        trials.append(t)
        print(
            f"trial {i:2d}: {t['kind']:7s} at {t['at_s']:5.1f} s rc={t['rc']:4d} committed={t['committed']} "
            f"{t.get('damage', 'no damage')} -> resumed from {t['resumed_from']}, rc={t['resume_rc']}, "
            f"fallback={t['fallback']}, identical={t['identical']}, lost={t['lost']}"
            + (f" ({t['resume_error']})" if "resume_error" in t else "")
            + (" [traceback on the signal]" if "traceback" in t else "")
            + (" [ended by the signal without a line]" if "silent" in t else ""),
            flush=True,
        )
    n = len(trials)
    counts = {
        "trials": n,
        "resumable": sum(t["resumable"] for t in trials),
        "identical": sum(t["identical"] for t in trials),
        "fallback_used": sum(t["fallback"] for t in trials),
        "damaged": sum("damage" in t for t in trials),
        "lost_steps": sum(t["lost"] for t in trials),
        "tracebacks_on_a_signal": sum("traceback" in t for t in trials),
        "silent_signal_exits": sum("silent" in t for t in trials),
        "by_kind": {k: sum(t["kind"] == k for t in trials) for k in KINDS},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(
        f"resumable {counts['resumable']}/{n}, identical {counts['identical']}/{n}, fallback used "
        f"{counts['fallback_used']} (of {counts['damaged']} damaged), lost steps {counts['lost_steps']} (must be 0); "
        f"tracebacks on a signal {counts['tracebacks_on_a_signal']}, silent signal exits "
        f"{counts['silent_signal_exits']}; kinds {counts['by_kind']}; "
        f"{math.ceil(counts['wall_s'])} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "trials": trials}, f, indent=1)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if counts["lost_steps"] == 0 and counts["resumable"] == n and counts["identical"] == n else 1


if __name__ == "__main__":
    sys.exit(main())
