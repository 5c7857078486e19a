"""LoRA adapters in PEFT's layout: read/write a PEFT adapter directory and merge adapters into a model.

An adapter on HF module `m` (q_proj, ..., down_proj) of layer i is A [r, in] and B [out, r] in HF's
orientation (`W_hf [out, in]`); the adapted weight is W_hf + (alpha / r) * B @ A (PEFT's formula,
without rsLoRA). Here adapters are stacked over layers: {target: (A [L, r, in], B [L, out, r])}.
`merge` adds the delta into our stacked weights through the same layouts models/hf.py loads HF
tensors with, so a merged model exports with save_hf and equals PEFT's merge_and_unload.

Training (model.lora) keeps the adapters as model parameters in our orientation (models/adapters.py:
lora_a_<w> [L, in..., r], lora_b_<w> [L, r, out...]); `to_peft` / `from_peft` convert between the two.

Called by: runtime/export.py (`rpeg export --adapter`), tests/test_lora.py, tests/test_lora_train.py,
bench/lora.py.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from rpeg_jax.config.model import ModelConfig
from rpeg_jax.models.adapters import PROJECTIONS, names
from rpeg_jax.models.hf import _layer_mapping
from rpeg_jax.models.llama import Transformer

# PEFT target module name -> (our stacked parameter, HF suffix under model.layers.{i}.)
TARGETS = {
    "q_proj": ("wq", "self_attn.q_proj"),
    "k_proj": ("wk", "self_attn.k_proj"),
    "v_proj": ("wv", "self_attn.v_proj"),
    "o_proj": ("wo", "self_attn.o_proj"),
    "gate_proj": ("w_gate", "mlp.gate_proj"),
    "up_proj": ("w_up", "mlp.up_proj"),
    "down_proj": ("w_down", "mlp.down_proj"),
}
PREFIX = "base_model.model.model.layers"


def _layouts(cfg: ModelConfig) -> dict:
    return {ours: layout for ours, _, layout in _layer_mapping(cfg)}


def target_shapes(cfg: ModelConfig, target: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A's shape [L, r, in], B's shape [L, out, r]) of one target."""
    if target not in TARGETS:
        raise ValueError(f"lora target {target!r}: unknown; known: {', '.join(TARGETS)}")
    out, inn = _layouts(cfg)[TARGETS[target][0]].hf_shape
    return (cfg.num_layers, rank, inn), (cfg.num_layers, out, rank)


def merge(model: Transformer, adapters: dict, *, rank: int, alpha: float) -> None:
    """Add (alpha / rank) * B @ A into `model`'s stacked weights in place."""
    scale = alpha / rank
    layouts = _layouts(model.cfg)
    for target, (a, b) in adapters.items():
        ours = TARGETS[target][0]
        var = getattr(model.layers, ours)
        w = var[...]
        delta = jnp.einsum("lor,lri->loi", jnp.asarray(b, jnp.float32), jnp.asarray(a, jnp.float32)) * scale
        delta = jax.vmap(layouts[ours].from_hf)(delta)
        var[...] = (w.astype(jnp.float32) + delta).astype(w.dtype)


def write_peft_adapter(
    path: str, cfg: ModelConfig, adapters: dict, *, rank: int, alpha: float, base_model: str | None = None
) -> None:
    """A PEFT adapter directory: adapter_config.json and adapter_model.safetensors (PEFT's key names)."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for target, (a, b) in adapters.items():
        suffix = TARGETS[target][1]
        for i in range(cfg.num_layers):
            tensors[f"{PREFIX}.{i}.{suffix}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a[i], np.float32))
            tensors[f"{PREFIX}.{i}.{suffix}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b[i], np.float32))
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(adapters),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def read_peft_adapter(path: str, cfg: ModelConfig) -> tuple[dict, int, float]:
    """(adapters, rank, alpha) from a PEFT adapter directory; one-line errors for what is unsupported."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{path}: only plain LoRA adapters are supported (no rsLoRA/DoRA)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{path}: per-module rank_pattern/alpha_pattern is not supported")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    targets = config["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    adapters = {}
    for target in targets:
        a_shape, b_shape = target_shapes(cfg, target, rank)
        suffix = TARGETS[target][1]
        a = np.stack([tensors[f"{PREFIX}.{i}.{suffix}.lora_A.weight"] for i in range(cfg.num_layers)])
        b = np.stack([tensors[f"{PREFIX}.{i}.{suffix}.lora_B.weight"] for i in range(cfg.num_layers)])
        if a.shape != a_shape or b.shape != b_shape:
            raise ValueError(f"{path}: {target} adapter shapes {a.shape}, {b.shape}; expected {a_shape}, {b_shape}")
        adapters[target] = (a, b)
    return adapters, rank, alpha


def init_adapters(cfg: ModelConfig, targets, rank: int, rngs: nnx.Rngs) -> dict:
    """PEFT's initialisation: A ~ kaiming-uniform-like (uniform ±1/sqrt(in)), B = 0 (so the adapted
    model starts equal to the base)."""
    out = {}
    for target in targets:
        a_shape, b_shape = target_shapes(cfg, target, rank)
        bound = 1.0 / np.sqrt(a_shape[-1])
        out[target] = (
            jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound),
            jnp.zeros(b_shape, jnp.float32),
        )
    return out


def _params(state) -> dict:
    """{name: array} of the adapters under `layers` of a state (nnx.State or nested dict of arrays)."""
    layers = state["layers"]
    return {k: (v[...] if isinstance(v, nnx.Variable) else v) for k, v in layers.items()}


def to_peft(cfg: ModelConfig, state) -> dict:
    """Adapters of a LoRA model's state (models/adapters.py orientation) -> {target: (A [L, r, in],
    B [L, out, r])} in PEFT's orientation, as float32 numpy. Our in-dims and out-dims are HF's
    grouped dims in HF's order (models/hf._layer_mapping), so each is a transpose and a reshape."""
    params = _params(state)
    out = {}
    for target in cfg.lora.targets:
        weight, _ = PROJECTIONS[target]
        a_name, b_name = names(weight)
        a, b = np.asarray(params[a_name], np.float32), np.asarray(params[b_name], np.float32)
        L, r = a.shape[0], a.shape[-1]
        out[target] = (
            np.moveaxis(a, -1, 1).reshape(L, r, -1),  # [L, in..., r] -> [L, r, in]
            np.moveaxis(b.reshape(L, r, -1), 1, 2),  # [L, r, out...] -> [L, out, r]
        )
    return out


def from_peft(cfg: ModelConfig, adapters: dict) -> dict:
    """{target: (A [L, r, in], B [L, out, r])} -> {"layers": {lora_a_<w>: ..., lora_b_<w>: ...}} in our
    orientation (the inverse of to_peft; shapes from the model's weight layouts)."""
    layouts = _layouts(cfg)
    out = {}
    for target, (a, b) in adapters.items():
        weight, c = PROJECTIONS[target]
        ours = layouts[weight].shape  # one layer's [in..., out...]
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        L, r = a.shape[0], a.shape[1]
        a_name, b_name = names(weight)
        out[a_name] = np.moveaxis(a.reshape(L, r, *ours[:c]), 1, -1)
        out[b_name] = np.moveaxis(b, 2, 1).reshape(L, r, *ours[c:])
    return {"layers": out}
