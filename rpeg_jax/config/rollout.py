"""Rollout section: sampling parameters and the paged sampler's engine settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rpeg_jax.config.base import check, key

ATTENTIONS = ("auto", "gather", "blocked", "chunk", "kernel")


def kernel_blocks_fit(page_size: int, head_dim: int) -> bool:
    """The compiled (Pallas Triton) paged kernel's block rule: page_size and head_dim powers of two >= 16."""
    return all(v >= 16 and v & (v - 1) == 0 for v in (page_size, head_dim))


def resolve_attention(attention: str, backend: str, *, page_size: int, head_dim: int) -> str:
    """The decode attention `attention` means on `backend` (jax.default_backend(), or a hardware
    profile's kind): auto = "chunk" on CPU (fastest there, sampling/chunk_attention.py), "kernel" on
    GPU (pages read in place, sampling/kernel_attention.py) where its blocks fit (kernel_blocks_fit),
    else "gather". An explicit choice is kept (SamplerConfig.check_backend refuses what cannot run)."""
    if attention != "auto":
        return attention
    if backend == "gpu":
        return "kernel" if kernel_blocks_fit(page_size, head_dim) else "gather"
    return "chunk" if backend == "cpu" else "gather"


def check_attention_backend(attention: str, interpret: bool, backend: str, path: str) -> None:
    """ConfigError unless the attention can run on `backend`: the "kernel" attention is a Pallas
    Triton (GPU) kernel, elsewhere it runs only through the Pallas interpreter ("auto" never
    resolves to it off a GPU)."""
    check(
        attention != "kernel" or backend == "gpu" or interpret,
        key(path, "attention"),
        attention,
        f"the Pallas paged-attention kernel needs a GPU (the backend is {backend}): "
        f"set {key(path, 'kernel_interpret')}=true to run it through the Pallas interpreter, or use gather/chunk",
    )


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """How a response is drawn (vLLM's names). Declared once: the run config's rollout section has
    these fields, and sampling/types.SamplingParams (one request's settings) is built on them."""

    max_new_tokens: int = 32
    temperature: float = 1.0  # T; 0 = greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    min_p: float = 0.0  # 0 disables
    stop_token_ids: tuple[int, ...] = ()  # besides the model's eos ids; they stop even with ignore_eos
    ignore_eos: bool = False  # benchmarks: run to max_new_tokens

    def check_sampling(self, path: str) -> None:
        check(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            key(path, "max_new_tokens"),
            self.max_new_tokens,
            "must be an int >= 1",
        )
        check(self.temperature >= 0, key(path, "temperature"), self.temperature, "must be >= 0 (0 = greedy)")
        check(isinstance(self.top_k, int) and self.top_k >= 0, key(path, "top_k"), self.top_k, "must be an int >= 0")
        check(0.0 < self.top_p <= 1.0, key(path, "top_p"), self.top_p, "must be in (0, 1]")
        check(0.0 <= self.min_p < 1.0, key(path, "min_p"), self.min_p, "must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The generation engine's settings a run chooses. Declared once: the run config's rollout
    section has these fields, and sampling/types.SamplerConfig (the engine's full settings: these
    plus what the runtime derives, slots, lengths, buckets) is built on them."""

    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # GLOBAL pages incl. the null page(s); None -> every slot at max length
    #   (+ watermark). With the pool split over D data shards each shard gets ceil(num_pages / D) pages
    chunk_steps: int = 64  # K: decode steps per jitted while_loop chunk (at most)
    min_chunk_steps: int = 8  # chunks end early where the page-table width bucket grows (or, under
    #                           continuous admission, once a waiting group's slots freed), not before
    #                           this many steps (= chunk_steps: one chunk per call when K allows)
    table_width_growth: float = 2.0  # ratio of consecutive decode page-table width buckets: every slot's
    #   table is read to the bucket above the longest running sequence, so smaller wastes fewer key
    #   columns per decode step (most where the tail is in flight: continuous admission) and compiles more
    #   decode programs (about log(max pages) / log(growth)); R2 on a CPU runs 1.25 (bench/NOTES.md)
    watermark: float = 0.01  # fraction of pages kept free when admitting groups
    attention: Literal["auto", "gather", "blocked", "chunk", "kernel"] = "auto"  # decode attention over
    #   pages (sampling/types.py): auto = "chunk" on CPU, "kernel" on GPU where its blocks fit (page_size
    #   and head_dim powers of two >= 16; else "gather"), "gather" elsewhere; "kernel" (a Pallas kernel
    #   reading the pages in place, docs/kernels.md) needs a GPU or kernel_interpret
    kernel_interpret: bool = False  # attention=kernel through the Pallas interpreter (runs on CPU, slowly)
    kv_pool: Literal["sharded", "replicated"] = "sharded"  # KV page pool over the generation mesh's data
    #   axis: one pool per data shard, or every device holding all pages (sampling/sharding.py)

    def check_engine(self, path: str) -> None:
        for name in ("page_size", "chunk_steps", "min_chunk_steps"):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= 1, key(path, name), v, "must be an int >= 1")
        if self.num_pages is not None:
            check(self.num_pages >= 2, key(path, "num_pages"), self.num_pages, "must be >= 2 (page 0 is the null page)")
        check(0.0 <= self.watermark < 1.0, key(path, "watermark"), self.watermark, "must be in [0, 1)")
        check(self.table_width_growth > 1.0, key(path, "table_width_growth"), self.table_width_growth, "must be > 1")
        check(
            self.attention in ATTENTIONS,
            key(path, "attention"),
            self.attention,
            "must be 'auto', 'gather', 'blocked', 'chunk' or 'kernel'",
        )
        check(
            self.kv_pool in ("sharded", "replicated"),
            key(path, "kv_pool"),
            self.kv_pool,
            "must be 'sharded' or 'replicated'",
        )

    def engine_settings(self) -> dict:
        """These fields by name (SamplerConfig.from_rollout copies them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineSettings)}


@dataclass(frozen=True, kw_only=True)
class RolloutConfig(SamplingSettings, EngineSettings):
    """The run's rollout section: sampling (SamplingSettings), the engine (EngineSettings) and how
    generation meets training (slots, weight updates, admission)."""

    max_slots: int | None = None  # concurrent sequences; None -> one step's whole batch (pipeline.plan=auto:
    #   the planner's choice); a value set here is kept under any plan (the prediction notes what it assumed)
    on_weight_update: Literal["auto", "finish", "recompute", "continue"] = "auto"  # sequences in flight when
    #   new weights arrive: finish on the old ones, recompute their KV with the new, or continue (partial
    #   rollout); auto = finish with admission=step, continue with admission=continuous
    admission: Literal["step", "continuous"] = "step"  # step: each RL step samples its prompts to the end;
    #   continuous (pipeline.staleness k >= 1): one engine across steps keeps max_slots sequences in flight,
    #   a step's batch is the first groups to complete (runtime/rollout/continuous.py)
    decode_ahead: bool | None = None  # continuous admission under split placement: the engine decodes the next
    #   step's groups (with the weights it has) while training runs this step's update, so the two overlap
    #   (generation one step ahead; graph/passes.decode_ahead). null: on exactly when pipeline.placement=split
    #   and admission=continuous (pipeline.plan=auto: the planner prices both ways and chooses); false: off (the
    #   groups take turns); true elsewhere is refused
    stale_groups: Literal["requeue", "drop"] = "requeue"  # continuous: a group whose oldest token would be
    #   older than the bound k when consumed is generated again from its prompt, or dropped
    forced_lengths: tuple[float, float, int, int] | None = None  # benchmarks (R2): each response stops at
    #   its own length, lognormal (median, sigma) clipped to [min, max] tokens, seeded per sequence; eos ignored

    @property
    def weight_update_policy(self) -> str:
        """on_weight_update with auto resolved for the admission mode."""
        if self.on_weight_update != "auto":
            return self.on_weight_update
        return "continue" if self.admission == "continuous" else "finish"

    def validate(self, path: str) -> None:
        self.check_sampling(path)
        self.check_engine(path)
        if self.max_slots is not None:
            check(self.max_slots >= 1, key(path, "max_slots"), self.max_slots, "must be >= 1")
        if self.forced_lengths is not None:
            median, sigma, lo, hi = self.forced_lengths
            check(
                median > 0 and sigma >= 0 and 1 <= lo <= hi <= self.max_new_tokens,
                key(path, "forced_lengths"),
                list(self.forced_lengths),
                f"must be (median > 0, sigma >= 0, 1 <= min <= max <= max_new_tokens={self.max_new_tokens})",
            )
        check(
            self.decode_ahead in (None, True, False),
            key(path, "decode_ahead"),
            self.decode_ahead,
            "must be null (on for split placement with continuous admission), true or false",
        )
        if self.decode_ahead:
            check(
                self.admission == "continuous",
                key(path, "decode_ahead"),
                self.decode_ahead,
                f"decodes ahead of training under admission=continuous only (admission={self.admission})",
            )
        if self.admission == "continuous":
            check(
                self.weight_update_policy in ("continue", "recompute"),
                key(path, "on_weight_update"),
                self.on_weight_update,
                "admission=continuous keeps sequences in flight across weight updates: use continue or recompute",
            )
