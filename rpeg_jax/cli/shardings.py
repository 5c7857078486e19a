"""`rpeg shardings --config X [key=value ...]`: for every parameter and main activation, its
shape, logical axes and partition per stage (train, generate), with bytes per device.

Runs on abstract meshes (no device is touched, `--devices N` picks the device count, default:
this machine's). The model is built abstractly with `nnx.eval_shape` (the CLI may import models;
the sharding library never does).
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.run import load_config
from rpeg_jax.models import Transformer
from rpeg_jax.sharding.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, LAYERS, MLP, SEQ, VOCAB
from rpeg_jax.sharding.layouts import ROLES, StageLayout, stage_layout
from rpeg_jax.sharding.params import bytes_per_device, param_infos, shard_shape
from rpeg_jax.sharding.rules import resolve


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML preset (default: configs/default.yaml)")
    p.add_argument("--devices", type=int, default=None, help="number of devices (default: jax.device_count())")
    p.add_argument("--stage", choices=("all",) + ROLES, default="all")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _spec_str(spec: Any) -> str:
    return "P(" + ", ".join("None" if e is None else repr(e) for e in tuple(spec)) + ")"


def activations(cfg) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """The main activations of a step: (name, shape, logical axes)."""
    m = cfg.model
    B = cfg.data.prompts_per_step * cfg.rl.group_size
    T = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    D, H, K, E, F, V, L = (
        m.hidden_size,
        m.num_heads,
        m.num_kv_heads,
        m.head_size,
        m.intermediate_size,
        m.vocab_size,
        m.num_layers,
    )
    return [
        ("tokens", (B, T), (BATCH, SEQ)),
        ("hidden", (B, T, D), (BATCH, SEQ, EMBED)),
        ("q", (B, T, H, E), (BATCH, SEQ, HEADS, HEAD_DIM)),
        ("k/v", (B, T, K, E), (BATCH, SEQ, KV_HEADS, HEAD_DIM)),
        ("mlp", (B, T, F), (BATCH, SEQ, MLP)),
        ("logits", (B, T, V), (BATCH, SEQ, VOCAB)),
        ("kv_cache", (L, B, T, K, E), (LAYERS, BATCH, SEQ, KV_HEADS, HEAD_DIM)),
    ]


def _row(cols: list[str], widths: list[int]) -> str:
    return "  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()


def print_stage(layout: StageLayout, trees: dict[str, Any], cfg, itemsize: int) -> None:
    sizes = dict(layout.mesh.shape)
    print(
        f"stage {layout.role}: mesh {sizes} ({math.prod(sizes.values())} devices), rules {layout.rules.name!r}, "
        f"{len(layout.overrides)} override(s)"
    )
    widths = [22, 18, 40, 34, 12]
    print(_row(["name", "shape", "logical axes", "partition", "bytes/device"], widths))
    for label, tree in trees.items():
        total = per_device = 0
        for info, spec, nbytes in layout.table(tree, unmatched_ok=len(trees) > 1):
            axes = "(" + ", ".join(str(a) for a in info.axes) + ")" if info.axes is not None else "-"
            print(
                _row(
                    [
                        f"{label}.{info.name}" if len(trees) > 1 else info.name,
                        str(info.shape),
                        axes,
                        _spec_str(spec),
                        human(nbytes),
                    ],
                    widths,
                )
            )
            total += bytes_per_device(info, (), layout.mesh)
            per_device += nbytes
        print(f"  {label} parameters: {human(per_device)} per device of {human(total)}")
    for name, shape, logical in activations(cfg):
        spec = resolve(logical, shape, layout.mesh, layout.rules, name, strict=False)
        n = math.prod(shard_shape(shape, spec, layout.mesh))
        print(
            _row(
                [f"[act] {name}", str(shape), "(" + ", ".join(logical) + ")", _spec_str(spec), human(n * itemsize)],
                widths,
            )
        )
    print()


def run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    n = args.devices or jax.device_count()
    trees = {"actor": nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)}
    if cfg.rl.algorithm == "ppo" and not cfg.pipeline.share_actor_critic:
        trees["critic"] = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.critic_model, rngs=nnx.Rngs(0))), nnx.Param)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype]
    roles = ROLES if args.stage == "all" else (args.stage,)
    for role in roles:
        layout = stage_layout(cfg.sharding, role, num_devices=n)
        print_stage(layout, trees if role == "train" else {"actor": trees["actor"]}, cfg, itemsize)
    if len(trees) > 1:  # overrides must match something in some tree
        layouts = stage_layout(cfg.sharding, "train", num_devices=n)
        names = [i.name for t in trees.values() for i in param_infos(t)]
        for o in layouts.overrides:
            if not any(o.regex.fullmatch(x) for x in names):
                raise ConfigError(o.key, o.pattern, "pattern matches no parameter")
    return 0
