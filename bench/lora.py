"""LoRA vs full fine-tuning on a ~46M model, side by side in one run (issue 33 item 5).

Default (--mode rl): the RL step's actor update as the trainer compiles it (rl.update.make_actor_update
over runtime/kernels.forward_fn: GRPO surrogate, AdamW with grad clipping) on one synthetic batch of
B rows x (P prompt + R response) tokens, three ways on the same model:
  full:       grads and AdamW state for every parameter;
  lora:       model.lora as training runs it: rank-r adapters on all 7 projections in the activation-side
              form y = x W + s (x A) B (models/adapters.py); the base is a non-differentiated input, so
              the backward forms no base dW, and grads and AdamW state exist for the adapters only;
  lora-merge: the same adapters merged into the base inside the step (W + s A B), the form measured
              first (2026-12-05 NOTES): the backward forms every adapted weight's full dW.
Prints trainable parameters, optimizer-state bytes, XLA's compiled peak memory (memory_analysis
peak_memory_in_bytes) and args+temps+outputs, and the median time of interleaved steps; ratios to
full. Also the weight sync's merge (base + s A B, the copy the sampler gets) time and the bytes a sync
moves: the merged model, as many as a full fine-tuning sync.
--mode ce: the first measurement (one AdamW step of next-token cross-entropy, full vs lora-merge).

Usage: PYTHONPATH=$PWD .venv/bin/python bench/lora.py [--mode rl|ce] [--rank 16] [--steps 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rpeg_jax.config.base import build
from rpeg_jax.config.model import LoraConfig, model_preset
from rpeg_jax.config.optim import OptimConfig
from rpeg_jax.config.rl import RLConfig
from rpeg_jax.models import adapters as lora_params
from rpeg_jax.models.llama import Transformer
from rpeg_jax.models.lora import TARGETS, init_adapters, merge
from rpeg_jax.rl import make_actor_update, make_optimizer


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def count(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


SHAPE = dict(vocab_size=8000, hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_size=1536)


def _memory(compiled) -> tuple[int, int]:
    """(XLA's peak, arguments + temporaries + outputs - aliased) of a compiled program, bytes."""
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return int(getattr(m, "peak_memory_in_bytes", 0) or 0), int(total)


def rl_main(args) -> None:
    """The actor update of one RL step, full vs lora vs lora-merge (module docstring)."""
    from rpeg_jax.runtime.kernels import forward_fn

    lora_cfg = model_preset("tiny", **SHAPE, lora=LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    plain_cfg = model_preset("tiny", **SHAPE)
    lora_gd, state = nnx.split(Transformer(lora_cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
    base, ad = lora_params.split(state)
    plain_gd = nnx.split(nnx.eval_shape(lambda: Transformer(plain_cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]
    ad = jax.tree.map(lambda x: x + 0.01, ad)  # B != 0: the adapters take part in the forward
    rng = np.random.default_rng(0)
    B, P, R = args.batch, args.prompt, args.response
    S = P + R
    batch = {
        "tokens_BxS": jnp.asarray(rng.integers(3, plain_cfg.vocab_size, (B, S)), jnp.int32),
        "positions_BxS": jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)),
        "segment_ids_BxS": jnp.ones((B, S), jnp.int32),
        "response_mask_BxR": jnp.ones((B, R), jnp.float32),
        "advantages_BxR": jnp.asarray(rng.normal(size=(B, 1)).repeat(R, 1), jnp.float32),
        "old_logp_BxR": jnp.full((B, R), -9.0, jnp.float32),
    }
    rl = build(RLConfig, {"algorithm": "grpo", "group_size": 4}, "rl")
    tx = make_optimizer(build(OptimConfig, {"lr": 1e-4, "grad_clip": 1.0}, "optim"), 100)
    kw = dict(temperature=1.0, logp=True, entropy=False, values=False)
    fwd_lora, fwd_plain = forward_fn(lora_gd, **kw), forward_fn(plain_gd, **kw)

    @jax.jit
    def full_step(params, opt, batch):
        return make_actor_update(fwd_plain, tx, rl)(params, opt, batch)

    @jax.jit
    def lora_step(base, adapters, opt, batch):  # as runtime/kernels.actor_update runs model.lora
        policy = lambda a, mb: fwd_lora(lora_params.join(base, a), mb)  # noqa: E731
        return make_actor_update(policy, tx, rl)(adapters, opt, batch)

    @jax.jit
    def merge_step(base, adapters, opt, batch):
        policy = lambda a, mb: fwd_plain(lora_params.merged_weights(lora_cfg, base, a), mb)  # noqa: E731
        return make_actor_update(policy, tx, rl)(adapters, opt, batch)

    full_opt, ad_opt = tx.init(base), tx.init(ad)
    programs = {
        "full": (full_step, (base, full_opt, batch), base),
        "lora": (lora_step, (base, ad, ad_opt, batch), ad),
        "lora-merge": (merge_step, (base, ad, ad_opt, batch), ad),
    }
    rows = {}
    for name, (fn, a, trainable) in programs.items():
        peak, mem = _memory(fn.lower(*a).compile())
        rows[name] = dict(trainable=count(trainable), opt=nbytes(a[-2]), peak=peak, mem=mem, times=[])
    for i in range(args.steps + 1):  # interleaved; round 0 warms up
        for name, (fn, a, _) in programs.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*a))
            if i:
                rows[name]["times"].append(time.perf_counter() - t)
    merge_fn = jax.jit(lambda b, a: lora_params.merged_weights(lora_cfg, b, a))
    jax.block_until_ready(merge_fn(base, ad))
    t = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(merge_fn(base, ad))
    merge_s = (time.perf_counter() - t) / 3
    print(
        f"model {count(base) / 1e6:.1f}M params, rank {args.rank}, all 7 targets; actor update (GRPO, AdamW) "
        f"on {B} rows x ({P} prompt + {R} response) tokens, {args.steps} interleaved steps after warm-up"
    )
    f = rows["full"]
    for name, r in rows.items():
        t = np.median(r["times"])
        print(
            f"{name:10s}: trainable {r['trainable'] / 1e6:7.3f}M  AdamW state {r['opt'] / 2**20:6.1f} MiB  "
            f"peak {r['peak'] / 2**20:7.1f} MiB  args+temps+outs {r['mem'] / 2**20:7.1f} MiB  step {t:.3f} s  "
            f"| /full: peak {r['peak'] / max(f['peak'], 1):.3f} memory {r['mem'] / f['mem']:.3f} "
            f"time {t / np.median(f['times']):.3f}"
        )
    print(
        f"weight sync: merge base + s A B {merge_s:.3f} s; bytes synced {nbytes(base) / 2**20:.1f} MiB (the merged "
        f"model; full fine-tuning syncs the same), adapters alone {nbytes(ad) / 2**20:.1f} MiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["rl", "ce"], default="rl")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=None, help="rows (rl: 16, ce: 4)")
    ap.add_argument("--seq", type=int, default=128, help="ce: sequence length")
    ap.add_argument("--prompt", type=int, default=64, help="rl: prompt tokens per row")
    ap.add_argument("--response", type=int, default=64, help="rl: response tokens per row")
    args = ap.parse_args()
    if args.mode == "rl":
        args.batch = args.batch or 16
        return rl_main(args)
    args.batch = args.batch or 4
    cfg = model_preset("tiny", **SHAPE)
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
