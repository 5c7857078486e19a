"""LoRA adapters as parameters of the model (model.lora), in the activation-side form.

With model.lora.rank = r > 0 every target projection W (stacked [L, in..., out...], in-dims first, as
models/llama.py keeps them) gets two parameters stacked over layers, in our orientation:
  lora_a_<w> [L, in..., r]   (PEFT's lora_A [r, in], transposed; uniform ±1/sqrt(in) as PEFT draws it)
  lora_b_<w> [L, r, out...]  (PEFT's lora_B [out, r], transposed; zero, so training starts at the base)
and the projection computes y = x W + s (x A) B with s = alpha / r: the backward never forms the
base weight's gradient dW (it is not differentiated), only dA, dB and dx (bench/lora.py measures it
against merging W + s A B inside the step). models/lora.py converts to and from PEFT's layout.

Called by: models/llama.py (the parameters and the projection), models/lora.py, runtime (setup, kernels).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from rpeg_jax.models.dense import dense

# PEFT target name -> (our stacked weight, contracted (input) dims of that weight after the layer axis)
PROJECTIONS = {
    "q_proj": ("wq", 1),
    "k_proj": ("wk", 1),
    "v_proj": ("wv", 1),
    "o_proj": ("wo", 2),
    "gate_proj": ("w_gate", 1),
    "up_proj": ("w_up", 1),
    "down_proj": ("w_down", 1),
}
BASE_PORT = "_lora_base"  # the stage input the runtime adds beside "actor" under model.lora: the frozen base
PREFIX = "lora_"  # every adapter parameter's name starts with it (and no base parameter's does)


def names(weight: str) -> tuple[str, str]:
    return f"{PREFIX}a_{weight}", f"{PREFIX}b_{weight}"


def add_adapters(layers: nnx.Module, cfg, rngs: nnx.Rngs) -> None:
    """Give `layers` (models/llama.Layers) the adapters of cfg.lora (called after every base weight is
    drawn, so the base equals the model without adapters from the same seed)."""
    r = cfg.lora.rank
    for target in cfg.lora.targets:
        weight, c = PROJECTIONS[target]
        w = getattr(layers, weight)
        shape, axes = w.shape, w.axes
        fan_in = math.prod(shape[1 : 1 + c])
        bound = 1.0 / math.sqrt(fan_in)
        a_name, b_name = names(weight)
        a = jax.random.uniform(rngs.params(), (shape[0], *shape[1 : 1 + c], r), jnp.float32, -bound, bound)
        setattr(layers, a_name, nnx.Param(a, axes=(axes[0], *axes[1 : 1 + c], None)))
        b = jnp.zeros((shape[0], r, *shape[1 + c :]), jnp.float32)
        setattr(layers, b_name, nnx.Param(b, axes=(axes[0], None, *axes[1 + c :])))


def adapter_names(layers: nnx.Module) -> list[str]:
    return sorted(n for n in vars(layers) if n.startswith(PREFIX) and getattr(layers, n) is not None)


def project(cfg, p: dict, weight: str, x, contract: int = 1):
    """x W (models/dense.dense), plus s (x A) B when the layer's params `p` hold adapters for W.
    The adapters run in x's dtype (their float32 params are cast like the base weight)."""
    dt = x.dtype
    y = dense(x, p[weight].astype(dt), contract=contract)
    a_name, b_name = names(weight)
    if a_name not in p:
        return y
    u = dense(x, p[a_name].astype(dt), contract=contract)
    return y + (cfg.lora.scale * dense(u, p[b_name].astype(dt))).astype(y.dtype)


def is_adapter(path, _value=None) -> bool:
    """nnx filter: an adapter parameter (its name starts with lora_)."""
    return any(str(getattr(k, "key", k)).startswith(PREFIX) for k in path)


def split(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(base, adapters) of a LoRA model's parameter state."""
    adapters, base = nnx.split_state(state, is_adapter, ...)
    return base, adapters


def join(base: nnx.State, adapters: nnx.State) -> nnx.State:
    return nnx.merge_state(base, adapters)


def merged_weights(cfg, base: nnx.State, adapters: nnx.State) -> nnx.State:
    """base with W + s A B written into every adapted weight (the model without adapters, for the
    sampler and export); jit-able. Float32 accumulation, cast to W's dtype."""
    out = jax.tree.map(lambda x: x, base)  # a new State (same leaves); adapted weights replaced below
    s = cfg.lora.scale
    for target in cfg.lora.targets:
        weight, c = PROJECTIONS[target]
        a_name, b_name = names(weight)
        w = out["layers"][weight][...]
        a = adapters["layers"][a_name][...].astype(jnp.float32)
        b = adapters["layers"][b_name][...].astype(jnp.float32)
        # one layer's a [in..., r] times b [r, out...] -> [in..., out...], over the stacked layers
        delta = jax.vmap(lambda a1, b1: jnp.tensordot(a1, b1, axes=([a1.ndim - 1], [0])))(a, b)
        out["layers"][weight][...] = (w.astype(jnp.float32) + s * delta).astype(w.dtype)
    return out
