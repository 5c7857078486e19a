"""Hugging Face checkpoint configs at config time: `model.path` (and `critic.path`) define the shape.

    fields = model_fields(json.load(open("ckpt/config.json")))    # -> ModelConfig fields (plain dict)
    data = resolve_checkpoint({"path": "ckpt", "rope_theta": 5e5}, "model")   # checkpoint under the given
    lines = checkpoint_overrides(cfg)                              # "model.rope_theta=...: given, overrides ..."

A local checkpoint directory's config.json (and generation_config.json, whose eos_token_id, an int
or a list as in Llama 3 and Qwen2.5, ends sequences besides eos_id: `model.eos_ids`) is read here,
with no JAX, before the run config is validated, so the planner, FLOP counts and memory checks
price the checkpoint's shape. Fields given beside the path (YAML or command line) win; those the
weights fix (vocab, layers, heads, widths, tying, biases, q/k norms) cannot differ, so a different
value is an error naming both sides. Every error is a ConfigError naming the file and the field.

Callers: config/run.from_dict (resolve_checkpoint), models/hf.load_hf (config_from_hf),
runtime/trainer.py and the `rpeg plan` / `rpeg config` commands (checkpoint_overrides).
"""

from __future__ import annotations

import json
import os
import typing
from typing import Any

from rpeg_jax.config.base import ConfigError, _coerce, build, key, to_dict
from rpeg_jax.config.model import ModelConfig

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe")  # config.json model_type values
QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config default: a qwen3 config.json without head_dim means 128
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# ModelConfig field -> the config.json key it comes from (for messages).
HF_NAMES = {
    "arch": "model_type",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "max_position_embeddings": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": "model_type",  # Qwen2 has q/k/v biases, Llama and Qwen3 not
    "qk_norm": "model_type",  # Qwen3 normalises q and k per head
    "bos_id": "bos_token_id",
    "eos_id": "eos_token_id",
    "pad_id": "pad_token_id",
    "eos_ids": "eos_token_id",
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
    "decoder_sparse_step": "decoder_sparse_step",
    "mlp_only_layers": "mlp_only_layers",
}
# Fixed by the weights' shapes: a value given beside the path that differs cannot load.
FIXED = (
    "arch",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "tie_embeddings",
    "qkv_bias",
    "qk_norm",
    "num_experts",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
)


class HFConfigError(ValueError):
    """A config.json the model cannot be built from; `str(err)` names the field (not the file)."""


def model_fields(hf: dict, generation: dict | None = None) -> dict[str, Any]:
    """ModelConfig fields (plain values, no dtype: the run's own) from a config.json dict and, if
    present, a generation_config.json dict. Raises HFConfigError naming the field."""
    if not isinstance(hf, dict):
        raise HFConfigError("must hold a JSON object")
    arch = hf.get("model_type")
    if arch is None:
        raise HFConfigError(f"has no model_type (required; supported: {', '.join(SUPPORTED)})")
    if arch not in SUPPORTED:
        raise HFConfigError(f"model_type={arch!r} is not supported ({', '.join(SUPPORTED)})")
    for name in REQUIRED:
        v = hf.get(name)
        if v is None:
            raise HFConfigError(f"has no {name} (required)")
        if isinstance(v, bool) or not isinstance(v, int):
            raise HFConfigError(f"{name}={v!r} must be an integer")
    if hf.get("mlp_bias"):
        raise HFConfigError("mlp_bias=true is not supported")
    qwen3 = arch in ("qwen3", "qwen3_moe")
    if arch in ("llama", "qwen3", "qwen3_moe") and hf.get("attention_bias"):
        raise HFConfigError(f"attention_bias=true (q/k/v/o_proj biases) is not supported for {arch}")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise HFConfigError("use_sliding_window=true is not supported")
    windowed = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if windowed:
        raise HFConfigError(f"layer_types has {windowed[0]!r}: only full_attention layers are supported")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or (QWEN3_HEAD_DIM if qwen3 else None)
    if head_dim == hf["hidden_size"] // heads:
        head_dim = None  # canonical: implied by hidden_size / num_heads
    eos = _ids(hf.get("eos_token_id"), "eos_token_id")
    eos_id = eos[0] if eos else 0
    if generation and generation.get("eos_token_id") is not None:
        eos = _ids(generation["eos_token_id"], "generation_config.json's eos_token_id")
    pad = hf.get("pad_token_id")
    return dict(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=(arch == "qwen2"),
        qk_norm=qwen3,
        **(_moe_fields(hf) if arch == "qwen3_moe" else {}),
        bos_id=hf.get("bos_token_id") or 0,
        eos_id=eos_id,
        pad_id=pad if pad is not None else eos_id,
        eos_ids=tuple(i for i in dict.fromkeys(eos) if i != eos_id),
    )


def _moe_fields(hf: dict) -> dict[str, Any]:
    """Qwen3-MoE's fields (transformers' Qwen3MoeConfig defaults where absent; transformers 5 writes
    num_experts as num_local_experts)."""
    if hf.get("num_experts") is None and hf.get("num_local_experts") is not None:
        hf = {**hf, "num_experts": hf["num_local_experts"]}
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        v = hf.get(name)
        if v is None or isinstance(v, bool) or not isinstance(v, int):
            raise HFConfigError(f"{name}={v!r} must be an integer (required for qwen3_moe)")
    return dict(
        num_experts=hf["num_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
    )


def _ids(v, name: str) -> list[int]:
    """An eos_token_id value (an int, a list of ints, or null) as a list."""
    if v is None:
        return []
    items = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise HFConfigError(f"{name}={v!r} must be an integer or a list of integers")
    return items


def _rope_scaling(hf: dict) -> dict | None:
    rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 nests rope settings here
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise HFConfigError(f"rope_scaling.rope_type={kind!r} is not supported (llama3)")
    out = {}
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if name not in scaling:
            raise HFConfigError(f"rope_scaling has no {name} (required for rope_type llama3)")
        out[name] = scaling[name]
    return out


def config_from_hf(hf: dict, *, value_head: bool = False, dtype: str | None = None) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (errors name the offending field). dtype:
    the parameters' and compute dtype; None -> the checkpoint's (torch_dtype / dtype), else float32."""
    try:
        fields = model_fields(hf)
    except HFConfigError as e:
        raise ValueError(f"config.json: {e}") from None
    ckpt_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    dtype = dtype or (ckpt_dtype if ckpt_dtype in ("float32", "bfloat16", "float16") else "float32")
    return build(ModelConfig, {**fields, "value_head": value_head, "param_dtype": dtype, "dtype": dtype}, "config.json")


def _read_json(file: str, section: str, path: str, required: bool) -> dict | None:
    if not os.path.isfile(file):
        if required:
            raise ConfigError(key(section, "path"), path, f"no {os.path.basename(file)} in it (a local checkpoint dir)")
        return None
    try:
        with open(file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(key(section, "path"), path, f"{file} is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(key(section, "path"), path, f"cannot read {file}: {e}") from None


def read_checkpoint(path: str, section: str = "model") -> dict[str, Any]:
    """The ModelConfig fields of the checkpoint dir `path` (config.json + generation_config.json),
    checked: errors are ConfigError(`<section>.path`, path, '<file>: <field> ...')."""
    if not isinstance(path, str) or not path:
        raise ConfigError(key(section, "path"), path, "must be a checkpoint directory")
    if not os.path.isdir(path):
        raise ConfigError(key(section, "path"), path, "not a directory (only local checkpoints are read)")
    file = os.path.join(path, "config.json")
    hf = _read_json(file, section, path, required=True)
    gen_file = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_file, section, path, required=False)
    try:
        fields = model_fields(hf, gen if isinstance(gen, dict) else None)
    except HFConfigError as e:
        where = gen_file if "generation_config" in str(e) else file
        raise ConfigError(key(section, "path"), path, f"{where}: {e}") from None
    try:  # the checkpoint's own values must make a valid model (ranges, divisibility)
        build(ModelConfig, fields, section)
    except ConfigError as e:
        name = e.key.rsplit(".", 1)[-1]
        raise ConfigError(
            key(section, "path"), path, f"{file}: {HF_NAMES.get(name, name)}={e.value!r}: {e.why}"
        ) from None
    return fields


def _same(name: str, given: Any, ckpt: dict[str, Any], section: str) -> bool:
    """Whether a value given for field `name` equals the checkpoint's (both read as the field's type)."""
    hint = typing.get_type_hints(ModelConfig)[name]
    ours = _coerce(hint, given, key(section, name))
    theirs = _coerce(hint, ckpt[name], key(section, name))
    if name == "head_dim":  # None means hidden_size / num_heads
        implied = ckpt["hidden_size"] // ckpt["num_heads"]
        return (ours or implied) == (theirs or implied)
    return ours == theirs


def resolve_checkpoint(data: dict, section: str = "model") -> dict:
    """A model section's dict with `path` set: the checkpoint's fields under the given ones. A preset
    beside the path is dropped (the checkpoint defines the shape); a given field the weights fix
    that differs from the checkpoint raises a ConfigError naming both."""
    data = dict(data)
    path = data["path"]
    ckpt = read_checkpoint(path, section)
    given = {k: v for k, v in data.items() if k not in ("path", "preset")}
    out = {**ckpt, **given, "path": path, "preset": None}
    for name, value in given.items():
        if name not in ckpt:
            continue
        if name == "rope_scaling" and isinstance(value, dict) and isinstance(ckpt[name], dict):
            out[name] = {**ckpt[name], **value}  # a partial mapping adjusts the checkpoint's scaling
        elif name in FIXED and not _same(name, value, ckpt, section):
            raise ConfigError(
                key(section, name),
                value,
                f"contradicts {key(section, 'path')}={path}: its config.json has "
                f"{HF_NAMES[name]}={_hf_value(name, ckpt)!r} (the weights have that shape)",
            )
    return out


def _hf_value(name: str, ckpt: dict[str, Any]) -> Any:
    """The config.json value behind field `name` (qkv_bias and qk_norm follow from model_type)."""
    if HF_NAMES[name] == "model_type":
        return ckpt["arch"]
    if name == "head_dim" and ckpt[name] is None:
        return ckpt["hidden_size"] // ckpt["num_heads"]
    return ckpt[name]


def checkpoint_overrides(cfg) -> list[str]:
    """One line per field that a run config's model (and critic) sets differently from its
    checkpoint: 'model.rope_theta=500000.0: given, overrides config.json's rope_theta=10000.0'."""
    lines = []
    for section, m in (("model", cfg.model), ("critic", cfg.critic)):
        if m is None or m.path is None:
            continue
        ref = build(ModelConfig, read_checkpoint(m.path, section), section)
        for name in HF_NAMES:
            ours, theirs = getattr(m, name), getattr(ref, name)
            if ours != theirs:
                src = "the checkpoint's eos ids" if name == "eos_ids" else f"config.json's {HF_NAMES[name]}"
                given = f"{section}.{name}={_shown(ours)}"
                lines.append(f"{given}: given, overrides {src}={_shown(theirs)} ({section}.path={m.path})")
    return lines


PRETRAINED_LR_MAX = 1e-5  # above this a pretrained model's GRPO run is likely to collapse (configs/finetune.yaml)


def pretrained_warnings(cfg) -> list[str]:
    """Settings that fit a random-init model but not a pretrained one (model.path given): one line
    each, logged as warnings at start-up (the run goes on)."""
    out = []
    if cfg.model.path is not None and cfg.optim.lr > PRETRAINED_LR_MAX:
        out.append(
            f"optim.lr={cfg.optim.lr:g} on the pretrained model.path={cfg.model.path}: GRPO recipes (verl, TRL) use "
            f"1e-6, and rates above {PRETRAINED_LR_MAX:g} tend to collapse a pretrained policy within a few steps; "
            "start from configs/finetune.yaml (make run CONFIG=configs/finetune.yaml ARGS=...)"
        )
    return out


def _shown(v: Any) -> str:
    return repr(to_dict(v)) if not isinstance(v, tuple) else repr(list(v))
