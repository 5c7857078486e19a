"""Llama/Qwen2/Qwen3-family decoder (Flax NNX), chunked logprobs, Hugging Face interop."""

from rpeg_jax.models.attention import DenseAttention, causal_segment_mask, gqa_attention
from rpeg_jax.models.hf import load_hf, save_hf
from rpeg_jax.models.llama import Transformer, init_model
from rpeg_jax.models.logprobs import chunked_logprobs, token_logprobs

__all__ = [
    "DenseAttention",
    "causal_segment_mask",
    "gqa_attention",
    "load_hf",
    "save_hf",
    "Transformer",
    "init_model",
    "chunked_logprobs",
    "token_logprobs",
]
