"""A run's checkpoint evaluated alone (`rpeg eval`): the same eval file, sampler settings, seed and
layout as the run's in-flight evaluation (runtime/evaluation.py), so a checkpoint's evaluation
reproduces the run's at that step. Its own module: it plans and builds like the trainer does."""

from __future__ import annotations

import dataclasses
import os

from rpeg_jax.config.base import ConfigError
from rpeg_jax.runtime.evaluation import Evaluator


def _step(ckpt_dir: str, asked: int | None) -> int:
    """The checkpoint step to evaluate (0: the initial model); a missing one is a ConfigError."""
    from rpeg_jax.runtime.checkpoint import Checkpointer

    have = sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()) if Checkpointer.has_checkpoint(ckpt_dir) else []
    if asked is None:
        return have[-1] if have else 0
    if asked != 0 and asked not in have:
        raise ConfigError("--step", asked, f"no checkpoint of that step in {ckpt_dir} (have {have or 'none'})")
    return asked


def evaluate_checkpoint(cfg, step: int | None = None, out: str | None = None) -> tuple[int, dict]:
    """(the step evaluated, its metrics) of the run `cfg` describes: its checkpoint `step` (default:
    the newest; 0 or none: the initial model) evaluated exactly as the run evaluates in flight, in
    the run's layout (its plan.json). `rpeg eval` calls this."""
    from flax import nnx

    from rpeg_jax.graph.plan import graph_for_plan
    from rpeg_jax.runtime.checkpoint import Checkpointer
    from rpeg_jax.runtime.placement import Placement
    from rpeg_jax.runtime.setup import build_actor, build_adapters, merge_adapters
    from rpeg_jax.runtime.trainer import choose_plan

    if not cfg.eval.enabled:
        raise ConfigError("eval.path", None, "rpeg eval needs a JSONL of held-out prompts")
    ckpt_dir = os.path.join(cfg.train.run_dir, "checkpoints")
    step = _step(ckpt_dir, step)
    saved = os.path.join(cfg.train.run_dir, "plan.json")
    if os.path.isfile(saved):  # the layout the run evaluated in
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, plan=saved))
    cfg, plan = choose_plan(cfg)  # the run's config: the plan's settings applied, as in training
    ev = Evaluator.for_run(cfg)  # reads and checks the eval file before any model is built
    graph = graph_for_plan(cfg, plan)
    placement = Placement(cfg, graph, plan)
    graphdef, params = nnx.split(build_actor(cfg, graph, placement), nnx.Param)
    ev.on(graphdef, placement.generate.mesh, placement.to_rollout)
    actor = build_adapters(cfg, placement)[1] if cfg.model.lora.rank else params  # model.lora: the adapters
    if step:
        ckpt = Checkpointer(ckpt_dir)
        try:
            actor = ckpt.restore_state(step, "actor", actor)
        finally:
            ckpt.close()
    params = merge_adapters(cfg, placement, params, actor) if cfg.model.lora.rank else actor
    if out is None:  # never the run's own eval/step_<N>.jsonl (its in-flight evaluation's record)
        out = ev.path(step)[: -len(".jsonl")] + ".rpeg_eval.jsonl"
    return step, ev.run(step, params, out)
