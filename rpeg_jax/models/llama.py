"""The Llama/Qwen2/Qwen3-family decoder (Flax NNX): RMSNorm, RoPE, grouped-query attention, SwiGLU;
q/k/v biases (Qwen2, model.qkv_bias) and a per-head RMSNorm of q and k before RoPE (Qwen3, model.qk_norm).

Letters in tensor names: B batch, T sequence, D hidden (embed), H query heads, K kv heads,
E head_dim, F mlp, V vocab, L layers.

Layer parameters are stacked along a leading `layers` axis and the layers run under
`jax.lax.scan` (compile time independent of depth) or unrolled (`model.scan_layers=false`).
Every parameter is an `nnx.Param` whose metadata `axes` holds its logical axis names; sharding
rules map those names to mesh axes (rpeg_jax/sharding). Attention is pluggable
(models/attention.py) so the sampler can run the same weights over paged KV caches; the
training/scoring attention's kernel is model.attention (xla, cudnn, pallas; auto).

Called by: the trainer stages (logprobs, values, updates), the sampler (prefill/decode), HF interop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rpeg_jax.config.model import ModelConfig
from rpeg_jax.models.adapters import adapter_names, add_adapters, project
from rpeg_jax.models.attention import DenseAttention, resolve_attention
from rpeg_jax.models.dense import compute_layout, dense, embed_lookup
from rpeg_jax.models.moe import MOE_PARAMS, layer_groups, moe_block
from rpeg_jax.models.rope import apply_rope, inv_frequencies, rope_tables
from rpeg_jax.sharding.axes import (
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    MLP,
    SEQ,
    VOCAB,
    constrain,
    explicit_spec,
)

LAYER_PARAMS = (
    "attn_norm",
    "wq",
    "bq",
    "wk",
    "bk",
    "wv",
    "bv",
    "q_norm",
    "k_norm",
    "wo",
    "mlp_norm",
    "w_gate",
    "w_up",
    "w_down",
    *MOE_PARAMS,
)


def jnp_dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) · up, whose backward keeps only gate and up (and the product, which the down
    projection saves as its input): JAX's jitted silu saves three more mlp-sized arrays per layer
    (bench/memory.py: RS's update held 1.57 GB less at remat none). Same forward values as
    `jax.nn.silu(gate) * up` (the sampler's forward computes that: logprob parity holds); the
    gradient is recomputed from gate in float32 (tests/test_model_memory.py)."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_bwd(res, g):
    gate, up = res
    x = gate.astype(jnp.float32)
    s = jax.nn.sigmoid(x)
    gf = g.astype(jnp.float32)
    d_gate = gf * up.astype(jnp.float32) * s * (1.0 + x * (1.0 - s))
    d_up = gf * x * s
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def rms_norm(x, scale, eps: float):
    """x / sqrt(mean(x²) + eps) · scale, computed in float32 and cast back (as HF does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * xf.astype(x.dtype)


class Layers(nnx.Module):
    """All decoder layers' parameters, stacked over L."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, D, H, K, E, F = (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_size,
            cfg.intermediate_size,
        )
        pd = jnp_dtype(cfg.param_dtype)
        normal = nnx.initializers.normal(cfg.init_std)

        def weight(shape, axes):
            return nnx.Param(normal(rngs.params(), shape, pd), axes=axes)

        def const(shape, axes, value):
            return nnx.Param(jnp.full(shape, value, pd), axes=axes)

        self.attn_norm = const((L, D), (LAYERS, EMBED), 1.0)
        self.wq = weight((L, D, H, E), (LAYERS, EMBED, HEADS, HEAD_DIM))
        self.wk = weight((L, D, K, E), (LAYERS, EMBED, KV_HEADS, HEAD_DIM))
        self.wv = weight((L, D, K, E), (LAYERS, EMBED, KV_HEADS, HEAD_DIM))
        self.wo = weight((L, H, E, D), (LAYERS, HEADS, HEAD_DIM, EMBED))
        if cfg.qkv_bias:
            self.bq = const((L, H, E), (LAYERS, HEADS, HEAD_DIM), 0.0)
            self.bk = const((L, K, E), (LAYERS, KV_HEADS, HEAD_DIM), 0.0)
            self.bv = const((L, K, E), (LAYERS, KV_HEADS, HEAD_DIM), 0.0)
        else:
            self.bq = self.bk = self.bv = None
        if cfg.qk_norm:  # one [E] scale per layer, shared by all q heads (q_norm) and all kv heads (k_norm)
            self.q_norm = const((L, E), (LAYERS, HEAD_DIM), 1.0)
            self.k_norm = const((L, E), (LAYERS, HEAD_DIM), 1.0)
        else:
            self.q_norm = self.k_norm = None
        self.mlp_norm = const((L, D), (LAYERS, EMBED), 1.0)
        Ls = sum(cfg.sparse_layers)  # Qwen3-MoE: dense MLP weights stacked over the dense layers only
        Ld = L - Ls
        self.w_gate = weight((Ld, D, F), (LAYERS, EMBED, MLP)) if Ld else None
        self.w_up = weight((Ld, D, F), (LAYERS, EMBED, MLP)) if Ld else None
        self.w_down = weight((Ld, F, D), (LAYERS, MLP, EMBED)) if Ld else None
        if Ls:  # expert weights stacked over the sparse layers (models/moe.py)
            X, Fe = cfg.num_experts, cfg.expert_size
            self.w_router = weight((Ls, D, X), (LAYERS, EMBED, None))
            self.we_gate = weight((Ls, X, D, Fe), (LAYERS, None, EMBED, MLP))
            self.we_up = weight((Ls, X, D, Fe), (LAYERS, None, EMBED, MLP))
            self.we_down = weight((Ls, X, Fe, D), (LAYERS, None, MLP, EMBED))
        else:
            self.w_router = self.we_gate = self.we_up = self.we_down = None

    def stacked(self) -> dict[str, jax.Array]:
        """{name: [L, ...] array} for the layer scan (biases and q/k norms only when present)."""
        out = {n: getattr(self, n)[...] for n in LAYER_PARAMS if getattr(self, n) is not None}
        return out | {n: getattr(self, n)[...] for n in adapter_names(self)}  # model.lora (models/adapters.py)


def qk_normed(cfg: ModelConfig, p: dict, q_BxTxHxE, k_BxTxKxE):
    """Qwen3's q_norm / k_norm: RMSNorm over head_dim of each head, before RoPE (identity when the
    layer has none). Every decoder layer implementation calls this (here and sampling/forward.py)."""
    if "q_norm" not in p:
        return q_BxTxHxE, k_BxTxKxE
    return rms_norm(q_BxTxHxE, p["q_norm"], cfg.rms_norm_eps), rms_norm(k_BxTxKxE, p["k_norm"], cfg.rms_norm_eps)


def decoder_layer(cfg: ModelConfig, p: dict, x_BxTxD, cos, sin, attention, layer, cache, experts_BxTxK=None):
    """One pre-norm decoder layer: x + Attn(norm(x)); then x + SwiGLU(norm(x)) (or the sparse MLP).
    Returns (x, cache, route): route is None for a dense MLP, else (router logits [B, T, X],
    experts used [B, T, k]); `experts_BxTxK` imposes a sparse layer's experts (routing replay; -1
    entries route freely, models/moe.route).

    Projections go through `dense` (one 2-D GEMM each, forward and backward; see models/dense.py).
    """
    dt = x_BxTxD.dtype
    h = rms_norm(x_BxTxD, p["attn_norm"], cfg.rms_norm_eps)
    q = project(cfg, p, "wq", h)  # x W (+ the LoRA term when model.lora: models/adapters.py)
    k = project(cfg, p, "wk", h)
    v = project(cfg, p, "wv", h)
    if "bq" in p:
        q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
    q, k = qk_normed(cfg, p, q, k)
    q = constrain(apply_rope(q, cos, sin), (BATCH, SEQ, HEADS, HEAD_DIM))
    k = constrain(apply_rope(k, cos, sin), (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    v = constrain(v, (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    attn, cache = attention(q, k, v, layer=layer, cache=cache)
    x = x_BxTxD + project(cfg, p, "wo", attn, contract=2)
    x = constrain(x, (BATCH, SEQ, EMBED))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    if "we_gate" in p:  # Qwen3-MoE sparse MLP (models/moe.py)
        y, logits, experts = moe_block(h, p, cfg.num_experts_per_tok, cfg.norm_topk_prob, experts_BxTxK)
        return constrain(x + y, (BATCH, SEQ, EMBED)), cache, (logits, experts)
    gate = project(cfg, p, "w_gate", h)
    up = project(cfg, p, "w_up", h)
    act = constrain(swiglu(gate, up), (BATCH, SEQ, MLP))
    x = x + project(cfg, p, "w_down", act)
    return constrain(x, (BATCH, SEQ, EMBED)), cache, None


_MLP_PARAMS = ("w_gate", "w_up", "w_down", *MOE_PARAMS)  # stacked over their own group of layers

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in backward
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Transformer(nnx.Module):
    """Decoder-only LM with an optional scalar value head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = jnp_dtype(cfg.param_dtype)
        normal = nnx.initializers.normal(cfg.init_std)
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = nnx.Param(normal(rngs.params(), (V, D), pd), axes=(VOCAB, EMBED))
        self.layers = Layers(cfg, rngs)
        self.final_norm = nnx.Param(jnp.ones((D,), pd), axes=(EMBED,))
        self.lm_head = None if cfg.tie_embeddings else nnx.Param(normal(rngs.params(), (D, V), pd), axes=(EMBED, VOCAB))
        if cfg.value_head:
            self.value_w = nnx.Param(jnp.zeros((D,), pd), axes=(EMBED,))
            self.value_b = nnx.Param(jnp.zeros((), pd), axes=())
        else:
            self.value_w = self.value_b = None
        if cfg.lora.rank:  # model.lora: adapters drawn after every base weight (models/adapters.py)
            add_adapters(self.layers, cfg, rngs)

    # ---- forward pieces -------------------------------------------------------------------
    def hidden(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None, *, attention=None, cache: Any = None):
        """Final-normed hidden states [B, T, D] (compute dtype) and the updated cache."""
        h, cache, _ = self.hidden_routed(tokens_BxT, positions_BxT, segment_ids_BxT, attention=attention, cache=cache)
        return h, cache

    def hidden_routed(
        self,
        tokens_BxT,
        positions_BxT=None,
        segment_ids_BxT=None,
        *,
        attention=None,
        cache: Any = None,
        experts_BxTxSxK=None,
    ):
        """`hidden` plus the sparse layers' routing: (h, cache, route) with route None for a dense
        model, else {"logits": router logits [B, T, S, X] float32, "experts": the experts used
        [B, T, S, k] int32} over the S sparse layers in order. `experts_BxTxSxK` imposes them
        (routing replay; -1 entries route freely)."""
        cfg = self.cfg
        tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1], dtype=jnp.int32), tokens_BxT.shape)
        if segment_ids_BxT is None:
            segment_ids_BxT = jnp.ones_like(tokens_BxT)
        dt = jnp_dtype(cfg.dtype)
        x = constrain(embed_lookup(self.embed[...], tokens_BxT, dt), (BATCH, SEQ, EMBED))
        if attention is None:
            attention = DenseAttention(
                jnp.asarray(segment_ids_BxT, jnp.int32), impl=self.attention_impl(x), interpret=cfg.attention_interpret
            )
        cos, sin = rope_tables(positions_BxT, inv_frequencies(cfg))

        def body(carry, xs):
            x, cache = carry
            p, layer, forced = xs
            p = {n: compute_layout(w, x) for n, w in p.items()}  # identity unless sharding is in types
            x, cache, route = decoder_layer(cfg, p, x, cos, sin, attention, layer, cache, forced)
            return (x, cache), route

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat])
        stacked = self.layers.stacked()
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        sparse = cfg.sparse_layers
        if experts_BxTxSxK is not None:
            experts_BxTxSxK = jnp.asarray(experts_BxTxSxK, jnp.int32)
        if cfg.scanned:  # every layer of one kind
            forced = None if experts_BxTxSxK is None else jnp.moveaxis(experts_BxTxSxK, 2, 0)
            (x, cache), routes = jax.lax.scan(body, (x, cache), (stacked, layer_ids, forced))
            route = None if routes is None else tuple(jnp.moveaxis(r, 0, 2) for r in routes)
        else:  # unrolled: no loop carry or stacked residuals (faster on CPU for a few layers)
            dense_row, sparse_row = layer_groups(sparse)
            routes = []
            for i in range(cfg.num_layers):
                row = {
                    n: (sparse_row[i] if n in MOE_PARAMS else dense_row[i]) if n in _MLP_PARAMS else i for n in stacked
                }
                p = {n: w[row[n]] for n, w in stacked.items() if row[n] >= 0}
                forced = None if experts_BxTxSxK is None or not sparse[i] else experts_BxTxSxK[:, :, sparse_row[i]]
                (x, cache), r = body((x, cache), (p, layer_ids[i], forced))
                if r is not None:
                    routes.append(r)
            route = tuple(jnp.stack(z, axis=2) for z in zip(*routes)) if routes else None
        h = rms_norm(x, compute_layout(self.final_norm[...], x), cfg.rms_norm_eps)
        return h, cache, (None if route is None else {"logits": route[0], "experts": route[1]})

    def attention_impl(self, x_BxTxD) -> str:
        """model.attention resolved for activations like `x_BxTxD` (models/attention.resolve_attention)."""
        return resolve_attention(self.cfg, explicit_sharding=explicit_spec(x_BxTxD) is not None)

    def output_matrix(self) -> jax.Array:
        """[D, V] unembedding (the transposed embedding when tied)."""
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]

    def logits(self, h_BxTxD) -> jax.Array:
        w = self.output_matrix().astype(h_BxTxD.dtype)
        logits = dense(h_BxTxD, w, preferred_element_type=jnp.float32)
        return constrain(logits, (BATCH, SEQ, VOCAB)) if logits.ndim == 3 else logits

    def values(self, h_BxTxD) -> jax.Array:
        if self.value_w is None:
            raise ValueError("model.values: this model has no value head (model.value_head=false)")
        h = h_BxTxD.astype(jnp.float32)
        return h @ self.value_w[...].astype(jnp.float32) + self.value_b[...].astype(jnp.float32)

    def forward(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
        """(logits [B,T,V] float32, values [B,T] float32 or None)."""
        h, _ = self.hidden(tokens_BxT, positions_BxT, segment_ids_BxT)
        return self.logits(h), (self.values(h) if self.value_w is not None else None)

    def __call__(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
        h, _ = self.hidden(tokens_BxT, positions_BxT, segment_ids_BxT)
        return self.logits(h)


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A randomly initialised model (weights on the default device)."""
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))
