"""Model section of the run config: the Llama/Qwen2/Qwen3-family decoder's shape and numerics.

Presets (`model.preset`) name the shapes of bench/WORKLOADS.md and the Qwen2/Qwen3/Llama sizes the
planner is asked about; any field given next to a preset overrides it. `model.path` points at a
local Hugging Face checkpoint directory whose config.json then defines the shape, ids and RoPE
settings (config/hf.py, at load time, before validation; a preset beside it is ignored).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import ConfigError, check, key

DType = Literal["float32", "bfloat16", "float16"]
UNROLL_MAX_LAYERS = 4  # default: models this shallow run their layers unrolled (ModelConfig.scan_layers)


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (rope_type "llama3" in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self, path: str) -> None:
        check(self.factor >= 1.0, key(path, "factor"), self.factor, "must be >= 1")
        check(
            self.high_freq_factor > self.low_freq_factor,
            key(path, "high_freq_factor"),
            self.high_freq_factor,
            "must exceed low_freq_factor",
        )


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # PEFT's names


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters on the actor's projections (models/lora.py): rank 0 trains every parameter; rank r
    > 0 trains only rank-r adapters A [r, in], B [out, r] per target (PEFT's layout and init: B = 0),
    the forward computing y = x W + (alpha / r) (x A^T) B^T beside the frozen base weight W."""

    rank: int = 0  # r; 0 = off (full fine-tuning)
    alpha: float | None = None  # the adapters' scale is alpha / rank; None -> 2 * rank (scale 2)
    targets: tuple[str, ...] = LORA_TARGETS  # projections (PEFT target_modules names) that get adapters

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else 2.0 * self.rank) / max(self.rank, 1)

    def validate(self, path: str) -> None:
        check(self.rank >= 0, key(path, "rank"), self.rank, "must be >= 0 (0 = off)")
        if self.alpha is not None:
            check(self.alpha > 0, key(path, "alpha"), self.alpha, "must be > 0")
        for t in self.targets:
            check(t in LORA_TARGETS, key(path, "targets"), t, f"unknown projection; known: {', '.join(LORA_TARGETS)}")
        check(len(self.targets) > 0, key(path, "targets"), list(self.targets), "must name at least one projection")
        twice = len(set(self.targets)) != len(self.targets)
        check(not twice, key(path, "targets"), list(self.targets), "names a projection twice")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Decoder shape. Letters used in tensor names: B batch, T sequence, D hidden (embed),
    H query heads, K kv heads, E head_dim, F mlp (intermediate), V vocab, L layers."""

    preset: str | None = None  # name in PRESETS; fields set beside it override the preset
    path: str | None = None  # local Hugging Face checkpoint dir (config.json + *.safetensors): its
    #   config.json sets every field it has (shape, ids, RoPE); fields given beside it override the
    #   numerics and ids (each reported), not the shape the weights fix (config/hf.py)
    arch: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = (
        "llama"  # the Hugging Face family (model_type) it exports as
    )
    vocab_size: int = 128  # V
    hidden_size: int = 256  # D
    num_layers: int = 4  # L
    num_heads: int = 4  # H
    num_kv_heads: int = 2  # K (grouped-query attention: H % K == 0)
    head_dim: int | None = None  # E; None -> hidden_size // num_heads
    intermediate_size: int = 768  # F (SwiGLU)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 512
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim (weights [E], shared by the heads) on every q and
    #   k head, after the projection and before RoPE
    num_experts: int = 0  # X: experts per sparse MLP layer (Qwen3-MoE); 0 = every MLP is dense (models/moe.py)
    num_experts_per_tok: int = 2  # k: experts each token is routed to (top-k of the router's softmax)
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (0 -> intermediate_size)
    norm_topk_prob: bool = True  # renormalise the k chosen probabilities to sum to 1 (HF norm_topk_prob)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (these keep a dense MLP)
    value_head: bool = False  # scalar value head (critic, or shared actor-critic)
    param_dtype: DType = "float32"
    dtype: DType = "float32"  # compute dtype of matmuls; logits/logprobs are always float32
    attention: Literal["auto", "xla", "cudnn", "pallas"] = "auto"  # training/scoring attention (models/
    #   attention.py): xla = the einsum path; cudnn = cuDNN flash attention (NVIDIA GPU, bf16/fp16);
    #   pallas = JAX's Pallas flash kernel (GPU); auto = cudnn where it can run, else xla
    attention_interpret: bool = False  # model.attention=pallas in Pallas interpret mode (any backend; slow: tests)
    remat: Literal["none", "full", "dots"] = "none"  # rematerialisation of each layer in backward
    scan_layers: bool | None = None  # layers under lax.scan (compile time flat in depth) or unrolled
    #   (faster on CPU for a few layers); None -> scan when num_layers > UNROLL_MAX_LAYERS
    init_std: float = 0.02
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    lora: LoraConfig = LoraConfig()  # LoRA fine-tuning of the actor (rank 0 = off)
    eos_ids: tuple[int, ...] = ()  # more ids that end a sequence as eos_id does (generation_config.json's
    #   eos_token_id list, e.g. Llama 3's <|eot_id|>): the sampler stops at them, rewards cut there

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence: eos_id, then eos_ids."""
        return tuple(dict.fromkeys((self.eos_id, *self.eos_ids)))

    @property
    def scanned(self) -> bool:
        """Whether the layers run under lax.scan (scan_layers, or its depth-based default)."""
        if self.scan_layers is not None:
            return self.scan_layers
        return self.num_layers > UNROLL_MAX_LAYERS and len(set(self.sparse_layers)) == 1

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its MLP is the mixture of experts (HF Qwen3-MoE's rule)."""
        if self.num_experts <= 0:
            return (False,) * self.num_layers
        return tuple(
            i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0 for i in range(self.num_layers)
        )

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def num_params(self, with_lm_head: bool = True) -> int:
        """Parameter count (embedding, layers, final norm, LM head unless tied, value head)."""
        d, e, f = self.hidden_size, self.head_size, self.intermediate_size
        q, kv = self.num_heads * e, self.num_kv_heads * e
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        layer = attn + 2 * d + (2 * e if self.qk_norm else 0)
        sparse = sum(self.sparse_layers)
        mlp = (self.num_layers - sparse) * 3 * d * f + sparse * (d * self.num_experts * (1 + 3 * self.expert_size))
        n = self.vocab_size * d + self.num_layers * layer + mlp + d
        if with_lm_head and not self.tie_embeddings:
            n += d * self.vocab_size
        if self.value_head:
            n += d + 1
        return n

    def validate(self, path: str) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            check(v >= 1, key(path, name), v, "must be >= 1")
        if self.head_dim is None:
            check(
                self.hidden_size % self.num_heads == 0,
                key(path, "num_heads"),
                self.num_heads,
                f"must divide hidden_size={self.hidden_size} (or set head_dim)",
            )
        else:
            check(self.head_dim >= 1, key(path, "head_dim"), self.head_dim, "must be >= 1")
        check(self.head_size % 2 == 0, key(path, "head_dim"), self.head_size, "must be even for RoPE")
        check(
            self.num_heads % self.num_kv_heads == 0,
            key(path, "num_kv_heads"),
            self.num_kv_heads,
            f"must divide num_heads={self.num_heads}",
        )
        check(self.rms_norm_eps > 0, key(path, "rms_norm_eps"), self.rms_norm_eps, "must be > 0")
        check(self.rope_theta > 0, key(path, "rope_theta"), self.rope_theta, "must be > 0")
        check(self.init_std > 0, key(path, "init_std"), self.init_std, "must be > 0")
        for name in ("pad_id", "bos_id", "eos_id"):
            v = getattr(self, name)
            check(0 <= v < self.vocab_size, key(path, name), v, f"must be in [0, vocab_size={self.vocab_size})")
        for v in self.eos_ids:
            check(0 <= v < self.vocab_size, key(path, "eos_ids"), v, f"must be in [0, vocab_size={self.vocab_size})")
        if self.num_experts > 0:
            k = self.num_experts_per_tok
            check(
                1 <= k <= self.num_experts,
                key(path, "num_experts_per_tok"),
                k,
                f"must be in [1, num_experts={self.num_experts}]",
            )
            check(
                self.moe_intermediate_size >= 0,
                key(path, "moe_intermediate_size"),
                self.moe_intermediate_size,
                "must be >= 0",
            )
            check(
                self.decoder_sparse_step >= 1,
                key(path, "decoder_sparse_step"),
                self.decoder_sparse_step,
                "must be >= 1",
            )
            for i in self.mlp_only_layers:
                check(
                    0 <= i < self.num_layers,
                    key(path, "mlp_only_layers"),
                    i,
                    f"must be in [0, num_layers={self.num_layers})",
                )
            mixed = len(set(self.sparse_layers)) > 1
            check(
                not (mixed and self.scan_layers),
                key(path, "scan_layers"),
                self.scan_layers,
                "a model mixing dense and sparse MLP layers runs unrolled: must be false or null",
            )
        check(self.num_experts >= 0, key(path, "num_experts"), self.num_experts, "must be >= 0")
        if self.arch == "qwen3_moe":
            check(
                self.num_experts > 0,
                key(path, "num_experts"),
                self.num_experts,
                "model.arch=qwen3_moe needs experts: must be >= 1",
            )
        elif self.num_experts > 0:
            check(
                False,
                key(path, "num_experts"),
                self.num_experts,
                f"experts are Qwen3-MoE's: need model.arch=qwen3_moe (not {self.arch})",
            )
        if self.arch in ("qwen3", "qwen3_moe"):  # the Hugging Face Qwen3 decoder, which export writes
            why = f"model.arch={self.arch} normalises q and k per head: must be true"
            check(self.qk_norm, key(path, "qk_norm"), self.qk_norm, why)
            why = f"model.arch={self.arch} has no q/k/v biases"
            check(not self.qkv_bias, key(path, "qkv_bias"), self.qkv_bias, why)
        else:
            why = f"the q/k norm is Qwen3's: needs model.arch=qwen3 (not {self.arch})"
            check(not self.qk_norm, key(path, "qk_norm"), self.qk_norm, why)
        check(
            self.attention != "cudnn" or self.dtype in ("bfloat16", "float16"),
            key(path, "attention"),
            self.attention,
            f"cuDNN flash attention needs model.dtype bfloat16 or float16, not {self.dtype}",
        )
        check(
            not self.attention_interpret or self.attention == "pallas",
            key(path, "attention_interpret"),
            self.attention_interpret,
            f"interpret mode is for model.attention=pallas, not {self.attention}",
        )
        if self.preset is not None:
            check(
                self.preset in PRESETS,
                key(path, "preset"),
                self.preset,
                f"unknown preset; known: {', '.join(sorted(PRESETS))}",
            )
        if self.rope_scaling is not None:
            self.rope_scaling.validate(key(path, "rope_scaling"))
        self.lora.validate(key(path, "lora"))
        if self.lora.rank:
            check(
                self.num_experts == 0,
                key(path, "lora.rank"),
                self.lora.rank,
                "LoRA on a mixture-of-experts model (model.num_experts > 0) is not supported",
            )


def _qwen3(*, tie_embeddings: bool = False, **shape) -> dict:
    """A Qwen3 dense preset: what every size shares, and its own shape (8 kv heads in all of them)."""
    return dict(
        arch="qwen3",
        vocab_size=151936,
        num_kv_heads=8,
        head_dim=128,
        qk_norm=True,
        tie_embeddings=tie_embeddings,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        **shape,
    )


# Shapes from bench/WORKLOADS.md (T, S) and Qwen2/Qwen3/Llama public configs (for the planner and GPU).
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=128,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=768,
        max_position_embeddings=512,
    ),
    "small": dict(
        vocab_size=32000,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        intermediate_size=2048,
        max_position_embeddings=2048,
    ),
    # RS (bench/WORKLOADS.md): SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M-Instruct config.json)
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        tie_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
    "qwen2-0.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        qkv_bias=True,
        tie_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    "qwen2-1.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        intermediate_size=8960,
        qkv_bias=True,
        tie_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    "qwen2-7b": dict(
        arch="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        intermediate_size=18944,
        qkv_bias=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    "qwen2-32b": dict(
        arch="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        intermediate_size=27648,
        qkv_bias=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
    ),
    "qwen2-72b": dict(
        arch="qwen2",
        vocab_size=152064,
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        intermediate_size=29568,
        qkv_bias=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
    ),
    # Qwen3 dense (Qwen/Qwen3-*'s config.json): head_dim 128 whatever hidden / heads is, q/k RMSNorm,
    # no q/k/v bias, vocab 151936, rope_theta 1e6, max_position_embeddings 40960, rms_norm_eps 1e-6;
    # embeddings tied up to 4B.
    "qwen3-0.6b": _qwen3(hidden_size=1024, num_layers=28, num_heads=16, intermediate_size=3072, tie_embeddings=True),
    "qwen3-1.7b": _qwen3(hidden_size=2048, num_layers=28, num_heads=16, intermediate_size=6144, tie_embeddings=True),
    "qwen3-4b": _qwen3(hidden_size=2560, num_layers=36, num_heads=32, intermediate_size=9728, tie_embeddings=True),
    "qwen3-8b": _qwen3(hidden_size=4096, num_layers=36, num_heads=32, intermediate_size=12288),
    "qwen3-14b": _qwen3(hidden_size=5120, num_layers=40, num_heads=40, intermediate_size=17408),
    "qwen3-32b": _qwen3(hidden_size=5120, num_layers=64, num_heads=64, intermediate_size=25600),
    # Qwen3-MoE (Qwen/Qwen3-30B-A3B's config.json): 48 layers, every MLP a mixture of 128 experts of
    # width 768 with 8 routed per token (renormalised), 4 kv heads; 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": {
        **_qwen3(hidden_size=2048, num_layers=48, num_heads=32, intermediate_size=6144),
        "arch": "qwen3_moe",
        "num_kv_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
    },
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    "llama3-70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        intermediate_size=28672,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
}


def resolve_preset(data: dict | None, path: str = "model") -> dict:
    """Merge `data` over the preset it names (explicit fields win)."""
    data = dict(data or {})
    name = data.get("preset")
    if name is None:
        return data
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(key(path, "preset"), name, f"unknown preset; known: {', '.join(sorted(PRESETS))}")
    return {**PRESETS[name], **data}


def model_preset(name: str, **overrides) -> ModelConfig:
    """A ModelConfig from a preset name, e.g. `model_preset("tiny", value_head=True)`."""
    from rpeg_jax.config.base import build

    return build(ModelConfig, resolve_preset({"preset": name, **overrides}), "model")


def replace(cfg: ModelConfig, **changes) -> ModelConfig:
    """dataclasses.replace + validation."""
    out = dataclasses.replace(cfg, **changes)
    out.validate("model")
    return out
