"""The sampler's public value types: engine settings, per-request sampling parameters, results.

Pure dataclasses (no JAX), used by `Sampler` (sampling/sampler.py), the runtime's generate stage
and the benchmarks. Validation errors name the field and the value and are raised before anything
is compiled or allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from rpeg_jax.config.base import check
from rpeg_jax.config.rollout import EngineSettings, RolloutConfig, SamplingSettings, check_attention_backend
from rpeg_jax.shapes.buckets import MIN_TABLE_WIDTH


@dataclass(frozen=True, kw_only=True)
class SamplerConfig(EngineSettings):
    """Engine settings (fixed for a Sampler's lifetime: they set the compiled shapes): the run's
    (config/rollout.EngineSettings: page_size, num_pages, chunk_steps, min_chunk_steps,
    table_width_growth, watermark, attention, kernel_interpret, kv_pool; declared there once) and
    those the runtime derives or a direct user sets."""

    max_slots: int = 64  # B: concurrent sequences (decode batch)
    max_seq_len: int | None = None  # prompt + completion tokens; None -> model max positions
    release_slots: bool = False  # end a decode chunk (after min_chunk_steps) once the first waiting
    #   group's worth of slots has freed, so it is admitted without idling to the chunk's end (set
    #   under continuous admission, where a group always waits; the sampled tokens do not change)
    on_weight_update: Literal["finish", "recompute", "continue"] = "finish"  # policy for in-flight
    #   sequences when weights change: finish them on the old weights, recompute their KV, or continue
    #   Decode attention (EngineSettings.attention): "gather" the table's pages every step then dense
    #   attention; "blocked": an online-softmax loop over blocks of pages that stops at the longest
    #   sequence; "chunk": gather the pages once per decode chunk into dense buffers (fastest on CPU,
    #   costs a dense copy of the chunk's KV); "kernel": JAX's Pallas paged-attention kernel reads each
    #   sequence's pages in place through its block table (GPU, or kernel_interpret; docs/kernels.md).
    #   Prefill always uses "gather".
    block_pages: int = 4  # pages per block of the "blocked" attention
    forward: Literal["auto", "model", "split", "split_t"] = "auto"  # the model's own forward, or its
    #   layers over per-layer weight copies ("split_t": transposed copies, faster for few rows); see
    #   sampling/forward.py; auto = split on CPU (split_t up to 16 slots), model elsewhere
    kv_dtype: str | None = None  # KV pool dtype; None -> the model's compute dtype
    eos_token_ids: tuple[int, ...] | None = None  # None -> model.cfg.end_ids (eos_id + eos_ids)
    max_stop_ids: int = 8  # N: stop token ids per sequence on device (eos + stop_token_ids)
    min_prefill_len: int = 16  # smallest prefill length bucket (powers of two above it)
    min_prefill_rows: int = 1  # smallest prefill row bucket (powers of two above it; with a sharded
    #                            pool the rows of all shards together: D blocks of the per-shard bucket)
    min_table_width: int = MIN_TABLE_WIDTH  # smallest decode page-table width bucket, in pages (fewer
    #                           compiles against more gathered columns; capped at the widest table)
    seed: int = 0  # base seed for requests whose SamplingParams.seed is None
    debug_checks: bool = False  # check allocator invariants after every operation
    config_path: str = "sampler"  # the config section these settings come from ("rollout" from a run
    #   config): the checks the Sampler makes against the backend name its keys

    def validate(self, path: str = "sampler") -> None:
        self.check_engine(path)
        for name in (
            "max_slots",
            "max_stop_ids",
            "min_prefill_len",
            "min_prefill_rows",
            "min_table_width",
            "block_pages",
        ):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= 1, f"{path}.{name}", v, "must be an int >= 1")
        if self.max_seq_len is not None:
            check(self.max_seq_len >= 2, f"{path}.max_seq_len", self.max_seq_len, "must be >= 2")
        check(
            self.on_weight_update in ("finish", "recompute", "continue"),
            f"{path}.on_weight_update",
            self.on_weight_update,
            "must be 'finish', 'recompute' or 'continue'",
        )
        check(
            self.forward in ("auto", "model", "split", "split_t"),
            f"{path}.forward",
            self.forward,
            "must be 'auto', 'model', 'split' or 'split_t'",
        )

    def check_backend(self, backend: str, head_dim: int) -> None:
        """ConfigError (naming `config_path`'s keys) unless the decode attention runs on `backend`:
        "kernel" needs a GPU or kernel_interpret, and the compiled (Triton) kernel power-of-two
        blocks of at least 16: page_size and the model's head_dim (docs/kernels.md)."""
        path = self.config_path
        check_attention_backend(self.attention, self.kernel_interpret, backend, path)
        if self.attention != "kernel" or self.kernel_interpret:  # "auto" takes the kernel only where it fits
            return
        for name, v in ((f"{path}.page_size", self.page_size), ("model.head_dim", head_dim)):
            check(
                v >= 16 and v & (v - 1) == 0,
                name,
                v,
                f"{path}.attention=kernel on GPU needs a power of two >= 16 (Triton blocks; docs/kernels.md)",
            )

    @classmethod
    def from_rollout(
        cls, r: RolloutConfig, *, max_slots: int, max_seq_len: int | None = None, **overrides
    ) -> "SamplerConfig":
        """Engine settings from the run config's rollout section."""
        kw = dict(
            r.engine_settings(),  # declared once (config/rollout.EngineSettings): copied by name
            max_slots=r.max_slots or max_slots,
            max_seq_len=max_seq_len,
            release_slots=r.admission == "continuous",
            on_weight_update=r.weight_update_policy,
            config_path="rollout",
        )
        return cls(**{**kw, **overrides})


@dataclass(frozen=True, kw_only=True)
class SamplingParams(SamplingSettings):
    """Per-request sampling (vLLM names; config/rollout.SamplingSettings: max_new_tokens, temperature
    (0 = greedy), top_k, top_p, min_p, stop_token_ids, ignore_eos, declared there once) plus the
    request's own: `n` completions, `stop` sequences (token-id tuples, or strings: these need a
    tokenizer given to the Sampler) and the seed."""

    n: int = 1  # G: completions per prompt (a GRPO group; the prompt is prefilled once)
    stop: tuple = ()  # stop sequences: tuple[int, ...] or str each
    seed: int | None = None  # None -> sampler seed + call counter (fresh samples per call)

    def validate(self, path: str = "sampling_params") -> None:
        check(isinstance(self.n, int) and self.n >= 1, f"{path}.n", self.n, "must be an int >= 1")
        self.check_sampling(path)
        for s in self.stop:
            ok = (isinstance(s, str) and s) or (
                isinstance(s, (tuple, list)) and s and all(isinstance(t, int) for t in s)
            )
            check(bool(ok), f"{path}.stop", s, "each stop sequence must be a non-empty str or tuple of token ids")

    @classmethod
    def from_rollout(cls, r: RolloutConfig, *, n: int = 1, seed: int | None = None) -> "SamplingParams":
        kw = {f.name: getattr(r, f.name) for f in dataclasses.fields(SamplingSettings)}  # declared once
        kw["stop_token_ids"] = tuple(r.stop_token_ids)
        kw["ignore_eos"] = r.ignore_eos or r.forced_lengths is not None  # forced lengths run to their own end
        return cls(**kw, n=n, seed=seed)


FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Completion:
    """One sampled continuation. `tokens` include the stop token / stop sequence that ended it."""

    tokens: np.ndarray  # int32 [n_tokens]
    logprobs: np.ndarray  # float32 [n_tokens]: log p(token) under the distribution sampled from
    finish_reason: FinishReason
    policy_versions: np.ndarray  # int32 [n_tokens]: weights version that produced each token
    num_preemptions: int = 0
    sample_index: int = 0
    experts: np.ndarray | None = None  # MoE models: int16 [prompt + n_tokens, S, k], the experts each
    #   token was routed to in each of the S sparse layers when the sampler ran it (-1: never run, e.g.
    #   the last token); the record routing replay imposes on the trainer (rl.routing=replay)


@dataclass
class RequestOutput:
    """All completions of one prompt, in sample order."""

    prompt_index: int
    prompt_tokens: list[int]
    completions: list[Completion] = field(default_factory=list)


def replace(obj, **changes):
    """dataclasses.replace + validate()."""
    out = dataclasses.replace(obj, **changes)
    out.validate()
    return out
