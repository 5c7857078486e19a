"""Validate the cost model against measured stage runs on this CPU (8 forced XLA devices).

    python bench/costmodel_validate.py --json out.json [--quick] [--repeats 3] [--hardware cpu]

Measures >= 20 stage configurations (model sizes, batch sizes, lengths, meshes data x fsdp x
tensor of the 8 CPU devices): forward logprob passes and actor updates (rpeg_jax.models +
rpeg_jax.rl.make_actor_update, the code the runtime runs), and generation (rpeg_jax.sampling). Each is compiled once, run `repeats` times (median), and compared with the model's
prediction on the calibrated `cpu` profile (`rpeg calibrate` first; the profile is fitted on
micro-benchmarks only, never on these stages). Peak memory per device is XLA's compiled memory
analysis (arguments + outputs + temporaries - aliased).

JSON: stages[...] (config, measured_s, predicted_s, error, memory measured/predicted),
mape_stage {kind: MAPE}, memory_error (mean |relative error|), and with --step-level the
step-level fields mape_step (the chosen plan of the default config), spearman (>= 10 candidate
plans, predicted vs measured step time) and chosen_vs_best, from whole RL steps run by
rpeg_jax.runtime.train under each plan (null with `pending` otherwise).

The machine is shared: timings taken while others run tests are noisy; rerun when it is quiet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from rpeg_jax.config.model import model_preset  # noqa: E402
from rpeg_jax.config.rl import RLConfig  # noqa: E402
from rpeg_jax.costmodel import stages as S  # noqa: E402
from rpeg_jax.costmodel.hardware import load_hardware  # noqa: E402
from rpeg_jax.costmodel.lengths import LengthDist  # noqa: E402
from rpeg_jax.costmodel.shape import ModelShape  # noqa: E402
from rpeg_jax.graph.algorithms import model_dims  # noqa: E402

# Model shapes small enough to time on a 2-core CPU (T is WORKLOADS.md's tiny model).
MODELS = {
    "T": dict(preset="tiny"),
    "M": dict(preset="tiny", vocab_size=1024, hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2,
              intermediate_size=1024),
    "W": dict(preset="tiny", vocab_size=2048, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
              intermediate_size=1536),
}

# (kind, model, B, P, R, mesh (data, fsdp, tensor), micro-batches, remat)
CONFIGS = [
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
]
# generate: (kind, model, B sequences, P prompt, R new tokens, mesh, G group size, "-")
CONFIGS += [
    ("generate", "T", 64, 16, 32, (8, 1, 1), 8, "-"),
    ("generate", "T", 128, 16, 32, (8, 1, 1), 8, "-"),
    ("generate", "T", 32, 16, 64, (4, 1, 2), 4, "-"),
    ("generate", "M", 32, 16, 32, (8, 1, 1), 8, "-"),
    ("generate", "M", 16, 16, 32, (1, 1, 1), 4, "-"),
    ("generate", "W", 16, 16, 32, (4, 1, 2), 4, "-"),
]
QUICK = [CONFIGS[i] for i in (0, 3, 8, 10, 13, 18, 21)]

# logical axis -> mesh axis for parameters (FSDP over 'fsdp', Megatron-style over 'tensor')
PARAM_RULES = {"embed": "fsdp", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


def model_cfg(name: str, remat: str):
    spec = dict(MODELS[name])
    preset = spec.pop("preset")
    return model_preset(preset, remat=remat, max_position_embeddings=512, **spec)


def param_specs(state, mesh):
    """PartitionSpec per parameter from its logical `axes` metadata (size must divide)."""
    import jax
    from flax import nnx

    def spec(var):
        axes = (var.get_metadata() or {}).get("axes") or ()
        shape = var.get_value().shape if hasattr(var, "get_value") else var.value.shape
        out, used = [], set()
        for ax, n in zip(axes, shape):
            m = PARAM_RULES.get(ax)
            ok = m is not None and m not in used and n % mesh.shape[m] == 0 and mesh.shape[m] > 1
            out.append(m if ok else None)
            if ok:
                used.add(m)
        return jax.sharding.NamedSharding(mesh, jax.P(*out))

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def layout(state, mesh):
    """(parameter shardings, activation resolver): the sharding package's fsdp_tensor preset (what
    the runtime uses) when present, else the small fallback mapping above with no activation hook."""
    try:
        from rpeg_jax.sharding.params import param_shardings
        from rpeg_jax.sharding.rules import activation_resolver, get_rules
    except ImportError:
        return param_specs(state, mesh), None
    rules = get_rules("fsdp_tensor")
    return param_shardings(state, mesh, rules), activation_resolver(mesh, rules)


class _traced:
    """A jitted function lowered inside the activation-resolver context (constrain() hooks)."""

    def __init__(self, fn, resolver):
        self.fn, self.resolver = fn, resolver

    def lower(self, *args):
        import contextlib

        from rpeg_jax.sharding.axes import use_resolver

        with use_resolver(self.resolver) if self.resolver is not None else contextlib.nullcontext():
            return self.fn.lower(*args)


def build_generate(mname, B, P, R, mesh_shape, G):
    """(callable, args) generating B = (B/G prompts) x G completions of R tokens (eos ignored)."""
    import jax
    from flax import nnx

    from rpeg_jax.models import init_model
    from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams

    n = int(np.prod(mesh_shape))
    mesh = jax.make_mesh(mesh_shape, ("data", "fsdp", "tensor"), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    model = init_model(model_cfg(mname, "none"), seed=0)
    state = nnx.state(model, nnx.Param)
    shard, _ = layout(state, mesh)
    nnx.update(model, jax.device_put(state, shard))
    sampler = Sampler(model, SamplerConfig(max_slots=B, max_seq_len=P + R), mesh=mesh)
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 100, P - 1).tolist() for _ in range(B // G)]
    params = SamplingParams(n=G, max_new_tokens=R, ignore_eos=True, temperature=1.0)
    return _Gen(sampler, prompts, params), (), mesh


class _Gen:
    """Sampler.generate with the timing interface of a compiled stage (compiles on first call)."""

    def __init__(self, sampler, prompts, params):
        self.sampler, self.prompts, self.params = sampler, prompts, params

    def lower(self, *args):
        return self

    def compile(self):
        self.sampler.generate(self.prompts, self.params)  # compiles prefill and decode buckets
        return self

    def memory_analysis(self):
        return None

    def __call__(self, *args):
        return self.sampler.generate(self.prompts, self.params)


def build(kind, mname, B, P, R, mesh_shape, micro, remat):
    """(jitted fn, args) for one stage configuration on a mesh of the first d*f*t devices."""
    if kind == "generate":
        return build_generate(mname, B, P, R, mesh_shape, micro)
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from rpeg_jax.models import init_model, token_logprobs
    from rpeg_jax.rl import make_actor_update

    n = int(np.prod(mesh_shape))
    mesh = jax.make_mesh(mesh_shape, ("data", "fsdp", "tensor"), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    cfg = model_cfg(mname, remat)
    model = init_model(cfg, seed=0)
    graphdef, state = nnx.split(model, nnx.Param)
    shard, resolver = layout(state, mesh)
    params = jax.device_put(state, shard)
    S_ = P + R
    rng = np.random.default_rng(0)
    bsh = jax.sharding.NamedSharding(mesh, jax.P(("data", "fsdp")))
    tokens = jax.device_put(jnp.asarray(rng.integers(3, cfg.vocab_size, (B, S_)), jnp.int32), bsh)
    positions = jax.device_put(jnp.broadcast_to(jnp.arange(S_, dtype=jnp.int32), (B, S_)), bsh)
    seg = jax.device_put(jnp.ones((B, S_), jnp.int32), bsh)
    targets = jax.device_put(jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1), bsh)

    def logp(p, tok, pos, sg, tg):
        m = nnx.merge(graphdef, p)
        return token_logprobs(m, tok, pos, sg, tg, start=P - 1, length=R)[0]

    if kind == "forward":
        return _traced(jax.jit(logp), resolver), (params, tokens, positions, seg, targets), mesh
    rl = RLConfig(algorithm="grpo", group_size=2, micro_batches=micro)
    tx = optax.adamw(1e-4)
    opt_state = jax.jit(tx.init)(params)

    def policy_fn(p, batch):
        return {"logp": logp(p, batch["tokens"], batch["positions"], batch["seg"], batch["targets"]),
                "entropy": None, "values": None}

    update = make_actor_update(policy_fn, tx, rl)
    batch = {"tokens": tokens, "positions": positions, "seg": seg, "targets": targets,
             "response_mask_BxR": jax.device_put(jnp.ones((B, R), jnp.float32), bsh),
             "advantages_BxR": jax.device_put(jnp.asarray(rng.normal(size=(B, R)), jnp.float32), bsh),
             "old_logp_BxR": jax.device_put(jnp.full((B, R), -5.0, jnp.float32), bsh)}
    fn = jax.jit(update, donate_argnums=(0, 1))
    return _traced(fn, resolver), (params, opt_state, batch), mesh


def measure(kind, fn, args, repeats):
    """(median seconds, compiled peak bytes per device)."""
    import jax

    compiled = fn.lower(*args).compile()
    ma = compiled.memory_analysis()
    peak = None
    if ma is not None:
        peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                - ma.alias_size_in_bytes)
    times = []
    state = args
    for i in range(repeats + 1):
        t = CLOCK()
        out = compiled(*state)
        if kind != "generate":
            jax.block_until_ready(out)
        if i:
            times.append(CLOCK() - t)
        if kind == "train":  # donated params/opt state: feed the outputs back
            state = (out[0], out[1], state[2])
    return statistics.median(times), peak


def predict(hw, kind, mname, B, P, R, mesh_shape, micro, remat):
    ms = ModelShape.of(model_dims(model_cfg(mname, remat if kind != "generate" else "none"), "actor"))
    st = S.Setting(hw=hw, B=B, P=P, R=R, G=1, dist=LengthDist.fixed(R), causal_skip=False, dense_scores=True,
                   packing=False, budget_bytes=hw.hbm_bytes)
    d, f, t = mesh_shape
    busy = d * f * t
    if kind == "generate":  # the sampler's slots are global: B / (d·f) per data replica
        st = dataclasses.replace(st, G=micro, kv_replicated=True)
        n = busy
        sec = S.generate_stage(st, ms, n, [t], [-(-B // (n // t))])[0][0]
        mem = float(S.generate_memory(st, ms, t, -(-B // (n // t)), n // t))
        return float(sec), mem
    if kind == "forward":
        sec = S.forward_stage(st, ms, busy, d, f, t, micro)[0]
        mem = ms.weight_bytes(ms.param_bytes_per) / (f * t) + S.forward_memory(st, ms, d, f, t, micro)
    else:
        sec = S.train_stage(st, ms, busy, d, f, t, micro, remat)[0]
        mem = S.train_memory(st, ms, d, f, t, micro, remat)
    return float(sec), float(mem)


CLOCK = time.perf_counter  # --clock cpu: process CPU seconds (use a profile calibrated with --clock cpu)


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def run_plan_steps(cfg, plan, steps: int, warmup: int = 2) -> list[float]:
    """Seconds per RL step (after `warmup` steps) of `cfg` run by the runtime under `plan`."""
    import tempfile

    from rpeg_jax.costmodel.planner import apply_plan_settings
    from rpeg_jax.runtime import train

    cfg = apply_plan_settings(cfg, plan)
    with tempfile.TemporaryDirectory() as d:
        tr = dataclasses.replace(cfg.train, steps=warmup + steps, run_dir=d, checkpoint_every=0,
                                 tensorboard=False, progress=False, resume="never")
        train(dataclasses.replace(cfg, train=tr), plan=plan)
        with open(os.path.join(d, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f if line.strip()]
    return [r["timing_s/step"] for r in recs[warmup:] if "timing_s/step" in r]


def step_level(args):
    """End-to-end step time of the default config's plans, measured by the runtime."""
    if not args.step_level:
        return {"mape_step": None, "spearman": None, "chosen_vs_best": None,
                "pending": "run with --step-level (needs a runtime that honours each plan's meshes)"}
    return run_step_validation(args)


def run_step_validation(args):
    """Measure >= 10 candidate plans of the default config against their predictions."""
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel import planner as P

    cfg = load_config(None, [])
    cfg = dataclasses.replace(cfg, costmodel=dataclasses.replace(cfg.costmodel, runners_up=12))
    res = P.search(cfg, 8, load_hardware(args.hardware))
    plans = [res.chosen, *res.runners_up, *res.baselines.values()]
    measured = [float(np.median(run_plan_steps(cfg, p.plan, steps=args.steps))) for p in plans]
    predicted = [p.step_time_s for p in plans]
    for p, q, m in zip(plans, predicted, measured):
        print(f"plan {p.label:<12} predicted {q:8.3f} s  measured {m:8.3f} s  ({100 * (q - m) / m:+.1f}%)", flush=True)
    err = [abs(p - m) / m for p, m in zip(predicted, measured)]
    return {"mape_step": float(err[0]), "mape_step_all": float(np.mean(err)),
            "spearman": spearman(predicted, measured),
            "chosen_vs_best": measured[0] / min(measured) - 1.0,
            "plans": [{"label": p.label, "predicted_s": q, "measured_s": m, "knobs": p.knobs, "layout": p.layout}
                      for p, q, m in zip(plans, predicted, measured)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--step-level", action="store_true", help="also run whole RL steps of >= 10 plans")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU seconds (robust to other processes; pair with a profile from "
                         "`rpeg calibrate --clock cpu`)")
    ap.add_argument("--only", default=None, help="comma-separated kinds to measure (forward,train,generate)")
    ap.add_argument("--reuse", default=None, help="re-predict the measurements of an earlier --json output "
                                                 "(e.g. after recalibrating) instead of measuring again")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    hw = load_hardware(args.hardware)
    rows = []
    kinds = set(args.only.split(",")) if args.only else {"forward", "train", "generate"}
    old = {}
    if args.reuse:
        with open(args.reuse) as f:
            for r in json.load(f)["stages"]:
                old[(r["kind"], r["model"], r["B"], r["P"], r["R"], tuple(r["mesh"]), r["micro"], r["remat"])] = r
    for c in [c for c in (QUICK if args.quick else CONFIGS) if c[0] in kinds]:
        if args.reuse:
            if c not in old:
                continue
            sec, peak = old[c]["measured_s"], old[c]["memory_measured"]
        else:
            fn, fargs, _ = build(*c)
            sec, peak = measure(c[0], fn, fargs, args.repeats)
        psec, pmem = predict(hw, *c)
        row = dict(zip(("kind", "model", "B", "P", "R", "mesh", "micro", "remat"), c),
                   measured_s=sec, predicted_s=psec, error=(psec - sec) / sec,
                   memory_measured=peak, memory_predicted=pmem,
                   memory_error=None if not peak else (pmem - peak) / peak)
        rows.append(row)
        print(f"{c[0]:<8} {c[1]} B{c[2]:<3} S{c[3] + c[4]:<4} mesh {c[5]} mb{c[6]} {c[7]:<4}  "
              f"measured {sec * 1e3:8.2f} ms  predicted {psec * 1e3:8.2f} ms  ({100 * row['error']:+6.1f}%)  "
              f"mem {peak or 0:>11.0f} vs {pmem:>11.0f}", flush=True)
    kinds = sorted({r["kind"] for r in rows})
    out = {"hardware": hw.name, "calibrated": bool(hw.calibrated), "clock": args.clock, "stages": rows,
           "mape_stage": {k: float(np.mean([abs(r["error"]) for r in rows if r["kind"] == k])) for k in kinds},
           "mape_stage_all": float(np.mean([abs(r["error"]) for r in rows])),
           "memory_error": float(np.mean([abs(r["memory_error"]) for r in rows if r["memory_error"] is not None])),
           "spearman_stage": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])}
    out.update(step_level(args))
    print(json.dumps({k: v for k, v in out.items() if k != "stages"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
