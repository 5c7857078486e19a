"""One actor-update step of a Qwen2-shaped model in bf16 compute with float32 parameters and
optimizer state, timed, as MFU (the GPU check's training number, issue 20).

    python bench/train_mfu.py [--preset qwen2-1.5b] [--batch 16] [--seq 1024] [--reps 3]
                              [--attention xla|cudnn|pallas|auto] [--remat none|dots|full] [--json out.json]
    python bench/train_mfu.py --dry-run     # CPU plumbing: preset tiny, 4 x 64 tokens, 2 reps

The update is the runtime's (runtime/kernels.actor_update without its stage wrapper):
load_config(model.preset, model.dtype=bfloat16, model.param_dtype=float32, model.attention,
model.remat, rl.micro_batches) -> rl.make_actor_update(kernels.forward_fn(..., logp=True), make_optimizer)
(GRPO surrogate, one AdamW step), jitted with params and optimizer state donated. The batch: B
full sequences of S tokens (random ids, no padding), the first S - R the prompt, the last
R = --response (default 3S/4) the response window with logits, advantages and π_old. The first
call compiles (warm-up); then --reps calls, each to jax.block_until_ready; the best and median
are reported, MFU from the median.

FLOPs are the cost model's (rpeg_jax/costmodel/shape.ModelShape, as the planner counts them):
  model FLOPs  = 3 x ModelShape.forward_flops(tokens=B·S, scored=B·R, Σs²=B·S², causal_skip=True)
               = 3 x [B·S·L·2(D·HE + 2·D·KE + HE·D + 3·D·F) + B·R·2·D·V + 2·L·HE·B·S²]
    (the planner's useful_flops of an update: forward + backward = 3 forwards, causal attention
    counted once, no recomputation); MFU = model FLOPs / median seconds / peak, the peak the
    hardware profile's datasheet number (configs/hardware/<h200|cpu>.yaml, uncalibrated:
    h200 989e12 dense bf16; a float32 compute dtype uses peak_flops_fp32).
  executed FLOPs = costmodel.stages.train_stage(...)["flops"]: dense attention (4·L·HE·S²) for
    model.attention=xla, the remat mode's extra forward (full) — the hardware FLOPs, HFU.
Also recorded: the cost model's predicted seconds and bytes per device for the same stage
(stages.train_stage / train_memory with the profile, its calibrated copy when one is cached), and
the device's peak bytes in use (GPU memory_stats). On a GPU, XLA_PYTHON_CLIENT_MEM_FRACTION
defaults to 0.94 here (the 1.5B step at 16 x 1024 with remat=none is priced at ~104 GB).

Prints one line: tokens/s, TFLOP/s, MFU. --json writes the record (a one-element list).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rpeg_jax.config import load_config  # noqa: E402
from rpeg_jax.costmodel import stages as S  # noqa: E402
from rpeg_jax.costmodel.fit import setting  # noqa: E402
from rpeg_jax.costmodel.hardware import load_hardware  # noqa: E402
from rpeg_jax.costmodel.shape import ModelShape  # noqa: E402
from rpeg_jax.graph.algorithms import model_dims  # noqa: E402
from rpeg_jax.models import Transformer  # noqa: E402
from rpeg_jax.models.attention import resolve_attention  # noqa: E402
from rpeg_jax.rl import make_actor_update, make_optimizer  # noqa: E402
from rpeg_jax.runtime import kernels  # noqa: E402

FLASH = ("cudnn", "pallas")  # attention kernels that skip the causal mask's masked blocks


def overrides(preset: str, attention: str, remat: str, micro: int, dtype: str) -> list[str]:
    return [
        f"model.preset={preset}",
        f"model.dtype={dtype}",
        "model.param_dtype=float32",
        f"model.attention={attention}",
        f"model.remat={remat}",
        f"rl.micro_batches={micro}",
        "rl.kl_coef=0.0",
        "rl.entropy_coef=0.0",
        "optim.warmup_steps=0",
        "optim.lr=1e-6",
    ]


def model_flops(ms: ModelShape, b: int, s: int, r: int) -> float:
    """Useful FLOPs of one update over b full sequences of s tokens, r of them scored (docstring)."""
    return float(3.0 * ms.forward_flops(b * s, b * r, b * float(s) ** 2, causal_skip=True))


def stage_prediction(hw, ms: ModelShape, b: int, p: int, r: int, attention: str, remat: str, micro: int) -> dict:
    """The cost model's train stage on one device: executed FLOPs, seconds, bytes per device."""
    st = dataclasses.replace(
        setting(hw, {"B": b, "P": p, "R": r}), causal_skip=attention in FLASH, dense_scores=attention not in FLASH
    )
    sec, parts = S.train_stage(st, ms, busy=1, d=1, f=1, t=1, micro=micro, remat=remat)
    mem = S.train_memory(st, ms, d=1, f=1, t=1, micro=micro, remat=remat)
    return {"executed_flops": float(parts["flops"]), "predicted_s": float(sec), "predicted_bytes": float(mem)}


def make_batch(b: int, s: int, r: int, vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    batch = dict(
        tokens_BxS=rng.integers(3, vocab, (b, s)).astype(np.int32),
        positions_BxS=np.tile(np.arange(s, dtype=np.int32), (b, 1)),
        segment_ids_BxS=np.ones((b, s), np.int32),
        response_mask_BxR=np.ones((b, r), np.float32),
        advantages_BxR=rng.standard_normal((b, r)).astype(np.float32),
        old_logp_BxR=np.full((b, r), -4.8, np.float32),
        behav_logp_BxR=np.full((b, r), -4.8, np.float32),
    )
    return {k: jnp.asarray(v) for k, v in batch.items()}


def build(cfg, group: int = 1, compiler_options: dict | None = None):
    """(jitted update, params, opt_state): the runtime's actor update, plain (group 1) or with each
    group of `group` responses sharing one prompt pass (runtime/kernels.forward_fn(group_size=...),
    as `rpeg train` runs it); `compiler_options`: per-program XLA options."""
    gd, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(params=0)), nnx.Param)
    tx = make_optimizer(cfg.optim, 100)
    fwd = kernels.forward_fn(gd, temperature=1.0, logp=True, entropy=False, values=False, group_size=group)
    update = make_actor_update(fwd, tx, cfg.rl, accum_dtype=jnp.float32, group_size=group)
    return jax.jit(update, donate_argnums=(0, 1), compiler_options=compiler_options or None), params, tx.init(params)


def peak_bytes() -> int | None:
    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 (backends without memory stats)
        return None
    return st.get("peak_bytes_in_use")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-1.5b")
    ap.add_argument("--batch", type=int, default=16, help="sequences per update")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (prompt + response)")
    ap.add_argument("--response", type=int, default=None, help="response tokens (scored); default 3/4 of --seq")
    ap.add_argument("--reps", type=int, default=3, help="timed calls after the warm-up")
    ap.add_argument("--attention", default="xla", choices=("xla", "cudnn", "pallas", "auto"), help="model.attention")
    ap.add_argument("--remat", default="dots", choices=("none", "dots", "full"), help="model.remat")
    ap.add_argument("--micro", type=int, default=1, help="rl.micro_batches (gradient accumulation)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="model.dtype (compute)")
    ap.add_argument("--hardware", default=None, help="profile for the peak and the prediction (default h200 / cpu)")
    ap.add_argument("--json", default=None, help="write the record here (a one-element list)")
    ap.add_argument("--dry-run", action="store_true", help="CPU plumbing: tiny preset, 4 x 64 tokens, 2 reps")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.preset, args.batch, args.seq, args.reps = "tiny", 4, 64, 2
    r = args.response if args.response is not None else (3 * args.seq) // 4
    for name, v, ok in (
        ("--batch", args.batch, args.batch >= 1),
        ("--seq", args.seq, args.seq >= 2),
        ("--response", r, 1 <= r < args.seq),
        ("--reps", args.reps, args.reps >= 1),
        ("--micro", args.micro, args.micro >= 1 and args.batch % args.micro == 0),
    ):
        if not ok:
            raise SystemExit(
                f"{name}={v}: out of range (batch >= 1, 2 <= seq, 1 <= response < seq, reps >= 1, micro divides batch)"
            )
    p = args.seq - r
    cfg = load_config(None, overrides(args.preset, args.attention, args.remat, args.micro, args.dtype))
    attention = resolve_attention(cfg.model)  # ConfigError naming model.attention where it cannot run
    on_gpu = jax.default_backend() == "gpu"
    hw_name = args.hardware or ("h200" if on_gpu else "cpu")
    datasheet = load_hardware(hw_name, calibrated=False)
    peak = datasheet.peak(cfg.model.dtype)
    ms = ModelShape.of(model_dims(cfg.model, "actor"))
    flops = model_flops(ms, args.batch, args.seq, r)
    pred = stage_prediction(
        load_hardware(hw_name, calibrated=True), ms, args.batch, p, r, attention, args.remat, args.micro
    )

    t0 = time.perf_counter()
    step, params, opt = build(cfg)
    batch, key = make_batch(args.batch, args.seq, r, cfg.model.vocab_size), jax.random.key(0)
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    params, opt, metrics = step(params, opt, batch, key)
    jax.block_until_ready(params)
    first_s = time.perf_counter() - t0
    times = []
    for i in range(args.reps):
        t0 = time.perf_counter()
        params, opt, metrics = step(params, opt, batch, jax.random.fold_in(key, i + 1))
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens = args.batch * args.seq
    loss = float(np.asarray(metrics.get("actor/loss", np.nan)))
    rec = dict(
        preset=args.preset,
        num_params=cfg.model.num_params(),
        batch=args.batch,
        seq=args.seq,
        prompt=p,
        response=r,
        dtype=cfg.model.dtype,
        param_dtype=cfg.model.param_dtype,
        attention=args.attention,
        attention_resolved=attention,
        remat=args.remat,
        micro_batches=args.micro,
        device=jax.devices()[0].device_kind,
        backend=jax.default_backend(),
        hardware=hw_name,
        peak_flops=peak,
        model_flops=flops,
        executed_flops=pred["executed_flops"],
        seconds=med,
        best_seconds=min(times),
        times=times,
        init_s=init_s,
        compile_s=first_s,
        tokens_per_s=tokens / med,
        tflops_per_s=flops / med / 1e12,
        mfu=flops / med / peak,
        hfu=pred["executed_flops"] / med / peak,
        predicted_seconds=pred["predicted_s"],
        predicted_bytes=pred["predicted_bytes"],
        peak_bytes_in_use=peak_bytes(),
        loss=loss,
        finite=bool(np.isfinite(loss)),
        dry_run=args.dry_run,
    )
    mem = f", peak {rec['peak_bytes_in_use'] / 1e9:.1f} GB" if rec["peak_bytes_in_use"] else ""
    print(
        f"train {args.preset} {args.batch}x{args.seq} {cfg.model.dtype}/{cfg.model.param_dtype} attention={attention} "
        f"remat={args.remat}: {rec['tokens_per_s']:.0f} tokens/s, {rec['tflops_per_s']:.2f} TFLOP/s, "
        f"MFU {rec['mfu']:.1%} of {peak / 1e12:.3g} TFLOP/s (HFU {rec['hfu']:.1%}; median {med:.3f}s of {args.reps}, "
        f"compile {first_s:.1f}s; predicted {pred['predicted_s']:.3f}s, {pred['predicted_bytes'] / 1e9:.1f} GB{mem})",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([rec], f, indent=1)
    return 0 if rec["finite"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
