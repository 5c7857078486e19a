"""One FLOP model of the decoder (matmul FLOPs; norms, biases and elementwise work are not counted):
the runtime's `perf/flops` and `perf/mfu` (runtime/rollout/stats.step_flops), the cost model's stage
prices and utilization (costmodel/shape.ModelShape) and the benchmarks' MFU all count with these.

Per token and layer: the Q, K, V, O projections and the SwiGLU MLP (3 matrices), 2 FLOPs per
multiply-add. The LM head: 2·D·V per position whose logits are computed. Attention: 4·H·E per
(query, key) pair and layer (the scores and the weighted values); causal attention over a sequence
of s tokens has s²/2 pairs (counted as s²/2, the diagonal's half pair ignored), a dense one s².
A mixture-of-experts layer (Qwen3-MoE) replaces the SwiGLU by its router (D·X) and the k experts a
token is routed to (3·D·Fe each): only the active parameters compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Dims:
    """The decoder's sizes: L layers, D hidden, H query heads, K kv heads, E head dim, F MLP, V vocab;
    a mixture of experts: X experts in each of Ls sparse layers, k routed per token, Fe wide."""

    L: int
    D: int
    H: int
    K: int
    E: int
    F: int
    V: int
    X: int = 0
    k: int = 0
    Fe: int = 0
    Ls: int = 0

    @classmethod
    def of(cls, m) -> "Dims":
        """From a model config (config/model.ModelConfig: head_size) or graph dims (head_dim)."""
        e = getattr(m, "head_size", None) or getattr(m, "head_dim", None) or m.hidden_size // m.num_heads
        moe = moe_of(m)
        return cls(
            m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, int(e), m.intermediate_size, m.vocab_size, *moe
        )

    @property
    def attn_matmul_flops(self) -> int:
        """Forward FLOPs per token per layer of the Q, K, V, O projections."""
        d, q, kv = self.D, self.H * self.E, self.K * self.E
        return 2 * (d * q + 2 * d * kv + q * d)

    @property
    def dense_mlp_flops(self) -> int:
        return 2 * 3 * self.D * self.F

    @property
    def sparse_mlp_flops(self) -> int:
        """Forward FLOPs per token of a mixture-of-experts MLP: the router and k experts."""
        return 2 * (self.D * self.X + 3 * self.D * self.Fe * self.k)

    @property
    def body_flops(self) -> int:
        """Forward matmul FLOPs per token through every layer."""
        dense = self.L - self.Ls
        return self.L * self.attn_matmul_flops + dense * self.dense_mlp_flops + self.Ls * self.sparse_mlp_flops

    @property
    def layer_matmul_flops(self) -> float:
        """Forward matmul FLOPs per token per layer (Q, K, V, O projections and SwiGLU; the mean
        over the layers when some are mixtures of experts)."""
        return self.body_flops / self.L

    @property
    def head_flops(self) -> int:
        """LM head FLOPs per position with logits."""
        return 2 * self.D * self.V

    @property
    def pair_flops(self) -> int:
        """Attention FLOPs per (query, key) pair over all layers."""
        return 4 * self.L * self.H * self.E

    def forward(self, tokens, scored, pairs):
        """One forward: the body over `tokens` positions, the head at `scored`, attention over
        `pairs` (query, key) pairs (arrays broadcast, float64)."""
        f = np.float64
        return (
            np.asarray(tokens, f) * self.body_flops
            + np.asarray(scored, f) * self.head_flops
            + np.asarray(pairs, f) * self.pair_flops
        )


def lora_projection_dims(d: Dims) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection LoRA may target (config/model.LORA_TARGETS, PEFT's names), per
    layer: an adapter on it is A [r, in] and B [out, r] (models/lora.target_shapes)."""
    q, kv = d.H * d.E, d.K * d.E
    return {
        "q_proj": (d.D, q),
        "k_proj": (d.D, kv),
        "v_proj": (d.D, kv),
        "o_proj": (q, d.D),
        "gate_proj": (d.D, d.F),
        "up_proj": (d.D, d.F),
        "down_proj": (d.F, d.D),
    }


def lora_params(d: Dims, rank: int, targets) -> int:
    """Adapter parameters of model.lora (rank r on `targets`) over every layer: L · r · (in + out)
    per target. 0 with rank 0."""
    dims = lora_projection_dims(d)
    return int(d.L * rank * sum(sum(dims[t]) for t in targets)) if rank else 0


def lora_target_params(d: Dims, targets) -> int:
    """Base parameters of the projections `targets` over every layer (what a merge rewrites)."""
    dims = lora_projection_dims(d)
    return int(d.L * sum(i * o for i, o in (dims[t] for t in targets)))


def moe_of(m) -> tuple[int, int, int, int]:
    """(X experts, k per token, Fe expert width, Ls sparse layers) of a model config
    (ModelConfig) or graph dims (ModelDims); zeros for a dense model."""
    x = int(getattr(m, "num_experts", 0) or 0)
    if x <= 0:
        return (0, 0, 0, 0)
    sparse = getattr(m, "sparse_layers", 0)
    ls = sum(sparse) if isinstance(sparse, tuple) else int(sparse)
    fe = int(getattr(m, "expert_size", 0) or getattr(m, "moe_intermediate_size", 0) or m.intermediate_size)
    return (x, int(m.num_experts_per_tok), fe, ls)


def attention_pairs(sum_sq, causal: bool):
    """(query, key) pairs of sequences whose squared lengths sum to `sum_sq`: s²/2 each if causal."""
    return np.asarray(sum_sq, np.float64) * (0.5 if causal else 1.0)
