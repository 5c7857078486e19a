"""Per-step stage timeline: a Chrome/Perfetto trace (trace.json) and a PNG plot.

Spans are recorded by the runtime as (stage name, device group, start, end, step); the trace
puts each device group on its own row ("tid") so overlapping stages on disjoint groups are
visible. Open trace.json in https://ui.perfetto.dev or chrome://tracing.

Called by: runtime/trainer.py.
"""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import dataclass

from rpeg_jax.config.files import write_atomic


@dataclass(frozen=True)
class Span:
    name: str
    group: str
    start: float
    end: float
    step: int


class Tracer:
    def __init__(self):
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def add(self, name: str, group: str, start: float, end: float, step: int) -> None:
        with self._lock:
            self.spans.append(Span(name, group, start - self._t0, end - self._t0, step))

    def step_spans(self, step: int) -> list[Span]:
        return [s for s in self.spans if s.step == step]

    def write_chrome(self, path: str) -> None:
        groups = sorted({s.group for s in self.spans})
        events = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": g}} for i, g in enumerate(groups)
        ]
        for s in self.spans:
            events.append(
                {
                    "name": s.name,
                    "ph": "X",
                    "pid": 0,
                    "tid": groups.index(s.group),
                    "ts": s.start * 1e6,
                    "dur": max(0.0, s.end - s.start) * 1e6,
                    "args": {"step": s.step},
                }
            )
        write_atomic(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))

    def plot_step(self, step: int, path: str, predicted: dict[str, float] | None = None) -> None:
        """A PNG timeline of one step (one row per device group), with predicted durations."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        spans = self.step_spans(step)
        if not spans:
            return
        t0 = min(s.start for s in spans)
        groups = sorted({s.group for s in spans})
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(groups)))
        colors = plt.get_cmap("tab10")
        names = sorted({s.name for s in spans})
        for s in spans:
            row = groups.index(s.group)
            ax.barh(
                row,
                s.end - s.start,
                left=s.start - t0,
                color=colors(names.index(s.name) % 10),
                edgecolor="black",
                linewidth=0.5,
            )
            ax.text(s.start - t0, row, f" {s.name}", va="center", fontsize=7)
        ax.set_yticks(range(len(groups)), groups)
        ax.set_xlabel("seconds")
        title = f"step {step}"
        if predicted:
            title += " | predicted: " + ", ".join(f"{k} {v:.3g}s" for k, v in predicted.items())
        ax.set_title(title, fontsize=8)
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        plt.close(fig)
        write_atomic(path, png.getvalue())
