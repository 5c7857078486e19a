"""Hugging Face checkpoint interop for the Llama and Qwen2 architectures (local paths only).

    model = load_hf("/path/to/checkpoint")        # config.json + *.safetensors (+ index)
    save_hf(model, "/path/to/out")                 # the same format back; exact round trip

HF stores linear weights as [out, in]; ours are [in, (heads, head_dim)] and stacked over layers.
The value head uses TRL's names (`v_head.summary.weight` [1, D], `v_head.summary.bias` [1]).
Nothing here downloads: a missing file is an error naming the path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from rpeg_jax.config.hf import config_from_hf  # config.json -> ModelConfig, pure (config time as well)
from rpeg_jax.config.model import ModelConfig
from rpeg_jax.models.llama import Transformer

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
__all__ = ["config_from_hf", "config_to_hf", "hf_state", "load_hf", "save_hf"]


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.arch == "llama" and cfg.qkv_bias:
        raise ValueError("save_hf: model.qkv_bias=true with arch=llama has no HF equivalent (use arch=qwen2)")
    out = {
        "architectures": [_ARCHS[cfg.arch]],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": cfg.param_dtype,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
        "pad_token_id": cfg.pad_id,
    }
    if cfg.head_dim is not None:
        out["head_dim"] = cfg.head_dim
    if cfg.arch == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return out


def _tensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"load_hf: no *.safetensors in {path}")
    return [os.path.join(path, n) for n in found]


def _read_tensors(path: str) -> dict:
    tensors = {}
    for file in _tensor_files(path):
        with safe_open(file, framework="flax") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _layer_mapping(cfg: ModelConfig):
    """(our stacked name, HF suffix, HF [out,in] -> ours per-layer transform)."""
    D, H, K, E = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    rows = [
        ("attn_norm", "input_layernorm.weight", lambda w: w),
        ("wq", "self_attn.q_proj.weight", lambda w: w.T.reshape(D, H, E)),
        ("wk", "self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, E)),
        ("wv", "self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, E)),
        ("wo", "self_attn.o_proj.weight", lambda w: w.T.reshape(H, E, D)),
        ("mlp_norm", "post_attention_layernorm.weight", lambda w: w),
        ("w_gate", "mlp.gate_proj.weight", lambda w: w.T),
        ("w_up", "mlp.up_proj.weight", lambda w: w.T),
        ("w_down", "mlp.down_proj.weight", lambda w: w.T),
    ]
    if cfg.qkv_bias:
        rows += [
            ("bq", "self_attn.q_proj.bias", lambda b: b.reshape(H, E)),
            ("bk", "self_attn.k_proj.bias", lambda b: b.reshape(K, E)),
            ("bv", "self_attn.v_proj.bias", lambda b: b.reshape(K, E)),
        ]
    return rows


def load_hf(path: str, *, value_head: bool = False, dtype: str | None = None) -> Transformer:
    """A Transformer with the weights of the local HF checkpoint at `path`."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"load_hf: {cfg_file} not found (only local checkpoints are read)")
    with open(cfg_file) as f:
        cfg = config_from_hf(json.load(f), value_head=value_head, dtype=dtype)
    tensors = _read_tensors(path)
    pd = jnp.dtype(cfg.param_dtype)

    def take(name):
        if name not in tensors:
            raise KeyError(f"load_hf: tensor {name!r} missing from the checkpoint in {path}")
        return tensors.pop(name)

    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    model.embed.set_value(take("model.embed_tokens.weight").astype(pd))
    for ours, suffix, fn in _layer_mapping(cfg):
        per_layer = [fn(take(f"model.layers.{i}.{suffix}")) for i in range(cfg.num_layers)]
        getattr(model.layers, ours).set_value(jnp.stack(per_layer).astype(pd))
    model.final_norm.set_value(take("model.norm.weight").astype(pd))
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    else:
        model.lm_head.set_value(take("lm_head.weight").T.astype(pd))
    if value_head:
        if "v_head.summary.weight" in tensors:
            model.value_w.set_value(take("v_head.summary.weight")[0].astype(pd))
            model.value_b.set_value(take("v_head.summary.bias")[0].astype(pd))
        else:
            model.value_w.set_value(jnp.zeros((cfg.hidden_size,), pd))
            model.value_b.set_value(jnp.zeros((), pd))
    tensors.pop("v_head.summary.weight", None), tensors.pop("v_head.summary.bias", None)
    leftovers = [n for n in tensors if not n.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ValueError(f"load_hf: unexpected tensors in {path}: {sorted(leftovers)[:5]}")
    return model


def hf_state(model: Transformer) -> dict:
    """{HF tensor name: array} for `model` (the inverse of load_hf's mapping)."""
    cfg = model.cfg
    out = {"model.embed_tokens.weight": model.embed[...], "model.norm.weight": model.final_norm[...]}
    inverse = {
        "wq": lambda w: w.reshape(w.shape[0], -1).T,
        "wk": lambda w: w.reshape(w.shape[0], -1).T,
        "wv": lambda w: w.reshape(w.shape[0], -1).T,
        "wo": lambda w: w.reshape(-1, w.shape[-1]).T,
        "w_gate": lambda w: w.T,
        "w_up": lambda w: w.T,
        "w_down": lambda w: w.T,
        "bq": lambda b: b.reshape(-1),
        "bk": lambda b: b.reshape(-1),
        "bv": lambda b: b.reshape(-1),
    }
    for ours, suffix, _ in _layer_mapping(cfg):
        stacked = getattr(model.layers, ours)[...]
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{suffix}"] = inverse.get(ours, lambda w: w)(stacked[i])
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head[...].T
    if model.value_w is not None:
        out["v_head.summary.weight"] = model.value_w[...][None, :]
        out["v_head.summary.bias"] = model.value_b[...].reshape(1)
    return {k: jnp.asarray(v) for k, v in out.items()}


def save_hf(model: Transformer, path: str, *, max_shard_bytes: int = 5 * 1024**3, overwrite: bool = False) -> None:
    """Write `model` as a HF checkpoint directory, atomically (a temp dir renamed into place)."""
    if os.path.exists(path) and os.listdir(path) and not overwrite:
        raise FileExistsError(f"save_hf: {path} exists and is not empty (pass overwrite=True)")
    state = hf_state(model)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".save_hf-", dir=parent)
    try:
        shards, current, size = [], {}, 0
        for name in sorted(state):
            nbytes = state[name].size * state[name].dtype.itemsize
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[name], size = state[name], size + nbytes
        shards.append(current)
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in shard})
            total = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in state.values())
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_to_hf(model.cfg), f, indent=2)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
