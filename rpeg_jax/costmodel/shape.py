"""FLOPs, bytes and memory of one decoder model, from its shape alone.

Letters (as in models/): L layers, D hidden, H query heads, K kv heads, E head_dim, F mlp width,
V vocab; t = tensor-parallel degree; a = bytes per element of the compute dtype, p = of the
parameter dtype. Every method takes numpy arrays or scalars, so the planner evaluates thousands
of layouts at once. Equations (counted from the matmul shapes of a GQA/SwiGLU decoder, as in
Narayanan et al. 2021 for GPT; activations after Korthikanti et al. 2022):

    matmul FLOPs per token per layer, forward = 2 (D·HE + 2·D·KE + HE·D + 3·D·F)
    attention FLOPs per sequence of length s  = 4·L·HE·s² (dense) or 2·L·HE·s² (causal skip)
    LM head FLOPs per scored token            = 2·D·V
    KV bytes per token                        = 2·L·K·E·a  (K and V)
    saved activations per token per layer     = a (4D + (2HE + 2KE + 3F)/t) [+ scores]

A mixture of experts (X experts of width Fe in Ls of the L layers, k routed per token) computes
with its active parameters (router D·X + k experts' 3·D·Fe per token), holds all of them (memory,
FSDP gathers, optimizer state), saves k experts' activations per token, and a decode step reads
only the experts its batch touches: X (1 - (1 - k/X)^b) of them per sparse layer for b tokens
(routing taken as uniform). Expert parallelism (an expert degree e > 1: the experts' dimension
over the fsdp axis, the runtime's `fsdp_expert` preset, models/moe.py's dispatch) keeps each
device's X / e experts local (not FSDP-gathered) and moves the tokens instead: per sparse layer an
all-to-all of the dispatch (`a2a_bytes`: the runtime's dropless buffers, e destinations x N·k rows
of D) and one of the combine, forward and backward; its expert activations run on the e·N·k
buffer rows (`act_bytes_per_token_layer(e=)`). docs/costmodel.md.

LoRA (model.lora: `adapters` trained parameters beside the frozen base, costmodel/context.with_lora):
the resident state is the base in the parameter dtype plus the adapters and their Adam moments,
gradients and optimizer streams count the adapters only (`trained_params`); stages.py prices the
update's backward without the base's weight gradients and the sync's merge.

Callers: costmodel/stages.py (stage times), candidates.py (memory), planner.py, fit.py,
microfit.py, calibration/stages.py, tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rpeg_jax.config.model import UNROLL_MAX_LAYERS
from rpeg_jax.graph.ir import DTYPE_BYTES, ModelDims
from rpeg_jax.shapes.flops import Dims, attention_pairs
from rpeg_jax.shapes.logits import chunk_elements

UPDATE_COPIES = 2  # new m, v held beside the old ones by rl/update.py's NaN guard (the new params
#                   fuse into its select); measured with XLA's memory analysis on CPU
LORA_BASE_COPIES = 1  # a full-precision LoRA update holds one copy of the frozen base beside it (the
#                   backward to the activations reads W transposed): bench/lora.py's RL update on CPU,
#                   46M model r16, 545.8 MiB args+temps+outputs measured, 376.5 MiB priced without it,
#                   551.7 with it (bench/NOTES.md session 21)


def default_scanned(num_layers: int) -> bool:
    """ModelConfig.scanned's depth rule (a ModelDims does not carry an explicit scan_layers)."""
    return num_layers > UNROLL_MAX_LAYERS


@dataclass(frozen=True)
class ModelShape:
    """A model's dimensions plus derived per-token costs (forward direction)."""

    num_params: int
    L: int
    D: int
    H: int
    K: int
    E: int
    F: int
    V: int
    param_bytes_per: int  # p
    act_bytes_per: int  # a
    dtype: str
    value_head: bool = False
    scanned: bool = True  # layers run under lax.scan (models/: deeper than UNROLL_MAX_LAYERS), else unrolled
    X: int = 0  # experts per sparse layer (0: dense)
    k: int = 0  # experts per token
    Fe: int = 0  # an expert's SwiGLU width
    Ls: int = 0  # sparse layers
    adapters: int = 0  # model.lora: the adapters' parameters, the only ones trained (0: every parameter)
    merged: int = 0  # model.lora: the base parameters the targeted projections hold (a merge rewrites them)
    lora_rank: int = 0  # model.lora.rank

    @staticmethod
    def of(m: ModelDims) -> ModelShape:
        return ModelShape(
            num_params=m.num_params,
            L=m.num_layers,
            D=m.hidden_size,
            H=m.num_heads,
            K=m.num_kv_heads,
            E=m.head_dim,
            F=m.intermediate_size,
            V=m.vocab_size,
            param_bytes_per=DTYPE_BYTES[m.param_dtype],
            act_bytes_per=DTYPE_BYTES[m.dtype],
            dtype=m.dtype,
            value_head=m.value_head,
            scanned=default_scanned(m.num_layers),
            X=m.num_experts,
            k=m.num_experts_per_tok,
            Fe=m.expert_size,
            Ls=m.sparse_layers,
        )

    # ---- FLOPs (shapes/flops.py: the one FLOP model) ------------------------------------------
    @property
    def dims(self) -> Dims:
        return Dims(self.L, self.D, self.H, self.K, self.E, self.F, self.V, self.X, self.k, self.Fe, self.Ls)

    @property
    def layer_matmul_flops(self) -> int:
        """Forward matmul FLOPs per token per layer (Q, K, V, O projections and SwiGLU)."""
        return self.dims.layer_matmul_flops

    @property
    def head_flops(self) -> int:
        """LM head FLOPs per scored token."""
        return self.dims.head_flops

    def attn_flops(self, sum_sq, causal_skip: bool):
        """Attention score + value FLOPs (forward, all layers) for Σ s² over the sequences."""
        return self.dims.forward(0.0, 0.0, attention_pairs(sum_sq, causal_skip))

    def forward_flops(self, tokens, scored, sum_sq, causal_skip: bool):
        """One forward over `tokens` positions with logits at `scored` positions."""
        return self.dims.forward(tokens, scored, attention_pairs(sum_sq, causal_skip))

    def decode_flops(self, batch, ctx):
        """One decode step: `batch` new tokens each attending over `ctx` cached positions."""
        b = np.asarray(batch, np.float64)
        return self.dims.forward(b, b, b * np.asarray(ctx, np.float64))

    def mm_size(self, tokens, t, e=1):
        """FLOPs of the largest single matmul (the MLP up projection) for `tokens` rows on one
        shard: the size the matmul efficiency table is looked up by. A mixture of experts' largest
        is the query projection, a dense layer's MLP, or one expert's up projection over the
        tokens*k/X rows routed to it (x e under expert parallelism: an expert gets the rows of the
        e devices sharing the experts), whichever is larger."""
        rows, t = np.asarray(tokens, np.float64), np.asarray(t, np.float64)
        if not self.X:
            return 2.0 * rows * self.D * self.F / t
        expert = self.Fe * self.k / self.X * np.asarray(e, np.float64)
        widths = [self.H * self.E + 0.0 * expert, expert] + ([self.F + 0.0 * expert] if self.L > self.Ls else [])
        return 2.0 * rows * self.D * np.maximum.reduce(np.broadcast_arrays(*widths)) / t

    @property
    def mlp_widths(self) -> tuple[int, ...]:
        """The MLP widths a tensor-parallel degree must divide (dense F, the experts' Fe)."""
        dense = (self.F,) if self.L > self.Ls else ()
        return dense + ((self.Fe,) if self.X else ())

    def act_mlp_width(self, e=1):
        """MLP activation columns a token saves per layer, the mean over the layers: F for a dense
        layer, k·Fe (+ the router's X logits) for a mixture; under expert parallelism (e > 1) the
        experts' SwiGLU runs on the e·k buffer rows per token the dropless dispatch receives
        (models/moe.py: C = N·k rows from each of the e devices, most of them empty), e·k·Fe."""
        e = np.asarray(e, np.float64)
        rows = np.where(e > 1, e, 1.0) * self.k
        return ((self.L - self.Ls) * self.F + self.Ls * (rows * self.Fe + self.X / 3.0)) / self.L

    def expert_degrees(self, f: int) -> tuple[int, ...]:
        """Expert degrees a training/forward layout with fsdp `f` may run: 1 (the experts sharded as
        every other weight, FSDP-gathered) and, for a mixture, f itself when f > 1 divides the X
        experts (the runtime's `fsdp_expert` rules: the experts' dimension over the fsdp axis)."""
        return (1, f) if self.X and f > 1 and self.X % f == 0 else (1,)

    def a2a_bytes(self, tokens, e, ids: bool = False):
        """One device's buffer in one all-to-all of the expert-parallel dispatch or combine for
        `tokens` tokens on the device: the runtime's dropless buffers (models/moe.py
        _dispatched_experts), e destinations x C = tokens·k rows of D values in the compute dtype
        (+ a 4-byte expert id per row on the dispatch, `ids`): e x a balanced dispatch's bytes.
        0 without expert parallelism (e <= 1)."""
        e = np.asarray(e, np.float64)
        row = self.D * self.act_bytes_per + (4.0 if ids else 0.0)
        return np.where(e > 1, e * np.asarray(tokens, np.float64) * self.k * row, 0.0)

    def a2a_extra_act(self, e):
        """Bytes per token per layer (the mean over the layers) an expert-parallel sparse layer
        saves beyond `act_mlp_width`: the received rows sorted by expert (e·k rows of D, the
        grouped matmul's input) and the combined results gathered back (k rows of D)."""
        e = np.asarray(e, np.float64)
        return np.where(e > 1, self.Ls / self.L * (e + 1.0) * self.k * self.D * self.act_bytes_per, 0.0)

    def expert_bytes(self, dtype_bytes: int | None = None) -> float:
        """Bytes of every expert of every sparse layer (0 for a dense model)."""
        return float(self.Ls * self.X * 3 * self.D * self.Fe * (dtype_bytes or self.act_bytes_per))

    def decode_weight_bytes(self, batch, dtype_bytes: int | None = None):
        """Weight bytes a decode step of `batch` tokens reads: every weight of a dense model; of a
        mixture, the dense part and the experts its tokens touch (uniform routing: each expert is
        missed by one token with probability 1 - k/X)."""
        w = self.weight_bytes(dtype_bytes)
        if not self.X:
            return np.full_like(np.asarray(batch, np.float64), w)
        touched = 1.0 - (1.0 - self.k / self.X) ** np.asarray(batch, np.float64)
        ex = self.expert_bytes(dtype_bytes)
        return (w - ex) + ex * touched

    # ---- bytes ---------------------------------------------------------------------------
    @property
    def layer_params(self) -> float:
        """Parameters of one layer (the mean over the layers with a mixture of experts: all experts)."""
        d, q, kv, f = self.D, self.H * self.E, self.K * self.E, self.F
        mlp = ((self.L - self.Ls) * 3 * d * f + self.Ls * d * self.X * (1 + 3 * self.Fe)) / self.L
        return d * q + 2 * d * kv + q * d + mlp + 2 * d

    @property
    def layer_expert_params(self) -> float:
        """The experts' parameters of one layer (the mean over the layers)."""
        return self.Ls * self.X * 3.0 * self.D * self.Fe / self.L

    def gathered_layer_params(self, e=1):
        """Parameters of one layer an FSDP pass gathers: all of them, or under expert parallelism
        (e > 1) all but the experts, which stay on the devices that own them."""
        return self.layer_params - np.where(np.asarray(e) > 1, self.layer_expert_params, 0.0)

    def gather_bytes(self, t, mode: str = "matrix", e=1):
        """FSDP gather buffers live at once (the profile's `fsdp_gather`): "matrix", each weight
        matrix gathered right before its use, two of the largest live (one in use, one prefetched);
        "layer", two whole layers; "model", every layer's weights (gathers hoisted out of the scan).
        Under expert parallelism (e > 1) the experts are not gathered."""
        d, q, kv, f = self.D, self.H * self.E, self.K * self.E, self.F
        dense_mlp = d * f if self.L > self.Ls else 0  # a dense layer's MLP matrix; the experts' stacked [X, D, Fe]
        e = np.asarray(e)
        largest = np.where(
            e > 1, max(d * q, d * kv, dense_mlp, d * self.X), max(d * q, d * kv, dense_mlp, self.X * d * self.Fe)
        )
        per = {
            "matrix": 2.0 * largest,
            "layer": 2.0 * self.gathered_layer_params(e),
            "model": self.L * self.gathered_layer_params(e),
        }[mode]
        return per * self.gather_bytes_per / np.asarray(t, np.float64)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.L * self.K * self.E * self.act_bytes_per

    def kv_shards(self, t):
        """KV heads split over min(t, K) devices; beyond K they are replicated."""
        return np.minimum(np.asarray(t, np.float64), self.K)

    @property
    def mixed_precision(self) -> bool:
        """Parameters kept in a wider dtype than the compute dtype (float32 params, bfloat16 matmuls)."""
        return self.act_bytes_per < self.param_bytes_per

    @property
    def gather_bytes_per(self) -> int:
        """Bytes per parameter an FSDP all-gather moves and holds: mixed-precision FSDP casts the
        shard to the compute dtype before gathering it (PyTorch FSDP MixedPrecision(param_dtype),
        Megatron's distributed optimizer), so bfloat16 gathers; full precision gathers the params."""
        return self.act_bytes_per if self.mixed_precision else self.param_bytes_per

    @property
    def grad_bytes_per(self) -> int:
        """Bytes per gradient element (held during the update, reduce-scattered / all-reduced): the
        compute dtype under mixed precision (ZeRO's accounting, below), else the parameter dtype."""
        return self.act_bytes_per if self.mixed_precision else self.param_bytes_per

    def weight_bytes(self, dtype_bytes: int | None = None) -> float:
        return float(self.num_params * (dtype_bytes or self.act_bytes_per))

    @property
    def trained_params(self) -> int:
        """Parameters with gradients and optimizer state: the LoRA adapters, else all of them."""
        return self.adapters or self.num_params

    def resident_state_bytes(self) -> float:
        """What a trained model keeps between steps: params + Adam m, v in the parameter dtype
        (optax keeps the moments in it). With LoRA (`adapters`): the frozen base in the parameter
        dtype (runtime/setup.py builds it as the plain model), the adapters and their m, v."""
        if self.adapters:
            return (self.num_params + 3.0 * self.adapters) * self.param_bytes_per
        return 3.0 * self.num_params * self.param_bytes_per

    def update_state_bytes(self, micro=1):
        """Extra parameter-sized buffers live during an update, before sharding (the caller divides
        by fsdp x tensor), N = num_params, p / a = parameter / compute bytes:

        mixed precision (a < p, e.g. float32 params with bfloat16 compute), the mixed-precision
        FSDP rule (ZeRO, Rajbhandari et al. 2020, sec. 3.1: 2 + 2 + 12 bytes per parameter):
            update = N·a (gradients in the compute dtype) + N·a (the compute-dtype copy of the
                     weights the passes read)
            so resident (N·p master + 2·N·p Adam m, v = 12 N at p = 4) + update = 16 N bytes
            at p = 4, a = 2, whatever the micro-batch count (gradients accumulate in place);
            FSDP's per-layer gathered buffers are counted by pass_weight_bytes.

        full precision (a = p, the CPU runs the calibration measured), our rl/update.py as XLA
        compiles it: the gradients (N·p); the new m and v beside the old ones (its NaN guard selects
        between them, so the update cannot happen in place: UPDATE_COPIES·N·p); a float32
        accumulator (4·N) with micro-batches > 1.

        With LoRA (`adapters`) the frozen base has no gradient, no optimizer state and no guarded
        copies: the trained-parameter terms count the adapters only (the compute-dtype copy of the
        weights the passes read stays whole). At full precision a LoRA update also holds one copy
        of the frozen base (LORA_BASE_COPIES: the backward's dx reads it transposed; measured with
        XLA's memory analysis on CPU, bench/NOTES.md session 21)."""
        n = self.trained_params
        if self.mixed_precision:
            return (n + self.num_params) * self.act_bytes_per + 0.0 * np.asarray(micro, np.float64)
        acc = np.where(np.asarray(micro) > 1, 4.0 * n, 0.0)
        base = LORA_BASE_COPIES * self.num_params * self.param_bytes_per if self.adapters else 0.0
        return (1.0 + UPDATE_COPIES) * n * self.param_bytes_per + acc + base

    def act_bytes_per_token_layer(self, t, remat: str, dense_scores_ctx=0.0, score_arrays: int = 2, e=1):
        """Activation bytes a layer saves for backward per token (Korthikanti-style count for
        SwiGLU/GQA without dropout; tensor parallelism splits the head and mlp parts).
        `dense_scores_ctx`: context length when attention materialises f32 scores and probs
        (`score_arrays` of them: 2 saved for backward, 1 live in a forward-only pass). `e`: the
        expert degree (a mixture's dispatch buffers, `act_mlp_width`, `a2a_extra_act`)."""
        t = np.asarray(t, np.float64)
        a = self.act_bytes_per
        q, kv, f = self.H * self.E, self.K * self.E, self.act_mlp_width(e)
        ep = self.a2a_extra_act(e) if self.X else 0.0
        full = (
            a * (4 * self.D + (2 * q + 2 * kv + 3 * f) / t)
            + ep
            + 4.0 * score_arrays * self.H / t * np.asarray(dense_scores_ctx)
        )
        if remat == "full":  # only the layer input (the scan carry) is kept
            return np.full_like(full, a * self.D)
        if remat == "dots":  # matmul outputs kept, elementwise results and scores recomputed
            return np.broadcast_to(a * (2 * self.D + (2 * q + 2 * kv + 2 * f) / t) + ep, full.shape).copy()
        return full

    def logits_bytes(self, scored_tokens, t=1):
        """Working set of one logits chunk (f32 logits + log-softmax temporaries, ≈3 copies); the
        vocabulary is split over the tensor axis (sharding/rules.py), so a device holds V/t columns."""
        return 3.0 * 4.0 * chunk_elements(scored_tokens, self.V) / np.asarray(t, np.float64)

    def pass_weight_bytes(self, f, t, mode: str, copies: float, train: bool, looped=False, e=1):
        """Weight buffers a forward-only pass or a training step holds beyond its resident shard
        (per device). Scanned layers: FSDP gathers by the profile's mode (f > 1) plus `copies`
        fitted extra copies of the shard. Unrolled layers (no loop scopes the per-layer weights):
        a forward slices every layer's weights out of the stacked arrays (f = 1) or gathers the
        whole model (f > 1) before the first layer, one whole copy in the tensor layout, W / t;
        a training step holds the gathered whole model when f > 1 (with f = 1 its slices are not
        extra: measured with XLA's memory analysis on CPU, bench/NOTES.md "Cost model"). A training
        step that loops over micro-batches or recomputes layers (`looped`) holds one more whole
        gathered copy when f > 1 (on the CPU points of 2026-11-30, bench/NOTES.md "Cost model", it
        brought the worst case, unrolled T on fsdp 8 with 2 micro-batches, from -30% to within the
        rest, and validation memory MAPE from 9.96% to 7.8%)."""
        f, t = np.asarray(f, np.float64), np.asarray(t, np.float64)
        w = self.weight_bytes(self.param_bytes_per)
        wg = self.weight_bytes(self.gather_bytes_per)  # a gathered copy (FSDP, f > 1)
        if self.X:  # expert parallelism: the experts stay sharded (not gathered)
            wg = wg - np.where(np.asarray(e) > 1, self.expert_bytes(self.gather_bytes_per) * (1.0 - 1.0 / f), 0.0)
        if not self.scanned:
            # A training step that loops (micro-batches) or recomputes (remat) holds a second
            # gathered copy under FSDP: the loop body's and the backward's (`looped`).
            extra = np.where((f > 1) & np.asarray(looped), wg / t, 0.0) if train else 0.0
            return np.where(f > 1, wg / t, 0.0 if train else w / t) + extra
        return np.where(f > 1, self.gather_bytes(t, mode, e), 0.0) + copies * w / (f * t)
