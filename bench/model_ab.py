"""Before/after of the model's training pass in one process: the update's forward + backward
(sum of response logprobs, R1 shapes: 128 sequences of 8 prompt + 32 response tokens, model T)
with the model code of an earlier commit against the working tree, calls interleaved.

    python bench/model_ab.py [--before 331fb5a] [--rounds 5]

The earlier commit's models/{llama,logprobs,attention,rope}.py are read with `git show` and
imported under private names, so both versions run side by side on the same parameters. Variants:
before (that commit), scan and unrolled (this tree, model.scan_layers true/false). Reports the
first call (compile + run), best and median seconds and the spread (max/min) per variant.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rpeg_jax.config import model_preset  # noqa: E402
from rpeg_jax.models import init_model, token_logprobs  # noqa: E402

B, P, R = 128, 8, 32
MODULES = ("attention", "rope", "llama", "logprobs")  # import order: dependencies first


def load_before(commit: str):
    """(Transformer class, token_logprobs) of `commit`, imported as private modules."""
    tmp = tempfile.mkdtemp(prefix="rpeg_before_")
    mods = {}
    for name in MODULES:
        src = subprocess.run(
            ["git", "-C", ROOT, "show", f"{commit}:rpeg_jax/models/{name}.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for dep in MODULES:  # point intra-package imports at the private copies
            src = src.replace(f"from rpeg_jax.models.{dep} import", f"from _before_{dep} import")
        path = os.path.join(tmp, f"_before_{name}.py")
        with open(path, "w") as f:
            f.write(src)
        spec = importlib.util.spec_from_file_location(f"_before_{name}", path)
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[f"_before_{name}"] = mods[name]
        spec.loader.exec_module(mods[name])
    return mods["llama"].Transformer, mods["logprobs"].token_logprobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="331fb5a", help="commit with the earlier model code")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 128, (B, P + R)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(P + R, dtype=jnp.int32), tokens.shape)
    seg = jnp.ones_like(tokens)
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], 1)
    Before, before_logprobs = load_before(args.before)
    models = {
        "before": (Before(model_preset("tiny"), rngs=nnx.Rngs(params=0)), before_logprobs),
        "scan": (init_model(model_preset("tiny", scan_layers=True), 0), token_logprobs),
        "unrolled": (init_model(model_preset("tiny", scan_layers=False), 0), token_logprobs),
    }
    fns = {}
    for name, (model, logprobs) in models.items():
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p, graphdef=graphdef, logprobs=logprobs):
            m = nnx.merge(graphdef, p)
            return jnp.sum(logprobs(m, tokens, pos, seg, targets, start=P - 1, length=R)[0])

        fns[name] = (jax.jit(jax.grad(loss)), params)
    times = {k: [] for k in fns}
    for name, (f, p) in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(p))
        print(f"{name:9s} first call (compile + run) {time.perf_counter() - t0:6.2f}s", flush=True)
    for _ in range(args.rounds):
        for name, (f, p) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(p))
            times[name].append(time.perf_counter() - t0)
    cfg = model_preset("tiny")
    gflop = 6 * (cfg.num_params() - 2 * cfg.vocab_size * cfg.hidden_size) * B * (P + R) / 1e9
    print(f"forward + backward of {gflop:.1f} GFLOP (matmuls of the decoder body), load {os.getloadavg()[0]:.1f}")
    for name, ts in times.items():
        print(
            f"{name:9s} best {min(ts):6.3f}s  median {statistics.median(ts):6.3f}s  spread {max(ts) / min(ts):4.2f}  "
            f"({gflop / statistics.median(ts):5.1f} GFLOP/s at the median)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
