"""The step loop: plan -> graph -> compiled program -> steps, with checkpoints, metrics, traces.

    summary = train(cfg)          # what `make run`, `rpeg train` and launch/multihost.py call

Reads top to bottom: choose the plan (manual, a file, or the cost model when
pipeline.plan=auto), rebuild the graph the plan describes, build models/sampler/data
(runtime/setup.py), compile every stage (graph/compile.py with runtime/kernels.py), resume
from the newest checkpoint when train.resume=auto, then run one executor slot per step and
write metrics (JSONL, TensorBoard), checkpoints (orbax, atomic, async) and the stage timeline.
Ctrl-C writes a final checkpoint and returns; a non-finite loss stops the run when
rl.on_nan=stop; non-finite parameters never reach a checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

from rpeg_jax.config.run import RunConfig, dump_yaml
from rpeg_jax.graph.compile import compile_graph
from rpeg_jax.graph.plan import Plan, graph_for_plan, plan_for_config
from rpeg_jax.runtime import resume, rollouts
from rpeg_jax.runtime.checkpoint import Checkpointer
from rpeg_jax.runtime.resume import TRAIN_STATES
from rpeg_jax.runtime.executor import Executor, Store
from rpeg_jax.runtime.kernels import default_registry
from rpeg_jax.runtime.metrics import MetricsWriter
from rpeg_jax.runtime.setup import RuntimeContext, build
from rpeg_jax.runtime.trace import Tracer

log = logging.getLogger("rpeg_jax")


class TrainingStopped(RuntimeError):
    pass


def expected_failures() -> tuple[type[BaseException], ...]:
    """Failures that end a run with one clear line (exit 1) rather than a traceback."""
    from rpeg_jax.data.rewards import RewardError
    from rpeg_jax.runtime.checkpoint import NonFiniteError
    from rpeg_jax.runtime.rollouts import StalenessError

    return (TrainingStopped, RewardError, NonFiniteError, StalenessError)


def choose_plan(cfg: RunConfig) -> tuple[RunConfig, Plan]:
    """The plan for this run (pipeline.plan: manual | auto | a file) and the config it implies
    (the planner also chooses settings outside the pipeline section, e.g. rl.micro_batches)."""
    if cfg.pipeline.plan != "auto":
        return cfg, plan_for_config(cfg, jax.device_count())
    from rpeg_jax.costmodel.planner import apply_plan_settings, choose_plan as planner  # the cost-model layer

    plan = plan_for_config(cfg, jax.device_count(), planner=planner)
    return apply_plan_settings(cfg, plan), plan


def train(cfg: RunConfig, *, plan: Plan | None = None, registry=None, on_step=None,
          keep_state: bool = False) -> dict[str, Any]:
    """Run cfg.train.steps RL steps (resuming when allowed). `on_step(step, metrics)` is called
    after each step's metrics are written (and its checkpoint, if any, is committed); with
    `keep_state` the summary holds the final state values under "state"."""
    if plan is None:
        cfg, plan = choose_plan(cfg)
    graph = graph_for_plan(cfg, plan)
    ctx, store = build(cfg, graph, plan)
    program = compile_graph(graph, plan, registry or default_registry(), ctx)
    lead = cfg.pipeline.staleness if graph.has("rollout_buffer") else 0
    chief = jax.process_index() == 0
    os.makedirs(cfg.train.run_dir, exist_ok=True)
    if chief:
        _write_run_files(cfg, plan, graph)
    ckpt = Checkpointer(os.path.join(cfg.train.run_dir, "checkpoints"), keep=cfg.train.keep_checkpoints)
    tracer = Tracer()
    executor = Executor(program, store, tracer=tracer)
    start = resume.restore(ckpt, store, executor, ctx) if cfg.train.resume == "auto" else 0
    writer = MetricsWriter(cfg.train.run_dir, enabled=chief, tensorboard=cfg.train.tensorboard,
                           progress=cfg.train.progress, total_steps=cfg.train.steps, start_step=start)
    last, interrupted = start, False
    try:
        for t in range(start, cfg.train.steps):
            executor.run_slot(t)
            metrics = _step_metrics(cfg, ctx, executor, store, plan, t, lead)
            writer.write(t + 1, metrics)
            last = t + 1
            if metrics.get("actor/nan_stop", 0) or metrics.get("critic/nan_stop", 0):
                raise TrainingStopped(f"step {t + 1}: non-finite loss or gradient and rl.on_nan=stop")
            if cfg.train.checkpoint_every and last % cfg.train.checkpoint_every == 0 and last < cfg.train.steps:
                resume.save(ckpt, store, executor, last, lead)
            executor.forget_before(t)
            if on_step is not None:
                ckpt.wait()
                on_step(last, metrics)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: writing a final checkpoint at step %d", last)
    finally:
        writer.close()
    if last > start or interrupted:
        resume.save(ckpt, store, executor, last, lead)
    ckpt.close()
    if chief:
        _write_trace(cfg, tracer, plan, last)
    out = {"steps": last, "interrupted": interrupted, "run_dir": cfg.train.run_dir}
    if keep_state:
        out["state"] = {n: store.latest(n)[1] for n in TRAIN_STATES if n in store.state}
        out["consumed"] = dict(executor.consumed)  # (stage, step, piece) -> {port: version | (step, piece)}
    return out


# ---- metrics -----------------------------------------------------------------------------------
def _step_metrics(cfg, ctx: RuntimeContext, ex: Executor, store: Store, plan: Plan, t: int, lead: int) -> dict:
    m = {k: v for k, v in jax.device_get(ex.metrics.pop(t, {})).items()}
    stats = rollouts.token_stats(store.get_data("completions", t))
    rollouts.assert_staleness(stats, t, lead)
    step_s = m.get("timing_s/step", float("nan"))
    m["perf/tokens_per_s"] = stats["seq"] / step_s
    flops = rollouts.step_flops(cfg, stats)  # useful work only: a rewrite that saves a pass saves time
    m["perf/flops"] = flops
    m["perf/tflops_per_device"] = flops / step_s / jax.device_count() / 1e12
    peak = ctx.extras.get("peak_flops_per_device")
    if peak:
        m["perf/mfu"] = flops / step_s / (peak * jax.device_count())
    if plan.predicted.get("stage_s"):  # the cost model's prediction next to what was measured
        from rpeg_jax.costmodel.planner import compare

        m.update(compare(plan, ex.stage_seconds.pop(t, {})))
    m["actor/version"] = float(store.latest("actor")[0])
    for reason, count in ctx.extras.get("data_skipped", {}).items():  # bad JSONL lines skipped at start-up
        m[f"data/skipped_{reason}"] = float(count)
    return {k: (float(np.asarray(v)) if np.ndim(v) == 0 else v) for k, v in m.items()}


# ---- outputs -----------------------------------------------------------------------------------
def _write_run_files(cfg: RunConfig, plan: Plan, graph) -> None:
    d = cfg.train.run_dir
    with open(os.path.join(d, "config.yaml"), "w") as f:
        f.write(dump_yaml(cfg))
    plan.save(os.path.join(d, "plan.json"))
    with open(os.path.join(d, "graph.txt"), "w") as f:
        f.write(graph.describe() + "\n")


def _write_trace(cfg: RunConfig, tracer: Tracer, plan: Plan, last: int) -> None:
    d = cfg.train.run_dir
    tracer.write_chrome(os.path.join(d, "trace.json"))
    if last > 0:
        steps = sorted({s.step for s in tracer.spans})
        show = steps[-1] if steps else last - 1
        tracer.plot_step(show, os.path.join(d, "timeline.png"), plan.predicted.get("stage_s"))

