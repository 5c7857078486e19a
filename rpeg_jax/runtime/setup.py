"""Run set-up: from a RunConfig and a Plan to the runtime context and the initial state.

Builds, in this order and before any step runs: the data pipeline (validates the data), the
models (random init or a local HF checkpoint) and their optimizer states, the sampler, the
kernels' context, and the store holding version 0 of every state node. Nothing here decides
placement: the Plan says where each stage runs.

Called by: runtime/trainer.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rpeg_jax.config.run import RunConfig
from rpeg_jax.data.pipeline import build_pipeline
from rpeg_jax.data.rewards import resolve_reward
from rpeg_jax.graph.ir import Graph, StateKind
from rpeg_jax.graph.plan import Plan
from rpeg_jax.models import init_model, load_hf
from rpeg_jax.rl import make_optimizer, optimizer_steps
from rpeg_jax.runtime.executor import Store
from rpeg_jax.runtime.rollouts import RolloutBuffer, StepPrompts
from rpeg_jax.sampling import Sampler, SamplerConfig


@dataclass
class RuntimeContext:
    """What kernels may use: the config, model graphdefs, optimizers, sampler, tokenizer, reward."""

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
    prompt_offset: int = 0
    extras: dict[str, Any] = field(default_factory=dict)

    def put_batch(self, x):
        """Host rollout arrays -> device arrays of the training stages."""
        return jnp.asarray(x)

    def to_rollout(self, params):
        """Weights in the training layout -> the sampler's layout (identity when they match)."""
        return params


def _load(cfg_model, path: str | None, seed: int, value_head: bool = False):
    if path:
        return load_hf(path, value_head=value_head, dtype=cfg_model.param_dtype)
    return init_model(dataclasses.replace(cfg_model, value_head=value_head or cfg_model.value_head), seed)


def build_models(cfg: RunConfig, graph: Graph) -> dict[str, nnx.Module]:
    """actor (+ value head when the backbone is shared), reference (a copy of the initial actor)
    when β > 0, and a separate critic for PPO without sharing."""
    shared = bool(graph.attrs.get("shared"))
    models = {"actor": _load(cfg.model, cfg.model.path, cfg.train.seed, value_head=shared)}
    if graph.has(StateKind.REFERENCE.value):
        models["reference"] = _load(cfg.model, cfg.model.path, cfg.train.seed, value_head=False)
    if graph.has(StateKind.CRITIC.value):
        critic_cfg = cfg.critic_model
        models["critic"] = _load(critic_cfg, critic_cfg.path, cfg.train.seed + 1, value_head=True)
    return models


def build(cfg: RunConfig, graph: Graph, plan: Plan) -> tuple[RuntimeContext, Store]:
    pipeline = build_pipeline(cfg, shard_index=jax.process_index(), shard_count=jax.process_count())
    models = build_models(cfg, graph)
    split = {name: nnx.split(m, nnx.Param) for name, m in models.items()}
    total = optimizer_steps(cfg.train.steps, cfg.rl)
    optimizers = {"actor": make_optimizer(cfg.optim, total)}
    if "critic" in models:
        optimizers["critic"] = make_optimizer(cfg.critic_optim or cfg.optim, total)
    batch = cfg.data.prompts_per_step * cfg.rl.group_size // jax.process_count()
    max_seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    scfg = SamplerConfig.from_rollout(cfg.rollout, max_slots=batch, max_seq_len=max_seq, seed=cfg.train.seed)
    sampler = Sampler(models["actor"], scfg, tokenizer=pipeline.tokenizer)
    reward_name, reward_fn = resolve_reward(cfg.data)
    ctx = RuntimeContext(
        cfg=cfg, graphdefs={k: v[0] for k, v in split.items()}, optimizers=optimizers, sampler=sampler,
        tokenizer=pipeline.tokenizer, reward_name=reward_name, reward_fn=reward_fn,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        update_key=jax.random.key(cfg.train.seed + 12345), fixed_shapes=cfg.pipeline.microbatches > 1,
        prompt_offset=jax.process_index() * (cfg.data.prompts_per_step // jax.process_count()))
    store = Store(keep_versions=cfg.pipeline.staleness + 2)
    store.put_state("actor", 0, split["actor"][1])
    store.put_state("actor_opt", 0, optimizers["actor"].init(split["actor"][1]))
    store.put_state("rollout_weights", 0, ctx.to_rollout(split["actor"][1]))
    store.put_state("data_iterator", 0, StepPrompts(pipeline))
    if "reference" in split:
        store.frozen["reference"] = split["reference"][1]
    if "critic" in split:
        store.put_state("critic", 0, split["critic"][1])
        store.put_state("critic_opt", 0, optimizers["critic"].init(split["critic"][1]))
    if graph.has(StateKind.ROLLOUT_BUFFER.value):
        k = graph.nodes["rollout_buffer"].attrs.get("max_staleness", cfg.pipeline.staleness)
        store.put_state("rollout_buffer", 0, RolloutBuffer(max_staleness=k))
    return ctx, store
