"""The planning context: what a config asks of the cost model, resolved once per search.

    ctx = make_context(cfg, num_devices, hardware_profile, processes)   # a types.Context
    roles = roles_of(ctx, graph)                                        # model shapes by role

The Setting (costmodel/stages.py) every price is computed with: batch and lengths (the response
length distribution, prompt columns at the runtime's bucket), attention kind, the sampler's
knobs, the memory budget; the roles (actor, critic, reference) as the graph's stages use them;
the fixed reference work (FLOPs) that every plan's utilization is measured against.

Callers: costmodel/planner.py, scoring.py, baselines.py, pricing.py, tests. No JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.config.rollout import RolloutConfig, resolve_attention
from rpeg_jax.config.run import RunConfig
from rpeg_jax.costmodel import candidates as C
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.hardware import HardwareProfile
from rpeg_jax.costmodel.lengths import LengthDist
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.costmodel.types import Context
from rpeg_jax.graph.algorithms import build_graph
from rpeg_jax.graph.ir import Graph, GraphError, Op
from rpeg_jax.graph.passes import apply_pipeline
from rpeg_jax.graph.processes import Runs, why_not
from rpeg_jax.shapes import buckets
from rpeg_jax.shapes.flops import lora_params, lora_target_params

FORCED_SAMPLES = 4096  # draws standing for rollout.forced_lengths' distribution


def length_dist(cfg: RunConfig) -> LengthDist:
    """The response lengths the model prices: rollout.forced_lengths' when a benchmark forces them
    (the runtime's draw: lognormal (median, sigma) rounded and clipped, no shift; as samples), else
    the costmodel section's shifted lognormal."""
    c, r = cfg.costmodel, cfg.rollout.max_new_tokens
    if cfg.rollout.forced_lengths is not None:
        med, sigma, lo, hi = cfg.rollout.forced_lengths
        z = np.random.default_rng(0).standard_normal(FORCED_SAMPLES)
        draw = np.clip(np.round(np.exp(np.log(med) + sigma * z)), lo, hi).astype(np.int64)
        return LengthDist(max_len=r, min_len=int(lo), samples=tuple(int(x) for x in draw))
    lo = min(c.response_len_min, r)
    med = None if c.response_len_median is None else min(max(c.response_len_median, lo), r)
    return LengthDist(max_len=r, min_len=lo, median=med, sigma=c.response_len_sigma)


def prompt_len(cfg: RunConfig, length_bucket: int) -> int:
    """Prompt columns the runtime computes on: the expected longest prompt (costmodel.prompt_len, else
    the data's longest) rounded up to the runtime's bucket, at most data.max_prompt_len; with fixed
    shapes (length_bucket 1) always data.max_prompt_len; the window shapes/buckets.length_bucket
    gives, as runtime/rollout/layout.lay_out pads the longest prompt of a batch (never longer than
    data.max_prompt_len)."""
    cap = cfg.data.max_prompt_len
    if length_bucket <= 1:
        return cap
    p = cfg.costmodel.prompt_len if cfg.costmodel.prompt_len is not None else cfg.data.longest_prompt()
    return buckets.length_bucket(min(p, cap))


def kv_read_of(r: RolloutConfig, kind: str, head_dim: int) -> str:
    """Setting.kv_read of the run's decode attention on a profile of `kind`: "once" for "kernel"
    (auto on GPU) compiled for a GPU (pages read in place), "chunk" for the chunk attention (auto on
    CPU: pages copied once per chunk), else "copy" (gather / blocked copy the pages every step: the
    profile's kv_read_factor; the kernel through the interpreter is no GPU kernel)."""
    att = resolve_attention(r.attention, kind, page_size=r.page_size, head_dim=head_dim)
    if att == "kernel" and kind == "gpu" and not r.kernel_interpret:
        return "once"
    return "chunk" if att == "chunk" else "copy"


def attention_is_flash(attention: str, kind: str) -> bool:
    """Whether the training passes' attention (model.attention) skips the masked half and keeps no
    [T, T] scores: cudnn and pallas do; xla materialises them; auto is priced as flash on an
    accelerator profile (the runtime takes cuDNN there when the model fits it: bfloat16 / float16,
    head size a multiple of 8; a float32 model runs xla, and plan_warnings flags float32 on a GPU)."""
    if attention == "auto":
        return kind != "cpu"
    return attention in ("cudnn", "pallas")


def make_context(cfg: RunConfig, num_devices: int, hw: HardwareProfile, processes: int = 1) -> Context:
    if num_devices < 1:
        raise GraphError("num_devices", f"{num_devices} must be >= 1")
    # What the config asks of the runtime on `processes` processes (graph/processes.py), before any
    # candidate: the search itself offers only what the runtime runs (space.runnable).
    bad = why_not(cfg, processes, num_devices, Runs(admission=cfg.rollout.admission))
    if bad is not None:
        raise bad.error()
    if hw.shared_host and hw.process_hosts:  # each process on its own cores: its devices share those
        hw = dataclasses.replace(hw, local_devices=max(1, num_devices // max(1, processes)))
    c = cfg.costmodel
    flash = attention_is_flash(cfg.model.attention, hw.kind)
    base = build_graph(cfg)
    sz = base.sizes
    bucket = 1 if cfg.pipeline.pieces > 1 else buckets.LENGTH_BUCKET
    st = S.Setting(
        hw=hw,
        B=sz["B"],
        P=prompt_len(cfg, bucket),
        R=sz["R"],
        G=sz["G"],
        dist=length_dist(cfg),
        causal_skip=flash,
        dense_scores=not flash,
        packing=cfg.train.pack_sequences,  # the updates and scoring forwards pack their rows
        budget_bytes=c.memory_budget * hw.hbm_bytes,
        kv_replicated=cfg.rollout.kv_pool == "replicated",
        prompt_sharing=cfg.sharding.axis_types != "explicit",  # kernels: explicit keeps the plain pass
        page_size=cfg.rollout.page_size,
        # the runtime pads prompts and responses to its length bucket unless shapes are
        # fixed (pieces > 1)
        length_bucket=bucket,
        chunk_steps=cfg.rollout.chunk_steps,
        min_chunk_steps=cfg.rollout.min_chunk_steps,
        table_growth=cfg.rollout.table_width_growth,
        recompute_kv=cfg.rollout.on_weight_update == "recompute",
        static_rows=hw.kind == "cpu",
        kv_read=kv_read_of(cfg.rollout, hw.kind, cfg.model.head_size),
    )
    return Context(cfg, hw, num_devices, st, base, processes)


def roles_of(ctx: Context, graph: Graph) -> C.Roles:
    """Model shapes by role as the graph's stages use them (shared backbone included)."""
    models = {}
    for s in graph.stages():
        for p in s.parts or (s,):
            for m in p.workload.models if p.workload else ():
                models.setdefault(m.role, ModelShape.of(m))
    rl = ctx.cfg.rl
    return C.Roles(
        actor=with_lora(models["actor"], ctx.cfg.model.lora),
        critic=models.get("critic"),
        ref=models.get("reference"),
        epochs=rl.ppo_epochs,
        minibatches=rl.minibatches,
        offload=ctx.cfg.train.offload,
    )


def with_lora(ms: ModelShape, lora) -> ModelShape:
    """The actor's shape with model.lora's adapters (rank 0: itself): only they train
    (ModelShape.adapters), the targeted projections' base parameters are what a merge rewrites."""
    if not lora.rank:
        return ms
    d = ms.dims
    return dataclasses.replace(
        ms,
        adapters=lora_params(d, lora.rank, lora.targets),
        merged=lora_target_params(d, lora.targets),
        lora_rank=lora.rank,
    )


def useful_flops(st: S.Setting, g: Graph) -> float:
    """FLOPs of one step's model work on the real (unpadded) tokens: generation (2N per token +
    attention), each forward, each update (3× forward), for the stages `g` has (a shared
    backbone does less work than a separate critic, and is not credited for the difference).
    Recomputation (remat) and padding are not useful work."""
    lens = st.dist.lengths(st.B).astype(np.float64)
    tok, scored, sq = float(np.sum(st.P + lens)), float(np.sum(lens)), float(np.sum((st.P + lens) ** 2))
    total = 0.0
    for p in (p for s in g.stages() for p in (s.parts or (s,))):  # fused stages count their parts
        w = p.workload
        if w is None or not w.models:
            continue
        fwd = float(ModelShape.of(w.models[0]).forward_flops(tok, scored, sq, causal_skip=True))
        if w.op in (Op.GENERATE, Op.FORWARD):
            total += fwd
        elif w.op == Op.TRAIN:
            total += 3.0 * fwd * w.epochs
    return total


def reference_graph(ctx: Context) -> Graph:
    """The graph of the fixed reference work: the config's algorithm synchronous and unfused, every
    forward a verl user's step runs (the verl-like baseline's graph: no elided or shared passes)."""
    return apply_pipeline(ctx.base, PipelineConfig(placement="colocated"))


def reference_flops(ctx: Context) -> float:
    """FLOPs of one step of the reference work (useful_flops of reference_graph): the numerator of
    every plan's `utilization`, so a plan that does less work for the same step scores higher."""
    return useful_flops(ctx.st, reference_graph(ctx))
