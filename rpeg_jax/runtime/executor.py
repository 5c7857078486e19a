"""Runs a compiled RPEG step after step: versioned state, per-step data, device-group threads.

A task is (stage, step, piece). Dependencies come from the graph (`Graph.deps`): a data input
waits for its producer in the same step (piece i only for piece i when the edge is streamed);
a state read at offset o waits for the writer of version t+o. Under bounded asynchrony
(`generate` reads rollout_weights at t-k, k = the graph's staleness) generation runs k steps
*ahead*: slot t runs generate(t+k) next to the training stages of step t. Each device group runs its tasks of a
slot in one thread, in an order that respects dependencies, and the groups' threads run
concurrently: with disjoint groups (split placement) generation of the next batch overlaps the
update of this one; with nested groups (graph.plan.widen_generation) the overlapping stages share
the inner group's devices, and at k = 0 the data dependencies order them one after the other.

Bookkeeping is exact: every task records the versions of the state it read and the steps and
pieces of the data it consumed (`Executor.consumed`), and state reads check the version they
get against the one the graph says (a mismatch is a bug, raised at once).

Called by: runtime/trainer.py.
"""

from __future__ import annotations

import resource
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from rpeg_jax.graph.compile import CompiledStage, Program
from rpeg_jax.graph.ir import TIMING_NAMES, DataNode, StageKind, StateNode


class ExecutionError(RuntimeError):
    pass


def tree_concat(pieces: list) -> Any:
    return jax.tree.map(
        lambda *xs: np.concatenate(xs) if isinstance(xs[0], np.ndarray) else jax.numpy.concatenate(xs), *pieces
    )


def tree_piece(value: Any, i: int, n: int) -> Any:
    def take(x):
        b = x.shape[0]
        if b % n:
            raise ExecutionError(f"cannot split a batch of {b} into {n} pieces")
        return x[i * b // n : (i + 1) * b // n]

    return jax.tree.map(take, value)


@dataclass
class Store:
    """Data of each step (whole, or as pieces) and versioned state."""

    data: dict[tuple[str, int], dict[int, Any]] = field(default_factory=lambda: defaultdict(dict))
    pieces: dict[tuple[str, int], int] = field(default_factory=dict)
    state: dict[str, dict[int, Any]] = field(default_factory=lambda: defaultdict(dict))
    frozen: dict[str, Any] = field(default_factory=dict)
    keep_versions: int = 3

    def put_data(self, node: str, step: int, value: Any, piece: int = 0, pieces: int = 1) -> None:
        self.data[(node, step)][piece] = value
        self.pieces[(node, step)] = pieces

    def get_data(self, node: str, step: int, piece: int | None = None, n: int = 1) -> Any:
        have = self.data.get((node, step))
        total = self.pieces.get((node, step))
        if not have or total is None or len(have) < (1 if piece is not None and total == n else total):
            raise ExecutionError(f"data {node!r} of step {step} is not ready")
        if piece is not None and total == n:
            return have[piece]
        whole = have[0] if total == 1 else tree_concat([have[i] for i in range(total)])
        return whole if piece is None or n == 1 else tree_piece(whole, piece, n)

    def drop_step(self, step: int) -> None:
        for key in [k for k in self.data if k[1] <= step]:
            del self.data[key]
            self.pieces.pop(key, None)

    def put_state(self, node: str, version: int, value: Any) -> None:
        versions = self.state[node]
        versions[version] = value
        for v in [v for v in versions if v < version - self.keep_versions]:
            del versions[v]

    def get_state(self, node: str, version: int) -> Any:
        if node in self.frozen:
            return self.frozen[node]
        versions = self.state.get(node, {})
        if version in versions:
            return versions[version]
        raise ExecutionError(f"state {node!r} version {version} is not available (have {sorted(versions)})")

    def latest(self, node: str) -> tuple[int, Any]:
        if node in self.frozen:
            return 0, self.frozen[node]
        v = max(self.state[node])
        return v, self.state[node][v]


@dataclass
class Roles:
    """Which stages this process runs when a split placement puts generation and training on
    disjoint sets of processes (runtime/split.py; None otherwise): the stages of its `local` groups,
    and the weight sync, which every process joins (a collective from the training group's devices
    to the generation group's); another group's stage is skipped here, its state outputs carried
    forward unchanged (this process holds none of their data). `handoff(step)`: step `step`'s rollout
    data from the generation group to the training group, a collective every process calls."""

    local: frozenset
    gen_group: str
    handoff: Any  # (step) -> None


@dataclass
class Task:
    stage: CompiledStage
    step: int
    piece: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.stage.name, self.step, self.piece)


class Executor:
    def __init__(self, program: Program, store: Store, *, tracer=None, sync: bool = True, roles: Roles | None = None):
        self.program, self.store, self.tracer, self.sync, self.roles = program, store, tracer, sync, roles
        g = program.graph
        self.graph = g
        self.order = {cs.name: i for i, cs in enumerate(program.stages)}
        self.ahead = {cs.name: self._ahead(cs) for cs in program.stages}  # steps a stage runs ahead
        self.staleness = g.staleness
        self.generation_ahead = max(self.ahead.values(), default=0)
        if self.generation_ahead != g.generation_ahead or self.generation_ahead > self.staleness:
            raise ExecutionError(
                f"stages run {self.generation_ahead} steps ahead; the graph's generation runs "
                f"{g.generation_ahead} ahead under staleness k={self.staleness}"
            )
        self.done: set[tuple[str, int, int]] = set()
        self.events: dict[tuple[str, int, int], threading.Event] = defaultdict(threading.Event)
        self.metrics: dict[int, dict[str, float]] = defaultdict(dict)
        self.stage_seconds: dict[int, dict[str, float]] = defaultdict(dict)  # by graph stage name
        self.consumed: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.next_ahead_step: dict[str, int] = {n: 0 for n, k in self.ahead.items() if k > 0}
        self._errors: list[BaseException] = []
        self.start = 0  # steps before this were run by an earlier process (restored from a checkpoint)
        self._slot = 0  # the slot run_slot runs

    def _ahead(self, cs: CompiledStage) -> int:
        """How many steps ahead a stage may run: k for generation reading weights at t-k."""
        offs = [
            p.offset
            for p in cs.reads
            if p.state and not isinstance(self.graph.nodes[p.node], DataNode) and not self.graph.nodes[p.node].frozen
        ]
        return max(0, -min(offs)) if offs else 0

    # ---- one slot ---------------------------------------------------------------------
    def run_slot(self, t: int) -> dict[int, dict[str, float]]:
        """Run the tasks of slot t: stages running k ahead for steps up to t+k, the rest for step t."""
        tasks = []
        for cs in self.program.stages:
            k = self.ahead[cs.name]
            steps = [t] if k == 0 else list(range(max(self.next_ahead_step[cs.name], t), t + k + 1))
            if k:
                self.next_ahead_step[cs.name] = t + k + 1
            for s in steps:
                tasks += [Task(cs, s, i) for i in range(cs.pieces)]
        by_group: dict[str, list[Task]] = defaultdict(list)
        for task in tasks:
            by_group[task.stage.plan.group].append(task)
        t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        self._slot = t
        if self.roles is not None:
            self._run_split(t, tasks)
        elif len(by_group) == 1:
            self._run_group(next(iter(by_group)), self._sorted(next(iter(by_group.values()))), threaded=False)
        else:
            # each group's tasks of this slot's step before those that run ahead: the other groups wait
            # for the former (generation's reward of step t before generate(t+1), which overlaps the update)
            threads = [
                threading.Thread(
                    target=self._run_group,
                    args=(
                        gname,
                        self._sorted([x for x in ts if x.step <= t]) + self._sorted([x for x in ts if x.step > t]),
                        True,
                    ),
                    name=f"rpeg-{gname}",
                    daemon=True,
                )
                for gname, ts in by_group.items()
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if self._errors:
                raise self._errors[0]
        self.metrics[t]["timing_s/step"] = self.stage_seconds[t]["step"] = time.perf_counter() - t0
        ru = resource.getrusage(resource.RUSAGE_SELF)
        # The process's kernel time and page faults over the slot (every thread): on a CPU host a step
        # that faults in fresh memory spends seconds here (bench/NOTES.md, session 27 and 32).
        self.metrics[t]["perf/host_sys_s"] = ru.ru_stime - ru0.ru_stime
        self.metrics[t]["perf/host_page_faults"] = float(ru.ru_minflt - ru0.ru_minflt)
        return self.metrics

    def _run_split(self, t: int, tasks: list[Task]) -> None:
        """A slot of a split placement across processes, in one thread and in one order on every
        process, so that the two collectives meet: the generation group's tasks of steps <= t,
        handoff(t), the training group's tasks (but the weight sync), the generation group's tasks
        that run ahead (step admission at k >= 1, or continuous admission decoding ahead,
        rollout.decode_ahead: on the generating processes they overlap the training processes'
        update), then the weight sync. The order is fixed, so what runs is a function of the steps alone."""
        roles = self.roles
        gen = lambda x: x.stage.plan.group == roles.gen_group  # noqa: E731
        sync = lambda x: x.stage.stage.kind == StageKind.WEIGHT_SYNC  # noqa: E731
        order = (
            self._sorted([x for x in tasks if gen(x) and x.step <= t])
            + [None]
            + self._sorted([x for x in tasks if not gen(x) and not sync(x)])
            + self._sorted([x for x in tasks if gen(x) and x.step > t])
            + self._sorted([x for x in tasks if sync(x) and not gen(x)])
        )
        for task in order:
            if task is None:
                roles.handoff(t)
            elif task.stage.plan.group in roles.local or sync(task):
                self._run_task(task, threaded=False)
            else:
                self._skip_task(task)

    def _skip_task(self, task: Task) -> None:
        """Another processes' stage (Roles): its state outputs are this process's latest, carried
        forward (placeholders: the arrays hold no data here); its data outputs are not made here."""
        for port in task.stage.writes:
            if port.state:
                self.store.put_state(port.node, task.step + 1, self.store.latest(port.node)[1])
        self.done.add(task.key)
        self.events[task.key].set()

    def _sorted(self, tasks: list[Task]) -> list[Task]:
        """Earlier steps first, then pieces in order (streaming), single-piece stages after the
        pieces they wait for, then topological order."""

        def key(task: Task):
            cs = task.stage
            if cs.pieces > 1:
                piece = task.piece
            else:  # after every piece of anything it may wait for within the step
                piece = most if any(d.step_offset == 0 for d in self.graph.deps(cs.name)) else 0
            return (task.step - self.ahead[cs.name], piece, self.order[cs.name])

        most = max(cs.pieces for cs in self.program.stages)
        return sorted(tasks, key=key)

    def _run_group(self, group: str, tasks: list[Task], threaded: bool) -> None:
        try:
            for task in tasks:
                self._run_task(task, threaded)
        except BaseException as e:  # surfaced by run_slot
            self._errors.append(e)
            for ev in list(self.events.values()):
                ev.set()
            if not threaded:
                raise

    # ---- one task ---------------------------------------------------------------------
    def _wait(self, stage: str, step: int, piece: int | None, threaded: bool) -> None:
        if step < self.start:
            return
        n = self.program.stage(stage).pieces
        pieces = range(n) if piece is None else [piece]
        for i in pieces:
            key = (stage, step, i)
            if key in self.done:
                continue
            if not threaded:
                raise ExecutionError(f"{stage}[step {step}, piece {i}] has not run; the task order is wrong")
            self.events[key].wait()
            if self._errors:
                raise ExecutionError("another device group failed") from self._errors[0]

    def _inputs(self, task: Task, threaded: bool) -> tuple[dict, dict]:
        cs, t, g = task.stage, task.step, self.graph
        inputs = (
            {"_step": np.int32(t), "_piece": task.piece, "_pieces": cs.pieces}
            if not cs.kernel.jittable
            else {"_step": np.int32(t)}
        )
        record = {}
        for dep in g.deps(cs.name):
            step = t + dep.step_offset
            if step >= 0 and dep.stage != cs.name:
                same_pieces = dep.streamed and self.program.stage(dep.stage).pieces == cs.pieces
                self._wait(dep.stage, step, task.piece if same_pieces else None, threaded)
            elif step >= 0 and dep.stage == cs.name and step < t:
                self._wait(dep.stage, step, None, threaded)
        for port in cs.reads:
            node = g.nodes[port.node]
            if isinstance(node, StateNode):
                version = max(0, t + port.offset)
                inputs[port.name] = self.store.get_state(port.node, version)
                record[port.name] = version if not node.frozen else "frozen"
            else:
                streamed = port.stream and self.store.pieces.get((port.node, t)) == cs.pieces
                inputs[port.name] = self.store.get_data(port.node, t, task.piece if cs.pieces > 1 else None, cs.pieces)
                record[port.name] = (t, task.piece if (streamed or cs.pieces > 1) else "all")
        return inputs, record

    def _run_task(self, task: Task, threaded: bool) -> None:
        cs, t = task.stage, task.step
        inputs, record = self._inputs(task, threaded)
        start = time.perf_counter()
        outputs = cs(inputs)
        metrics = outputs.pop("metrics", None) if isinstance(outputs, dict) else None
        if self.sync:
            jax.block_until_ready([v for k, v in outputs.items() if not k.startswith("host_")])
        end = time.perf_counter()
        for port in cs.writes:
            if port.name not in outputs:
                raise ExecutionError(f"stage {cs.name!r} did not produce {port.name!r}")
            if port.state:
                self.store.put_state(port.node, t + 1, outputs[port.name])
            else:
                self.store.put_data(port.node, t, outputs[port.name], task.piece, cs.pieces)
        self.consumed[task.key] = record
        m = self.metrics[t]
        # A fused stage is one program: it is timed under its own name (e.g. timing_s/forwards).
        name = cs.name.replace("+", "_") if cs.stage.parts else verl_name(cs.stage.kind)
        m[f"timing_s/{name}"] = m.get(f"timing_s/{name}", 0.0) + (end - start)
        sec = self.stage_seconds[t]
        sec[cs.name] = sec.get(cs.name, 0.0) + (end - start)
        if self.graph.decode_ahead and t > self._slot and self.ahead[cs.name]:
            # continuous admission decoding ahead: generation of step t run during slot t-1's update
            here = self.metrics[self._slot]
            here["timing_s/decode_ahead"] = here.get("timing_s/decode_ahead", 0.0) + (end - start)
        if metrics:
            for k, v in metrics.items():
                m[k] = v
        if self.tracer is not None:
            self.tracer.add(cs.name, cs.plan.group, start, end, t)
        self.done.add(task.key)
        self.events[task.key].set()

    # ---- checkpoints -----------------------------------------------------------------
    def pending_metrics(self, steps) -> dict[str, dict[str, float]]:
        """Metrics already recorded for `steps` (those of stages that ran ahead), as floats."""
        return {str(s): {k: float(np.asarray(v)) for k, v in self.metrics.get(s, {}).items()} for s in steps}

    def resume_at(
        self, step: int, buffered: list[int], pending: dict[str, dict[str, float]], next_ahead_step: dict[str, int]
    ) -> None:
        """Continue from a checkpoint taken after `step` steps: the stages that run ahead have run
        already for the `buffered` steps (their outputs are back in the store)."""
        self.start = step
        for s in buffered:
            for stage, k in self.ahead.items():
                if k:
                    self.done.update((stage, s, i) for i in range(self.program.stage(stage).pieces))
            self.metrics[s].update(pending.get(str(s), {}))
        self.next_ahead_step.update({k: int(v) for k, v in next_ahead_step.items()})

    def forget_before(self, step: int) -> None:
        """Drop finished bookkeeping and data of steps < step (memory stays bounded)."""
        self.store.drop_step(step - 1)
        for key in [k for k in self.done if k[1] < step - 1]:
            self.done.discard(key)
            self.events.pop(key, None)
        for t in [t for t in self.stage_seconds if t < step - 1]:
            del self.stage_seconds[t]


def verl_name(kind: StageKind) -> str:
    return TIMING_NAMES.get(kind, kind.value)
