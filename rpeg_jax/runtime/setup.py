"""Run set-up: from a RunConfig and a Plan to the runtime context and the initial state.

Builds, in this order and before any step runs: the data pipeline (validates the data), the
models (random init or a local HF checkpoint) and their optimizer states, the sampler, the
kernels' context, and the store holding version 0 of every state node. Nothing here decides
placement: the Plan says where each stage runs.

Called by: runtime/trainer.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.hf import FIXED
from rpeg_jax.config.model import LoraConfig
from rpeg_jax.config.run import RunConfig
from rpeg_jax.data.pipeline import build_pipeline
from rpeg_jax.data.rewards import resolve_reward
from rpeg_jax.graph.ir import Graph, StateKind
from rpeg_jax.graph.plan import Plan
from rpeg_jax.graph.processes import check_plan, share_of
from rpeg_jax.models import Transformer, adapters, load_hf
from rpeg_jax.models.attention import resolve_attention
from rpeg_jax.models.hf import WeightsFileError
from rpeg_jax.rl import make_optimizer, optimizer_steps
from rpeg_jax.runtime import xla_flags
from rpeg_jax.runtime.executor import Store
from rpeg_jax.runtime.offload import Offload
from rpeg_jax.runtime.placement import Placement
from rpeg_jax.runtime.rollout.continuous import ContinuousRollouts, forced_lengths
from rpeg_jax.runtime.rollout.prompts import RolloutBuffer, StepPrompts
from rpeg_jax.runtime.rollout.scoring import group_scores
from rpeg_jax.runtime.rollout.sources import make_source
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams
from rpeg_jax.sharding import shard_model


@dataclass
class RuntimeContext:
    """What kernels may use (`StageEnv.context`): the config, model graphdefs, optimizers, sampler,
    tokenizer, reward, and the placement of arrays (runtime/placement.py). It is also the
    compiler's StageRuntime (graph/compile.py): `place_inputs`, `stage_scope`, `compiler_options`."""

    cfg: RunConfig
    graphdefs: dict[str, Any]
    optimizers: dict[str, Any]
    sampler: Sampler
    tokenizer: Any
    reward_name: str
    reward_fn: Any
    temperature: float
    update_key: jax.Array
    fixed_shapes: bool
    placement: Placement
    offload: Offload  # train.offload: what lives in host memory between steps (runtime/offload.py)
    prompt_offset: int = 0  # this process's first prompt index within a step's batch
    # each of its prompts' samples this process generates, [sample_offset, sample_offset + samples)
    # (samples 0: all rl.group_size of them): part of each group when processes share the groups
    # (graph/processes.share_of)
    sample_offset: int = 0
    samples: int = 0
    data_skipped: dict[str, int] = field(default_factory=dict)  # bad JSONL lines skipped at start-up, by reason
    engine: ContinuousRollouts | None = None  # rollout.admission=continuous: the engine across steps
    admission: str = "step"  # rollout.admission as the graph runs it (Graph.admission, like k)
    rollout: Any = None  # the RolloutSource every step's batch comes from (runtime/rollout/sources.py), set by build
    compiler_options: dict[str, str] = field(default_factory=dict)  # stage programs' XLA options (xla_flags)
    lora_base: Any = None  # model.lora: the actor's frozen base params (training layout); the "actor"
    #   state then holds only the adapters (models/adapters.py), and stages reading it get the base too
    adapter_sync: AdapterSync | None = None  # model.lora on disjoint devices: syncs move the adapters only

    # ---- model.lora ----------------------------------------------------------------------------------
    def policy_params(self, actor):
        """The actor state as a plain model's params (graphdefs["policy"]): itself, or with model.lora
        the base with the adapters merged in (W + s A B; a new copy, for the sampler and evaluation)."""
        if self.lora_base is None:
            return actor
        return merge_adapters(self.cfg, self.placement, self.lora_base, actor)

    def rollout_params(self, actor):
        """The sampler's weights from the actor state (the weight sync): training layout ->
        generation layout; with model.lora on disjoint devices only the adapters move (AdapterSync)."""
        if self.adapter_sync is not None:
            return self.adapter_sync(actor)
        return self.placement.to_rollout(self.policy_params(actor))

    # ---- graph.compile.StageRuntime ----------------------------------------------------------------
    def place_inputs(self, cs, inputs):
        out = self.placement.place_inputs(cs, inputs)
        if self.lora_base is not None and any(p.state and p.node == "actor" for p in cs.reads):
            out[adapters.BASE_PORT] = self.placement.place_state(cs, "lora_base", self.lora_base)
        return out

    def stage_scope(self, cs):
        layout = self.placement.layouts.get(cs.name)
        return layout.activations() if layout is not None else contextlib.nullcontext()


def _model(cfg_model, path: str | None, seed: int, layout, value_head: bool = False, section: str = "model"):
    """A model built directly in `layout`: a sharded init, or loaded from a local HF checkpoint
    (each process reads only the slices of the files its devices hold); a damaged weights file
    is a ConfigError naming `<section>.path` and the file."""
    mcfg = dataclasses.replace(cfg_model, value_head=value_head or cfg_model.value_head, lora=LoraConfig())
    resolve_attention(mcfg)  # model.attention=cudnn|pallas where it cannot run: ConfigError before any compile
    if path:
        try:
            model = load_hf(path, value_head=value_head, dtype=cfg_model.param_dtype, shardings=layout.params)
        except WeightsFileError as e:
            raise ConfigError(f"{section}.path", path, str(e)) from None
        shape = [("head_size" if f == "head_dim" else f) for f in FIXED]  # head_dim None = implied
        changed = [f for f in shape if getattr(model.cfg, f) != getattr(mcfg, f)]
        if changed:  # the config read the same config.json (config/hf.py); it changed since
            f = changed[0]
            raise ConfigError(f"model.{f}", getattr(mcfg, f), f"{path}/config.json now says {getattr(model.cfg, f)!r}")
        model.cfg = mcfg  # the run's numerics and ids (config.json's, or the overrides given beside it)
        return model
    return shard_model(
        lambda: Transformer(mcfg, rngs=nnx.Rngs(params=seed)), layout.mesh, layout.rules, list(layout.overrides)
    )


def build_actor(cfg: RunConfig, graph: Graph, placement: Placement) -> nnx.Module:
    """The initial actor (model.path, else a random init from train.seed) in its training layout, with
    a value head when the backbone is shared (runtime/evaluation.py builds it alone). With model.lora
    this is the frozen base (no adapters: build_adapters)."""
    shared = bool(graph.attrs.get("shared"))
    return _model(cfg.model, cfg.model.path, cfg.train.seed, placement.state_layout("actor"), shared)


def build_models(cfg: RunConfig, graph: Graph, placement: Placement) -> dict[str, nnx.Module]:
    """actor (+ value head when the backbone is shared), reference (the initial actor's weights,
    separate buffers) when β > 0 (with model.lora none: the reference is the actor's frozen base), and
    a separate critic for PPO without sharing."""
    seed = cfg.train.seed
    models = {"actor": build_actor(cfg, graph, placement)}
    if graph.has(StateKind.REFERENCE.value) and not cfg.model.lora.rank:
        models["reference"] = _model(cfg.model, cfg.model.path, seed, placement.state_layout("reference"))
    if graph.has(StateKind.CRITIC.value):
        critic_cfg = cfg.critic_model
        models["critic"] = _model(
            critic_cfg,
            critic_cfg.path,
            seed + 1,
            placement.state_layout("critic"),
            True,
            section="critic" if cfg.critic is not None else "model",
        )
    return models


@functools.lru_cache(maxsize=4)
def _merge_program(mcfg):
    return jax.jit(functools.partial(adapters.merged_weights, mcfg))


def merge_adapters(cfg: RunConfig, placement: Placement, base, adapter_params):
    """model.lora: base + s A B in the training layout (the plain model's params: a new copy)."""
    with placement.train.activations():
        return _merge_program(cfg.model)(base, adapter_params)


class AdapterSync:
    """model.lora with generation on other devices than training (split placement): the generation
    group keeps its own copy of the frozen base, moved there once, and each weight sync moves only
    the adapters (2·r·(in + out) per targeted projection, ~4% of a 46M model at rank 16), merged
    there into the sampler's copy (W + s A B, the same program as merge_adapters). Colocated, the
    merge runs in the training layout and the merged model is resharded (no second base is kept)."""

    def __init__(self, cfg: RunConfig, placement: Placement, base):
        self.cfg, self.placement, self.base = cfg, placement, base
        self.rollout_base = None  # the base in the generation layout (after the first sync)
        self._merge = None

    def __call__(self, adapter_params):
        pl = self.placement
        if self.rollout_base is None:  # once: every process takes part in the move (a collective)
            self.rollout_base = pl.to_rollout(self.base, key="rollout_base")
        moved = pl.to_rollout(adapter_params, key="rollout_adapters")
        if not pl.generates_here:  # a training process holds none of the sampler's weights
            return moved
        if self._merge is None:
            out = jax.tree.map(lambda x: x.sharding, self.rollout_base)
            self._merge = jax.jit(functools.partial(adapters.merged_weights, self.cfg.model), out_shardings=out)
        with pl.generate.activations():
            return self._merge(self.rollout_base, moved)


def build_adapters(cfg: RunConfig, placement: Placement) -> tuple[Any, Any]:
    """model.lora: (the LoRA model's graphdef, its adapters' initial params in the actor's training
    layout). The adapters are those of `Transformer(cfg.model)` from train.seed (drawn after the base
    weights); the init runs under jit and keeps only them, so no second base is ever made."""
    mcfg = dataclasses.replace(cfg.model, value_head=False)

    def init():
        return adapters.split(nnx.split(Transformer(mcfg, rngs=nnx.Rngs(params=cfg.train.seed)), nnx.Param)[1])[1]

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))), nnx.Param)
    layout = placement.state_layout("actor")
    shardings = layout.params(jax.eval_shape(init))
    return graphdef, jax.jit(init, out_shardings=shardings)()


def sampler_config(cfg: RunConfig, processes: int | None = None) -> SamplerConfig:
    """The sampler's engine settings: the rollout section, this process's share of a step's batch as
    slots (prompts x G / P sequences, whole groups or a part of one: graph/processes.share_of), and
    the model's end ids (eos_id + eos_ids, from generation_config.json with model.path).
    The evaluation sampler (runtime/evaluation.py) has the same, so the two share compiled programs."""
    batch = cfg.data.prompts_per_step * cfg.rl.group_size // (processes or jax.process_count())
    max_seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    return SamplerConfig.from_rollout(
        cfg.rollout, max_slots=batch, max_seq_len=max_seq, seed=cfg.train.seed, eos_token_ids=cfg.model.end_ids
    )


def build(cfg: RunConfig, graph: Graph, plan: Plan) -> tuple[RuntimeContext, Store]:
    check_plan(cfg, plan, graph, jax.process_count())  # what several processes cannot run: one line, first
    placement = Placement(cfg, graph, plan)
    # the generating processes share the prompt stream (all of them, unless a split placement puts
    # generation on some processes only: runtime/split.py): whole groups of a data shard each, or,
    # with more processes than prompts, part of one prompt's group each (graph/processes.share_of)
    gen_rank, gen_count = placement.gen_rank, placement.gen_count
    mine = share_of(cfg.data.prompts_per_step, cfg.rl.group_size, gen_count, gen_rank)
    share = mine.prompts  # this process's prompts of a step
    pipeline = build_pipeline(cfg, shard_index=mine.shard, shard_count=mine.shards)
    runner = None
    if cfg.env.name != "single_turn":  # episodes: their prompts render the tool schemas (checked here)
        from rpeg_jax.env.runner import EnvRunner

        runner = EnvRunner.build(cfg, pipeline.tokenizer)
        runner.check_prompt_lengths(pipeline.records, cfg.data.max_prompt_len, cfg.data.path or cfg.data.task)
    offload = placement.offload
    models = build_models(cfg, graph, placement)
    split = {name: nnx.split(m, nnx.Param) for name, m in models.items()}
    graphdefs = {k: v[0] for k, v in split.items()}
    graphdefs["policy"] = split["actor"][0]  # the plain model the sampler and evaluation run
    actor, base = split["actor"][1], None
    if cfg.model.lora.rank:  # the actor state is the adapters; the base is frozen (and the reference)
        base = actor
        graphdefs["actor"], actor = build_adapters(cfg, placement)
        graphdefs["reference"] = graphdefs["policy"]
    total = optimizer_steps(cfg.train.steps, cfg.rl)
    optimizers = {"actor": make_optimizer(cfg.optim, total)}
    if "critic" in models:
        optimizers["critic"] = make_optimizer(cfg.critic_optim or cfg.optim, total)
    scfg = sampler_config(cfg, gen_count)
    adapter_sync = AdapterSync(cfg, placement, base) if base is not None and placement.disjoint else None
    reward_name, reward_fn = resolve_reward(cfg.data)
    ctx = RuntimeContext(
        cfg=cfg,
        graphdefs=graphdefs,
        optimizers=optimizers,
        sampler=None,  # set below, from the rollout weights the context makes
        tokenizer=pipeline.tokenizer,
        reward_name=reward_name,
        reward_fn=reward_fn,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        update_key=jax.random.key(cfg.train.seed + 12345),
        fixed_shapes=cfg.pipeline.pieces > 1,
        placement=placement,
        offload=offload,
        prompt_offset=mine.first_prompt,
        sample_offset=mine.first_sample,
        samples=mine.samples,
        data_skipped=dict(pipeline.skipped),
        admission=graph.admission,
        compiler_options=xla_flags.train_compiler_options(),
        lora_base=base,
        adapter_sync=adapter_sync,
    )
    rollout_params = ctx.rollout_params(actor)  # the first weight sync: what every later one does
    sampler = None  # a training process of a split placement samples nothing
    if placement.generates_here:
        sampler = Sampler(
            nnx.merge(graphdefs["policy"], rollout_params),
            scfg,
            tokenizer=pipeline.tokenizer,
            mesh=placement.generate.mesh,
        )
    engine = None
    if graph.admission == "continuous" and sampler is not None:
        r, G = cfg.rollout, cfg.rl.group_size
        engine = ContinuousRollouts(
            sampler,
            groups_per_step=share,
            group_size=G,
            staleness=graph.staleness,
            stale_groups=r.stale_groups,
            sampling=SamplingParams.from_rollout(r, n=G, seed=0),
            seed=cfg.train.seed,
            prompt_offset=mine.first_prompt,
            lengths=forced_lengths(r.forced_lengths, cfg.train.seed, G) if r.forced_lengths else None,
            # this process's share of the bound (each process fills its own share of the batch)
            max_filtered=cfg.rl.filter_max_rounds * share,
            runner=runner,  # episodes (env.name other than single_turn), else None
            max_total_tokens=r.max_new_tokens,
        )
    ctx.sampler, ctx.engine = sampler, engine
    if engine is not None and cfg.rl.filter_groups != "none":
        engine.scorer = functools.partial(group_scores, ctx)
    ctx.rollout = make_source(ctx, runner) if sampler is not None else None  # where each step's batch comes from
    store = Store(keep_versions=graph.staleness + 2)  # generation reads t - k while training writes t + 1
    store.put_state("actor", 0, actor)
    store.put_state("actor_opt", 0, offload.park_now("actor_opt", placement.init_opt_state(optimizers["actor"], actor)))
    store.put_state("rollout_weights", 0, rollout_params)
    store.put_state("data_iterator", 0, StepPrompts(pipeline))
    if "reference" in split:
        store.frozen["reference"] = offload.park_now("reference", split["reference"][1])
    elif base is not None and graph.has(StateKind.REFERENCE.value):
        store.frozen["reference"] = base  # model.lora: the same buffers as the actor's base
    if "critic" in split:
        store.put_state("critic", 0, split["critic"][1])
        critic_opt = placement.init_opt_state(optimizers["critic"], split["critic"][1])
        store.put_state("critic_opt", 0, offload.park_now("critic_opt", critic_opt))
    if graph.has(StateKind.ROLLOUT_BUFFER.value):
        store.put_state("rollout_buffer", 0, RolloutBuffer(staleness=graph.staleness))
    return ctx, store
