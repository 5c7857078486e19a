"""Memory of a real-model RL step by component (issue 34 item 5): what must be resident, what XLA
allocates on top, and the process's peak RSS, for RS's shape (bench/WORKLOADS.md: SmolLM2-135M,
float32, 8 prompts x 4 responses, 32 + 48 tokens, GRPO without a KL reference).

    python bench/memory.py [--json out.json] [--steps 2]

Three views, one run:
  resident   the bytes that must live through a step, counted from the shapes: parameters,
             gradients, the two Adam moments, the KV pool the sampler allocates, the reference
             (none here: kl_coef 0)
  programs   XLA's compiled memory analysis of the update (the real rl.make_actor_update, as
             rpeg_jax/calibration/stages.py builds it), the logprob forward and the sampler's
             programs: arguments, outputs, temporaries (activations, logits, gradients, XLA's own)
  process    `rpeg train` on RS in a subprocess, its VmHWM (peak RSS) and its RSS sampled every
             0.1 s; the RSS of a bare `import jax` process with the model built, for the baseline
Peak RSS / (baseline + resident) is the number issue 34 bounds at ~2x. Memory does not depend on
the machine's load: this may run beside other work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rpeg_jax.costmodel.devices import force_cpu_devices  # noqa: E402 (imports no JAX)

force_cpu_devices(1)

from rs import NEW, PROMPT_LEN, PROMPTS, ROOT, N, rs_overrides, write_prompts  # noqa: E402 (bench/rs.py: RS itself)

MB = 1 << 20


def resident(cfg) -> dict:
    """Bytes that must be resident through a step, from the shapes (float32 parameters and Adam)."""
    from rpeg_jax.costmodel.shape import ModelShape
    from rpeg_jax.graph.algorithms import model_dims

    ms = ModelShape.of(model_dims(cfg.model, "actor"))
    p = ms.num_params * 4
    kv_tok = ms.kv_bytes_per_token
    slots = PROMPTS * N
    kv = slots * (PROMPT_LEN + NEW) * kv_tok  # the pool's live pages at the longest point of the step
    return {"params": p, "grads": p, "adam": 2 * p, "kv_pool": kv, "num_params": ms.num_params}


def programs(remats) -> dict:
    """XLA's memory analysis of the update (per remat) and the logprob forward on RS's batch (one
    device), and the sampler's programs."""
    from rpeg_jax.calibration import stages as CS

    CS.MODELS["RS"] = dict(preset="smollm2-135m")
    out = {}
    for kind, remat in [("forward", "none")] + [("train", r) for r in remats]:
        s = CS.build(kind, "RS", PROMPTS * N, PROMPT_LEN, NEW, (1, 1, 1), 1, remat)
        ma = s.compiled.memory_analysis()
        out[kind if kind == "forward" else f"train/{remat}"] = {
            "arguments": ma.argument_size_in_bytes,
            "outputs": ma.output_size_in_bytes,
            "temporaries": ma.temp_size_in_bytes,
            "aliased": ma.alias_size_in_bytes,
            "peak": s.peak,
        }
        del s
    with CS.sampler_programs() as peaks:
        g = CS.build("generate", "RS", PROMPTS * N, PROMPT_LEN, NEW, (1, 1, 1), N, "-")
        g.run()
    out["generate"] = {f"{k[0]}#{i}": v for i, (k, v) in enumerate(peaks.items())}
    return out


def _rss_kb(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def overrides(data: str, steps: int, run_dir: str, remat: str) -> list[str]:
    """RS's overrides (bench/rs.py) with `remat` as the config sets it (a manual plan, not the planner's choice)."""
    return [*rs_overrides(data, steps, run_dir), f"model.remat={remat}", "pipeline.plan=manual"]


def predicted_gb(remat: str) -> float:
    """The cost model's predicted peak per device for RS run as configured (manual plan, this remat)."""
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel.pricing import predict_run

    cfg = load_config(os.path.join(ROOT, "configs/default.yaml"), overrides("x.jsonl", 1, "runs/x", remat))
    return predict_run(cfg, "cpu", 1).memory_per_gpu_gb


def process(steps: int, remat: str) -> dict:
    """Peak RSS of `rpeg train` on RS (subprocess, sampled)."""
    with tempfile.TemporaryDirectory() as d:
        data = write_prompts(os.path.join(d, "prompts.jsonl"), steps)
        over = overrides(data, steps, os.path.join(d, "run"), remat)
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
        cmd = [sys.executable, "-m", "rpeg_jax.cli", "train", "--config", "configs/default.yaml", *over]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        samples, hwm = [], [0]

        def watch():
            t0 = time.time()
            while proc.poll() is None:
                kb = _rss_kb(proc.pid, "VmRSS")
                h = _rss_kb(proc.pid, "VmHWM")
                if kb:
                    samples.append((round(time.time() - t0, 2), kb))
                if h:
                    hwm[0] = max(hwm[0], h)
                time.sleep(0.1)

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        log = proc.communicate()[0]
        th.join()
        if proc.returncode != 0:
            raise SystemExit(f"rpeg train failed ({proc.returncode}):\n{log[-3000:]}")
    return {"peak_rss": hwm[0] * 1024, "rss_samples_kb": samples[:: max(1, len(samples) // 200)]}


def runtime_rss() -> dict:
    """RSS of a process that imported JAX and ran one op (the runtime's own), then built RS's model."""
    code = (
        "import gc, jax, jax.numpy as jnp\n"
        "rss = lambda: int([x for x in open('/proc/self/status') if x.startswith('VmRSS')][0].split()[1]) * 1024\n"
        "jnp.ones(3).block_until_ready(); a = rss()\n"
        "from rpeg_jax.config.model import model_preset\nfrom rpeg_jax.models import init_model\n"
        "m = init_model(model_preset('smollm2-135m'), seed=0); gc.collect(); print(a, rss())"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    a, b = (int(x) for x in r.stdout.split()[-2:])
    return {"jax": a, "jax_and_model": b}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--remat", default="none,full", help="comma-separated model.remat values to compare")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-process", action="store_true", help="skip the rpeg train subprocesses")
    args = ap.parse_args(argv)
    from rpeg_jax.config import load_config

    remats = args.remat.split(",")
    cfg = load_config(os.path.join(ROOT, "configs/default.yaml"), ["model.preset=smollm2-135m"])
    res = {"resident": resident(cfg), "runtime": runtime_rss(), "programs": programs(remats), "load": []}
    res["predicted_gb"] = {r: predicted_gb(r) for r in remats}
    if not args.no_process:
        res["process"] = {}
        for r in remats:
            res["load"].append(os.getloadavg()[0])
            res["process"][r] = process(args.steps, r)
    r, pg, rt = res["resident"], res["programs"], res["runtime"]
    must = r["params"] + r["grads"] + r["adam"] + r["kv_pool"] + rt["jax"]
    print(f"RS ({r['num_params'] / 1e6:.1f}M parameters, float32), MB:")
    for k in ("params", "grads", "adam", "kv_pool"):
        print(f"  resident {k:<10} {r[k] / MB:9.1f}")
    print(f"  runtime (import jax) {rt['jax'] / MB:7.1f}   (+ the model built: {rt['jax_and_model'] / MB:.1f})")
    print(f"  must be resident     {must / MB:7.1f}")
    for k, p in pg.items():
        if k == "generate":
            continue
        print(
            f"  {k:<12} program: arguments {p['arguments'] / MB:8.1f} outputs {p['outputs'] / MB:8.1f} "
            f"temporaries {p['temporaries'] / MB:8.1f} aliased {p['aliased'] / MB:8.1f} peak {p['peak'] / MB:8.1f}"
        )
    gen = pg["generate"]
    print(f"  sampler programs: max peak {max(v for v in gen.values() if v) / MB:.1f} ({len(gen)} programs)")
    for rm in remats:
        line = f"  remat={rm:<5} predicted peak {res['predicted_gb'][rm] * 1e9 / MB:8.1f}"
        if "process" in res:
            pk = res["process"][rm]["peak_rss"]
            line += f"   process peak RSS {pk / MB:8.1f} = {pk / must:.2f}x what must be resident"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
