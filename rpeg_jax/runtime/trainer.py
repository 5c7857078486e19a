"""The step loop: plan -> graph -> compiled program -> steps, with checkpoints, metrics, traces.

    summary = train(cfg)          # what `make run`, `rpeg train` and launch/multihost.py call

Reads top to bottom: choose the plan (manual, a file, or the cost model when pipeline.plan=auto)
and take the run's structure from it (graph/plan.config_for_plan: whatever the plan's source, its
knobs and settings are what runs, and config.yaml / plan.json record them), build the graph the
plan describes, build models/sampler/data (runtime/setup.py), compile every stage
(graph/compile.py with runtime/kernels.py), resume from the newest checkpoint when
train.resume=auto, then run one executor slot per step and write metrics (JSONL every step;
console and TensorBoard every train.log_every steps), checkpoints (orbax, atomic, async) and the
stage timeline.

Stopping: SIGINT (Ctrl-C) and SIGTERM (what SLURM sends before it kills a job) only set a flag.
The step in flight finishes, every process agrees on the same last step, and the final checkpoint
is of that step boundary, so it always resumes exactly; a second Ctrl-C stops at once and leaves
the newest checkpoint already committed. A non-finite loss stops the run when rl.on_nan=stop;
non-finite parameters never reach a checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import threading
from typing import Any

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils

from rpeg_jax.config.base import ConfigError, to_dict
from rpeg_jax.config.files import refuse_links, write_atomic
from rpeg_jax.config.hf import FIXED as SHAPE_FIELDS
from rpeg_jax.config.hf import checkpoint_overrides, pretrained_warnings
from rpeg_jax.config.run import RunConfig, dump_yaml
from rpeg_jax.costmodel import devices as cost_devices
from rpeg_jax.costmodel.planner import choose_plan as cost_model_planner
from rpeg_jax.data.pipeline import with_data_prompt_len
from rpeg_jax.data.rewards import RewardError
from rpeg_jax.graph.compile import compile_graph
from rpeg_jax.graph.ir import Graph, GraphError
from rpeg_jax.graph.plan import Plan, config_for_plan, graph_for_plan, plan_for_config
from rpeg_jax.runtime import host_memory, resume
from rpeg_jax.runtime import split as split_run
from rpeg_jax.runtime.checkpoint import CheckpointCorrupt, Checkpointer, DiskFull, NonFiniteError
from rpeg_jax.runtime.evaluation import Evaluator
from rpeg_jax.runtime.executor import Executor, Store
from rpeg_jax.runtime.hooks import Hook, StepInfo, run_hooks
from rpeg_jax.runtime.kernels import default_registry
from rpeg_jax.runtime.metrics import MetricsWriter, prediction_metrics
from rpeg_jax.runtime.resume import TRAIN_STATES
from rpeg_jax.runtime.rollout import stats as rollout_stats
from rpeg_jax.runtime.rollout.continuous import FilterExhausted
from rpeg_jax.runtime.rollout.prompts import StalenessError
from rpeg_jax.runtime.setup import RuntimeContext, build
from rpeg_jax.runtime.trace import Tracer

log = logging.getLogger("rpeg_jax")


class TrainingStopped(RuntimeError):
    pass


def expected_failures() -> tuple[type[BaseException], ...]:
    """Failures that end a run with one clear line (exit 1) rather than a traceback."""
    return (
        TrainingStopped,
        RewardError,
        NonFiniteError,
        StalenessError,
        FilterExhausted,
        CheckpointCorrupt,
        DiskFull,
    )


def choose_plan(cfg: RunConfig, plan: Plan | None = None) -> tuple[RunConfig, Plan]:
    """The plan for this run (`plan`, else pipeline.plan: manual | auto | a file) and the config it
    implies: the plan's structural knobs and settings replace the config's (each change logged)."""
    if plan is None and cfg.pipeline.plan == "auto" and _resumable(cfg):
        # A resumed run continues under the plan it was checkpointed with: planning again could
        # choose another structure, which the checkpoint cannot continue (resume.check_structure
        # refuses it in one line, so an unreadable plan.json is planned again, not fatal).
        saved = os.path.join(cfg.train.run_dir, "plan.json")
        try:
            Plan.load(saved)  # readable (plan_for_config checks it against the graph)
            log.info("resuming: pipeline.plan=auto takes the run's own plan %s", saved)
            cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, plan=saved))
        except (OSError, GraphError) as e:
            log.warning("resuming: the run's %s is unreadable (%s); planning again", saved, e)
    if plan is None and cfg.pipeline.plan == "auto":  # a JSONL run's prompts, not the cap, are priced
        cfg = with_data_prompt_len(cfg)
    if plan is None:
        # auto: planned for the processes this run has (only plans they run: graph/processes.py)
        auto = functools.partial(cost_model_planner, processes=jax.process_count())
        planner = auto if cfg.pipeline.plan == "auto" else None
        plan = plan_for_config(cfg, jax.device_count(), planner=planner)
    cfg, changed = config_for_plan(cfg, plan)
    for key, (given, chosen) in changed.items():
        log.info("the plan (%s) sets %s=%s (the config had %s)", plan.source, key, chosen, given)
    if "slots_priced" in plan.predicted:
        log.warning(
            "rollout.max_slots=%s is the config's and is kept; the plan's prediction assumed %s slots "
            "(leave rollout.max_slots unset to let the planner choose)",
            cfg.rollout.max_slots,
            plan.predicted["slots_priced"],
        )
    return cfg, plan


def check_run_dir(cfg: RunConfig) -> None:
    """Before anything is planned, built or written: the run directory holds no symbolic link
    where the run writes (config/files.RUN_FILES), train.resume=never is not pointed at an earlier
    run's checkpoints (its first save would collide with them), and a run that will resume asks
    for the model shapes its checkpoints hold (its config.yaml's; resume.check_shapes checks the
    checkpoint itself again before any array is read)."""
    d = cfg.train.run_dir
    if not os.path.isdir(d):
        return
    refuse_links(d)
    ckpts = os.path.join(d, "checkpoints")
    if not Checkpointer.has_checkpoint(ckpts):
        return
    if cfg.train.resume == "never":
        raise ConfigError(
            "train.resume",
            "never",
            f"{ckpts} holds an earlier run's checkpoints, which a new run there would collide with: "
            "use a new train.run_dir (or train.resume=auto to continue that run)",
        )
    try:
        with open(os.path.join(d, "config.yaml")) as f:
            saved = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return
    for section in ("model", "critic"):
        ours, theirs = getattr(cfg, section), saved.get(section) if isinstance(saved, dict) else None
        if ours is None or not isinstance(theirs, dict):
            continue
        for name in (*SHAPE_FIELDS, "param_dtype"):
            if name in theirs and to_dict(getattr(ours, name)) != theirs[name]:
                raise ConfigError(
                    f"{section}.{name}",
                    getattr(ours, name),
                    f"the run in {d} was trained with {section}.{name}={theirs[name]!r} (its config.yaml) and "
                    "its checkpoints hold those shapes: resume with that config or start a new train.run_dir",
                )


def _resumable(cfg: RunConfig) -> bool:
    """Whether train.resume=auto will continue from a checkpoint of this run directory."""
    d = cfg.train.run_dir
    return (
        cfg.train.resume == "auto"
        and os.path.isfile(os.path.join(d, "plan.json"))
        and Checkpointer.has_checkpoint(os.path.join(d, "checkpoints"))
    )


def train(
    cfg: RunConfig,
    *,
    plan: Plan | None = None,
    registry=None,
    on_step=None,
    hooks=(),
    keep_state: bool = False,
) -> dict[str, Any]:
    """Run cfg.train.steps RL steps (resuming when allowed). `hooks`: runtime/hooks.Hook's run at
    step boundaries with their `every=` (evaluation and checkpoints are built-in hooks);
    `on_step(step, metrics)` is called after each step's metrics are written (and its checkpoint,
    if any, is committed); with `keep_state` the summary holds the final state values under "state"."""
    with StopSignals() as stop:
        check_run_dir(cfg)
        for line in checkpoint_overrides(cfg):  # fields given beside model.path / critic.path
            log.info("%s", line)
        for line in pretrained_warnings(cfg):  # a random-init model's settings on a pretrained one
            log.warning("%s", line)
        cfg, plan = choose_plan(cfg, plan)
        graph = graph_for_plan(cfg, plan)
        evaluator = Evaluator.for_run(cfg)  # None without eval.path; the eval file is checked here
        ctx, store = build(cfg, graph, plan)
        if evaluator is not None:
            evaluator.on(ctx.graphdefs["policy"], ctx.placement.generate.mesh, ctx.placement.to_rollout)
        program = compile_graph(graph, plan, registry or default_registry(), ctx)
        chief = jax.process_index() == 0
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        ckpt = Checkpointer(
            os.path.join(cfg.train.run_dir, "checkpoints"), keep=cfg.train.keep_checkpoints, cleanup_tmp=True
        )
        tracer = Tracer()
        executor = Executor(program, store, tracer=tracer, roles=split_run.roles(ctx.placement, program, store))
        try:  # the checkpointer is closed (its saves in flight committed) on every way out
            start = resume.restore(ckpt, store, executor, ctx) if cfg.train.resume == "auto" else 0
            if chief:  # only once the resume checks passed: a refused resume leaves the run's files as they were
                _write_run_files(cfg, plan, graph)
            last, saved = _loop(
                cfg, ctx, executor, store, plan, ckpt, stop, start, chief, on_step, evaluator, tuple(hooks)
            )
            if last > start and last != saved:
                resume.save(ckpt, store, executor, last, ctx.engine, ctx.placement)
        finally:
            ckpt.close()
        if chief:
            _write_trace(cfg, tracer, plan, last)
        stopped = stop.signal_name is not None and last < cfg.train.steps  # a signal in the last step stops nothing
        if stopped and chief:
            log.warning(
                "stopped by %s after step %d: %s; run the same command to resume",
                stop.signal_name,
                last,
                f"checkpoint of step {last} in {ckpt.directory}"
                if last > start
                else "no step ran, nothing new to save",
            )
    out = {"steps": last, "interrupted": stopped, "run_dir": cfg.train.run_dir}
    if keep_state:
        out["state"] = {n: store.latest(n)[1] for n in TRAIN_STATES if n in store.state}
        out["consumed"] = dict(executor.consumed)  # (stage, step, piece) -> {port: version | (step, piece)}
    return out


def _loop(
    cfg: RunConfig,
    ctx: RuntimeContext,
    executor: Executor,
    store: Store,
    plan: Plan,
    ckpt: Checkpointer,
    stop: StopSignals,
    start: int,
    chief: bool,
    on_step,
    evaluator: Evaluator | None = None,
    hooks=(),
) -> tuple[int, int | None]:
    """Steps start..train.steps-1, one executor slot each, until a stop is agreed; returns the
        number of whole steps done and the step of the last checkpoint it wrote (None: none). Held-out
        evaluation (runtime/evaluation.py) runs at step boundaries: step 0 with eval.before_train (a
        fresh run), then where `due`; its metrics join that step's record. Evaluation, checkpoints,
    `on_step` and the user's `hooks` are trainer hooks (runtime/hooks.py)."""
    writer = MetricsWriter(
        cfg.train.run_dir,
        enabled=chief,
        tensorboard=cfg.train.tensorboard,
        progress=cfg.train.progress,
        total_steps=cfg.train.steps,
        start_step=start,
        log_every=cfg.train.log_every,
    )
    peak = _peak_flops(cfg)
    last, saved = start, None
    saved_box = [None]

    def checkpoint(info: StepInfo) -> None:
        if not info.last:  # the last step's checkpoint is train()'s, after the loop
            resume.save(ckpt, store, executor, info.step, ctx.engine, ctx.placement)
            saved_box[0] = info.step

    def evaluate(info: StepInfo) -> dict:
        return evaluator.run(info.step, ctx.policy_params(store.latest("actor")[1]))

    built_in = []
    if evaluator is not None and cfg.eval.every > 0:  # eval.every steps and after the last (runtime/evaluation.due)
        built_in.append(Hook(evaluate, every=cfg.eval.every, metrics=True, at_end=True, name="evaluation"))
    if cfg.train.checkpoint_every:
        built_in.append(Hook(checkpoint, every=cfg.train.checkpoint_every, name="checkpoint"))
    if on_step is not None:  # the older callback: after the record, with the checkpoint committed

        def call_on_step(info: StepInfo) -> None:
            ckpt.wait()
            on_step(info.step, info.metrics)

        built_in.append(Hook(call_on_step, name="on_step"))
    all_hooks = built_in + list(hooks)
    _COMPILES.register()
    _COMPILES.step = None
    try:
        if evaluator is not None and cfg.eval.before_train and start == 0:
            writer.write(0, evaluator.run(0, ctx.policy_params(store.latest("actor")[1])))
        for t in range(start, cfg.train.steps):
            if stop.agreed():
                break
            _COMPILES.step = t + 1 if t > start else None  # the first step compiles everything: not reported
            executor.run_slot(t)
            metrics = _step_metrics(cfg, ctx, executor, store, plan, t, peak)
            info = StepInfo(t + 1, cfg.train.steps, metrics, chief, cfg.train.run_dir, lambda n: store.latest(n)[1])
            run_hooks(all_hooks, info, metrics=True)  # evaluation's metrics join the step's record
            writer.write(t + 1, metrics, last=t + 1 == cfg.train.steps)
            last = t + 1
            if metrics.get("actor/nan_stop", 0) or metrics.get("critic/nan_stop", 0):
                raise TrainingStopped(f"step {t + 1}: non-finite loss or gradient and rl.on_nan=stop")
            run_hooks([h for h in all_hooks if h.name == "checkpoint"], info, metrics=False)
            saved = saved_box[0]
            executor.forget_before(t)
            host_memory.release_if_tight()  # CPU: kept freed memory back when the host is short of it
            ckpt.poll()  # "checkpoint of step N written" once an earlier save has committed
            run_hooks([h for h in all_hooks if h.name != "checkpoint"], info, metrics=False)
    finally:
        _COMPILES.step = None
        writer.close()
    return last, saved


# ---- recompiles --------------------------------------------------------------------------------
class _CompileLog:
    """One log line for each program XLA compiles after a run's first step (a new prompt or response
    length, a new page-table width, evaluation's first call): what and how long. A listener on JAX's
    own compile-time event (jax.monitoring), registered once per process; quiet outside the loop."""

    MIN_S = 0.5  # shorter compiles (small host-side helpers) are not worth a line
    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.step: int | None = None
        self._registered = False

    def register(self) -> None:
        if not self._registered:
            jax.monitoring.register_event_duration_secs_listener(self)
            self._registered = True

    def __call__(self, event: str, duration: float, **kw) -> None:
        if event == self.EVENT and self.step is not None and duration >= self.MIN_S:
            log.info(
                "step %d: compiled %s in %.1f s (a shape not seen before)", self.step, kw.get("fun_name", "?"), duration
            )


_COMPILES = _CompileLog()


# ---- stopping ----------------------------------------------------------------------------------
class StopSignals:
    """SIGINT and SIGTERM -> a request to stop at the next step boundary (installed only in the main
    thread; a second SIGINT raises KeyboardInterrupt at once). `agreed()` is the request as every
    process sees it: with several processes the flag is all-gathered, so all stop after the same step."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        for handler in self._previous.values():  # the launcher's (cli/train.py): a start-up signal it could
            for signum in getattr(handler, "pending", ()):  # not stop with (swallowed): stop before step 1
                self.signal_name = signal.Signals(signum).name
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            if hasattr(handler, "trained"):  # the launcher's handler: training is over, all committed
                handler.trained = True
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        if jax.process_index() == 0:
            log.warning(
                "%s: stopping after the step in flight (Ctrl-C again stops at once, without a checkpoint)",
                self.signal_name,
            )

    def agreed(self) -> bool:
        requested = self.signal_name is not None
        if jax.process_count() > 1:  # every process learns which signal stopped the job, and where
            mine = signal.Signals[self.signal_name].value if requested else 0
            codes = np.asarray(multihost_utils.process_allgather(np.int32(mine))).reshape(-1)
            hit = np.flatnonzero(codes)
            requested = hit.size > 0
            if requested and hit[0] != jax.process_index():
                self.signal_name = f"{signal.Signals(int(codes[hit[0]])).name} (on process {int(hit[0])})"
        return requested


# ---- metrics -----------------------------------------------------------------------------------
def _peak_flops(cfg: RunConfig) -> float | None:
    """The run's peak FLOP/s for perf/mfu: the hardware profile of costmodel.hardware (auto: the
    devices' own) at the model's compute dtype, times the devices (once for a shared CPU host)."""
    try:
        hw, n, _ = cost_devices.resolve(cfg, jax.device_count(), None, jax.process_count())
    except (OSError, ValueError) as e:
        log.warning("perf/mfu is not logged: no hardware profile (%s)", e)
        return None
    if hw.kind == "cpu" and not hw.calibrated:  # a placeholder peak: "MFU" 1.3-1.5 was logged (issue 34)
        log.info(
            "perf/mfu is not logged: the %s profile is not calibrated on this machine (its peak is a placeholder); "
            "`rpeg calibrate` and costmodel.calibration=cached give one",
            hw.name,
        )
        return None
    return hw.peak(cfg.model.dtype) * (1 if hw.shared_host else n)


def _step_metrics(cfg, ctx: RuntimeContext, ex: Executor, store: Store, plan: Plan, t: int, peak: float | None) -> dict:
    m = {k: v for k, v in jax.device_get(ex.metrics.pop(t, {})).items()}
    stats = rollout_stats.token_stats(store.get_data("completions", t))
    rollout_stats.assert_staleness(stats, t, ex.staleness)
    step_s = m.get("timing_s/step", float("nan"))
    m["perf/tokens_per_s"] = stats["seq"] / step_s
    flops = rollout_stats.step_flops(
        cfg, stats, ex.staleness
    )  # useful work only: a rewrite that saves a pass saves time
    m["perf/flops"] = flops
    m["perf/tflops_per_device"] = flops / step_s / jax.device_count() / 1e12
    if peak:
        m["perf/mfu"] = flops / step_s / peak
    m.update(prediction_metrics(plan.predicted, ex.stage_seconds.pop(t, {})))
    m["actor/version"] = float(store.latest("actor")[0])
    for reason, count in ctx.data_skipped.items():  # bad JSONL lines skipped at start-up
        m[f"data/skipped_{reason}"] = float(count)
    out = {k: (float(np.asarray(v)) if np.ndim(v) == 0 else v) for k, v in m.items()}
    # split placement across processes: generation's metrics are the generating processes', training's the others'
    return split_run.merged_metrics(ctx.placement, out) if ctx.placement.split else out


# ---- outputs -----------------------------------------------------------------------------------
def _write_run_files(cfg: RunConfig, plan: Plan, graph: Graph) -> None:
    """The config and plan that run (the plan's structure already in the config), and the graph."""
    d = cfg.train.run_dir
    write_atomic(os.path.join(d, "config.yaml"), dump_yaml(cfg))
    plan.save(os.path.join(d, "plan.json"))
    write_atomic(os.path.join(d, "graph.txt"), graph.describe() + "\n")


def _write_trace(cfg: RunConfig, tracer: Tracer, plan: Plan, last: int) -> None:
    d = cfg.train.run_dir
    tracer.write_chrome(os.path.join(d, "trace.json"))
    if last > 0:
        steps = sorted({s.step for s in tracer.spans})
        show = steps[-1] if steps else last - 1
        tracer.plot_step(show, os.path.join(d, "timeline.png"), plan.predicted.get("stage_s"))
