"""G1 generation throughput (bench/WORKLOADS.md): rpeg_jax's paged sampler against the naive
baseline (bench/naive_generate.py), with the fraction of this machine's limit measured in the same run.

    python bench/generate.py --json out.json [--workloads G1-T-greedy,G1-S-greedy] [--reps 3] [--no-naive]
                             [--attention auto|gather|blocked|chunk|kernel[,...]] [--kernel-interpret]

Records: {workload, variant ("rpeg" | "naive"), new_tokens_per_s (best of reps), median_tokens_per_s,
limit_fraction, limit_kind ("matmul" | "bandwidth"), limit_tokens_per_s, ...}. The limit:
- matmul-bound workloads (T at batch >= 64): FLOPs per new token (2 x matmul params + attention over
  the mean context) over the measured float matmul rate;
- bandwidth-bound ones (S, batch 8): bytes per decode step (all weights except the embedding table,
  plus the batch's KV at the mean context) over the measured memory bandwidth.
`--attention` (SamplerConfig.attention; default auto = chunk on CPU, kernel on GPU where its blocks fit,
config/rollout.resolve_attention): a comma-separated list runs the sampler once per attention on the
same model and prompts (the naive baseline once). "kernel" off a GPU needs `--kernel-interpret` (the
Pallas interpreter: plumbing, slow). Every record has `attention` (as asked), `attention_resolved`
and `kernel_interpret`; the naive baseline's are "dense" (its own dense-cache attention) and false.
Timings follow one warm-up run of each workload (all compiles). On a shared machine they are noisy.
On a CPU the limits are probed before the first workload and after each one, and every fraction is
taken against the best rate seen (strict, like rl_step.py's; a single probe taken in a slow moment
read 205.6 GFLOP/s where the machine does ~280, and made every fraction read 1.35x high).
On a GPU the S model runs in bfloat16 and a ~0.5B Qwen2-shaped model is added (G1-Q05-greedy).

Devices (`--data N`, default: every core of a CPU host as a device, one device on a GPU): the
sampler of a matmul-bound workload runs its sequences over a `data` mesh of N devices (each device
decodes B/N slots; on a CPU host the N device programs run side by side on the cores, which one
program's small decode GEMMs do not fill: G1-T greedy 7.8k -> 10.6k tok/s on 2 cores, 2026-12-01).
Bandwidth-bound workloads stay on one device: every data replica streams its own copy of the
weights (G1-S 157 -> 127 tok/s on 2). The naive baseline and the limits use one device; on a CPU
host the limit's matmul already uses every core (XLA's intra-op thread pool). Each record has
`devices`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rpeg_jax.costmodel.devices import force_cpu_devices  # noqa: E402 (imports no JAX)

force_cpu_devices(os.cpu_count() or 1)  # the host's cores as CPU devices
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rpeg_jax.config.model import ModelConfig, model_preset  # noqa: E402
from rpeg_jax.config.rollout import ATTENTIONS, resolve_attention  # noqa: E402
from rpeg_jax.models import init_model  # noqa: E402
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from naive_generate import naive_generate  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
# name -> (model preset, prompts, prompt_len, n, new_tokens, temperature, bound)
WORKLOADS = {
    "G1-T-greedy": ("tiny", 64, 16, 1, 128, 0.0, "matmul"),
    "G1-T-sample": ("tiny", 64, 16, 1, 128, 1.0, "matmul"),
    "G1-S-greedy": ("small", 8, 32, 1, 128, 0.0, "bandwidth"),
    "G1-T-grpo": ("tiny", 16, 16, 8, 128, 1.0, "matmul"),
}
GPU_WORKLOADS = {"G1-Q05-greedy": ("qwen2-0.5b", 64, 32, 1, 128, 0.0, "bandwidth")}


# ---- machine limits -----------------------------------------------------------------------------
def best_time(fn, *args, reps=5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_limits(dtype) -> dict:
    """Matmul FLOP/s (square matmuls) and memory bandwidth, both through JAX in `dtype`.

    Bandwidth = the best streaming READ rate of three probes over 1 GiB (CPU) / 4 GiB (GPU) of
    float32: a full reduction, a row reduction and a few-row GEMV against [out, in] weight blocks
    (the decode step's own access pattern). The array is several times the CPU's last-level cache
    (300 MB L3 on the development machine) so the rate is DRAM's, as for model S, whose 440 MB of
    weights per step do not fit either; a 256 MiB probe measured up to 2x more (partly from L3).
    A copy (read + write) is recorded too but is not the limit of a read-only workload."""
    n_mm = 8192 if ON_GPU else 1536
    a = jnp.ones((n_mm, n_mm), dtype)
    flops = 2 * n_mm**3 / best_time(jax.jit(lambda x: x @ x), a)
    del a
    n_bw = 1 << 30 if ON_GPU else 1 << 28  # elements: 4 GiB / 1 GiB of float32
    x = jnp.ones((n_bw,), jnp.float32)
    read = 4 * n_bw / best_time(jax.jit(lambda x: jnp.sum(x)), x)
    rows = 4 * n_bw / best_time(jax.jit(lambda x: jnp.sum(x.reshape(-1, 4096), axis=1)), x)
    copy = 8 * n_bw / best_time(jax.jit(lambda x: x * 2.0), x)
    w_t = x.reshape(-1, 4096)  # [out, in] blocks read by an 8-row product
    v = jnp.ones((8, 4096), jnp.float32)
    gemv = 4 * n_bw / best_time(jax.jit(lambda w, v: jnp.einsum("oi,mi->mo", w, v)), w_t, v)
    del x, w_t
    bw = max(read, rows, gemv)
    return {
        "matmul_flops": flops,
        "bandwidth_bytes_s": bw,
        "bw_read": read,
        "bw_rowsum": rows,
        "bw_gemv": gemv,
        "bw_copy": copy,
    }


def work_per_token(cfg: ModelConfig, batch: int, mean_ctx: float, param_bytes: int) -> tuple[float, float]:
    """(FLOPs per new token, bytes per decode step)."""
    d, e, f, v = cfg.hidden_size, cfg.head_size, cfg.intermediate_size, cfg.vocab_size
    h, k, layers = cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
    matmul_params = layers * (d * h * e * 2 + d * k * e * 2 + 3 * d * f) + d * v
    attn = layers * 4 * h * e * mean_ctx  # q.k and p.v
    flops = 2 * matmul_params + attn
    weight_bytes = (cfg.num_params() - v * d * (0 if cfg.tie_embeddings else 1)) * param_bytes
    return flops, weight_bytes + batch * mean_ctx * kv_bytes_per_token(cfg, param_bytes)


def kv_bytes_per_token(cfg: ModelConfig, param_bytes: int) -> int:
    """K and V of one token over all layers: what a decode step reads per context position."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_size * param_bytes


# ---- runs ---------------------------------------------------------------------------------------
def model_for(preset: str):
    kw = {}
    if ON_GPU and preset != "tiny":
        kw = dict(dtype="bfloat16", param_dtype="bfloat16")
    cfg = model_preset(preset, **kw)
    return init_model(cfg, seed=0)


def data_mesh(n: int):
    """A data x fsdp x tensor = n x 1 x 1 mesh of the first n devices (the sampler's axes)."""
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(n, 1, 1), ("data", "fsdp", "tensor"))


PAGE_SIZE = 16  # the sampler's pages in every run (a power of two >= 16: the GPU kernel's blocks)


def run_rpeg(
    model, prompts, n, new, temp, reps, devices: int = 1, attention: str = "auto", interpret: bool = False
) -> list[float]:
    batch = len(prompts) * n
    cfg = SamplerConfig(
        attention=attention,
        kernel_interpret=interpret,
        page_size=PAGE_SIZE,
        max_slots=batch,
        max_seq_len=len(prompts[0]) + new,
        chunk_steps=new,
        min_prefill_len=len(prompts[0]),
    )
    mesh = data_mesh(devices)
    if devices > 1:  # the weights replicated on every device of the mesh
        from flax import nnx

        model = nnx.clone(model)  # the naive baseline keeps the single-device original
        state = nnx.state(model, nnx.Param)
        nnx.update(model, jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.P())))
    sampler = Sampler(model, cfg, mesh=mesh)
    params = SamplingParams(n=n, temperature=temp, max_new_tokens=new, ignore_eos=True, seed=0)
    sampler.generate(prompts, params)  # warm-up: compiles
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = sampler.generate(prompts, params)
        dt = time.perf_counter() - t0
        rates.append(sum(len(c.tokens) for o in outs for c in o.completions) / dt)
    return rates


def run_naive(model, prompts, n, new, temp, reps) -> list[float]:
    naive_generate(model, prompts, new, temp, n=n)  # warm-up
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        toks = naive_generate(model, prompts, new, temp, n=n)
        rates.append(toks.size / (time.perf_counter() - t0))
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--workloads", default=None, help="comma-separated subset (default: all G1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-naive", action="store_true", help="skip the naive baseline")
    ap.add_argument(
        "--data",
        type=int,
        default=None,
        help="devices of the sampler's data mesh for matmul-bound workloads (default: every CPU device, 1 on a GPU)",
    )
    ap.add_argument(
        "--attention",
        default="auto",
        help=f"the sampler's decode attention, comma-separated to run several (of {', '.join(ATTENTIONS)}; "
        "auto = chunk on CPU, kernel on GPU)",
    )
    ap.add_argument(
        "--kernel-interpret", action="store_true", help="run attention=kernel through the Pallas interpreter (CPU)"
    )
    args = ap.parse_args(argv)
    backend = jax.default_backend()
    attentions = args.attention.split(",")
    for a in attentions:
        if a not in ATTENTIONS:
            raise SystemExit(f"--attention: unknown {a!r}; known: {', '.join(ATTENTIONS)}")
        if a == "kernel" and backend != "gpu" and not args.kernel_interpret:
            raise SystemExit(
                f"--attention {a}: the Pallas kernel needs a GPU (the backend is {backend}); "
                "add --kernel-interpret to run it through the interpreter, or use gather/chunk"
            )
    data = args.data if args.data is not None else (1 if ON_GPU else jax.local_device_count())
    if not 1 <= data <= jax.local_device_count():
        raise SystemExit(f"--data {data}: must be in [1, {jax.local_device_count()}] (the devices JAX sees)")
    table = {**WORKLOADS, **(GPU_WORKLOADS if ON_GPU else {})}
    names = args.workloads.split(",") if args.workloads else list(table)
    for name in names:
        if name not in table:
            raise SystemExit(f"--workloads: unknown {name!r}; known: {', '.join(table)}")
    dtype = jnp.bfloat16 if ON_GPU else jnp.float32
    limits = measure_limits(dtype)
    probes = [limits]
    print(
        f"device {jax.devices()[0].device_kind}: matmul {limits['matmul_flops'] / 1e9:.1f} GFLOP/s, "
        f"bandwidth {limits['bandwidth_bytes_s'] / 1e9:.1f} GB/s (read {limits['bw_read'] / 1e9:.1f}, "
        f"rows {limits['bw_rowsum'] / 1e9:.1f}, gemv {limits['bw_gemv'] / 1e9:.1f}, "
        f"copy {limits['bw_copy'] / 1e9:.1f}); "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    records, models = [], {}
    for name in names:
        preset, num_prompts, plen, n, new, temp, bound = table[name]
        model = models.setdefault(preset, model_for(preset))
        rng = np.random.default_rng(0)
        prompts = rng.integers(3, model.cfg.vocab_size, size=(num_prompts, plen)).tolist()
        batch = num_prompts * n
        pbytes = jnp.dtype(model.cfg.param_dtype).itemsize
        flops, step_bytes = work_per_token(model.cfg, batch, plen + new / 2, pbytes)
        devices = data if bound == "matmul" and batch % data == 0 else 1
        variants = [
            (
                "rpeg",
                a,
                resolve_attention(a, backend, page_size=PAGE_SIZE, head_dim=model.cfg.head_size),
                args.kernel_interpret
                and resolve_attention(a, backend, page_size=PAGE_SIZE, head_dim=model.cfg.head_size) == "kernel",
            )
            for a in attentions
        ] + ([] if args.no_naive else [("naive", "dense", "dense", False)])
        for variant, attention, resolved, interpret in variants:
            if variant == "rpeg":
                rates = run_rpeg(model, prompts, n, new, temp, args.reps, devices, resolved, interpret)
            else:
                rates = run_naive(model, prompts, n, new, temp, args.reps)
            best = max(rates)
            rec = dict(
                workload=name,
                variant=variant,
                attention=attention,
                attention_resolved=resolved,
                kernel_interpret=interpret,
                new_tokens_per_s=best,
                median_tokens_per_s=statistics.median(rates),
                limit_kind=bound,
                batch=batch,
                flops_per_token=flops,
                bytes_per_step=step_bytes,
                device=jax.devices()[0].device_kind,
                devices=devices if variant == "rpeg" else 1,
                load_avg_1m=os.getloadavg()[0],
            )
            records.append(rec)
            print(
                f"{name:14s} {variant:6s} {resolved:6s} {rec['devices']} dev {best:10.1f} new tok/s "
                f"(median {rec['median_tokens_per_s']:.1f})",
                flush=True,
            )
        mine = [r for r in records if r["workload"] == name]
        naive = [r["new_tokens_per_s"] for r in mine if r["variant"] == "naive"]
        for r in mine:
            if naive and r["variant"] == "rpeg":
                print(
                    f"{name:14s} rpeg ({r['attention_resolved']}) / naive = {r['new_tokens_per_s'] / naive[0]:.2f}x",
                    flush=True,
                )
        if not ON_GPU:  # a CPU's rates move with the load: probe after every workload, keep the best
            probes.append(measure_limits(dtype))
    # The limit is the best rate any probe saw (strict: a probe taken in a slow moment would make
    # every fraction read high; bench/ceiling.py bounds the fraction under the same definition).
    limits = {k: max(p[k] for p in probes) for k in probes[0]}
    print(
        f"limits (best of {len(probes)} probes): matmul {limits['matmul_flops'] / 1e9:.1f} GFLOP/s, "
        f"bandwidth {limits['bandwidth_bytes_s'] / 1e9:.1f} GB/s"
    )
    for rec in records:
        per_tok = rec["flops_per_token"] if rec["limit_kind"] == "matmul" else rec["bytes_per_step"] / rec["batch"]
        rate = limits["matmul_flops"] if rec["limit_kind"] == "matmul" else limits["bandwidth_bytes_s"]
        rec.update(
            limit_tokens_per_s=rate / per_tok,
            limit_fraction=rec["new_tokens_per_s"] * per_tok / rate,
            probes=len(probes),
            **limits,
        )
        print(
            f"{rec['workload']:14s} {rec['variant']:6s} {rec['attention_resolved']:6s} "
            f"{rec['new_tokens_per_s']:10.1f} new tok/s = "
            f"{rec['limit_fraction']:.1%} of the {rec['limit_kind']} limit ({rec['limit_tokens_per_s']:.0f} tok/s)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
