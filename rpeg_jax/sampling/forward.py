"""How the sampler runs the model inside its jitted prefill and decode functions.

Two interchangeable forwards (static, hashable objects passed to `sampling/engine.py`):
- `ModelForward(graphdef)`: the model's own `Transformer.hidden` / `.logits` over its stacked
  parameters (layer scan or loop, as the model is configured). The sampler's params are the model's.
- `SplitForward(cfg)`: the same computation built from the model's layer function
  (`models.llama.decoder_layer`) over *per-layer* parameter buffers, one jit argument per layer.
  Why: XLA:CPU copies each layer's weights out of a stacked [L, ...] array before every product
  (dynamic- or static-slice fusions), so a bandwidth-bound decode step reads the weights about three
  times; with separate buffers the products read them in place (measured on CPU: model S decode
  step 111 -> 67 ms of CPU time, model T 6.4 -> 3.7 ms). The cost is one device copy of the weights
  per `update_weights` (one jitted split) and a layer loop unrolled at trace time (compile time grows
  with depth), so "auto" picks it on CPU only.

Tests hold both to the model's plain forward (tests/test_sampler.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rpeg_jax.config.model import ModelConfig
from rpeg_jax.models.dense import dense, embed_lookup
from rpeg_jax.models.llama import decoder_layer, jnp_dtype, rms_norm
from rpeg_jax.models.rope import inv_frequencies, rope_tables
from rpeg_jax.sharding.axes import BATCH, EMBED, SEQ, constrain


@dataclasses.dataclass(frozen=True)
class ModelForward:
    graphdef: Any

    def prepare(self, params):
        return params

    def hidden(self, params, tokens_BxT, positions_BxT, attention, cache):
        return nnx.merge(self.graphdef, params).hidden(tokens_BxT, positions_BxT, attention=attention, cache=cache)

    def logits(self, params, h):
        return nnx.merge(self.graphdef, params).logits(h)


@functools.partial(jax.jit, static_argnames=("num_layers",))
def _split(params, num_layers: int):
    """{embed, final_norm, out, layers: tuple of per-layer dicts} from the model's params State."""
    flat = nnx.to_pure_dict(params)
    layers = flat["layers"]
    out = flat["embed"].T if flat.get("lm_head") is None else flat["lm_head"]
    return dict(embed=flat["embed"], final_norm=flat["final_norm"], out=out,
                layers=tuple({n: w[i] for n, w in layers.items() if w is not None} for i in range(num_layers)))


@dataclasses.dataclass(frozen=True)
class SplitForward:
    cfg: ModelConfig

    def prepare(self, params):
        """Per-layer copies of the weights (one jitted call; compiled once per parameter layout)."""
        return _split(params, self.cfg.num_layers)

    def hidden(self, gp, tokens_BxT, positions_BxT, attention, cache):
        """As `Transformer.hidden`, with the layer loop unrolled over per-layer buffers."""
        cfg = self.cfg
        x = constrain(embed_lookup(gp["embed"], tokens_BxT, jnp_dtype(cfg.dtype)), (BATCH, SEQ, EMBED))
        cos, sin = rope_tables(positions_BxT, inv_frequencies(cfg))
        for i, lp in enumerate(gp["layers"]):
            x, cache = decoder_layer(cfg, lp, x, cos, sin, attention, i, cache)
        return rms_norm(x, gp["final_norm"], cfg.rms_norm_eps), cache

    def logits(self, gp, h):
        return dense(h, gp["out"].astype(h.dtype), preferred_element_type=jnp.float32)


def choose_forward(kind: str, graphdef, cfg: ModelConfig):
    if kind == "auto":
        kind = "split" if jax.default_backend() == "cpu" else "model"
    return SplitForward(cfg) if kind == "split" else ModelForward(graphdef)
