"""Hugging Face checkpoint interop for the Llama, Qwen2 and Qwen3 architectures (local paths only).

    model = load_hf("/path/to/checkpoint")        # config.json + *.safetensors (+ index)
    model = load_hf(path, shardings=layout.params) # each parameter born in its sharding
    save_hf(model, "/path/to/out")                 # the same format back; exact round trip

HF stores linear weights as [out, in]; ours are [in, (heads, head_dim)] and stacked over layers
(one `_Layout` per tensor says how: split HF's dims, then transpose). Loading reads, for each
device, only the slice of each file that the device's block of a parameter needs (the layout maps
the block's index back to HF coordinates), so host memory stays near the model's own bytes.
The value head uses TRL's names (`v_head.summary.weight` [1, D], `v_head.summary.bias` [1]).
Nothing here downloads: a missing file is an error naming the path.

Called by: runtime/setup.py (model.path, critic.path), cli/export.py (save_hf), tests, bench.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from rpeg_jax.config.hf import config_from_hf  # config.json -> ModelConfig, pure (config time as well)
from rpeg_jax.config.model import ModelConfig
from rpeg_jax.models.llama import Transformer
from rpeg_jax.sharding.params import path_name

_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_EXPERT_PARAMS = {"we_gate": "gate_proj", "we_up": "up_proj", "we_down": "down_proj"}
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
    if cfg.head_dim is not None or cfg.arch in ("qwen3", "qwen3_moe"):  # Qwen3's own default head_dim is 128
        out["head_dim"] = cfg.head_size
    if cfg.arch == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if cfg.arch in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=False, use_sliding_window=False)
    if cfg.arch == "qwen3_moe":
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.expert_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            router_aux_loss_coef=0.0,
            output_router_logits=False,
        )
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


class WeightsFileError(ValueError):
    """A weights file that cannot be read (truncated, damaged); the message names the file."""


def _open(file: str):
    """safe_open, with a damaged file reported by name in one line (safetensors' own error names
    neither the file nor what to do)."""
    try:
        return safe_open(file, framework="numpy")
    except (SafetensorError, OSError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsFileError(
            f"{os.path.basename(file)} is not a readable safetensors file ({why}): a truncated or damaged copy?"
        ) from None


class _Tensors:
    """The checkpoint's tensors by name, read a slice at a time. Only the files' headers are read
    up front; `read` opens the file, copies the slice out and closes it again, so the memory map
    (whose touched pages count as the process's resident memory while it is open) never covers
    more than the tensor being read."""

    def __init__(self, path: str):
        self.path = path
        self.file: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        for file in _tensor_files(path):
            with _open(file) as f:
                for name in f.keys():
                    self.file[name] = file
                    self.shape[name] = tuple(f.get_slice(name).get_shape())

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self.file:
            raise KeyError(f"load_hf: tensor {name!r} missing from the checkpoint in {self.path}")
        if self.shape[name] != shape:
            raise ValueError(f"load_hf: tensor {name!r} in {self.path} has shape {self.shape[name]}, expected {shape}")

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        with _open(self.file[name]) as f:
            try:
                return f.get_slice(name)[index]
            except (SafetensorError, OSError) as e:
                file = os.path.basename(self.file[name])
                raise WeightsFileError(f"{file}: tensor {name!r} is unreadable ({e})") from None


@dataclass(frozen=True)
class _Layout:
    """How one of our arrays (one layer's, for stacked parameters) is made from one HF tensor:
    HF's dims are split into `groups` (a dim of size H*E into (H, E); `()` drops a dim of size 1),
    then transposed by `perm` (our dim i is split dim perm[i]). So q_proj [H*E, D] -> wq [D, H, E]
    is groups ((H, E), (D,)), perm (2, 0, 1)."""

    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    @property
    def shape(self) -> tuple[int, ...]:
        split = [s for g in self.groups for s in g]
        return tuple(split[p] for p in self.perm)

    def block_shape(self, index: tuple[slice, ...]) -> tuple[int, ...]:
        return tuple(len(range(*s.indices(n))) for s, n in zip(index, self.shape))

    def from_hf(self, w):
        return w.reshape([s for g in self.groups for s in g]).transpose(self.perm)

    def to_hf(self, x):
        return x.transpose(np.argsort(self.perm)).reshape(self.hf_shape)

    def read(self, tensors: _Tensors, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Our block `index` (slices in our coordinates) read as the HF slice that holds it: the
        slice of a split dim (H, E) is the row range [h0*E, h1*E) of the HF dim when E is whole;
        a part of E is cut after the reshape."""
        split = [s for g in self.groups for s in g]
        ranges: list[tuple[int, int]] = [(0, 0)] * len(split)
        for i, p in enumerate(self.perm):
            ranges[p] = index[i].indices(split[p])[:2]
        hf_index, cut, block, r = [], [], [], 0
        for g in self.groups:
            if not g:  # a dim of size 1 that we drop
                hf_index.append(slice(0, 1))
                continue
            (a, b), inner = ranges[r], math.prod(g[1:])
            hf_index.append(slice(a * inner, b * inner))
            block += [b - a, *g[1:]]
            cut += [slice(None)] + [slice(*ranges[r + k]) for k in range(1, len(g))]
            r += len(g)
        w = tensors.read(name, tuple(hf_index))
        return w.reshape(block)[tuple(cut)].transpose(self.perm)


def _layer_mapping(cfg: ModelConfig) -> list[tuple[str, str, _Layout]]:
    """(our stacked name, HF suffix, layout of one layer)."""
    D, H, K, E, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.intermediate_size
    rows = [
        ("attn_norm", "input_layernorm.weight", _Layout(((D,),), (0,))),
        ("wq", "self_attn.q_proj.weight", _Layout(((H, E), (D,)), (2, 0, 1))),
        ("wk", "self_attn.k_proj.weight", _Layout(((K, E), (D,)), (2, 0, 1))),
        ("wv", "self_attn.v_proj.weight", _Layout(((K, E), (D,)), (2, 0, 1))),
        ("wo", "self_attn.o_proj.weight", _Layout(((D,), (H, E)), (1, 2, 0))),
        ("mlp_norm", "post_attention_layernorm.weight", _Layout(((D,),), (0,))),
        ("w_gate", "mlp.gate_proj.weight", _Layout(((F,), (D,)), (1, 0))),
        ("w_up", "mlp.up_proj.weight", _Layout(((F,), (D,)), (1, 0))),
        ("w_down", "mlp.down_proj.weight", _Layout(((D,), (F,)), (1, 0))),
    ]
    if cfg.qkv_bias:
        rows += [
            ("bq", "self_attn.q_proj.bias", _Layout(((H, E),), (0, 1))),
            ("bk", "self_attn.k_proj.bias", _Layout(((K, E),), (0, 1))),
            ("bv", "self_attn.v_proj.bias", _Layout(((K, E),), (0, 1))),
        ]
    if cfg.qk_norm:
        rows += [
            ("q_norm", "self_attn.q_norm.weight", _Layout(((E,),), (0,))),
            ("k_norm", "self_attn.k_norm.weight", _Layout(((E,),), (0,))),
        ]
    if cfg.num_experts:  # one HF tensor per expert: the layout is one expert's ("{e}" in the suffix)
        Fe, X = cfg.expert_size, cfg.num_experts
        rows += [
            ("w_router", "mlp.gate.weight", _Layout(((X,), (D,)), (1, 0))),
            ("we_gate", "mlp.experts.{e}.gate_proj.weight", _Layout(((Fe,), (D,)), (1, 0))),
            ("we_up", "mlp.experts.{e}.up_proj.weight", _Layout(((Fe,), (D,)), (1, 0))),
            ("we_down", "mlp.experts.{e}.down_proj.weight", _Layout(((D,), (Fe,)), (1, 0))),
        ]
    return rows


def _mapping(cfg: ModelConfig) -> dict[str, tuple[list[str] | str, _Layout]]:
    """Our parameter path -> (HF name, or one name per layer for a stacked parameter; layout)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[list[str] | str, _Layout]] = {
        "embed": ("model.embed_tokens.weight", _Layout(((V,), (D,)), (0, 1))),
        "final_norm": ("model.norm.weight", _Layout(((D,),), (0,))),
    }
    if not cfg.tie_embeddings:
        out["lm_head"] = ("lm_head.weight", _Layout(((V,), (D,)), (1, 0)))
    sparse = cfg.sparse_layers
    for ours, suffix, layout in _layer_mapping(cfg):
        if ours in ("w_gate", "w_up", "w_down", "w_router", *_EXPERT_PARAMS):  # their own group of layers
            rows = [i for i in range(cfg.num_layers) if sparse[i] == (ours not in ("w_gate", "w_up", "w_down"))]
        else:
            rows = list(range(cfg.num_layers))
        if ours in _EXPERT_PARAMS:  # [layer][expert] names
            names = [[f"model.layers.{i}.{suffix.format(e=e)}" for e in range(cfg.num_experts)] for i in rows]
        else:
            names = [f"model.layers.{i}.{suffix}" for i in rows]
        if names:
            out[f"layers.{ours}"] = (names, layout)
    if cfg.value_head:  # TRL's names
        out["value_w"] = ("v_head.summary.weight", _Layout(((), (D,)), (0,)))
        out["value_b"] = ("v_head.summary.bias", _Layout(((),), ()))
    return out


def _flat_names(names) -> list[str]:
    if isinstance(names, str):
        return [names]
    return [n for x in names for n in (x if isinstance(x, list) else [x])]


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)


def _sharding_of(shardings, params) -> dict[str, jax.sharding.Sharding | None]:
    """{parameter path: sharding} from load_hf's `shardings` argument (see there)."""
    tree = shardings(params) if callable(shardings) else shardings
    if tree is None:  # uncommitted arrays (as jnp.asarray makes), free to join any mesh's computation
        return {name: None for name in _paths(params)}
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_sharding)[0]
    out = {path_name(p): s for p, s in flat}
    missing = [n for n in _paths(params) if not _is_sharding(out.get(n))]
    if missing:
        raise ValueError(f"load_hf: shardings gives no sharding for {missing[:5]}")
    return out


def _paths(params) -> list[str]:
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]]


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _load(tensors: _Tensors, names: list[str] | str, layout: _Layout, shape, dtype, sharding) -> jax.Array:
    """One parameter as a global array in `sharding`: each addressable device's block is read on
    its own from the files (a stacked parameter's block one layer at a time)."""

    def block(index: tuple[slice, ...]) -> np.ndarray:
        if isinstance(names, str):
            return layout.read(tensors, names, index).astype(dtype, copy=False)
        lo, hi = index[0].indices(len(names))[:2]
        if isinstance(names[0], list):  # [layer][expert] (Qwen3-MoE's experts)
            e0, e1 = index[1].indices(len(names[0]))[:2]
            out = np.empty((hi - lo, e1 - e0, *layout.block_shape(index[2:])), dtype)
            for i in range(lo, hi):
                for e in range(e0, e1):
                    out[i - lo, e - e0] = layout.read(tensors, names[i][e], index[2:])
            return out
        out = np.empty((hi - lo, *layout.block_shape(index[1:])), dtype)
        for i in range(lo, hi):
            out[i - lo] = layout.read(tensors, names[i], index[1:])
        return out

    if sharding is None:
        return jnp.asarray(block(tuple(slice(None) for _ in shape)))
    return jax.make_array_from_callback(shape, sharding, block, dtype=dtype)


def load_hf(path: str, *, value_head: bool = False, dtype: str | None = None, shardings: Any = None) -> Transformer:
    """A Transformer with the weights of the local HF checkpoint at `path`, every parameter built
    directly in its sharding: each process reads from the files only the slices its own devices
    hold (`jax.make_array_from_callback`), so a device holds only its own blocks and the host
    never a second copy of the model (bench/NOTES.md, session 11: peak 1.19x the model's bytes
    on 8 CPU devices, where the devices' 1x is host memory too).

    `shardings`: None (every parameter an uncommitted array on the default device, as
    `jnp.asarray` makes, so a sampler or trainer on any mesh can take it), a tree with one jax Sharding per
    parameter of the model's nnx.State (`nnx.split(model, nnx.Param)[1]`; a flat dict keyed by
    dotted path, {"layers.wq": sharding, ...}, is one), or a function from the
    abstract state (ShapeDtypeStruct values with their `axes` metadata) to such a tree (or to
    None), e.g. `StageLayout.params` (runtime/setup.py)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"load_hf: {cfg_file} not found (only local checkpoints are read)")
    with open(cfg_file) as f:
        cfg = config_from_hf(json.load(f), value_head=value_head, dtype=dtype)
    tensors = _Tensors(path)
    mapping = _mapping(cfg)
    zero_value_head = value_head and "v_head.summary.weight" not in tensors.file  # a new head starts at 0
    expected = set()
    for ours, (names, layout) in mapping.items():
        if zero_value_head and ours in ("value_w", "value_b"):
            continue
        for name in _flat_names(names):
            tensors.check(name, layout.hf_shape)
            expected.add(name)
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    ignored |= set() if value_head else {"v_head.summary.weight", "v_head.summary.bias"}
    leftovers = [n for n in tensors.file if n not in expected | ignored and not n.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ValueError(f"load_hf: unexpected tensors in {path}: {sorted(leftovers)[:5]}")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    where = _sharding_of(shardings, params)
    pd = np.dtype(jnp.dtype(cfg.param_dtype))

    def build(keypath, var):
        name = path_name(keypath)
        shape = tuple(var.get_value().shape)
        if zero_value_head and name in ("value_w", "value_b"):
            zeros = np.zeros(shape, pd)
            return var.replace(jnp.asarray(zeros) if where[name] is None else jax.device_put(zeros, where[name]))
        names, layout = mapping[name]
        return var.replace(_load(tensors, names, layout, shape, pd, where[name]))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(build, params, is_leaf=_is_variable))


def hf_state(model: Transformer) -> dict:
    """{HF tensor name: array} for `model` (the inverse of load_hf's mapping)."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=_is_variable)[0]
    values = {path_name(p): v.get_value() for p, v in flat}
    out = {}
    for ours, (names, layout) in _mapping(model.cfg).items():
        if isinstance(names, str):
            out[names] = layout.to_hf(values[ours])
        elif isinstance(names[0], list):
            out.update({n: layout.to_hf(values[ours][i][e]) for i, row in enumerate(names) for e, n in enumerate(row)})
        else:
            out.update({name: layout.to_hf(values[ours][i]) for i, name in enumerate(names)})
    return {k: jnp.asarray(v) for k, v in out.items()}


def save_hf(
    model: Transformer,
    path: str,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    overwrite: bool = False,
    extra_files: dict[str, str] | None = None,
) -> None:
    """Write `model` as a HF checkpoint directory, atomically (a temp dir renamed into place).
    `extra_files` ({name in the directory: source path}) are copied in with it (tokenizer files,
    generation_config.json: cli/export.py)."""
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
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, os.path.join(tmp, name))
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
