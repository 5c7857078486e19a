"""`rpeg calibrate [--profile cpu|h200|...] [--out PATH] [--quick]`: measure this machine, fit the
profile's efficiency factors, save the fitted profile (reused by `load_hardware(name)`).

Micro-benchmarks (each a few hundred ms; the whole run well under a minute on CPU):
  matmul      FLOP/s of square matmuls of several sizes      -> peak (CPU) and the matmul table
  memory      bytes/s of y = x * 2 + 1 over several sizes   -> memory_bw (CPU) and the memory table
  dispatch    one jitted call on a tiny array               -> efficiency.dispatch_s
  layers      a jitted scan over L tiny layers, two L values -> efficiency.layer_s (slope)
  loop        a while_loop of trivial steps                 -> efficiency.decode_step_s
  all-reduce  psum over all local devices, several sizes     -> node.link_bw and the intra_node table
On a CPU profile the measured rates replace the peaks; on an accelerator the nominal peak stays
and the tables become measured / nominal. JAX is imported inside the functions only, so
importing this module (and `rpeg plan`) never initialises a device.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

from rpeg_jax.costmodel.hardware import (HardwareProfile, calibrated_path, load_hardware, save_hardware,
                                         with_nodes)


def add_arguments(p) -> None:
    p.add_argument("--profile", default=None, help="base profile to fit (default: cpu on CPU, h200 on GPU)")
    p.add_argument("--out", default=None, help="where to save (default ~/.cache/rpeg_jax/hardware/<profile>.yaml)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (tests)")
    p.add_argument("--devices", type=int, default=8, help="forced CPU devices for the collective benchmark")


def _timeit(fn, *args, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn(*args) (blocking on the result)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_matmul(dtype: str, sizes, repeats: int) -> list[tuple[float, float]]:
    """[(FLOPs of one matmul, FLOP/s)] on the first device."""
    import jax
    import jax.numpy as jnp

    out = []
    f = jax.jit(lambda a, b: a @ b)
    for n in sizes:
        a = jnp.ones((n, n), dtype) * 0.5
        sec = _timeit(f, a, a, repeats=repeats)
        out.append((2.0 * n ** 3, 2.0 * n ** 3 / sec))
    return out


def bench_memory(sizes_bytes, repeats: int) -> list[tuple[float, float]]:
    """[(bytes touched, bytes/s)] of an elementwise pass (read + write) over float32 arrays."""
    import jax
    import jax.numpy as jnp

    out = []
    f = jax.jit(lambda x: x * 2.0 + 1.0)
    for nb in sizes_bytes:
        x = jnp.ones((int(nb) // 4,), jnp.float32)
        sec = _timeit(f, x, repeats=repeats)
        out.append((2.0 * nb, 2.0 * nb / sec))
    return out


def bench_overheads(repeats: int) -> dict[str, float]:
    """dispatch_s, layer_s (per scanned layer), decode_step_s (per while-loop step)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((8, 64), jnp.float32)
    w = jnp.ones((64, 64), jnp.float32) * 0.01
    dispatch = _timeit(jax.jit(lambda v: v + 1.0), x, repeats=max(repeats, 20))

    def scan(ws, v):
        return jax.lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), v, ws)[0]

    f = jax.jit(scan)
    t8 = _timeit(f, jnp.stack([w] * 8), x, repeats=repeats)
    t64 = _timeit(f, jnp.stack([w] * 64), x, repeats=repeats)
    layer = max((t64 - t8) / 56.0, 0.0)
    loop = jax.jit(lambda v, n: jax.lax.fori_loop(0, n, lambda i, c: c * 0.999 + 0.001, v))
    l16 = _timeit(loop, x, 16, repeats=repeats)
    l272 = _timeit(loop, x, 272, repeats=repeats)
    return {"dispatch_s": dispatch, "layer_s": layer, "decode_step_s": max((l272 - l16) / 256.0, 0.0)}


def bench_allreduce(sizes_bytes, repeats: int) -> list[tuple[float, float, int]]:
    """[(bytes, seconds, devices)] of a psum over all local devices (shard_map)."""
    import jax
    import jax.numpy as jnp

    devs = jax.local_devices()
    n = len(devs)
    if n < 2:
        return []
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=jax.P("data"),
                              out_specs=jax.P("data")))
    out = []
    for nb in sizes_bytes:
        per = max(int(nb) // 4, 1)
        x = jax.device_put(jnp.ones((n * per,), jnp.float32), jax.NamedSharding(mesh, jax.P("data")))
        out.append((float(per * 4), _timeit(f, x, repeats=repeats), n))
    return out


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
    device = dataclasses.replace(base.device, peak_flops=peak, peak_flops_fp32=peak if cpu else base.device.peak_flops_fp32,
                                 memory_bw=bw)
    eff = dataclasses.replace(base.efficiency, matmul=_monotone_table([(s, r / peak) for s, r in mm]),
                              memory=_monotone_table([(s, r / bw) for s, r in mem]), **ov)
    node = base.node
    if ar:
        n = ar[0][2]
        busbw = [(s, 2.0 * (n - 1) / n * s / sec) for s, sec, _ in ar]
        link = max(b for _, b in busbw) if cpu else base.node.link_bw
        node = dataclasses.replace(base.node, link_bw=link, latency_s=min(sec for _, sec, _ in ar) / (2 * (n - 1)))
        eff = dataclasses.replace(eff, intra_node=_monotone_table([(s, b / float(base.node_bw(n) if not cpu else link))
                                                                   for s, b in busbw]))
    calibrated = {"time": time.time(), "matmul_peak_measured": max(r for _, r in mm),
                  "memory_bw_measured": max(r for _, r in mem)}
    return with_nodes(base, device=device, efficiency=eff, node=node, calibrated=calibrated)


def measure(dtype: str, quick: bool, accelerator: bool = False) -> dict:
    reps = 3 if quick else 7
    if accelerator:  # big enough to reach the tensor-core and HBM plateaus
        mm_sizes = (256, 1024, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
        mem_sizes = (1 << 20, 1 << 26) if quick else (1 << 16, 1 << 20, 1 << 24, 1 << 28, 1 << 30)
        ar_sizes = (1 << 16, 1 << 24) if quick else (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28)
    else:
        mm_sizes = (64, 256, 512) if quick else (64, 128, 256, 512, 1024, 2048)
        mem_sizes = (1 << 16, 1 << 20, 1 << 24) if quick else (1 << 14, 1 << 16, 1 << 20, 1 << 24, 1 << 26)
        ar_sizes = (1 << 12, 1 << 16, 1 << 20) if quick else (1 << 10, 1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
    return {"matmul": bench_matmul(dtype, mm_sizes, reps), "memory": bench_memory(mem_sizes, reps),
            "overheads": bench_overheads(reps), "allreduce": bench_allreduce(ar_sizes, reps)}


def run(args) -> int:
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax

    on_gpu = jax.default_backend() == "gpu"
    name = args.profile or ("h200" if on_gpu else "cpu")
    base = load_hardware(name, calibrated=False)
    meas = measure("float32" if base.kind == "cpu" else "bfloat16", args.quick, accelerator=base.kind != "cpu")
    prof = fit(base, meas)
    path = save_hardware(prof, args.out or calibrated_path(name))
    d, e = prof.device, prof.efficiency
    print(f"calibrated {name} on {jax.default_backend()} ({len(jax.local_devices())} devices): "
          f"peak {d.peak_flops / 1e9:.1f} GFLOP/s, memory {d.memory_bw / 1e9:.1f} GB/s, "
          f"dispatch {e.dispatch_s * 1e6:.0f} us, layer {e.layer_s * 1e6:.1f} us, "
          f"loop step {e.decode_step_s * 1e6:.1f} us, link {prof.node.link_bw / 1e9:.2f} GB/s -> {path}")
    return 0
