"""Calibration: the measurements behind `rpeg calibrate` (JAX). The fits are pure Python and live in
the cost model (costmodel/microfit.py for these micro-benchmarks and the synthetic decoder,
costmodel/fit.py for stage points of the real code); this package measures.

Micro-benchmarks (each a few hundred ms; all of them well under a minute on CPU):
  matmul      FLOP/s of square matmuls of several sizes      -> peak (CPU) and the matmul table
  memory      bytes/s of y = x * 2 + 1 over several sizes   -> memory_bw (CPU) and the memory table
  dispatch    one jitted call on a tiny array               -> efficiency.dispatch_s
  layers      a jitted scan over L tiny layers, two L values -> efficiency.layer_s (slope)
  loop        a while_loop of trivial steps                 -> efficiency.decode_step_s
  all-reduce  psum over all local devices, several sizes     -> node.link_bw and the intra_node table
  kv attend   the CPU chunk attention's products over dense KV -> efficiency.kv_attend_bw
and a synthetic dense decoder (pure jnp, forward and train step, 1 and 8 devices, a few depths and
batch shapes) whose times costmodel/microfit.fit_stages fits.
"""

from __future__ import annotations

import math
import statistics
import time

from rpeg_jax.costmodel.microfit import STAGE_SHAPES, SYN

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def set_clock(name: str) -> None:
    """wall: elapsed seconds (a quiet machine). cpu: this process's CPU seconds, which other
    processes' load barely changes; a profile fitted on it predicts core-seconds (host_cores=1)."""
    global _clock
    _clock = CLOCKS[name]


def _timeit(fn, *args, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn(*args) (blocking on the result) on the chosen clock."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = _clock()
        jax.block_until_ready(fn(*args))
        times.append(_clock() - t)
    return statistics.median(times)


CPU_LOOP_WORK = 2e8  # on a CPU: FLOPs (or bytes) per timed call; the CPU profile's tables were fitted so
CALL_TARGET_S = 0.02  # on an accelerator: a timed call lasts about this long (a 0.1-0.2 ms dispatch: ~1-2%)
MAX_LOOP = 4096


def _looped_rate(make, args, work: float, repeats: int, accelerator: bool) -> float:
    """work / second of `make(k)` (a jitted function doing `work` k times in one call) on `args`.
    On a CPU k is min(256, CPU_LOOP_WORK / work) as the CPU profile was calibrated (a 64 MB pass runs
    once: its page faults are part of what the decode step sees). On an accelerator k is sized from a
    first timing at k = 1 so that one call lasts CALL_TARGET_S: the CPU's fixed work target left one
    4096^2 bf16 matmul (0.2 ms) per call on an H200, timing the dispatch (calibrate read 200 TFLOP/s
    and 571 GB/s there against 694 TFLOP/s and 3.67 TB/s measured by bench/generate.py; NOTES.md)."""
    if not accelerator:
        k = int(min(256, max(1, CPU_LOOP_WORK // max(work, 1.0))))
        return k * work / _timeit(make(k), *args, repeats=repeats)
    sec = _timeit(make(1), *args, repeats=repeats)
    k = int(min(MAX_LOOP, max(1, math.ceil(CALL_TARGET_S / max(sec, 1e-9)))))
    if k > 1:
        sec = _timeit(make(k), *args, repeats=repeats)
    return k * work / sec


def bench_matmul(dtype: str, sizes, repeats: int, accelerator: bool = False) -> list[tuple[float, float]]:
    """[(FLOPs of one matmul, FLOP/s)] on the first device; small sizes repeat inside one call."""
    import jax
    import jax.numpy as jnp

    out = []
    for n in sizes:

        def make(k):
            return jax.jit(lambda a, b: jax.lax.fori_loop(0, k, lambda i, x: (x @ b) * 0.5, a))

        a = jnp.ones((n, n), dtype) * 0.5
        out.append((2.0 * n**3, _looped_rate(make, (a, a), 2.0 * n**3, repeats, accelerator)))
    return out


def bench_memory(sizes_bytes, repeats: int, accelerator: bool = False) -> list[tuple[float, float]]:
    """[(bytes touched, bytes/s)] of an elementwise pass (read + write) over float32 arrays."""
    import jax
    import jax.numpy as jnp

    out = []
    for nb in sizes_bytes:

        def make(k):
            return jax.jit(lambda x: jax.lax.fori_loop(0, k, lambda i, y: y * 0.999 + 0.001, x))

        x = jnp.ones((int(nb) // 4,), jnp.float32)
        out.append((2.0 * nb, _looped_rate(make, (x,), 2.0 * nb, repeats, accelerator)))
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


def attend_dense_t(q, kt, v, kv_len):
    """sampling/chunk_attention.attend_dense_t in plain jnp (costmodel imports no sampler code;
    tests/test_costmodel_calibrate.py checks they agree): one query per slot, q [B, H, E] over keys
    transposed kt [K, B, E, C] and values v [K, B, C, E], columns >= kv_len masked."""
    import jax.numpy as jnp

    b, h, e = q.shape
    kh, c = kt.shape[0], kt.shape[3]
    qg = q.reshape(b, kh, h // kh, e).swapaxes(0, 1)
    s = jnp.einsum("kbge,kbec->kbgc", qg, kt, preferred_element_type=jnp.float32) * (e**-0.5)
    s = jnp.where((jnp.arange(c)[None, :] < kv_len[:, None])[None, :, None, :], s, -1e30)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o = jnp.einsum("kbgc,kbce->kbge", p, v, preferred_element_type=jnp.float32) / jnp.sum(p, -1, keepdims=True)
    return jnp.where(kv_len[None, :, None, None] > 0, o, 0.0).swapaxes(0, 1).reshape(b, h, e)


KV_ATTEND_SHAPE = dict(B=128, K=2, H=4, E=64, L=4)  # model T's decode at R2's 128 slots
KV_ATTEND_WIDTHS = (64, 256)  # key columns: the slope between them excludes the per-step fixed cost


def bench_kv_attend(repeats: int, shape=KV_ATTEND_SHAPE, widths=KV_ATTEND_WIDTHS, steps: int = 16) -> float:
    """Bytes of cached K and V per second of a decode step's attention over dense per-layer buffers,
    as the CPU sampler runs it (sampling/chunk_attention.py: every step writes one column per slot in
    place, then two batched products), in a while loop of `steps` steps: the slope of the step's
    time over the key widths (its fixed part is the decode_step_s / decode_layer_s overheads')."""
    import jax
    import jax.numpy as jnp

    B, K, H, E, L = (shape[k] for k in "BKHEL")
    rows = jnp.arange(B)

    def per_step(c: int) -> float:
        kt = tuple(jnp.full((K, B, E, c), 0.01, jnp.float32) for _ in range(L))
        v = tuple(jnp.full((K, B, c, E), 0.01, jnp.float32) for _ in range(L))
        q, kv_len = jnp.full((B, H, E), 0.1, jnp.float32), jnp.full((B,), c, jnp.int32)

        def body(i, carry):
            q, kt, v = carry
            col = jnp.full((B,), i % c, jnp.int32)
            kt = tuple(x.at[:, rows, :, col].set(0.0, mode="drop") for x in kt)
            v = tuple(x.at[:, rows, col].set(0.0, mode="drop") for x in v)
            for layer in range(L):
                q = q + 1e-3 * attend_dense_t(q, kt[layer], v[layer], kv_len)
            return q, kt, v

        f = jax.jit(lambda q, kt, v: jax.lax.fori_loop(0, steps, body, (q, kt, v))[0])
        return _timeit(f, q, kt, v, repeats=repeats) / steps

    lo, hi = (per_step(c) for c in widths)
    nbytes = [2.0 * L * K * B * c * E * 4 for c in widths]
    return (nbytes[1] - nbytes[0]) / max(hi - lo, 1e-9)


def bench_allreduce(sizes_bytes, repeats: int) -> list[tuple[float, float, int]]:
    """[(bytes, seconds, devices)] of a psum over all local devices (shard_map)."""
    import jax
    import jax.numpy as jnp

    devs = jax.local_devices()
    n = len(devs)
    if n < 2:
        return []
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = jax.jit(
        jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))
    )
    out = []
    for nb in sizes_bytes:
        per = max(int(nb) // 4, 1)
        x = jax.device_put(jnp.ones((n * per,), jnp.float32), jax.NamedSharding(mesh, jax.P("data")))
        out.append((float(per * 4), _timeit(f, x, repeats=repeats), n))
    return out


# ---- stage-level fit on a synthetic decoder (pure jnp; costmodel imports no model code) --------
def _synthetic_fns(L: int, B: int, T: int, n: int, D: int):
    """(forward fn, train fn, params, tokens) of a dense decoder, batch sharded over n devices."""
    import jax
    import jax.numpy as jnp

    H, F, V = SYN["H"], 3 * D, SYN["V"]
    E = D // H
    ks = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    w = lambda *sh: jax.random.normal(next(ks), sh, jnp.float32) * 0.02  # noqa: E731
    params = {
        "embed": w(V, D),
        "head": w(D, V),
        "norm": jnp.ones((D,)),
        "layers": {
            "wq": w(L, D, D),
            "wk": w(L, D, D),
            "wv": w(L, D, D),
            "wo": w(L, D, D),
            "wg": w(L, D, F),
            "wu": w(L, D, F),
            "wd": w(L, F, D),
            "n1": jnp.ones((L, D)),
            "n2": jnp.ones((L, D)),
        },
    }
    mask = jnp.tril(jnp.ones((T, T), bool))

    def rms(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

    def layer(x, p):
        h = rms(x, p["n1"])
        q, k, v = ((h @ p[n]).reshape(B // n_dev, T, H, E) for n in ("wq", "wk", "wv"))
        s = jnp.einsum("bthe,bshe->bhts", q, k) / jnp.sqrt(E)
        a = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
        x = x + jnp.einsum("bhts,bshe->bthe", a, v).reshape(x.shape) @ p["wo"]
        h = rms(x, p["n2"])
        return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"], None

    n_dev = n

    def loss(p, tok):
        x = jnp.take(p["embed"], tok, axis=0)
        x, _ = jax.lax.scan(layer, x, p["layers"])
        logits = rms(x, p["norm"]) @ p["head"]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tok[..., None], -1)[..., 0])

    def train(p, tok):  # gradients + an Adam step (params, m, v read, written: as the model counts)
        g = jax.grad(loss)(p, tok)
        m = jax.tree.map(lambda x: 0.1 * x, g)
        v = jax.tree.map(lambda x: 0.001 * x * x, g)
        return jax.tree.map(lambda a, mm, vv: a - 1e-3 * mm / (jnp.sqrt(vv) + 1e-8), p, m, v)

    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))
    tok = jax.device_put(jnp.ones((B, T), jnp.int32), jax.NamedSharding(mesh, jax.P("data")))
    rep = jax.NamedSharding(mesh, jax.P())
    params = jax.device_put(params, rep)
    fwd = jax.jit(
        jax.shard_map(
            lambda p, t: jax.lax.pmean(loss(p, t), "data"),
            mesh=mesh,
            in_specs=(jax.P(), jax.P("data")),
            out_specs=jax.P(),
        )
    )
    trn = jax.jit(
        jax.shard_map(
            lambda p, t: jax.tree.map(lambda a: jax.lax.pmean(a, "data"), train(p, t)),
            mesh=mesh,
            in_specs=(jax.P(), jax.P("data")),
            out_specs=jax.P(),
        )
    )
    return fwd, trn, params, tok


def bench_stages(repeats: int, shapes=STAGE_SHAPES) -> list[dict]:
    """Measured seconds of the synthetic decoder's forward / train step at a few shapes."""
    import jax

    out = []
    n_max = len(jax.devices())
    for kind, L, B, T, n, D in shapes:
        n = min(n, n_max)
        fwd, trn, params, tok = _synthetic_fns(L, B, T, n, D)
        sec = _timeit(fwd if kind == "forward" else trn, params, tok, repeats=repeats)
        out.append({"kind": kind, "L": L, "B": B, "T": T, "devices": n, "D": D, "seconds": sec})
    return out


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
    return {
        "matmul": bench_matmul(dtype, mm_sizes, reps, accelerator),
        "memory": bench_memory(mem_sizes, reps, accelerator),
        "overheads": bench_overheads(reps),
        "allreduce": bench_allreduce(ar_sizes, reps),
        **({} if accelerator else {"kv_attend": bench_kv_attend(reps)}),
    }
