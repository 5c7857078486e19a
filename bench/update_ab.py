"""The R1-a update program alone (advantage folded into the actor update, as the optimized
pipeline runs it), plain pass against the group-shared prompt (models/prefix.py), calls
interleaved in one process; optionally a jax.profiler trace and the compiled HLO of each.

    python bench/update_ab.py [--groups 1,8] [--ynn default,off] [--reps 5] [--profile DIR] [--hlo PREFIX]

--groups: 1 = the plain pass over every row's prompt, 8 = each group's prompt once. The batch is
R1-shaped (16 prompts of 7 tokens x 8 responses, P=8, R=32, 90% of responses full length).
--ynn: "default" = XLA's defaults (YNNPACK fusions on CPU in JAX 0.10), "off" = this program
compiled with `xla_cpu_experimental_ynn_fusion_type` empty (Eigen dots), as a per-program compiler
option (rpeg_jax/runtime/xla_flags.py); every (group, ynn) pair is one interleaved variant.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rpeg_jax.config import load_config  # noqa: E402
from rpeg_jax.models import Transformer  # noqa: E402
from rpeg_jax.rl import compute_advantages, make_actor_update, make_optimizer  # noqa: E402
from rpeg_jax.runtime import kernels  # noqa: E402

B, P, R, G = 128, 8, 32, 8
YNN_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}
R1 = [
    "data.task=add",
    "rl.group_size=8",
    "optim.lr=1e-4",
    "optim.warmup_steps=0",
    "model.preset=tiny",
    "rl.kl_coef=0.0",
]


def r1_batch(seed: int = 0) -> dict:
    """An R1-shaped rollout batch: groups of G rows with one 7-token prompt, responses right-padded."""
    rng = np.random.default_rng(seed)
    tok, pos, seg = (np.zeros((B, P + R), np.int32) for _ in range(3))
    for g in range(B // G):
        lp, prompt = 7, rng.integers(3, 128, 7)
        for j in range(G):
            b = g * G + j
            lr = R if rng.random() < 0.9 else int(rng.integers(1, R))
            tok[b, P - lp : P], tok[b, P : P + lr] = prompt, rng.integers(3, 128, lr)
            pos[b, P - lp : P + lr] = np.arange(lp + lr)
            seg[b, P - lp : P + lr] = 1
    mask = (seg[:, P:] > 0).astype(np.float32)
    batch = dict(
        tokens_BxS=tok,
        positions_BxS=pos,
        segment_ids_BxS=seg,
        response_mask_BxR=mask,
        behav_logp_BxR=np.where(mask > 0, -4.8, 0).astype(np.float32),
        rewards_B=rng.random(B).astype(np.float32),
        group_ids_B=np.repeat(np.arange(B // G), G).astype(np.int32),
        versions_BxR=np.zeros((B, R), np.int32),
    )
    return {k: jnp.asarray(v) for k, v in batch.items()}


def build(cfg, group: int, compiler_options: dict | None = None):
    """(jitted step, params, opt_state) with the advantage folded in, prompt shared per `group`."""
    gd, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(params=0)), nnx.Param)
    tx = make_optimizer(cfg.optim, 100)
    fwd = kernels.forward_fn(gd, temperature=1.0, logp=True, entropy=False, values=False, group_size=group)
    update = make_actor_update(fwd, tx, cfg.rl, group_size=group)

    def step(params, opt, batch, key):
        adv, _ = compute_advantages(batch, cfg.rl)
        b = dict(batch, advantages_BxR=adv["advantages_BxR"], old_logp_BxR=batch["behav_logp_BxR"])
        return update(params, opt, b, key)

    return (jax.jit(step, donate_argnums=(0, 1), compiler_options=compiler_options or None), params, tx.init(params))


def timed(st, batch, key) -> float:
    t0 = time.perf_counter()
    st[1], st[2], m = st[0](st[1], st[2], batch, key)
    jax.block_until_ready(st[1])
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", default=None, help="write a jax.profiler trace per variant under this folder")
    ap.add_argument("--hlo", default=None, help="write the compiled HLO per variant to PREFIX.<variant>.hlo")
    ap.add_argument("--groups", default="1,8")
    ap.add_argument("--ynn", default="default", help="comma list of default / off (per-program compiler option)")
    args = ap.parse_args(argv)
    cfg, batch, key = load_config(None, R1), r1_batch(), jax.random.key(0)
    runs = {}
    for grp in (int(x) for x in args.groups.split(",")):
        for ynn in args.ynn.split(","):
            name = f"g{grp}" + ("" if ynn == "default" else f".ynn-{ynn}")
            opts = {"default": None, "off": YNN_OFF}[ynn]
            f, params, opt = build(cfg, grp, opts)
            runs[name] = [f, params, opt, []]
            print(f"{name}: first call (compile + run) {timed(runs[name], batch, key):.2f}s", flush=True)
            if args.hlo:
                with open(f"{args.hlo}.{name}.hlo", "w") as fh:
                    fh.write(f.lower(runs[name][1], runs[name][2], batch, key).compile().as_text())
    for _ in range(args.reps):
        for st in runs.values():
            st[3].append(timed(st, batch, key))
    for name, st in runs.items():
        if args.profile:
            jax.profiler.start_trace(f"{args.profile}/{name}", create_perfetto_trace=True)
            timed(st, batch, key)
            timed(st, batch, key)
            jax.profiler.stop_trace()
        ts = st[3]
        print(f"{name}: median {statistics.median(ts):.3f}s best {min(ts):.3f}s (steps {[round(t, 3) for t in ts]})")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
