"""Calibration: measure this machine and fit a profile's efficiency factors (`rpeg calibrate`,
rpeg_jax/cli/calibrate.py, saves the result; `load_hardware(name, calibrated=True)` reads it).

Micro-benchmarks (each a few hundred ms; the whole run well under a minute on CPU):
  matmul      FLOP/s of square matmuls of several sizes      -> peak (CPU) and the matmul table
  memory      bytes/s of y = x * 2 + 1 over several sizes   -> memory_bw (CPU) and the memory table
  dispatch    one jitted call on a tiny array               -> efficiency.dispatch_s
  layers      a jitted scan over L tiny layers, two L values -> efficiency.layer_s (slope)
  loop        a while_loop of trivial steps                 -> efficiency.decode_step_s
  all-reduce  psum over all local devices, several sizes     -> node.link_bw and the intra_node table
then a stage-level fit: a synthetic dense decoder (pure jnp, forward and train step, 1 and 8
devices, a few depths and batch shapes) whose measured times fit, by least squares on relative
error, a matmul scale, `efficiency.elementwise_factor` and `efficiency.layer_s`. The validation
benchmark (bench/costmodel_validate.py) uses the real models, meshes and shapes, never these.
On a CPU profile the measured rates replace the peaks; on an accelerator the nominal peak stays
and the tables become measured / nominal. Last, when stage measurements of the real code exist
(`--points`, default <cache>/hardware/<profile>.points.json, written by
`bench/costmodel_validate.py --calibrate`, which runs the real model, update and sampler on the
CALIBRATION configurations of bench/costmodel_stages.py), the profile is refitted to them
(costmodel/fit.py: least squares on log time, the FSDP gather mode for memory); the validation
configurations are never among them. The saved profile is what `rpeg plan` and
`pipeline.plan: auto` load under `costmodel.calibration=cached` (costmodel/devices.profile). JAX is imported inside the
functions only, so importing this module (and `rpeg plan`) never initialises a device.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time

from rpeg_jax.costmodel.hardware import HardwareProfile, with_nodes

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


def fit_stages(prof: HardwareProfile, stages: list[dict]) -> tuple[HardwareProfile, dict]:
    """Two least-squares fits on relative error. Forward points:
        t ≈ a·matmul + b·elementwise + c·(layers · overhead multiplier) + dispatch
    (a matmul scale, `elementwise_factor`, `layer_s`); then train points, with those fixed:
        t ≈ (1 + 2k)·(one forward, incl. its layer cost) + comm + optimizer + dispatch
    (k = `backward_factor`)."""
    import numpy as np

    from rpeg_jax.costmodel import stages as S
    from rpeg_jax.costmodel.lengths import LengthDist

    def parts(hw, m):
        ms = synthetic_shape(m["L"], m["D"])
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
        n = m["devices"]
        if m["kind"] == "forward":
            return ms, S.forward_stage(st, ms, n, n, 1, 1, 1)[1], float(S.rates(hw, "float32", n)[2])
        return ms, S.train_stage(st, ms, n, n, 1, 1, 1, "none")[1], float(S.rates(hw, "float32", n)[2])

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


def _predict(hw: HardwareProfile, m: dict) -> float:
    from rpeg_jax.costmodel import stages as S
    from rpeg_jax.costmodel.lengths import LengthDist

    ms = synthetic_shape(m["L"], m["D"])
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
    n = m["devices"]
    if m["kind"] == "forward":
        return float(S.forward_stage(st, ms, n, n, 1, 1, 1)[0])
    return float(S.train_stage(st, ms, n, n, 1, 1, 1, "none")[0])


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
