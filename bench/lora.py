"""LoRA vs full fine-tuning on a ~46M model, side by side in one run (issue 33 item 5).

One AdamW step of next-token cross-entropy on random tokens, jitted, on the same model:
  full: grads and AdamW state for every parameter;
  lora: rank-r adapters on all 7 projections (models/lora.py, PEFT layout), merged into the base inside
        the step (W + alpha/r B@A); the base is a non-differentiated input, so grads and AdamW state
        exist for the adapters only.
Prints trainable parameters, optimizer-state bytes, XLA's compiled memory (arguments + temporaries +
outputs, from memory_analysis) and the median step time of interleaved steps; ratios lora/full.

Usage: PYTHONPATH=$PWD .venv/bin/python bench/lora.py [--rank 16] [--steps 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rpeg_jax.config.model import model_preset
from rpeg_jax.models.llama import Transformer
from rpeg_jax.models.lora import TARGETS, init_adapters, merge


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def count(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    cfg = model_preset(
        "tiny", vocab_size=8000, hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_size=1536
    )
    graphdef, base = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq)), jnp.int32)
    tx = optax.adamw(1e-4)

    def loss(params, adapters):
        model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))  # fresh Variables in this trace
        if adapters is not None:
            merge(model, adapters, rank=args.rank, alpha=2.0 * args.rank)
        logits = model(tokens).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()

    @jax.jit
    def full_step(params, opt):
        g = jax.grad(loss)(params, None)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt

    @jax.jit
    def lora_step(base, adapters, opt):
        g = jax.grad(lambda a: loss(base, a))(adapters)  # the base is an input, not differentiated
        upd, opt = tx.update(g, opt, adapters)
        return optax.apply_updates(adapters, upd), opt

    adapters = init_adapters(cfg, list(TARGETS), args.rank, nnx.Rngs(params=1))
    full_opt, lora_opt = tx.init(base), tx.init(adapters)
    rows = {}
    for name, fn, a in (("full", full_step, (base, full_opt)), ("lora", lora_step, (base, adapters, lora_opt))):
        m = fn.lower(*a).compile().memory_analysis()
        mem = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        trainable = base if name == "full" else adapters
        rows[name] = dict(trainable=count(trainable), opt_bytes=nbytes(a[-1]), mem=mem, times=[])
    p, fo, ad, lo = base, full_opt, adapters, lora_opt
    for i in range(args.steps + 1):  # interleaved; step 0 warms up
        t = time.perf_counter()
        p, fo = full_step(p, fo)
        jax.block_until_ready(p)
        t1 = time.perf_counter()
        ad, lo = lora_step(base, ad, lo)
        jax.block_until_ready(ad)
        t2 = time.perf_counter()
        if i:
            rows["full"]["times"].append(t1 - t)
            rows["lora"]["times"].append(t2 - t1)
    print(f"model params {count(base) / 1e6:.1f}M, rank {args.rank}, all 7 targets, batch {args.batch}x{args.seq}")
    for name, r in rows.items():
        print(
            f"{name}: trainable {r['trainable'] / 1e6:.3f}M  opt-state {r['opt_bytes'] / 2**20:.1f} MiB  "
            f"compiled memory {r['mem'] / 2**20:.1f} MiB  step {np.median(r['times']):.3f} s"
        )
    f, lo_ = rows["full"], rows["lora"]
    print(
        f"lora/full: trainable {lo_['trainable'] / f['trainable']:.4f}  "
        f"opt-state {lo_['opt_bytes'] / f['opt_bytes']:.4f}  "
        f"memory {lo_['mem'] / f['mem']:.3f}  step time {np.median(lo_['times']) / np.median(f['times']):.3f}"
    )


if __name__ == "__main__":
    main()
