"""Attention implementations behind the model's pluggable interface.

    attention(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, *, layer, cache) -> (out_BxTxHxE, cache)

q and k arrive with RoPE applied. `layer` is the traced layer index inside the layer scan and
`cache` any pytree carried through it (the sampler's paged KV pools; see rpeg_jax/sampling).
`DenseAttention` is the training / scoring implementation: causal within each nonzero segment
(segment 0 is padding), scores and softmax in float32, grouped-query heads without repeating K/V.

How it computes is `model.attention` (`resolve_attention`):
- `xla`: the einsum path below (`gqa_attention` over `causal_segment_mask`), the numerics the
  project has always had; jax.nn.dot_product_attention(implementation="xla") with the same mask
  gives bitwise the same values on the CPU, but its probabilities·V product has no float32
  accumulation type, so it is not kept as the reference.
- `cudnn`: cuDNN's fused flash attention through jax.nn.dot_product_attention(implementation=
  "cudnn") (NVIDIA GPUs, bf16/fp16). That API takes no segment ids, and the rows are left-padded
  prompts (its sequence lengths assume right padding), so the segment mask goes in as a boolean
  mask, which JAX turns into an additive bias of [B, 1, T, S] (one per row, not per head), with
  is_causal so the kernel skips the blocks above the diagonal. Odd lengths are padded to even
  (the kernel's bias path needs them in training).
- `pallas`: JAX's Pallas (Triton) flash attention (jax.experimental.pallas.ops.gpu.attention.mha),
  which takes the segment ids itself: no [T, S] array exists. It has no grouped-query heads, so
  K/V are repeated to H heads; lengths are padded to its block sizes. A pallas_call has no
  partitioning rule: under a multi-device mesh XLA gathers its operands (use cudnn there).
  `model.attention_interpret` runs it in Pallas interpret mode (the CPU tests).
- `auto`: cudnn on an NVIDIA GPU when the compute dtype (bf16/fp16) and head size allow it and the
  arrays carry no explicit sharding (sharding in types), else xla.

Every implementation gives the same outputs at real queries (segment != 0), to the rounding of
its compute dtype. Outputs at padding queries differ between them (xla: the mean of all values;
pallas: the mean over the padding keys; all finite); nothing reads them unmasked, and real
queries never attend padding keys, so real outputs and every gradient agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from rpeg_jax.config.base import ConfigError
from rpeg_jax.sharding.axes import explicit_spec

NEG_INF = -1e30  # finite: fully masked rows (padding queries) stay finite instead of NaN
CUDNN_DTYPES = ("bfloat16", "float16")  # cuDNN flash attention has no float32 kernel
PALLAS_BLOCK = 128  # the Pallas kernel's default forward block (BlockSizes.get_default)
PALLAS_MIN = 16  # smallest length the kernel is given (Triton's dot needs >= 16 rows)


def _group_heads(q_BxTxHxE, k_BxSxKxE):
    """q [B, T, H, E] -> [B, T, K, G, E]. With sharding in types the split of a sharded head axis
    is stated: the kv-head axis takes k's layout (q's heads gathered first when k's kv heads are
    not sharded, e.g. fewer kv heads than tensor devices)."""
    b, t, h, e = q_BxTxHxE.shape
    kv = k_BxSxKxE.shape[2]
    q_spec = explicit_spec(q_BxTxHxE)
    if q_spec is None:
        return q_BxTxHxE.reshape(b, t, kv, h // kv, e)
    k_spec = explicit_spec(k_BxSxKxE) or (None,) * 4
    if q_spec[2] != k_spec[2]:
        q_BxTxHxE = jax.reshard(q_BxTxHxE, jax.P(q_spec[0], q_spec[1], k_spec[2], q_spec[3]))
    return jnp.reshape(
        q_BxTxHxE, (b, t, kv, h // kv, e), out_sharding=jax.P(q_spec[0], q_spec[1], k_spec[2], None, q_spec[3])
    )


def gqa_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS) -> jax.Array:
    """softmax(q·kᵀ/√E + mask)·v with H query heads sharing K kv heads (H % K == 0).

    Scores accumulate in float32; the output has q's dtype. Masked entries get NEG_INF.
    """
    b, t, h, e = q_BxTxHxE.shape
    q = _group_heads(q_BxTxHxE, k_BxSxKxE)
    scores = jnp.einsum("btkge,bske->bkgts", q, k_BxSxKxE, preferred_element_type=jnp.float32)
    scores = scores * (e**-0.5)
    scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bske->btkge", probs.astype(v_BxSxKxE.dtype), v_BxSxKxE, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, e).astype(q_BxTxHxE.dtype)


def causal_segment_mask(segment_ids_BxT: jax.Array) -> jax.Array:
    """mask[b, i, j] = j <= i and seg[b, i] == seg[b, j] != 0."""
    t = segment_ids_BxT.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    seg = segment_ids_BxT
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    return causal[None] & same


# ---- choosing the implementation ------------------------------------------------------------------
@functools.cache
def _cuda_capability() -> tuple[int, int] | None:
    """The first device's CUDA compute capability, None when the backend is not CUDA."""
    from jax.extend import backend  # noqa: PLC0415 (jax does not import jax.extend itself)

    if jax.default_backend() != "gpu" or "cuda" not in backend.get_backend().platform_version.lower():
        return None
    major, minor = str(jax.devices()[0].compute_capability).split(".")[:2]
    return int(major), int(minor)


def _cudnn_unfit(cfg) -> str | None:
    """Why cuDNN's flash attention cannot run this model here (None when it can)."""
    cap = _cuda_capability()
    if cap is None:
        return f"cuDNN flash attention needs an NVIDIA GPU (the backend is {jax.default_backend()})"
    if cap < (8, 0):
        return f"cuDNN flash attention needs compute capability >= 8.0 (this GPU has {cap[0]}.{cap[1]})"
    if cfg.dtype not in CUDNN_DTYPES:
        return f"cuDNN flash attention needs model.dtype bfloat16 or float16, not {cfg.dtype}"
    e_max = 256 if cap >= (9, 0) else 128
    if cfg.head_size % 8 or cfg.head_size > e_max:
        return f"cuDNN flash attention needs a head size that is a multiple of 8 and <= {e_max}, not {cfg.head_size}"
    return None


def resolve_attention(cfg, *, explicit_sharding: bool = False) -> str:
    """`cfg.attention` on this backend: "xla", "cudnn" or "pallas" ("auto" resolved; to xla when
    the activations are sharded in types, `explicit_sharding`, a combination not tried with cuDNN).

    ConfigError (one line naming model.attention and the value) for cudnn or pallas where it cannot
    run, so a run on the wrong backend stops before anything compiles (runtime/setup.py calls this
    when it builds a model; the model's forward calls it again while tracing)."""
    choice = cfg.attention
    if choice == "auto":
        return "cudnn" if not explicit_sharding and _cudnn_unfit(cfg) is None else "xla"
    if choice == "cudnn":
        why = _cudnn_unfit(cfg)
        if why is not None:
            raise ConfigError("model.attention", choice, why)
    if choice == "pallas" and not cfg.attention_interpret and jax.default_backend() != "gpu":
        raise ConfigError(
            "model.attention",
            choice,
            f"the Pallas (Triton) kernel needs a GPU (the backend is {jax.default_backend()}); "
            "model.attention_interpret=true runs it in interpret mode (slow, for tests)",
        )
    return choice


# ---- the kernels ----------------------------------------------------------------------------------
def _pad_axis(x, axis: int, size: int, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def sdpa_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS, *, causal: bool, implementation: str = "cudnn"):
    """jax.nn.dot_product_attention with `mask_BxTxS` (True = attend) as a [B, 1, T, S] mask and,
    when `causal` (the mask is already causal: a statement that lets cuDNN skip blocks), is_causal.
    T and S are padded to even lengths (padded keys masked, padded queries dropped). `implementation`
    "cudnn" in the model; "xla" runs the same call on any backend (the tests' check of the arguments)."""
    b, t, h, e = q_BxTxHxE.shape
    s = k_BxSxKxE.shape[1]
    if causal and t != s:
        raise ValueError(f"sdpa_attention: is_causal aligns the diagonal top-left; needs T == S, got {t} and {s}")
    tp, sp = t + t % 2, s + s % 2
    q = _pad_axis(q_BxTxHxE, 1, tp)
    k, v = _pad_axis(k_BxSxKxE, 1, sp), _pad_axis(v_BxSxKxE, 1, sp)
    mask = _pad_axis(_pad_axis(mask_BxTxS, 1, tp, False), 2, sp, False)
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None], scale=e**-0.5, is_causal=causal, implementation=implementation
    )
    return out[:, :t]


def pallas_segment_attention(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, segment_ids_BxT, *, interpret: bool = False):
    """Causal attention within equal segment ids by the Pallas flash kernel (mha), K/V repeated
    to the H query heads. T is padded to the kernel's block multiple (padded positions get segment
    id -1: no real query sees them). Padding queries (segment 0) attend the padding keys before them."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # noqa: PLC0415

    b, t, h, e = q_BxTxHxE.shape
    g = h // k_BxTxKxE.shape[2]
    tp = -(-t // PALLAS_BLOCK) * PALLAS_BLOCK if t > PALLAS_BLOCK else max(PALLAS_MIN, 1 << (t - 1).bit_length())
    q = _pad_axis(q_BxTxHxE, 1, tp)
    k = _pad_axis(jnp.repeat(k_BxTxKxE, g, axis=2), 1, tp)
    v = _pad_axis(jnp.repeat(v_BxTxKxE, g, axis=2), 1, tp)
    seg = _pad_axis(jnp.asarray(segment_ids_BxT, jnp.int32), 1, tp, -1)
    out = pallas_attention.mha(q, k, v, seg, sm_scale=e**-0.5, causal=True, interpret=interpret)
    return out[:, :t]


def segment_attention(q, k, v, segment_ids_BxT, *, impl: str = "xla", interpret: bool = False):
    """Self-attention causal within each nonzero segment, by implementation `impl` (resolved)."""
    if impl == "pallas":
        return pallas_segment_attention(q, k, v, segment_ids_BxT, interpret=interpret)
    mask = causal_segment_mask(segment_ids_BxT)
    if impl == "cudnn":
        return sdpa_attention(q, k, v, mask, causal=True)
    return gqa_attention(q, k, v, mask)


@dataclass(frozen=True)
class DenseAttention:
    """Full causal attention over the current tokens (training, scoring, reference decoding);
    `impl` is a resolved model.attention (`resolve_attention`)."""

    segment_ids_BxT: jax.Array
    impl: str = "xla"
    interpret: bool = False

    def __call__(self, q, k, v, *, layer, cache):
        del layer
        return segment_attention(q, k, v, self.segment_ids_BxT, impl=self.impl, interpret=self.interpret), cache


jax.tree_util.register_dataclass(DenseAttention, data_fields=["segment_ids_BxT"], meta_fields=["impl", "interpret"])
