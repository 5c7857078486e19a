"""`rpeg eval --config X [--step N] [--out FILE] [key=value ...]`: held-out evaluation alone.

Evaluates the policy of a run's checkpoint (train.run_dir/checkpoints; the newest without --step;
only the actor's params are read), or, where the run has no checkpoint (or with --step 0), the
initial model (model.path, else the random init of train.seed), exactly as the run evaluates in
flight (runtime/evaluation.py): the same eval file, sampler settings, seed and layout (the run's
plan.json when there is one), so a checkpoint's evaluation reproduces the run's at that step. The
per-prompt results go to --out (default: <run_dir>/eval/step_<N>.jsonl); the metrics are printed
as one JSON line. A missing checkpoint, step or eval file is one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.run import load_config


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML preset of the run (or its config.yaml)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest; 0: initial)")
    p.add_argument("--out", default=None, help="per-prompt results (default: <run_dir>/eval/step_<N>.jsonl)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")


def _step(ckpt_dir: str, asked: int | None) -> int:
    """The checkpoint step to evaluate (0: the initial model); a missing one is a ConfigError."""
    from rpeg_jax.runtime.checkpoint import Checkpointer

    have = sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()) if Checkpointer.has_checkpoint(ckpt_dir) else []
    if asked is None:
        return have[-1] if have else 0
    if asked != 0 and asked not in have:
        raise ConfigError("--step", asked, f"no checkpoint of that step in {ckpt_dir} (have {have or 'none'})")
    return asked


def evaluate(cfg, step: int | None = None, out: str | None = None) -> tuple[int, dict]:
    """(the step evaluated, its metrics) of the run `cfg` describes (module docstring)."""
    from flax import nnx

    from rpeg_jax.graph.plan import graph_for_plan
    from rpeg_jax.runtime.checkpoint import Checkpointer
    from rpeg_jax.runtime.evaluation import Evaluator
    from rpeg_jax.runtime.placement import Placement
    from rpeg_jax.runtime.setup import build_actor
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
    if step:
        ckpt = Checkpointer(ckpt_dir)
        try:
            params = ckpt.restore_state(step, "actor", params)
        finally:
            ckpt.close()
    return step, ev.run(step, params, out)


def run(args) -> int:
    from rpeg_jax.runtime.trainer import expected_failures

    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        step, metrics = evaluate(cfg, args.step, args.out)
    except expected_failures() as e:  # e.g. a reward that raises with data.reward_on_error=stop
        print(f"rpeg eval: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"step": step, **metrics}, sort_keys=True))
    return 0
