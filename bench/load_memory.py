"""Peak host memory of loading a Hugging Face checkpoint: load_hf building each parameter in its
FSDP sharding (models/hf.py, reading each device's slice of the files) against the whole-tensor
load it replaced (every tensor read whole, stacked per layer, then device_put into the shardings,
as runtime/setup.py did before 2026-12-02), with 8 CPU devices.

    python bench/load_memory.py                      # ~1 GB fp32 llama-shaped model (default shape)
    python bench/load_memory.py --hidden 512 --layers 8 --intermediate 1408 --vocab 32000 --json out.json

The checkpoint (random weights, fp32, one safetensors file per layer plus one for the embeddings
and one for lm_head + norm, with an index) is written once under --dir with numpy, a tensor at a
time, so the writer never holds more than one file's tensors. Each load method then runs in a
fresh process (XLA_FLAGS forces 8 CPU devices before JAX is imported). Its baseline is the
resident memory after importing JAX and rpeg_jax and building the FSDP mesh; the peak is the
resident high-water mark during the load: VmHWM of /proc/self/status, reset at the baseline
(`echo 5 > /proc/self/clear_refs`), and, as a check, resource.getrusage(RUSAGE_SELF).ru_maxrss
(not reset, so never below the baseline's own high-water mark). On CPU the devices' buffers are
host memory, so the loaded model itself accounts for 1x the model's bytes. After the load,
glibc's malloc_trim(0) returns freed heap pages; the resident size then is what the load keeps.

Results: bench/NOTES.md ("2026-12-02, session 11: sharded HF loading"). tests/test_hf_sharded.py
runs a ~200 MB version (slow).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def shape_config(args) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "intermediate_size": args.intermediate,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def tensor_shapes(c: dict) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """[(file, [(tensor, HF shape)])] in the order they are written."""
    D, V, F = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    E = D // c["num_attention_heads"]
    Q, KV = c["num_attention_heads"] * E, c["num_key_value_heads"] * E
    L = c["num_hidden_layers"]
    files = [(f"model-embed-of-{L + 2}.safetensors", [("model.embed_tokens.weight", (V, D))])]
    for i in range(L):
        p = f"model.layers.{i}."
        files.append(
            (
                f"model-layer{i:03d}-of-{L + 2}.safetensors",
                [
                    (p + "input_layernorm.weight", (D,)),
                    (p + "self_attn.q_proj.weight", (Q, D)),
                    (p + "self_attn.k_proj.weight", (KV, D)),
                    (p + "self_attn.v_proj.weight", (KV, D)),
                    (p + "self_attn.o_proj.weight", (D, Q)),
                    (p + "post_attention_layernorm.weight", (D,)),
                    (p + "mlp.gate_proj.weight", (F, D)),
                    (p + "mlp.up_proj.weight", (F, D)),
                    (p + "mlp.down_proj.weight", (D, F)),
                ],
            )
        )
    files.append((f"model-head-of-{L + 2}.safetensors", [("lm_head.weight", (V, D)), ("model.norm.weight", (D,))]))
    return files


def write_checkpoint(path: str, c: dict, seed: int = 0) -> int:
    """Random fp32 weights into `path`, a file at a time; returns the model's bytes."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for fname, tensors in tensor_shapes(c):
        data = {n: (rng.standard_normal(s, dtype=np.float32) * 0.02) for n, s in tensors}
        save_file(data, os.path.join(path, fname), metadata={"format": "pt"})
        total += sum(a.nbytes for a in data.values())
        weight_map.update({n: fname for n in data})
        del data
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    return total


# ---- one load, in its own process ---------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def whole_tensor_load(path: str, layout):
    """The load before session 11: every tensor read whole (safetensors' flax reader, onto the
    default device), per-layer tensors transformed and stacked, then put into the layout."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from safetensors import safe_open

    from rpeg_jax.models import hf
    from rpeg_jax.models.llama import Transformer

    with open(os.path.join(path, "config.json")) as f:
        cfg = hf.config_from_hf(json.load(f))
    tensors = {}
    for file in hf._tensor_files(path):
        with safe_open(file, framework="flax") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    for ours, (names, lay) in hf._mapping(cfg).items():
        if isinstance(names, str):
            value = lay.from_hf(tensors.pop(names))
        else:
            value = jnp.stack([lay.from_hf(tensors.pop(n)) for n in names])
        target = model
        for part in ours.split(".")[:-1]:
            target = getattr(target, part)
        getattr(target, ours.split(".")[-1]).set_value(value)
    graphdef, params = nnx.split(model, nnx.Param)
    return nnx.merge(graphdef, jax.device_put(params, layout.params(params)))


def child(method: str, path: str) -> dict:
    import ctypes
    import resource

    import jax
    from flax import nnx

    from rpeg_jax.config.sharding import ShardingConfig
    from rpeg_jax.models import load_hf
    from rpeg_jax.sharding import layout_for

    assert jax.device_count() == 8, jax.devices()
    layout = layout_for({"fsdp": 8}, "fsdp", ShardingConfig())
    jax.block_until_ready([jax.device_put(np.zeros(8, np.float32), d) for d in jax.devices()])  # allocators up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    base_kb = _status_kb("VmRSS")
    base_ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if method == "sharded":
        model = load_hf(path, shardings=layout.params)
    else:
        model = whole_tensor_load(path, layout)
    params = nnx.state(model, nnx.Param)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - start
    specs = {str(s.spec) for s in jax.tree.leaves(jax.tree.map(lambda x: x.sharding, params))}
    peak_kb, after_kb = _status_kb("VmHWM"), _status_kb("VmRSS")
    ru_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back: what is left is held
    trimmed_kb = _status_kb("VmRSS")
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return {
        "method": method,
        "load_s": load_s,
        "model_bytes": n_bytes,
        "baseline_mb": base_kb / 1024,
        "peak_over_baseline_mb": (peak_kb - base_kb) / 1024,
        "ru_maxrss_over_baseline_mb": (ru_kb - base_kb) / 1024,
        "ru_maxrss_at_baseline_mb": base_ru / 1024,
        "resident_after_over_baseline_mb": (after_kb - base_kb) / 1024,
        "resident_trimmed_over_baseline_mb": (trimmed_kb - base_kb) / 1024,
        "specs": sorted(specs),
    }


def measure(method: str, path: str) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", method, "--dir", path],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{method} load failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/rpeg_load_memory")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--methods", default="sharded,whole")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return 0
    c = shape_config(args)
    name = f"llama_d{args.hidden}_l{args.layers}_f{args.intermediate}_v{args.vocab}_h{args.heads}_k{args.kv_heads}"
    path = os.path.join(args.dir, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        write_checkpoint(path, c)
    results = [measure(m, path) for m in args.methods.split(",")]
    for r in results:
        ratio = r["peak_over_baseline_mb"] * 2**20 / r["model_bytes"]
        r["peak_ratio"] = ratio
        print(
            f"{r['method']:8s} model {r['model_bytes'] / 2**20:7.1f} MiB  baseline {r['baseline_mb']:6.0f} MiB  "
            f"peak +{r['peak_over_baseline_mb']:7.1f} MiB ({ratio:.2f}x)  "
            f"ru_maxrss +{r['ru_maxrss_over_baseline_mb']:7.1f}  "
            f"resident after +{r['resident_after_over_baseline_mb']:7.1f}"
            f"  after malloc_trim +{r['resident_trimmed_over_baseline_mb']:7.1f}  {r['load_s']:.1f} s"
            f"  specs {r['specs']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
