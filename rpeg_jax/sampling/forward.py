"""How the sampler runs the model inside its jitted prefill and decode functions.

Two interchangeable forwards (static, hashable objects passed to `sampling/engine.py`):
- `ModelForward(graphdef)`: the model's own `Transformer.hidden` / `.logits` over its stacked
  parameters (layer scan or loop, as the model is configured). The sampler's params are the model's.
- `SplitForward(cfg)`: the same computation over *per-layer* parameter buffers, one jit argument
  per layer, run by this module's copy of the decoder layer (`_layer`: the model's rms_norm /
  qk_normed / apply_rope, the operations and order of `models.llama.decoder_layer`), with the q/k/v
  projections fused into one product and gate/up into another when a layer's weights are small
  (`fused`; FUSE_MAX_LAYER_BYTES).
  Why per-layer: XLA:CPU copies each layer's weights out of a stacked [L, ...] array before every
  product (dynamic- or static-slice fusions), so a bandwidth-bound decode step reads the weights about
  three times; with separate buffers the products read them in place (measured on CPU: model S
  decode step 111 -> 67 ms of CPU time, model T 6.4 -> 3.7 ms). Why fused: fewer, wider GEMMs (model
  T at 64 rows: 7 -> 4 products per layer, the GEMM part of a step 4.2 -> 3.5 ms, one noisy
  measurement). Why not fused for larger layers: products whose weights stream from memory gain
  from being separate, since XLA:CPU runs independent products of one step side by side on the
  cores, and one product of a few rows runs on one core (SmolLM2-135M, 14 MB a layer, 32 rows:
  RS generation 291 -> 305 tok/s unfused, 2026-12-06). The cost is one device copy of the weights
  per `update_weights` (one jitted split) and a layer loop unrolled at trace time (compile time
  grows with depth), so "auto" picks it on CPU only.
- `SplitForward(cfg, transposed=True)`: the same with every product weight stored TRANSPOSED
  ([out, in]). Why: for a few rows (decode batch <= TRANSPOSED_MAX_ROWS) a product against
  [out, in] weights streams each weight row once; XLA:CPU's [in, out] product at 8 rows reads the
  weights at ~60-70% of the rate the transposed one does (measured on the 2-core CPU over
  model-S-sized weights: 4.9 vs 6.5 GB/s at 8 rows, 5.2 vs 7.8 in another run, 2.9 vs 3.8 at 32;
  for model T's cache-resident weights at 32-64 rows the [in, out] form is ~10% faster).

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
from rpeg_jax.models.llama import jnp_dtype, qk_normed, rms_norm
from rpeg_jax.models.moe import MOE_PARAMS, layer_groups, moe_block
from rpeg_jax.models.rope import apply_rope, inv_frequencies, rope_tables
from rpeg_jax.sharding.axes import (
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    MLP,
    SEQ,
    ExpertLayout,
    constrain,
    use_experts,
)

_MLP_PARAMS = ("w_gate", "w_up", "w_down", *MOE_PARAMS)  # stacked over their own group of layers
TRANSPOSED_MAX_ROWS = 16  # "auto" uses transposed weights at decode batches up to this many rows
FUSE_MAX_LAYER_BYTES = 8 << 20  # SplitForward fuses q/k/v and gate/up when a layer's weights are this small


@dataclasses.dataclass(frozen=True)
class ModelForward:
    graphdef: Any
    experts: ExpertLayout | None = None  # a mixture's experts split over mesh axes (models/moe.py)
    static_layers = False  # the model passes a traced layer index to the attention

    def prepare(self, params):
        return params

    def model_cfg(self, params) -> ModelConfig:
        return nnx.merge(self.graphdef, params).cfg

    def hidden(self, params, tokens_BxT, positions_BxT, attention, cache):
        """(h, cache, experts [B, T, S, k] of the S sparse layers, or None for a dense model)."""
        model = nnx.merge(self.graphdef, params)
        with use_experts(self.experts):
            h, cache, route = model.hidden_routed(tokens_BxT, positions_BxT, attention=attention, cache=cache)
        return h, cache, (None if route is None else route["experts"])

    def logits(self, params, h):
        return nnx.merge(self.graphdef, params).logits(h)


@functools.partial(jax.jit, static_argnames=("sparse_layers", "transposed", "fused"))
def _split(params, sparse_layers: tuple[bool, ...], transposed: bool, fused: bool = True):
    """{embed, final_norm, out, layers: tuple of per-layer dicts} from the model's params State.
    Per layer, with `fused` the q/k/v projections are concatenated into one 2-D weight `wqkv`
    [D, (H+2K)*E] (biases into `bqkv`) and gate and up into `w_gu` [D, 2F]; without, they stay
    separate 2-D weights `wq` [D, H*E], `wk`, `wv` (biases `bq`, `bk`, `bv` flat), `w_gate`,
    `w_up` [D, F]. `wo` is flattened to [H*E, D]; Qwen3's
    q_norm / k_norm [E] are kept as they are; with `transposed`, every product weight (and `out`)
    is stored transposed, [out, in]. A Qwen3-MoE sparse layer keeps its router and expert weights
    as they are (w_router [D, X], we_* [X, ...]: models/moe.py's grouped products) instead of w_gu /
    w_down."""
    flat = nnx.to_pure_dict(params)
    tied = flat.get("lm_head") is None
    out = flat["embed"].T if tied else flat["lm_head"]  # [D, V]
    t = (lambda w: w.T) if transposed else (lambda w: w)

    def layer(p):
        d = p["wq"].shape[0]
        qkv = [p[n].reshape(d, -1) for n in ("wq", "wk", "wv")]
        lp = dict(attn_norm=p["attn_norm"], mlp_norm=p["mlp_norm"], wo=t(p["wo"].reshape(-1, d)))
        if fused:
            lp["wqkv"] = t(jnp.concatenate(qkv, axis=1))
        else:
            lp.update(wq=t(qkv[0]), wk=t(qkv[1]), wv=t(qkv[2]))
        if p.get("we_gate") is not None:
            lp.update({n: p[n] for n in MOE_PARAMS})
        elif fused:
            lp.update(w_gu=t(jnp.concatenate([p["w_gate"], p["w_up"]], axis=1)), w_down=t(p["w_down"]))
        else:
            lp.update(w_gate=t(p["w_gate"]), w_up=t(p["w_up"]), w_down=t(p["w_down"]))
        if p.get("bq") is not None and fused:
            lp["bqkv"] = jnp.concatenate([p[n].reshape(-1) for n in ("bq", "bk", "bv")])
        elif p.get("bq") is not None:
            lp.update({n: p[n].reshape(-1) for n in ("bq", "bk", "bv")})
        if p.get("q_norm") is not None:  # Qwen3's per-head q/k RMSNorm scales, [E] each
            lp["q_norm"], lp["k_norm"] = p["q_norm"], p["k_norm"]
        return lp

    dense_row, sparse_row = layer_groups(sparse_layers)

    def row(n, i):
        return (sparse_row[i] if n in MOE_PARAMS else dense_row[i]) if n in _MLP_PARAMS else i

    per_layer = tuple(
        layer({n: w[row(n, i)] for n, w in flat["layers"].items() if w is not None and row(n, i) >= 0})
        for i in range(len(sparse_layers))
    )
    return dict(embed=flat["embed"], final_norm=flat["final_norm"], out=t(out), layers=per_layer)


def dense_t(x, w_t, *, preferred_element_type=None):
    """x [..., I] @ w_t.T for w_t [O, I] -> [..., O], as one product contracting both minor axes."""
    lead = x.shape[:-1]
    y = jnp.einsum("oi,mi->mo", w_t, x.reshape(-1, x.shape[-1]), preferred_element_type=preferred_element_type)
    return y.reshape(*lead, w_t.shape[0])


def _layer(cfg: ModelConfig, p: dict, x_BxTxD, cos, sin, attention, layer, cache, transposed: bool):
    """`models.llama.decoder_layer` over `_split`'s per-layer weights: the same operations in the same
    order, with q/k/v as one product and gate/up as one product when the weights are fused."""
    dt = x_BxTxD.dtype
    b, t, _ = x_BxTxD.shape
    mm = dense_t if transposed else dense
    e, h_n, k_n = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
    h = rms_norm(x_BxTxD, p["attn_norm"], cfg.rms_norm_eps)
    if "wqkv" in p:
        qkv = mm(h, p["wqkv"].astype(dt))
        if "bqkv" in p:
            qkv = qkv + p["bqkv"].astype(dt)
        q, k, v = jnp.split(qkv, [h_n * e, (h_n + k_n) * e], axis=-1)
    else:
        q, k, v = (mm(h, p["w" + n].astype(dt)) for n in "qkv")
        if "bq" in p:
            q, k, v = (y + p["b" + n].astype(dt) for y, n in zip((q, k, v), "qkv"))
    q, k = qk_normed(cfg, p, q.reshape(b, t, h_n, e), k.reshape(b, t, k_n, e))
    q = constrain(apply_rope(q, cos, sin), (BATCH, SEQ, HEADS, HEAD_DIM))
    k = constrain(apply_rope(k, cos, sin), (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    v = constrain(v.reshape(b, t, k_n, e), (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    attn, cache = attention(q, k, v, layer=layer, cache=cache)
    x = constrain(x_BxTxD + mm(attn.reshape(b, t, -1), p["wo"].astype(dt)), (BATCH, SEQ, EMBED))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    if "we_gate" in p:  # Qwen3-MoE sparse MLP: the model's own block (models/moe.py)
        y, _, experts = moe_block(h, p, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        return constrain(x + y, (BATCH, SEQ, EMBED)), cache, experts
    if "w_gu" in p:
        gate, up = jnp.split(mm(h, p["w_gu"].astype(dt)), 2, axis=-1)
    else:
        gate, up = mm(h, p["w_gate"].astype(dt)), mm(h, p["w_up"].astype(dt))
    act = constrain(jax.nn.silu(gate) * up, (BATCH, SEQ, MLP))
    return constrain(x + mm(act, p["w_down"].astype(dt)), (BATCH, SEQ, EMBED)), cache, None


@dataclasses.dataclass(frozen=True)
class SplitForward:
    cfg: ModelConfig
    transposed: bool = False
    experts: ExpertLayout | None = None  # a mixture's experts split over mesh axes (models/moe.py)
    fused: bool = True  # q/k/v and gate/up as one product each (see the module docstring)
    static_layers = True  # layers are unrolled: the attention gets a Python-int layer

    def model_cfg(self, params) -> ModelConfig:
        return self.cfg

    def prepare(self, params):
        """Per-layer copies of the weights (one jitted call; compiled once per parameter layout)."""
        return _split(params, self.cfg.sparse_layers, self.transposed, self.fused)

    def hidden(self, gp, tokens_BxT, positions_BxT, attention, cache):
        """As `Transformer.hidden_routed`, with the layer loop unrolled over per-layer buffers:
        (h, cache, experts [B, T, S, k] of the S sparse layers or None)."""
        cfg = self.cfg
        x = constrain(embed_lookup(gp["embed"], tokens_BxT, jnp_dtype(cfg.dtype)), (BATCH, SEQ, EMBED))
        cos, sin = rope_tables(positions_BxT, inv_frequencies(cfg))
        routed = []
        for i, lp in enumerate(gp["layers"]):
            with use_experts(self.experts):
                x, cache, experts = _layer(cfg, lp, x, cos, sin, attention, i, cache, self.transposed)
            if experts is not None:
                routed.append(experts)
        experts = jnp.stack(routed, axis=2) if routed else None
        return rms_norm(x, gp["final_norm"], cfg.rms_norm_eps), cache, experts

    def logits(self, gp, h):
        if self.transposed:
            return dense_t(h, gp["out"].astype(h.dtype), preferred_element_type=jnp.float32)
        return dense(h, gp["out"].astype(h.dtype), preferred_element_type=jnp.float32)


def choose_forward(kind: str, graphdef, cfg: ModelConfig, rows: int = 1 << 30, experts: ExpertLayout | None = None):
    """kind: "auto" (split on CPU, transposed when `rows` (the decode batch) <= TRANSPOSED_MAX_ROWS;
    the model's forward elsewhere), "model", "split" or "split_t". A split forward fuses products
    when a layer's weights take at most FUSE_MAX_LAYER_BYTES (`layer_bytes`). `experts`: where a
    mixture's experts are split (sampling/sharding.expert_layout), for the expert-parallel block."""
    if kind == "auto":
        if jax.default_backend() != "cpu":
            kind = "model"
        else:
            kind = "split_t" if rows <= TRANSPOSED_MAX_ROWS else "split"
    if kind == "model":
        return ModelForward(graphdef, experts)
    return SplitForward(
        cfg, transposed=kind == "split_t", experts=experts, fused=layer_bytes(cfg) <= FUSE_MAX_LAYER_BYTES
    )


def layer_bytes(cfg: ModelConfig) -> int:
    """Bytes of one decoder layer's dense product weights (q, k, v, o, gate, up, down) in the
    parameter dtype."""
    d, e = cfg.hidden_size, cfg.head_size
    n = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * e + cfg.num_heads * e * d + 3 * d * cfg.intermediate_size
    return n * jnp.dtype(jnp_dtype(cfg.param_dtype)).itemsize
