"""RS's actor update (or another preset's) in several variants, calls alternated in one process.

    python bench/update_variants.py "" "model.scan_layers=false" "opt:xla_cpu_experimental_ynn_fusion_type="
        [--preset smollm2-135m] [--batch 32] [--seq 80] [--response 48] [--group 4] [--reps 5]

Each positional argument is one variant: space-separated config overrides on top of
bench/train_mfu.overrides (remat none, lr 1e-6, no KL), and `opt:<XLA option>=<value>` for a
per-program compiler option; "" is the baseline. Every variant is built and compiled first, then the
timed calls go round-robin (variant 1, 2, ..., 1, 2, ...), so machine drift hits all of them alike;
the median, the minimum and every call are printed, with the page faults of each call (a call that
faults in fresh host memory is seconds slower: bench/NOTES.md, session 32). --group 4 is the update
as `rpeg train` runs RS (the prompt shared per group of 4 responses, bench/train_mfu.build).
Session 32 used it for unrolled layers, no LM-head recompute, oneDNN dots and micro-batches.
Time it alone: nothing else may run on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rpeg_jax.runtime import host_memory  # noqa: E402

host_memory.keep_freed_memory()  # as `rpeg train` does on the CPU, before JAX starts a thread
import jax  # noqa: E402
import train_mfu as T  # noqa: E402
import update_profile as U  # noqa: E402

from rpeg_jax.config import load_config  # noqa: E402


def build(variant: str, args):
    """A call() running one update of this variant (compiled by a first call)."""
    parts = variant.split()
    opts = dict(p[4:].split("=", 1) for p in parts if p.startswith("opt:"))
    over = [p for p in parts if not p.startswith("opt:")]
    cfg = load_config(None, T.overrides(args.preset, "xla", "none", 1, "float32") + over)
    f, params, opt = T.build(cfg, args.group, opts)
    state = [params, opt]
    batch = T.make_batch(args.batch, args.seq, args.response, cfg.model.vocab_size)
    key = jax.random.key(0)

    def call():
        state[0], state[1], _ = f(state[0], state[1], batch, key)
        jax.block_until_ready(state[0])

    call()
    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help='space-separated overrides per variant; "" = baseline')
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=80)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    calls = [build(v, args) for v in args.variants]
    times = [[] for _ in calls]
    faults = [[] for _ in calls]
    for _ in range(args.reps):
        for i, call in enumerate(calls):
            t, n = U.timed_call(call)
            times[i].append(t)
            faults[i].append(n)
    for v, ts, fs in zip(args.variants, times, faults):
        print(
            f"{v or '(baseline)'!s:60s} median {statistics.median(ts):.3f} s  min {min(ts):.3f} s  "
            f"calls {[round(t, 2) for t in ts]}  faults {fs}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
