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
- `SplitForward(cfg, transposed=True)`: per-layer buffers holding every projection TRANSPOSED
  ([out, in]), run by this module's own copy of the decoder layer (`_layer_t`: the model's
  rms_norm / apply_rope, the same operations and order as `decoder_layer`). Why: for a few rows
  (decode batch <= TRANSPOSED_MAX_ROWS) a product against [out, in] weights streams each weight row
  once; XLA:CPU's [in, out] product at 8 rows reads the weights at ~60% of the rate the transposed
  one does (measured on the 2-core CPU over model-S-sized weights: 4.9 vs 6.5 GB/s at 8 rows, 2.9 vs
  3.8 at 32; for model T's cache-resident weights at 32-64 rows the [in, out] form is ~10% faster).

Tests hold all three to the model's plain forward (tests/test_sampler.py).
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
from rpeg_jax.models.rope import apply_rope, inv_frequencies, rope_tables
from rpeg_jax.sharding.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, MLP, SEQ, constrain

TRANSPOSED_MAX_ROWS = 16  # "auto" uses transposed weights at decode batches up to this many rows


@dataclasses.dataclass(frozen=True)
class ModelForward:
    graphdef: Any
    static_layers = False  # the model passes a traced layer index to the attention

    def prepare(self, params):
        return params

    def hidden(self, params, tokens_BxT, positions_BxT, attention, cache):
        return nnx.merge(self.graphdef, params).hidden(tokens_BxT, positions_BxT, attention=attention, cache=cache)

    def logits(self, params, h):
        return nnx.merge(self.graphdef, params).logits(h)


@functools.partial(jax.jit, static_argnames=("num_layers", "transposed"))
def _split(params, num_layers: int, transposed: bool):
    """{embed, final_norm, out, layers: tuple of per-layer dicts} from the model's params State;
    with `transposed`, every product weight is flattened to 2-D and transposed to [out, in]."""
    flat = nnx.to_pure_dict(params)
    layers = {n: w for n, w in flat["layers"].items() if w is not None}
    tied = flat.get("lm_head") is None
    if not transposed:
        out = flat["embed"].T if tied else flat["lm_head"]
        per_layer = tuple({n: w[i] for n, w in layers.items()} for i in range(num_layers))
        return dict(embed=flat["embed"], final_norm=flat["final_norm"], out=out, layers=per_layer)
    out_t = flat["embed"] if tied else flat["lm_head"].T  # [V, D]

    def t(name, w):
        if name in ("wq", "wk", "wv"):  # [D, N, E] -> [N*E, D]
            return w.reshape(w.shape[0], -1).T
        if name == "wo":  # [H, E, D] -> [D, H*E]
            return w.reshape(-1, w.shape[-1]).T
        if name in ("w_gate", "w_up", "w_down"):
            return w.T
        return w.reshape(-1) if name in ("bq", "bk", "bv") else w  # norms, biases

    per_layer = tuple({n: t(n, w[i]) for n, w in layers.items()} for i in range(num_layers))
    return dict(embed=flat["embed"], final_norm=flat["final_norm"], out=out_t, layers=per_layer)


def dense_t(x, w_t, *, preferred_element_type=None):
    """x [..., I] @ w_t.T for w_t [O, I] -> [..., O], as one product contracting both minor axes."""
    lead = x.shape[:-1]
    y = jnp.einsum("oi,mi->mo", w_t, x.reshape(-1, x.shape[-1]), preferred_element_type=preferred_element_type)
    return y.reshape(*lead, w_t.shape[0])


def _layer_t(cfg: ModelConfig, p: dict, x_BxTxD, cos, sin, attention, layer, cache):
    """`models.llama.decoder_layer` over transposed weights (same operations, same order)."""
    dt = x_BxTxD.dtype
    b, t, _ = x_BxTxD.shape
    h = rms_norm(x_BxTxD, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = (dense_t(h, p[n].astype(dt)) for n in ("wq", "wk", "wv"))
    if "bq" in p:
        q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
    e = cfg.head_size
    q = constrain(apply_rope(q.reshape(b, t, -1, e), cos, sin), (BATCH, SEQ, HEADS, HEAD_DIM))
    k = constrain(apply_rope(k.reshape(b, t, -1, e), cos, sin), (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    v = constrain(v.reshape(b, t, -1, e), (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    attn, cache = attention(q, k, v, layer=layer, cache=cache)
    x = constrain(x_BxTxD + dense_t(attn.reshape(b, t, -1), p["wo"].astype(dt)), (BATCH, SEQ, EMBED))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    act = jax.nn.silu(dense_t(h, p["w_gate"].astype(dt))) * dense_t(h, p["w_up"].astype(dt))
    act = constrain(act, (BATCH, SEQ, MLP))
    return constrain(x + dense_t(act, p["w_down"].astype(dt)), (BATCH, SEQ, EMBED)), cache


@dataclasses.dataclass(frozen=True)
class SplitForward:
    cfg: ModelConfig
    transposed: bool = False
    static_layers = True  # layers are unrolled: the attention gets a Python-int layer

    def prepare(self, params):
        """Per-layer copies of the weights (one jitted call; compiled once per parameter layout)."""
        return _split(params, self.cfg.num_layers, self.transposed)

    def hidden(self, gp, tokens_BxT, positions_BxT, attention, cache):
        """As `Transformer.hidden`, with the layer loop unrolled over per-layer buffers."""
        cfg = self.cfg
        x = constrain(embed_lookup(gp["embed"], tokens_BxT, jnp_dtype(cfg.dtype)), (BATCH, SEQ, EMBED))
        cos, sin = rope_tables(positions_BxT, inv_frequencies(cfg))
        layer_fn = _layer_t if self.transposed else decoder_layer
        for i, lp in enumerate(gp["layers"]):
            x, cache = layer_fn(cfg, lp, x, cos, sin, attention, i, cache)
        return rms_norm(x, gp["final_norm"], cfg.rms_norm_eps), cache

    def logits(self, gp, h):
        if self.transposed:
            return dense_t(h, gp["out"].astype(h.dtype), preferred_element_type=jnp.float32)
        return dense(h, gp["out"].astype(h.dtype), preferred_element_type=jnp.float32)


def choose_forward(kind: str, graphdef, cfg: ModelConfig, rows: int = 1 << 30):
    """kind: "auto" (split on CPU, transposed when `rows` (the decode batch) <= TRANSPOSED_MAX_ROWS;
    the model's forward elsewhere), "model", "split" or "split_t"."""
    if kind == "auto":
        if jax.default_backend() != "cpu":
            kind = "model"
        else:
            kind = "split_t" if rows <= TRANSPOSED_MAX_ROWS else "split"
    if kind == "model":
        return ModelForward(graphdef)
    return SplitForward(cfg, transposed=kind == "split_t")
