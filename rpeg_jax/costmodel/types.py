"""The planner's values: the planning problem (Context), one priced plan (Prediction), a search's
result (SearchResult) and what a profile's seconds are (clock_of).

Shared by the planner (costmodel/planner.py, which builds them), the report (costmodel/report.py,
which renders them) and pricing (costmodel/pricing.py); none of those import each other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rpeg_jax.config.run import RunConfig
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.hardware import HardwareProfile
from rpeg_jax.graph.ir import Graph
from rpeg_jax.graph.plan import Plan


@dataclass
class Context:
    """Everything fixed for one planning problem."""

    cfg: RunConfig
    hw: HardwareProfile
    N: int
    st: S.Setting
    base: Graph  # synchronous unfused graph of the config
    processes: int = 1  # JAX processes the N devices belong to (N / processes each, in order)


@dataclass
class Prediction:
    """One fully specified plan and what the model predicts for it."""

    label: str
    step_time_s: float  # steady-state seconds per RL step
    latency_s: float  # makespan of one step from a cold start
    memory_per_gpu_gb: float  # predicted peak
    # FLOPs of the fixed reference work (planner.reference_graph: the config's algorithm synchronous
    # and unfused, every forward verl runs) / (step time × devices × peak): the same numerator for
    # every plan, so a plan that removes passes is credited for the time it saves
    utilization: float
    stage_times_s: dict[str, float]  # duration of each graph stage
    spans: dict[str, tuple[float, float]]  # (start, end) of each stage within a steady step
    knobs: dict[str, Any]
    layout: dict[str, Any]  # groups, meshes and settings of the row
    plan: Plan | None = None
    utilization_own_work: float = 0.0  # the FLOPs of this plan's own graph / (step time × devices × peak)

    def summary(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "latency_s": self.latency_s,
            "memory_per_gpu_gb": self.memory_per_gpu_gb,
            "utilization": self.utilization,
            "utilization_own_work": self.utilization_own_work,
            "stage_times_s": self.stage_times_s,
            "knobs": self.knobs,
            "layout": self.layout,
        }


@dataclass
class SearchResult:
    chosen: Prediction
    runners_up: list[Prediction]
    baselines: dict[str, Prediction]
    search_seconds: float
    evaluations: int  # complete plans scored: table rows + (row × structural option) simulations
    plans_considered: int  # every (layouts × micro-batch × remat) combination priced, before pruning
    hardware: str
    num_devices: int
    processes: int = 1
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # printed first by rpeg plan (e.g. fp32 on a GPU)
    # The chosen plan's layout priced synchronously (k = 0, rollout.admission=step, its other knobs
    # kept): {"sync_step_s", "asynchrony" (= sync_step_s / chosen), "rest" (= verl-like / sync_step_s)};
    # speedup over the verl-like plan = asynchrony x rest. None when the chosen plan is synchronous
    # or no verl-like plan fits (then "rest" is None).
    asynchrony: dict[str, Any] | None = None
    # The best plan at the synchronous algorithm (k = 0, separate models; the chosen one when it is
    # such a plan), and the gain over verl-like split by kind (planner.gains_of): {"systems",
    # "algorithmic", "total", "equal_algorithm_step_s", "algorithmic_searched", "algorithmic_knobs"}.
    equal_algorithm: Prediction | None = None
    gains: dict[str, Any] = field(default_factory=dict)


def clock_of(hw: HardwareProfile) -> str:
    """What the profile's seconds are: "cpu" (process CPU seconds, calibrated with --clock cpu on a
    shared machine) or "wall"."""
    return "cpu" if hw.calibrated.get("clock_cpu") else "wall"
