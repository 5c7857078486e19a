"""Step time by simulating the compiled schedule of an RPEG over device groups, vectorised.

The graph (after passes and placement) is unrolled over several RL steps into tasks
(step, stage, piece). A task starts when its dependencies are done and its device group is
free, and groups run their tasks in one fixed order: by step, then by piece wave (piece i of a
streamed chain before piece i+1), then topologically. That order is the one the runtime issues
stages in, and because it is fixed the simulation is a max-plus recursion that runs on numpy
arrays of thousands of candidate plans at once:

    finish(task) = max(finish(deps), finish(previous task on its group)) + duration(task)

Stages on disjoint groups overlap; colocated stages serialise. Bounded asynchrony (generate at t
reading weights of t-k) turns the unrolled steps into a pipeline whose steady-state period,
measured over the last steps, is set by the slowest group. On a shared-host profile all groups
are one resource (the CPU devices share the host's cores). Host stages (reward verifiers) run on
a resource of their own.

Callers: costmodel/planner.py, tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rpeg_jax.graph.ir import Graph, Op


@dataclass(frozen=True)
class Task:
    step: int
    stage: str
    piece: int
    group: str
    deps: tuple[int, ...]  # indices of earlier tasks


@dataclass
class Program:
    """A graph unrolled over `steps` RL steps into an ordered task list."""

    tasks: list[Task]
    steps: int
    window: int  # steps averaged for the steady-state period
    last_of_step: list[int] = field(default_factory=list)  # index of each step's last-finishing task set
    step_tasks: list[list[int]] = field(default_factory=list)
    # Groups sharing devices with a group (nested sub-meshes: "all" and its disjoint parts): a task
    # waits until every group it shares devices with is free. Absent: a group shares with itself only.
    shares: dict[str, tuple[str, ...]] = field(default_factory=dict)


def unroll(
    g: Graph, shared_resource: bool = False, steps: int | None = None, nested: dict[str, tuple[str, ...]] | None = None
) -> Program:
    """Tasks of `steps` consecutive RL steps in issue order (see the module docstring). `nested`:
    {group: its disjoint sub-groups} (a sub-group's task and the group's serialise; sub-groups
    of one group overlap)."""
    k = g.staleness
    steps = steps or 4 * (k + 1) + 2
    order = g.topo_order()
    topo = {n: i for i, n in enumerate(order)}
    pieces = {n: g.stage(n).pieces for n in order}
    m = max(pieces.values())
    deps = {n: g.deps(n) for n in order}
    # Host stages (reward verifiers) run in Python beside the devices, not on them.
    host = {
        n: all(p.workload is not None and p.workload.op == Op.HOST for p in (g.stage(n).parts or (g.stage(n),)))
        for n in order
    }
    keyed = []
    for s in range(steps):
        for n in order:
            for j in range(pieces[n]):
                wave = j if pieces[n] > 1 else m - 1
                keyed.append(((s, wave, topo[n], j), s, n, j))
    keyed.sort(key=lambda x: x[0])
    index = {(s, n, j): i for i, (_, s, n, j) in enumerate(keyed)}
    tasks = []
    for _, s, n, j in keyed:
        dl = []
        for d in deps[n]:
            ds = s + d.step_offset
            if ds < 0 or d.stage == n and d.step_offset == 0:
                continue
            if d.streamed and d.step_offset == 0 and pieces[d.stage] == pieces[n]:
                dl.append(index[(ds, d.stage, j)])
            else:
                dl.append(index[(ds, d.stage, pieces[d.stage] - 1)])
        group = "host" if host[n] else ("all" if shared_resource else g.stage(n).placement)
        tasks.append(Task(s, n, j, group, tuple(sorted(set(dl)))))
    step_tasks = [[i for i, t in enumerate(tasks) if t.step == s] for s in range(steps)]
    shares: dict[str, tuple[str, ...]] = {}
    for parent, subs in (nested or {}).items():
        if shared_resource:
            break
        shares[parent] = (parent, *subs)
        for sub in subs:
            shares[sub] = tuple(dict.fromkeys((*shares.get(sub, (sub,)), parent)))
    return Program(tasks, steps, window=min(2 * (k + 1), steps - 1), step_tasks=step_tasks, shares=shares)


def simulate(
    prog: Program,
    durations: dict[str, np.ndarray],
    piece_durations: dict[str, list] | None = None,
    record: bool = False,
):
    """Run the program. `durations[stage]`: seconds of the whole stage per candidate (split evenly
    over its pieces unless `piece_durations[stage][j]` is given). Returns (period, latency,
    starts, ends): steady-state seconds per step, makespan of the first step, and per-task arrays
    (only when `record`)."""
    piece_durations = piece_durations or {}
    n_pieces: dict[str, int] = {}
    for t in prog.tasks:
        n_pieces[t.stage] = max(n_pieces.get(t.stage, 0), t.piece + 1)
    shape = np.broadcast(*[np.asarray(v) for v in durations.values()]).shape
    zero = np.zeros(shape)
    free: dict[str, np.ndarray] = {}
    ends: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    for t in prog.tasks:
        ready = free.get(t.group, zero)
        for other in prog.shares.get(t.group, ()):
            ready = np.maximum(ready, free.get(other, zero))
        for d in t.deps:
            ready = np.maximum(ready, ends[d])
        pd = piece_durations.get(t.stage)
        dur = pd[t.piece] if pd is not None else np.asarray(durations[t.stage]) / n_pieces[t.stage]
        end = ready + dur
        free[t.group] = end
        ends.append(end)
        if record:
            starts.append(ready)
    finish = [np.max(np.stack([ends[i] for i in idx]), axis=0) for idx in prog.step_tasks]
    w = prog.window
    with np.errstate(invalid="ignore"):  # a candidate with an infinite stage (does not fit) is infinite
        period = np.where(np.isfinite(finish[-1]), (finish[-1] - finish[-1 - w]) / w, np.inf)
    first = prog.step_tasks[0]
    latency = finish[0] - np.min(np.stack([starts[i] for i in first]), axis=0) if record else finish[0]
    return period, latency, (starts if record else None), (ends if record else None)


def stage_spans(prog: Program, starts, ends, step: int | None = None) -> dict[str, tuple[float, float]]:
    """(first start, last end) of each stage in one unrolled step (a middle one by default),
    relative to that step's first start; scalar candidates only (for explanations and traces)."""
    step = prog.steps - prog.window - 1 if step is None else step
    idx = prog.step_tasks[step]
    t0 = min(float(np.asarray(starts[i]).ravel()[0]) for i in idx)
    spans: dict[str, tuple[float, float]] = {}
    for i in idx:
        t = prog.tasks[i]
        s, e = float(np.asarray(starts[i]).ravel()[0]) - t0, float(np.asarray(ends[i]).ravel()[0]) - t0
        a, b = spans.get(t.stage, (s, e))
        spans[t.stage] = (min(a, s), max(b, e))
    return spans
