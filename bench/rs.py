"""RS: a real-model-shaped RL step and its generation, rpeg_jax against its peers, side by side.

    python bench/rs.py --peer-python /tmp/peers/bin/python [--rounds 2] [--steps 6] [--json out.json]

The workload (bench/WORKLOADS.md, RS): SmolLM2-135M's shape (`model.preset=smollm2-135m`, random
init, float32), 8 prompts of 32 tokens x 4 responses of exactly 48 new tokens; one GRPO step (lr 1e-6,
no KL reference, one optimizer step per batch) and the same generation alone. rpeg_jax runs in this
venv (`rpeg train` in a subprocess, its median step after the first; the Sampler for generation);
the peers, Hugging Face `generate` and TRL's GRPOTrainer (bench/peers.py), in `--peer-python`'s
venv. Each round runs the four measurements one after the other, so machine drift hits both sides
alike; ratios are per round. Time it alone: nothing else may run on the machine.

Each round also measures the ceilings on the machine as it is then (`ceilings`, issue 34's ">= 80% of
the ceiling"; the machine's rates drift between sessions, so a ceiling from another day is not one):
- generation: the weight products alone (q/k/v, o, gate/up, down of every layer and the LM head),
  timed as one compiled chain on one device in both forms the sampler may run (q/k/v and gate/up
  fused or separate; the faster counts): one chain of 256 rows (the 8 x 32 prompt tokens' prefill,
  which also gives the first token) plus 47 chains of 32 rows (the decode steps);
- the step: that, plus the update's model FLOPs (bench/train_mfu.model_flops: 32 sequences of 80
  tokens, 48 scored, three forwards) at the float32 matmul rate, plus the optimizer's bytes (7 x 4 B
  per parameter) at the memory rate (both bench/update_profile.measured_rates: the best of square
  products of 1024 and 2048, and a 256 MB copy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from rpeg_jax.runtime import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS, N, PROMPT_LEN, NEW = 8, 4, 32, 48


def write_prompts(path: str, steps: int) -> str:
    """RS's prompts for `steps` steps (and one spare): 31 characters + bos = 32 tokens under the
    character tokenizer."""
    with open(path, "w") as f:
        for i in range(PROMPTS * (steps + 1)):
            f.write(json.dumps({"prompt": f"{i:05d}" + "3+4=" * 6 + "12", "answer": "7"}) + "\n")
    return path


def rs_overrides(data: str, steps: int, run_dir: str) -> list[str]:
    """`rpeg train` overrides of configs/default.yaml that make it RS (bench/WORKLOADS.md)."""
    return [
        "model.preset=smollm2-135m",
        "data.task=jsonl",
        f"data.path={data}",
        f"data.max_prompt_len={PROMPT_LEN}",
        f"data.prompts_per_step={PROMPTS}",
        f"rl.group_size={N}",
        "rl.kl_coef=0.0",
        f"rollout.max_new_tokens={NEW}",
        "rollout.ignore_eos=true",
        "optim.lr=1e-6",
        "optim.warmup_steps=0",
        f"train.steps={steps}",
        "train.checkpoint_every=0",
        "train.tensorboard=false",
        "train.progress=false",
        f"train.run_dir={run_dir}",
    ]


def rpeg_step(steps: int) -> dict:
    """Median seconds per step of `rpeg train` on RS (steps after the first), from metrics.jsonl."""
    with tempfile.TemporaryDirectory() as d:
        data = write_prompts(os.path.join(d, "prompts.jsonl"), steps)
        over = rs_overrides(data, steps, os.path.join(d, "run"))
        cmd = [sys.executable, "-m", "rpeg_jax.cli", "train", "--config", "configs/default.yaml", *over]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        rows = [json.loads(line) for line in open(os.path.join(d, "run", "metrics.jsonl"))]
    times = [r["timing_s/step"] for r in rows[1:]]
    stages = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[-1] if k.startswith("timing_s/")}
    return {"seconds_per_step": statistics.median(times), "steps_s": times, "stages_s": stages}


def rpeg_generate(reps: int) -> dict:
    code = f"""
import json, time
import numpy as np
from rpeg_jax.config.model import model_preset
from rpeg_jax.models.llama import init_model
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams
model = init_model(model_preset("smollm2-135m"), seed=0)
prompts = np.random.default_rng(1).integers(3, 49152, size=({PROMPTS}, {PROMPT_LEN})).tolist()
s = Sampler(model, SamplerConfig(max_slots={PROMPTS * N}, max_seq_len={PROMPT_LEN + NEW}, chunk_steps={NEW},
            min_prefill_len={PROMPT_LEN}))
sp = SamplingParams(n={N}, temperature=1.0, max_new_tokens={NEW}, ignore_eos=True, seed=0)
rates = []
for rep in range({reps} + 1):
    t0 = time.perf_counter(); outs = s.generate(prompts, sp); dt = time.perf_counter() - t0
    if rep: rates.append(sum(len(c.tokens) for o in outs for c in o.completions) / dt)
print(json.dumps({{"tokens_per_s": max(rates), "median_tokens_per_s": sorted(rates)[len(rates) // 2]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


CEILING = f"""
import json, sys, time
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
import train_mfu as T
from update_profile import measured_rates
from rpeg_jax.config.model import model_preset
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.graph.algorithms import model_dims

cfg = model_preset("smollm2-135m")
d, e, f, L = cfg.hidden_size, cfg.head_size, cfg.intermediate_size, cfg.num_layers
h, k = cfg.num_heads, cfg.num_kv_heads
rng = np.random.default_rng(0)
def w(i, o):
    return jnp.asarray(rng.standard_normal((i, o)).astype(np.float32) * 0.02)
fused = [[w(d, (h + 2 * k) * e), w(h * e, d), w(d, 2 * f), w(f, d)] for _ in range(L)]
split = [[w(d, h * e), w(d, k * e), w(d, k * e), w(h * e, d), w(d, f), w(d, f), w(f, d)] for _ in range(L)]
head = w(d, cfg.vocab_size)

@jax.jit
def chain_fused(ws, head, x):
    for wqkv, o, wgu, dn in ws:  # every output column is used (XLA could narrow a product only sliced)
        qkv, gu = x @ wqkv, x @ wgu
        a = (qkv[:, : h * e] + 1e-3 * jnp.sum(qkv[:, h * e :], -1, keepdims=True)) @ o
        m = (gu[:, :f] * gu[:, f:]) @ dn
        x = x + 1e-3 * (a + m)
    return x @ head

@jax.jit
def chain_split(ws, head, x):
    for q, kk, v, o, g, u, dn in ws:
        a = (x @ q + 1e-3 * jnp.sum(x @ kk, -1, keepdims=True) + 1e-3 * jnp.sum(x @ v, -1, keepdims=True)) @ o
        m = ((x @ g) * (x @ u)) @ dn
        x = x + 1e-3 * (a + m)
    return x @ head

def best(fn, *args, reps=10):  # generate.best_time's loop; importing bench/generate would force 2 CPU devices
    jax.block_until_ready(fn(*args))
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(fn(*args)); out = min(out, time.perf_counter() - t0)
    return out

x1 = jnp.asarray(rng.standard_normal(({PROMPTS * N}, d)).astype(np.float32))
xp = jnp.asarray(rng.standard_normal(({PROMPTS * PROMPT_LEN}, d)).astype(np.float32))
step = min(best(chain_fused, fused, head, x1), best(chain_split, split, head, x1))
prefill = min(best(chain_fused, fused, head, xp), best(chain_split, split, head, xp))
gen_s = prefill + ({NEW} - 1) * step
rate, bw = measured_rates()
ms = ModelShape.of(model_dims(cfg, "actor"))
flops = T.model_flops(ms, {PROMPTS * N}, {PROMPT_LEN + NEW}, {NEW})
update_s = flops / rate + 7 * 4 * cfg.num_params() / bw
print(json.dumps(dict(decode_step_s=step, prefill_s=prefill, generate_s=gen_s,
                      generate_tokens_per_s={PROMPTS * N * NEW} / gen_s, matmul_gflops=rate / 1e9,
                      memory_gbs=bw / 1e9, update_s=update_s, step_s=gen_s + update_s)))
"""


def ceilings() -> dict:
    out = subprocess.run([sys.executable, "-c", CEILING], cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# rpeg's host-memory settings for a peer process (torch's CPU allocator goes through the same malloc)
KEEP_MALLOC = host_memory.GLIBC_ENV


def peer(python: str, what: str, *extra: str, env: dict | None = None) -> dict:
    args = [python, "bench/peers.py", what, "--model", "rs", "--prompts", str(PROMPTS), "--n", str(N)]
    args += ["--prompt-len", str(PROMPT_LEN), "--new", str(NEW), *extra]
    env = None if env is None else {**os.environ, **env}
    out = subprocess.run(args, cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-python", required=True, help="python of the venv with torch, transformers, trl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--steps",
        type=int,
        default=6,
        help="rpeg train / TRL steps per measurement (first: warm-up); rpeg's steps 2-3 still fault in fresh"
        " host memory (perf/host_page_faults 80-137k, 1.4-2.1 s of kernel time), steps 4+ ~0",
    )
    ap.add_argument(
        "--trl-keep-malloc",
        action="store_true",
        help="also time TRL under rpeg's host-memory settings (glibc: one arena, no mmap, no trim)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    records = []
    for r in range(args.rounds):
        t0 = time.time()
        rec = {"round": r, "load": os.getloadavg()[0]}
        rec["ceiling"] = ceilings()
        rec["rpeg_generate"] = rpeg_generate(3)
        rec["hf_generate"] = peer(args.peer_python, "hf-generate", "--temperature", "1.0", "--reps", "3")
        rec["rpeg_step"] = rpeg_step(args.steps)
        rec["trl_step"] = peer(args.peer_python, "trl-step", "--steps", str(args.steps - 1))
        if args.trl_keep_malloc:
            rec["trl_step_keep"] = peer(args.peer_python, "trl-step", "--steps", str(args.steps - 1), env=KEEP_MALLOC)
            rec["step_ratio_keep"] = rec["trl_step_keep"]["seconds_per_step"] / rec["rpeg_step"]["seconds_per_step"]
        rec["generate_ratio"] = rec["rpeg_generate"]["tokens_per_s"] / rec["hf_generate"]["tokens_per_s"]
        rec["step_ratio"] = rec["trl_step"]["seconds_per_step"] / rec["rpeg_step"]["seconds_per_step"]
        c = rec["ceiling"]
        rec["generate_of_ceiling"] = rec["rpeg_generate"]["tokens_per_s"] / c["generate_tokens_per_s"]
        rec["step_of_ceiling"] = c["step_s"] / rec["rpeg_step"]["seconds_per_step"]
        upd = rec["rpeg_step"]["stages_s"].get("timing_s/advantage_actor_update")
        rec["update_of_ceiling"] = c["update_s"] / upd if upd else None
        rec["wall_s"] = time.time() - t0
        records.append(rec)
        print(
            f"round {r}: generate rpeg {rec['rpeg_generate']['tokens_per_s']:.0f} tok/s vs HF "
            f"{rec['hf_generate']['tokens_per_s']:.0f} ({rec['generate_ratio']:.2f}x); step rpeg "
            f"{rec['rpeg_step']['seconds_per_step']:.2f} s vs TRL {rec['trl_step']['seconds_per_step']:.2f} s "
            f"({rec['step_ratio']:.2f}x); load {rec['load']:.1f}",
            flush=True,
        )
        if args.trl_keep_malloc:
            print(
                f"  TRL under rpeg's host-memory settings: {rec['trl_step_keep']['seconds_per_step']:.2f} s "
                f"({rec['step_ratio_keep']:.2f}x)",
                flush=True,
            )
        print(f"  rpeg stages (median s): {rec['rpeg_step']['stages_s']}", flush=True)
        print(
            f"  ceilings now: generation {c['generate_tokens_per_s']:.0f} tok/s (rpeg at "
            f"{rec['generate_of_ceiling']:.0%}; decode step {c['decode_step_s'] * 1e3:.1f} ms, prefill "
            f"{c['prefill_s'] * 1e3:.0f} ms), update {c['update_s']:.2f} s (matmul {c['matmul_gflops']:.0f} "
            f"GFLOP/s, memory {c['memory_gbs']:.1f} GB/s), step {c['step_s']:.2f} s "
            f"(rpeg at {rec['step_of_ceiling']:.0%})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
