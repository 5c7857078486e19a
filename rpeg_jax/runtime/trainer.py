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
from rpeg_jax.runtime import rollouts
from rpeg_jax.runtime.checkpoint import Checkpointer
from rpeg_jax.runtime.executor import Executor, Store
from rpeg_jax.runtime.kernels import default_registry
from rpeg_jax.runtime.metrics import MetricsWriter
from rpeg_jax.runtime.setup import RuntimeContext, build
from rpeg_jax.runtime.trace import Tracer

log = logging.getLogger("rpeg_jax")
TRAIN_STATES = ("actor", "actor_opt", "critic", "critic_opt")


class TrainingStopped(RuntimeError):
    pass


def choose_plan(cfg: RunConfig) -> Plan:
    planner = None
    if cfg.pipeline.plan == "auto":
        from rpeg_jax.costmodel.planner import choose_plan as planner  # noqa: F811  (optional layer)
    return plan_for_config(cfg, jax.device_count(), planner=planner)


def train(cfg: RunConfig, *, plan: Plan | None = None, registry=None) -> dict[str, Any]:
    plan = plan or choose_plan(cfg)
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
    start = _resume(ckpt, store, executor, ctx) if cfg.train.resume == "auto" else 0
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
                _save(ckpt, store, executor, last, lead)
            executor.forget_before(t)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: writing a final checkpoint at step %d", last)
    finally:
        writer.close()
    if last > start or interrupted:
        _save(ckpt, store, executor, last, lead)
    ckpt.close()
    if chief:
        _write_trace(cfg, tracer, plan, last)
    return {"steps": last, "interrupted": interrupted, "run_dir": cfg.train.run_dir}


# ---- metrics -----------------------------------------------------------------------------------
def _step_metrics(cfg, ctx: RuntimeContext, ex: Executor, store: Store, plan: Plan, t: int, lead: int) -> dict:
    m = {k: v for k, v in jax.device_get(ex.metrics.pop(t, {})).items()}
    comps = store.get_data("completions", t)
    m.update(rollouts.assert_staleness(comps["versions_BxR"], comps["response_mask_BxR"], t, lead))
    step_s = m.get("timing_s/step", float("nan"))
    seg = np.asarray(comps["segment_ids_BxS"])
    m["perf/tokens_per_s"] = float(seg.sum()) / step_s
    fwd = sum(1 for cs in ex.program.stages for p in (cs.stage.parts or (cs.stage,))
              if p.kind.value in ("ref_forward", "old_forward", "critic_forward"))
    trains = sum(1 for cs in ex.program.stages for p in (cs.stage.parts or (cs.stage,))
                 if p.kind.value in ("actor_update", "critic_update")) * cfg.rl.ppo_epochs
    flops = rollouts.useful_flops(cfg, comps, forwards=fwd, train_passes=trains)
    m["perf/flops"] = flops
    m["perf/tflops_per_device"] = flops / step_s / jax.device_count() / 1e12
    peak = ctx.extras.get("peak_flops_per_device")
    if peak:
        m["perf/mfu"] = flops / step_s / (peak * jax.device_count())
    for stage, secs in (plan.predicted.get("stage_s") or {}).items():
        m[f"predicted_s/{stage}"] = secs
    m["actor/version"] = float(store.latest("actor")[0])
    return {k: (float(np.asarray(v)) if np.ndim(v) == 0 else v) for k, v in m.items()}


# ---- checkpoints -------------------------------------------------------------------------------
def _save(ckpt: Checkpointer, store: Store, ex: Executor, step: int, lead: int) -> None:
    """Everything a resume needs after `step` steps (see runtime/checkpoint.py)."""
    train = {name: store.latest(name)[1] for name in TRAIN_STATES if name in store.state}
    meta = {"step": step, "versions": {n: store.latest(n)[0] for n in TRAIN_STATES if n in store.state},
            "data_iterator": store.latest("data_iterator")[1].state(),
            "next_lead_step": dict(ex.next_lead_step), "buffer_steps": [], "host": {}, "pending_metrics": {}}
    buffer = {}
    if "rollout_buffer" in store.state:
        meta["admitted"] = {str(s): v for s, v in store.latest("rollout_buffer")[1].admitted.items()}
    for s in range(step, step + lead):  # rollouts generated ahead of their update
        meta["buffer_steps"].append(s)
        for node in ("completions", "behav_logp"):
            value = store.get_data(node, s)
            flat = value if isinstance(value, dict) else {"": value}
            for key, arr in flat.items():
                if key.startswith("host_"):
                    meta["host"][f"{s}/{node}/{key}"] = [_jsonable(x) for x in arr]
                else:
                    buffer[f"{s}/{node}/{key}"] = np.asarray(arr)
        meta["pending_metrics"][str(s)] = {k: float(np.asarray(v)) for k, v in ex.metrics.get(s, {}).items()}
    ckpt.save(step, train, meta, buffer=buffer)


def _jsonable(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return x


def _resume(ckpt: Checkpointer, store: Store, ex: Executor, ctx: RuntimeContext) -> int:
    step = ckpt.latest_step()
    if step is None:
        return 0
    target = {name: store.latest(name)[1] for name in TRAIN_STATES if name in store.state}
    train, meta, buffer = ckpt.restore(step, target)
    for name, value in train.items():
        store.put_state(name, meta["versions"][name], value)
    version, actor = store.latest("actor")
    store.put_state("rollout_weights", version, ctx.to_rollout(actor))
    prompts = store.latest("data_iterator")[1]
    prompts.pipeline.set_state(meta["data_iterator"])
    store.put_state("data_iterator", step, prompts)
    if "admitted" in meta and "rollout_buffer" in store.state:
        buf = store.latest("rollout_buffer")[1]
        buf.admitted = {int(s): int(v) for s, v in meta["admitted"].items()}
        store.put_state("rollout_buffer", step, buf)
    ex.next_lead_step.update({k: int(v) for k, v in meta["next_lead_step"].items()})
    for s in meta["buffer_steps"]:
        for node in ("completions", "behav_logp"):
            arrays = {k.split("/", 2)[2]: v for k, v in buffer.items() if k.startswith(f"{s}/{node}/")}
            host = {k.split("/", 2)[2]: _objects(v) for k, v in meta["host"].items() if k.startswith(f"{s}/{node}/")}
            value = arrays.get("") if "" in arrays else {**{k: jax.numpy.asarray(v) for k, v in arrays.items()}, **host}
            store.put_data(node, s, jax.numpy.asarray(value) if node == "behav_logp" else value)
        for stage in ex.lead:
            if ex.lead[stage]:
                for i in range(ex.program.stage(stage).pieces):
                    ex.done.add((stage, s, i))
        ex.metrics[s].update(meta["pending_metrics"].get(str(s), {}))
    log.info("resumed from %s at step %d", ckpt.directory, step)
    return step


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


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

