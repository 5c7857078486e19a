"""Stage measurements for the cost model: the real model, update and sampler code on CPU meshes.

Used by `rpeg calibrate` (the CALIBRATION set, or QUICK_CALIBRATION with --quick, fitted by
costmodel/fit.py) and bench/costmodel_validate.py (validation, and `--calibrate`, which measures
both sets interleaved). Two disjoint sets of stage configurations: CALIBRATION (fitted) and
VALIDATION (never fitted).
A configuration is (kind, model, B, P, R, mesh (data, fsdp, tensor), micro-batches | group size,
remat). Forward = token_logprobs over the response window (rpeg_jax.models); train = one
rl.make_actor_update step (GRPO loss, AdamW); generate = Sampler.generate of B/G prompts x G
completions of R tokens (eos ignored). Peak memory per device is XLA's compiled memory analysis
(arguments + outputs + temporaries - aliased; none for generation, which runs several programs).

Timing: `measure_set` compiles a batch of configurations, then runs them round-robin (every
configuration once per round, `repeats` rounds) so that a change of machine load hits all of
them alike, and keeps the median per configuration. The clock is wall or process CPU seconds.
Run it from a snapshot of the committed tree (`git archive HEAD`) when others edit the working
tree: the measured code must not change during a measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics

import numpy as np

from rpeg_jax.calibration.micro import CLOCKS  # noqa: F401 (the clocks measure_set is given)
from rpeg_jax.config.model import model_preset
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.graph.algorithms import model_dims

# Model shapes small enough to time on a 2-core CPU (T is bench/WORKLOADS.md's tiny model).
MODELS = {
    "T": dict(preset="tiny"),
    "M": dict(
        preset="tiny",
        vocab_size=1024,
        hidden_size=384,
        num_layers=4,
        num_heads=6,
        num_kv_heads=2,
        intermediate_size=1024,
    ),
    "W": dict(
        preset="tiny",
        vocab_size=2048,
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
    ),
}

VALIDATION = [
    ("forward", "T", 32, 16, 32, (8, 1, 1), 1, "none"),
    ("forward", "T", 32, 16, 32, (1, 8, 1), 1, "none"),
    ("forward", "T", 16, 32, 64, (2, 2, 2), 1, "none"),
    ("forward", "M", 16, 16, 48, (8, 1, 1), 1, "none"),
    ("forward", "M", 16, 16, 48, (4, 1, 2), 1, "none"),
    ("forward", "M", 32, 16, 48, (1, 8, 1), 1, "none"),
    ("forward", "M", 8, 16, 48, (1, 1, 1), 1, "none"),
    ("forward", "W", 8, 16, 48, (8, 1, 1), 1, "none"),
    ("forward", "W", 8, 16, 48, (1, 4, 2), 1, "none"),
    ("forward", "W", 16, 32, 96, (2, 1, 4), 1, "none"),
    ("train", "T", 32, 16, 32, (8, 1, 1), 1, "none"),
    ("train", "T", 32, 16, 32, (1, 8, 1), 2, "none"),
    ("train", "T", 16, 32, 64, (2, 2, 2), 1, "none"),
    ("train", "M", 16, 16, 48, (8, 1, 1), 1, "none"),
    ("train", "M", 16, 16, 48, (1, 8, 1), 1, "full"),
    ("train", "M", 16, 16, 48, (4, 1, 2), 2, "none"),
    ("train", "M", 8, 16, 48, (1, 1, 1), 1, "none"),
    ("train", "W", 8, 16, 48, (8, 1, 1), 1, "none"),
    ("train", "W", 8, 16, 48, (1, 8, 1), 1, "none"),
    ("train", "W", 16, 16, 48, (2, 1, 4), 1, "dots"),
    ("train", "W", 16, 32, 32, (2, 4, 1), 2, "full"),
    ("generate", "T", 64, 16, 32, (8, 1, 1), 8, "-"),
    ("generate", "T", 128, 16, 32, (8, 1, 1), 8, "-"),
    ("generate", "T", 32, 16, 64, (4, 1, 2), 4, "-"),
    ("generate", "M", 32, 16, 32, (8, 1, 1), 8, "-"),
    ("generate", "M", 16, 16, 32, (1, 1, 1), 4, "-"),
    ("generate", "W", 16, 16, 32, (4, 1, 2), 4, "-"),
    # Long responses on one device (R2's regime: R up to 256, where attention's quadratic part counts)
    ("train", "T", 48, 16, 192, (1, 1, 1), 1, "none"),
    ("generate", "T", 32, 16, 192, (1, 1, 1), 8, "-"),
]
# Disjoint from VALIDATION: other batch sizes, lengths and meshes (1, 2, 4, 8 devices).
CALIBRATION = [
    ("forward", "T", 16, 16, 32, (1, 1, 1), 1, "none"),
    ("forward", "T", 64, 16, 32, (4, 1, 1), 1, "none"),
    ("forward", "M", 16, 16, 48, (2, 1, 1), 1, "none"),
    ("forward", "M", 16, 32, 64, (1, 2, 2), 1, "none"),
    ("forward", "W", 8, 16, 32, (1, 1, 1), 1, "none"),
    ("forward", "W", 16, 16, 48, (4, 2, 1), 1, "none"),
    ("forward", "T", 32, 32, 64, (1, 4, 2), 1, "none"),
    ("train", "T", 16, 16, 32, (1, 1, 1), 1, "none"),
    ("train", "T", 64, 16, 32, (4, 1, 1), 2, "none"),
    ("train", "M", 16, 16, 48, (2, 1, 1), 1, "none"),
    ("train", "M", 16, 32, 64, (1, 2, 2), 1, "dots"),
    ("train", "W", 8, 16, 32, (1, 1, 1), 1, "none"),
    ("train", "W", 16, 16, 48, (4, 2, 1), 1, "full"),
    ("train", "T", 32, 32, 64, (1, 4, 2), 2, "none"),
    ("generate", "T", 32, 16, 32, (1, 1, 1), 8, "-"),
    ("generate", "T", 64, 16, 32, (4, 1, 1), 8, "-"),
    ("generate", "M", 16, 16, 48, (2, 1, 1), 4, "-"),
    ("generate", "M", 32, 16, 32, (4, 1, 2), 8, "-"),
    ("generate", "W", 16, 16, 32, (1, 1, 1), 4, "-"),
    ("generate", "T", 64, 16, 48, (2, 1, 2), 8, "-"),
    # 8-device meshes (added after the first validation run: the set above stopped at fsdp 4)
    ("forward", "W", 16, 16, 32, (1, 8, 1), 1, "none"),
    ("forward", "M", 32, 16, 32, (8, 1, 1), 1, "none"),
    ("train", "M", 32, 16, 32, (1, 8, 1), 1, "none"),
    ("train", "T", 64, 16, 32, (8, 1, 1), 2, "none"),
    ("generate", "M", 64, 16, 32, (8, 1, 1), 8, "-"),
    # Tensor meshes with data > 1, 8 data replicas of the large model, and more generation shapes
    # (with only the 7 generation points above its factors were loose: validation 18.6%, 2026-11-30).
    ("forward", "T", 32, 16, 32, (2, 1, 2), 1, "none"),
    ("forward", "W", 8, 16, 32, (4, 1, 2), 1, "none"),
    ("train", "M", 16, 16, 32, (2, 1, 2), 1, "none"),
    ("train", "W", 16, 16, 32, (8, 1, 1), 2, "none"),
    ("generate", "M", 32, 16, 32, (2, 1, 1), 8, "-"),
    ("generate", "W", 16, 16, 48, (2, 1, 2), 4, "-"),
    ("generate", "T", 32, 16, 48, (1, 1, 1), 4, "-"),
    # Generation at the batch sizes and lengths of whole RL steps (many slots, few
    # tokens: B 64-256, R 4-12; the configs of --calibrate-steps, not the default's B=128, R=8),
    # tensor 1 and 2: the points above (B <= 64, R >= 32) left the sampler's tensor-parallel
    # cost at large batch unpinned (T B192 R6: tensor 1 259 ms, tensor 2 391 ms of CPU time).
    ("generate", "T", 192, 16, 6, (1, 1, 1), 8, "-"),
    ("generate", "T", 192, 16, 6, (1, 1, 2), 8, "-"),
    ("generate", "T", 192, 16, 6, (2, 1, 1), 8, "-"),
    ("generate", "T", 64, 16, 12, (1, 1, 2), 8, "-"),
    ("generate", "T", 96, 16, 10, (1, 1, 2), 8, "-"),
    ("generate", "M", 64, 16, 8, (1, 1, 2), 8, "-"),
    ("generate", "T", 256, 16, 4, (1, 1, 1), 8, "-"),
    ("generate", "T", 64, 16, 12, (2, 1, 2), 8, "-"),
    ("generate", "T", 64, 16, 12, (1, 1, 1), 8, "-"),
    # The small model on 8 data replicas (otherwise only model M is calibrated there)
    ("generate", "T", 32, 16, 32, (8, 1, 1), 8, "-"),
    # Long responses on one device (every point above has R <= 64; R2 trains at R = 256): the
    # attention's quadratic part and the long sequences' elementwise traffic
    ("train", "T", 32, 16, 256, (1, 1, 1), 1, "none"),
    ("train", "T", 64, 16, 128, (1, 1, 1), 1, "none"),
    ("forward", "T", 32, 16, 256, (1, 1, 1), 1, "none"),
    ("generate", "T", 64, 16, 128, (1, 1, 1), 8, "-"),
]
assert not set(VALIDATION) & set(CALIBRATION), "calibration and validation configurations must be disjoint"
QUICK = [VALIDATION[i] for i in (0, 3, 8, 10, 13, 18, 21)]
# `rpeg calibrate --quick`: one forward, train and generation point per model size, 1-4 devices
QUICK_CALIBRATION = [CALIBRATION[i] for i in (0, 2, 7, 9, 14, 16, 11, 18)]
KEYS = ("kind", "model", "B", "P", "R", "mesh", "micro", "remat")

# One GPU (bench/gpu_check.sh -> costmodel_validate.py --gpu): bfloat16 Qwen2-0.5B / 1.5B shapes
# (random weights) on a 1-device mesh; disjoint calibration and validation halves, each with every
# stage kind and both models. GPU_DRY_*: the same plumbing with model T on a CPU (--dry-run).
GPU_MODELS = {
    "Q05": dict(preset="qwen2-0.5b", dtype="bfloat16", param_dtype="bfloat16"),
    "Q15": dict(preset="qwen2-1.5b", dtype="bfloat16", param_dtype="bfloat16"),
}
GPU_CALIBRATION = [  # Q05 forward, train, generate first: a budget cut still leaves every kind
    ("forward", "Q05", 64, 64, 192, (1, 1, 1), 1, "none"),
    ("train", "Q05", 32, 64, 192, (1, 1, 1), 1, "none"),
    ("generate", "Q05", 64, 32, 128, (1, 1, 1), 8, "-"),
    ("forward", "Q15", 32, 64, 448, (1, 1, 1), 1, "none"),
    ("train", "Q15", 32, 64, 192, (1, 1, 1), 2, "full"),
    ("generate", "Q15", 32, 32, 128, (1, 1, 1), 4, "-"),
]
GPU_VALIDATION = [
    ("forward", "Q05", 128, 64, 448, (1, 1, 1), 1, "none"),
    ("train", "Q05", 64, 64, 192, (1, 1, 1), 2, "none"),
    ("generate", "Q05", 128, 32, 128, (1, 1, 1), 8, "-"),
    ("forward", "Q15", 64, 64, 192, (1, 1, 1), 1, "none"),
    ("train", "Q15", 16, 64, 192, (1, 1, 1), 1, "none"),
    ("generate", "Q15", 16, 32, 256, (1, 1, 1), 4, "-"),
]
GPU_DRY_CALIBRATION = [
    ("forward", "T", 8, 16, 16, (1, 1, 1), 1, "none"),
    ("train", "T", 8, 16, 16, (1, 1, 1), 1, "none"),
    ("generate", "T", 8, 16, 16, (1, 1, 1), 4, "-"),
]
GPU_DRY_VALIDATION = [
    ("forward", "T", 16, 16, 16, (1, 1, 1), 1, "none"),
    ("train", "T", 4, 16, 16, (1, 1, 1), 1, "none"),
    ("generate", "T", 16, 16, 16, (1, 1, 1), 8, "-"),
]
assert not set(GPU_VALIDATION) & set(GPU_CALIBRATION), "GPU calibration and validation must be disjoint"


# Generation memory: the sampler's compiled programs (prefill, page fork, decode chunk) per
# device against stages.generate_memory. (model, slots B, prompt P, response R, tensor t, group G,
# page size); meshes of `tensor` devices only (data = 1: the page pool's layout over `data` is the
# sampler's, in flux). The formula was chosen looking at GEN_MEMORY_CAL; GEN_MEMORY_VAL is held out.
GEN_MEMORY_CAL = [
    ("T", 32, 16, 32, 1, 8, 16),
    ("T", 64, 16, 48, 2, 8, 16),
    ("M", 16, 16, 48, 1, 4, 8),
    ("W", 16, 16, 32, 2, 4, 16),
    ("T", 128, 16, 8, 1, 8, 16),
    ("M", 32, 16, 40, 2, 8, 16),
]
GEN_MEMORY_VAL = [
    ("T", 128, 16, 8, 2, 8, 16),
    ("M", 64, 16, 32, 1, 8, 32),
    ("W", 8, 32, 64, 1, 4, 16),
    ("W", 32, 16, 24, 2, 8, 8),
    ("T", 16, 16, 100, 1, 4, 16),
    ("M", 16, 32, 64, 2, 4, 16),
]
assert not set(GEN_MEMORY_CAL) & set(GEN_MEMORY_VAL)


def model_cfg(name: str, remat: str):
    spec = dict(MODELS[name] if name in MODELS else GPU_MODELS[name])
    preset = spec.pop("preset")
    return model_preset(preset, remat=remat, max_position_embeddings=512, **spec)


def point(c: tuple, seconds: float, memory: float | None) -> dict:
    """A measured configuration as a cost-model point (rpeg_jax/costmodel/fit.py)."""
    kind, mname, B, P, R, mesh, micro, remat = c
    ms = ModelShape.of(model_dims(model_cfg(mname, remat if kind != "generate" else "none"), "actor"))
    return {
        **dict(zip(KEYS, c)),
        "mesh": list(mesh),
        "dims": dataclasses.asdict(ms),
        "G": micro if kind == "generate" else 1,
        "micro": micro if kind != "generate" else 1,
        "seconds": seconds,
        "memory": memory,
    }


def layout(state, mesh):
    """(parameter shardings, activation resolver) of the sharding package's fsdp_tensor preset."""
    from rpeg_jax.sharding.params import param_shardings
    from rpeg_jax.sharding.rules import activation_resolver, get_rules

    rules = get_rules("fsdp_tensor")
    return param_shardings(state, mesh, rules), activation_resolver(mesh, rules)


def _mesh(shape):
    import jax

    n = int(np.prod(shape))
    return jax.make_mesh(
        shape, ("data", "fsdp", "tensor"), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,) * 3
    )


class Stage:
    """A compiled stage: `run()` executes it once and blocks; `peak` is bytes per device."""

    def __init__(self, kind, fn, args, resolver=None):
        self.kind, self.fn, self.args, self.peak = kind, fn, args, None
        if kind == "generate":
            fn()  # compiles prefill and the decode buckets
            return
        from rpeg_jax.sharding.axes import use_resolver

        with use_resolver(resolver) if resolver is not None else contextlib.nullcontext():
            self.compiled = fn.lower(*args).compile()
        ma = self.compiled.memory_analysis()
        if ma is not None:
            self.peak = (
                ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
            )

    def run(self):
        import jax

        if self.kind == "generate":
            return self.fn()
        out = self.compiled(*self.args)
        jax.block_until_ready(out)
        if self.kind == "train":  # donated params / optimizer state: feed the outputs back
            self.args = (out[0], out[1], self.args[2])


def build(kind, mname, B, P, R, mesh_shape, micro, remat) -> Stage:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rpeg_jax.models import init_model

    mesh = _mesh(mesh_shape)
    cfg = model_cfg(mname, remat if kind != "generate" else "none")
    model = init_model(cfg, seed=0)
    if kind == "generate":
        from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

        state = nnx.state(model, nnx.Param)
        nnx.update(model, jax.device_put(state, layout(state, mesh)[0]))
        sampler = Sampler(model, SamplerConfig(max_slots=B, max_seq_len=P + R), mesh=mesh)
        rng = np.random.default_rng(0)
        prompts = [[1] + rng.integers(3, 100, P - 1).tolist() for _ in range(B // micro)]
        params = SamplingParams(n=micro, max_new_tokens=R, ignore_eos=True, temperature=1.0)
        return Stage(kind, lambda: sampler.generate(prompts, params), ())
    from rpeg_jax.models import token_logprobs

    graphdef, state = nnx.split(model, nnx.Param)
    shard, resolver = layout(state, mesh)
    params = jax.device_put(state, shard)
    rng = np.random.default_rng(0)
    bsh = jax.sharding.NamedSharding(mesh, jax.P(("data", "fsdp")))
    put = lambda x: jax.device_put(x, bsh)  # noqa: E731
    tokens = put(jnp.asarray(rng.integers(3, cfg.vocab_size, (B, P + R)), jnp.int32))
    positions = put(jnp.broadcast_to(jnp.arange(P + R, dtype=jnp.int32), (B, P + R)))
    seg = put(jnp.ones((B, P + R), jnp.int32))
    targets = put(jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1))

    def logp(p, tok, pos, sg, tg):
        return token_logprobs(nnx.merge(graphdef, p), tok, pos, sg, tg, start=P - 1, length=R)[0]

    if kind == "forward":
        return Stage(kind, jax.jit(logp), (params, tokens, positions, seg, targets), resolver)
    import optax

    from rpeg_jax.config.rl import RLConfig
    from rpeg_jax.rl import make_actor_update

    tx = optax.adamw(1e-4)
    opt_state = jax.jit(tx.init)(params)

    def policy_fn(p, batch):
        return {
            "logp": logp(p, batch["tokens"], batch["positions"], batch["seg"], batch["targets"]),
            "entropy": None,
            "values": None,
        }

    update = make_actor_update(policy_fn, tx, RLConfig(algorithm="grpo", group_size=2, micro_batches=micro))
    batch = {
        "tokens": tokens,
        "positions": positions,
        "seg": seg,
        "targets": targets,
        "response_mask_BxR": put(jnp.ones((B, R), jnp.float32)),
        "advantages_BxR": put(jnp.asarray(rng.normal(size=(B, R)), jnp.float32)),
        "old_logp_BxR": put(jnp.full((B, R), -5.0, jnp.float32)),
    }
    return Stage(kind, jax.jit(update, donate_argnums=(0, 1)), (params, opt_state, batch), resolver)


@contextlib.contextmanager
def sampler_programs():
    """Record XLA's compiled memory analysis (bytes per device: arguments + outputs + temporaries -
    aliased, as for the training programs) of every distinct sampler device program called inside
    the block: {(name, signature): bytes}. Each program is lowered and compiled once more from its
    first call's arguments (before the call: the pools are donated)."""
    from rpeg_jax.sampling import engine

    names = ("prefill", "decode_chunk", "fork_pages")
    saved = {n: getattr(engine, n) for n in names}
    peaks: dict = {}

    def sig(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", "")))
        return type(x).__name__ if isinstance(x, (int, float, bool)) else x

    def wrap(name, fn):
        def call(*args, **kw):
            leaves = jax.tree_util.tree_leaves((args, {k: v for k, v in kw.items() if k not in STATIC_KW}))
            key = (name, tuple(sig(x) for x in leaves), tuple(sorted((k, kw[k]) for k in kw if k in STATIC_KW)))
            if key not in peaks:
                ma = fn.lower(*args, **kw).compile().memory_analysis()
                peaks[key] = (
                    (
                        ma.argument_size_in_bytes
                        + ma.output_size_in_bytes
                        + ma.temp_size_in_bytes
                        - ma.alias_size_in_bytes
                    )
                    if ma is not None
                    else None
                )
            return fn(*args, **kw)

        return call

    import jax

    STATIC_KW = ("chunk", "attention", "block_pages", "mesh")
    for n in names:
        setattr(engine, n, wrap(n, saved[n]))
    try:
        yield peaks
    finally:
        for n in names:
            setattr(engine, n, saved[n])


def generation_memory(c: tuple) -> dict:
    """A GEN_MEMORY configuration: build the sampler on a (1, 1, tensor) mesh, generate once, and
    return a point (kind "generate", memory = the largest per-device peak of its programs)."""
    import jax
    from flax import nnx

    from rpeg_jax.models import init_model
    from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

    mname, B, P, R, t, G, page = c
    mesh = _mesh((1, 1, t))
    model = init_model(model_cfg(mname, "none"), seed=0)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, layout(state, mesh)[0]))
    sampler = Sampler(model, SamplerConfig(max_slots=B, max_seq_len=P + R, page_size=page), mesh=mesh)
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 100, P - 1).tolist() for _ in range(B // G)]
    with sampler_programs() as peaks:
        sampler.generate(prompts, SamplingParams(n=G, max_new_tokens=R, ignore_eos=True, temperature=1.0))
    progs = {f"{k[0]}#{i}": v for i, (k, v) in enumerate(peaks.items())}
    p = point(("generate", mname, B, P, R, (1, 1, t), G, "-"), float("nan"), max(v for v in progs.values() if v))
    p.update(page_size=page, programs=progs)
    return p


def measure_set(configs, repeats: int, clock, batch: int = 7, log=print) -> list[dict]:
    """Points for `configs`: compiled `batch` at a time, one warm-up run each, then `repeats`
    round-robin rounds; the median of each configuration's runs on `clock`."""
    out = []
    for i in range(0, len(configs), batch):
        group, stages = [], []
        for c in configs[i : i + batch]:  # a configuration that fails to build or run is reported, not fatal
            try:
                s = build(*c)
                s.run()
            except Exception as e:  # noqa: BLE001
                log(f"  FAILED {c}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            group.append(c)
            stages.append(s)
        times = [[] for _ in stages]
        for _ in range(repeats):
            for j, s in enumerate(stages):
                t = clock()
                s.run()
                times[j].append(clock() - t)
        for c, s, ts in zip(group, stages, times):
            p = point(c, statistics.median(ts), s.peak)
            p["runs_s"] = ts
            out.append(p)
            log(
                f"  measured {c[0]:<8} {c[1]} B{c[2]:<3} S{c[3] + c[4]:<4} mesh {tuple(c[5])} mb{c[6]} {c[7]:<4} "
                f"{1e3 * p['seconds']:9.2f} ms  (runs {', '.join(f'{1e3 * x:.0f}' for x in ts)})"
            )
        del stages
        gc.collect()
    return out
