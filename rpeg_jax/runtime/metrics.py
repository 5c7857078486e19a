"""Metrics sinks for the step loop: JSONL (always), TensorBoard (optional), a progress bar on a
terminal or, when stdout is not one (SLURM, nohup, a pipe), one plain log line per shown step and
one for the held-out metrics.

Only process 0 writes (`enabled=False` elsewhere). Each record is one step: the step number,
verl-compatible names (`timing_s/gen`, `actor/pg_loss`, `perf/mfu`, ...) and our own
(`predicted_s/<stage>`). Values are plain floats/ints; non-finite values are kept (as JSON
null) so a NaN is visible rather than dropped. metrics.jsonl gets every step; TensorBoard and
the progress bar every `log_every` steps (and the last). A resumed run first drops the records
after the step it resumes from (`drop_after`), so every step appears once.

Called by: runtime/trainer.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from rpeg_jax.config.files import open_append, write_atomic

log = logging.getLogger("rpeg_jax")


def _plain(v: Any):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    if isinstance(v, (bool, int)) and not isinstance(v, float):
        return int(v)
    return f if math.isfinite(f) else None


class MetricsWriter:
    def __init__(
        self,
        run_dir: str,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        progress: bool = True,
        total_steps: int = 0,
        start_step: int = 0,
        log_every: int = 1,
    ):
        self.enabled, self.log_every = enabled, log_every
        self._unshown: dict[str, Any] | None = None  # the newest record not yet on TensorBoard / the bar
        self._jsonl = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        drop_after(path, start_step)
        self._jsonl = open_append(path)  # never through a link planted at that name
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if progress and total_steps > start_step:
            # a terminal gets the live bar; a file (SLURM, nohup, a pipe) one plain line per shown step
            self._bar = _Progress(total_steps, start_step) if _is_terminal() else _Lines(total_steps, start_step)

    def write(self, step: int, metrics: dict[str, Any], last: bool = False) -> None:
        """Record step `step`: always to metrics.jsonl; to TensorBoard and the bar when `step` is a
        multiple of log_every or `last` (a run that stops early gets its last step there on close)."""
        if not self.enabled:
            return
        # '+' joins fused stage names; TensorBoard tags do not allow it, so keys use '_' throughout
        record = {"step": step, **{k.replace("+", "_"): _plain(v) for k, v in sorted(metrics.items())}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._unshown = record
        if step % self.log_every == 0 or last or any(k.startswith("val-") for k in record):
            self._show(record)  # a step with held-out metrics is always shown

    def _show(self, record: dict[str, Any]) -> None:
        self._unshown = None
        step = record["step"]
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            self._bar.update(step, record)

    def close(self) -> None:
        if self._unshown is not None:
            self._show(self._unshown)
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._bar:
            self._bar.close()


def drop_after(path: str, step: int) -> None:
    """Keep only the records of steps <= `step` in the metrics.jsonl at `path` (none for a run
    starting at 0): a run that resumes from checkpoint `step` computes the later ones again, so
    the file holds each step once. A half-written last line (a killed process) goes too."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if step > 0 and isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) != len(lines):
        dropped = len(lines) - len(keep)
        log.info("metrics.jsonl: %d records after step %d dropped (this run computes them again)", dropped, step)
        write_atomic(path, "".join(keep))


def _is_terminal() -> bool:
    import sys

    return bool(getattr(sys.stdout, "isatty", lambda: False)())


# (metric, label, format) shown per logged step: what a cluster user reads first
LINE_FIELDS = (
    ("reward/mean", "reward", "{:.4g}"),
    ("actor/pg_loss", "pg_loss", "{:.4g}"),
    ("actor/kl", "kl", "{:.3g}"),
    ("critic/vf_loss", "vf_loss", "{:.4g}"),
    ("actor/grad_norm", "grad_norm", "{:.3g}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("timing_s/step", "s/step", "{:.2f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
)


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Lines:
    """Without a terminal: one plain log line per shown step (step, reward, key losses, s/step,
    tokens/s, ETA from the mean step time since the start), and one for the held-out metrics when
    a step has them."""

    def __init__(self, total: int, start: int):
        import time

        self.total, self._clock = total, time.monotonic
        self._first: tuple[int, float] | None = None  # (step, time) of the first line: the ETA runs
        #   from there, so the first step's compiles do not inflate it

    def update(self, step: int, record: dict) -> None:
        parts = [f"step {step}/{self.total}"]
        parts += [f"{label} {fmt.format(record[k])}" for k, label, fmt in LINE_FIELDS if _number(record.get(k))]
        now = self._clock()
        if self._first is None:
            self._first = (step, now)
        elif step < self.total and step > self._first[0]:
            per_step = (now - self._first[1]) / (step - self._first[0])
            parts.append(f"eta {_duration(per_step * (self.total - step))}")
        log.info("%s", " | ".join(parts))
        val = {k: v for k, v in record.items() if k.startswith("val-") and _number(v)}
        if val:
            log.info("step %d held-out: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(val.items())))

    def close(self) -> None:
        pass


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Progress:
    """A rich progress bar with ETA and the latest reward/step time."""

    def __init__(self, total: int, start: int):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._p = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        self._task = self._p.add_task("train", total=total, completed=start, info="")
        self._p.start()

    def update(self, step: int, record: dict) -> None:
        info = " ".join(
            f"{label}={record[k]:.3g}"
            for k, label in (("reward/mean", "reward"), ("timing_s/step", "s/step"))
            if isinstance(record.get(k), float)
        )
        self._p.update(self._task, completed=step, info=info)

    def close(self) -> None:
        self._p.stop()


def prediction_metrics(predicted: dict[str, Any], measured_s: dict[str, float]) -> dict[str, float]:
    """The cost model's prediction next to what was measured, per (graph) stage and for the step:
    `predicted_s/<stage>` and `pred_error/<stage>` = (predicted - measured) / measured. Empty for a
    plan without a prediction (manual plans); the step is compared with the steady-state step time."""
    pred = dict(predicted.get("stage_s", {}))
    if pred and "step" in measured_s and "step_time_s" in predicted:
        pred["step"] = float(predicted["step_time_s"])
    out = {}
    for name, p in pred.items():
        out[f"predicted_s/{name}"] = p
        m = measured_s.get(name)
        if m is not None and m > 0:
            out[f"pred_error/{name}"] = (p - m) / m
    return out


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics.jsonl (later records for a step replace earlier ones)."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]
