"""Where the RS update's time goes (issue 34 item 6): one actor update of RS's shape, profiled.

    python bench/update_profile.py [--preset smollm2-135m] [--batch 32] [--seq 80] [--response 48]
                                   [--group 1] [--dtype float32] [--remat dots] [--reps 3] [--keep DIR]
                                   [--products 20]

RS's update as `rpeg train` runs it: --remat none --group 4 --reps 5.

The update is bench/train_mfu.py's (the runtime's actor update: GRPO surrogate, one AdamW step,
params and optimizer state donated). After a warm-up call and --reps timed calls, two more calls
run under jax.profiler with a Perfetto trace (twice; see below); this script reads the trace's complete events of
XLA's op threads and sums their durations by class:

  dot     matrix products (XLA `dot`/`convolution` ops and the fusions that contain them: names
          with "dot", "convolution", "gemm", "matmul" or YNNPACK's "ynn")
  reduce  reductions (softmax sums, norms, the loss's token means)
  copy    copies, transposes, broadcasts, concatenates, slices, dynamic-update-slices
  elem    other fusions (elementwise: the optimizer, activations, residuals, masks)
  other   everything else

and compares against what the machine allows:
  matmul rate    measured here (float32 square products of 1024 and 2048, best of 10, the faster size)
  memory rate    measured here (a 256 MB array summed and copied, best of 5)
  ceiling        model FLOPs (train_mfu.model_flops: 3 forwards, causal attention once) / matmul rate
                 + the optimizer's bytes (params, grads, m, v read; params, m, v written: 7 x 4 B
                 per parameter) / memory rate.
The dot class's achieved rate is model FLOPs (with the remat mode's extra forward) / dot time.
Op durations overlap when XLA runs ops on several threads; the class shares are of summed op time,
the wall time is the timed calls'.

--group G builds the update as the runtime does for groups of G responses to one prompt (the prompt
runs once per group, models/prefix.py; RS's runtime uses 4), so it executes fewer FLOPs than the
plain pass the ceiling prices. "products" lists the largest matrix products, joined with the
compiled HLO by name: count per call, output = lhs . rhs shapes with contracting dims, seconds per
call and GFLOP/s from the HLO's own shapes; "product_flops" sums them. Two caveats, both measured
(bench/NOTES.md, session 32): a product sharing the cores with another runs at about half its rate
alone; Eigen's products (XLA `dot.N`, e.g. weight gradients with a transposed left operand) run
asynchronously on the thread pool and their trace time is only the launch, so their rate is not
meaningful here. The first traced call of a process faults in ~1M fresh pages (the profiler's
buffers), so the script traces twice and reads the second trace.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rpeg_jax.runtime import host_memory  # noqa: E402

host_memory.keep_freed_memory()  # as `rpeg train` does on the CPU, before JAX starts a thread
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import train_mfu as T  # noqa: E402

from rpeg_jax.config import load_config  # noqa: E402
from rpeg_jax.costmodel.shape import ModelShape  # noqa: E402
from rpeg_jax.graph.algorithms import model_dims  # noqa: E402

DOT = ("dot", "convolution", "gemm", "matmul", "ynn")
COPY = ("copy", "transpose", "broadcast", "concatenate", "slice", "dynamic-update-slice", "pad", "gather", "scatter")


def classify(name: str) -> str:
    n = name.lower()
    if any(k in n for k in DOT):
        return "dot"
    if "reduce" in n:
        return "reduce"
    if any(k in n for k in COPY):
        return "copy"
    if "fusion" in n or "add" in n or "multiply" in n:
        return "elem"
    return "other"


def op_events(trace_dir: str) -> list[tuple[str, float]]:
    """(name, seconds) of the trace's complete events on XLA's op threads (not Python/runtime)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise SystemExit(f"no perfetto trace under {trace_dir}")
    with gzip.open(paths[0], "rt") as fh:
        tr = json.load(fh)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    threads = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        tname = threads.get((e.get("pid"), e.get("tid")), "")
        if "python" in tname.lower() or "pjrt" in tname.lower() and "xla" not in tname.lower():
            continue
        name = e.get("name", "")
        if name.startswith(("PjitFunction", "ThunkExecutor", "Execute", "$")) or "::" in name:
            continue
        out.append((name, e["dur"] * 1e-6))
    return out


def _dims(shape: str) -> list[int]:
    """[2560, 576] of "f32[2560,576]"."""
    return [int(x) for x in re.findall(r"\d+", shape.split("[", 1)[1])]


def hlo_products(hlo: str) -> dict[str, tuple[str, str, str, float]]:
    """{op name: (output shape, "lhs . rhs", contracting dims, FLOPs)} for the compiled HLO's products:
    top-level `dot`s and the fusions whose computation holds one (by the fusion's name)."""
    shapes, calls, dots, comp = {}, {}, {}, None
    for line in hlo.splitlines():
        head = re.match(r"%?([\w.\-]+) .*\{$", line)
        if head:
            comp = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+\[[\d,]*\])", line)
        if not m:
            continue
        name, shape = m.groups()
        shapes[name] = shape
        c = re.search(r"calls=%?([\w.\-]+)", line)
        if c:
            calls[name] = c.group(1)
        if " dot(" in line:
            dots.setdefault(comp, []).append((name, line))
            dots[name] = [(name, line)]
    out = {}
    for name in set(calls) | {n for n in dots if n.startswith("dot")}:
        for _, line in dots.get(calls.get(name, name), []):
            d = re.search(r"= (\w+\[[\d,]*\])\S* dot\(%?([\w.\-]+), %?([\w.\-]+)\)", line)
            lc = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
            rc = re.search(r"rhs_contracting_dims=\{([\d,]*)\}", line)
            if not (d and lc and rc):
                continue
            lhs = _dims(shapes.get(d.group(2), "x[]"))
            k = int(np.prod([lhs[int(i)] for i in lc.group(1).split(",") if i])) if lhs else 0
            flops = 2.0 * k * float(np.prod(_dims(d.group(1))))
            operands = f"{shapes.get(d.group(2), '?')} . {shapes.get(d.group(3), '?')}"
            out[name] = (d.group(1), operands, f"lc{{{lc.group(1)}}} rc{{{rc.group(1)}}}", flops)
    return out


def measured_rates(reps: int = 10) -> tuple[float, float]:
    """(float32 matmul FLOP/s, memory bytes/s): the best of `reps` square products of 1024 and of 2048
    (the faster size counts: on a shared VM one short product is easily slowed, which would lower
    the ceiling and flatter what is compared with it), and a 256 MB scale-and-copy."""
    rate = 0.0
    mm = jax.jit(lambda x: x @ x)
    for n in (1024, 2048):
        a = jnp.ones((n, n), jnp.float32)
        mm(a).block_until_ready()
        rate = max(rate, 2 * n**3 / min(_time(lambda: mm(a).block_until_ready()) for _ in range(reps)))
    big = jnp.ones((64 * 1024 * 1024,), jnp.float32)  # 256 MB
    cp = jax.jit(lambda x: x * 1.0001)
    cp(big).block_until_ready()
    bw = 2 * big.nbytes / min(_time(lambda: cp(big).block_until_ready()) for _ in range(5))
    return rate, bw


def timed_call(call) -> tuple[float, int]:
    """(seconds, minor page faults) of one call(); a call that faults in fresh host memory is
    seconds slower on a VM (bench/NOTES.md, session 32)."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = _time(call)
    return t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def _time(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=80)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--group", type=int, default=1, help="responses per prompt sharing one prompt pass (RS: 4)")
    ap.add_argument("--products", type=int, default=20, help="largest products to list")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--remat", default="dots", choices=("none", "dots", "full"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", default=None, help="keep the trace in this folder")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    cfg = load_config(None, T.overrides(args.preset, "xla", args.remat, 1, args.dtype))
    b, s, r = args.batch, args.seq, args.response
    ms = ModelShape.of(model_dims(cfg.model, "actor"))
    flops = T.model_flops(ms, b, s, r)
    fwd1 = flops / 3.0
    executed = flops + (fwd1 if args.remat == "full" else 0.0)
    n_params = cfg.model.num_params()
    f, params, opt = T.build(cfg, args.group)
    batch = T.make_batch(b, s, r, cfg.model.vocab_size)
    products = hlo_products(f.lower(params, opt, batch, jax.random.key(0)).compile().as_text())
    key = jax.random.key(0)

    def call():
        nonlocal params, opt
        params, opt, _ = f(params, opt, batch, key)
        jax.block_until_ready(params)

    t0 = time.perf_counter()
    call()
    compile_s = time.perf_counter() - t0
    times, faults = map(list, zip(*(timed_call(call) for _ in range(args.reps))))
    wall = statistics.median(times)
    d = args.keep or tempfile.mkdtemp(prefix="rpeg_update_profile_")
    for rep in ("warm", "read"):  # the first trace of a process faults in its buffers (docstring)
        jax.profiler.start_trace(os.path.join(d, rep), create_perfetto_trace=True)
        call()
        call()
        jax.profiler.stop_trace()
    ev = op_events(os.path.join(d, "read"))
    by = defaultdict(float)
    top = defaultdict(float)
    count = defaultdict(int)
    for name, sec in ev:
        by[classify(name)] += sec / 2
        top[name] += sec / 2
        count[name] += 1
    total = sum(by.values())
    pflops = sum(products[n][3] * count[n] / 2 for n in top if n in products)
    rate, bw = measured_rates()
    opt_bytes = 7 * 4 * n_params
    ceiling = flops / rate + opt_bytes / bw
    rec = {
        "preset": args.preset,
        "batch": b,
        "seq": s,
        "response": r,
        "dtype": args.dtype,
        "remat": args.remat,
        "params": int(n_params),
        "compile_s": round(compile_s, 2),
        "wall_s": round(wall, 3),
        "steps_s": [round(t, 3) for t in times],
        "page_faults": faults,
        "model_flops": flops,
        "executed_flops": executed,
        "op_seconds": {k: round(v, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
        "op_seconds_total": round(total, 3),
        # the plain pass's FLOPs; with a shared prompt (--group) the products' own (fewer) FLOPs
        "dot_rate_gflops": round((executed if args.group == 1 else pflops) / by["dot"] / 1e9, 1) if by["dot"] else None,
        "matmul_rate_gflops": round(rate / 1e9, 1),
        "memory_rate_gbs": round(bw / 1e9, 1),
        "optimizer_bytes": opt_bytes,
        "ceiling_s": round(ceiling, 3),
        "fraction_of_ceiling": round(ceiling / wall, 3),
        "top_ops": [(n, round(v, 3)) for n, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]],
        "group": args.group,
        "product_flops": pflops,
        "products": [
            {
                "op": n,
                "per_call": count[n] // 2,
                "shape": f"{products[n][0]} = {products[n][1]} {products[n][2]}",
                "seconds": round(v, 3),
                "gflops": round(products[n][3] * count[n] / 2 / v / 1e9, 1) if v else None,
            }
            for n, v in sorted(top.items(), key=lambda kv: -kv[1])
            if n in products
        ][: args.products],
        "load": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(rec, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([rec], fh, indent=1)
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    raise SystemExit(main())
