"""The candidate table: one row per candidate plan of a placement family, as typed numpy columns.

    tab = candidates.build(...)          # a Table
    len(tab); tab.take(idx)              # rows idx, every column alike
    side = tab.admitted(k)               # generation and training-side seconds of step admission
                                         # (k None) or continuous admission at staleness k

Columns (one value per row; seconds unless named mem_*, bytes per device):
  groups    n_gen, n_train: devices of the generation / training group (colocated: equal, the one group)
  generate  t_g (tensor degree), slots (per replica, step admission), n_rep (sequences per replica)
  train     d, f, t (data x fsdp x tensor), micro (gradient micro-batches), remat (index in REMATS)
  forward   fd, ff, ft (the scoring forwards' layout), fmicro (their micro-batches)
  experts   e, fe: the expert degree of the training / forward layout (1, or f: a mixture of
            experts' experts over the fsdp axis, the runtime's `fsdp_expert` rules)
  memory    mem_peak (pipelined), mem_peak_sync (one batch in flight), mem_resident, mem_gen,
            mem_update, mem_forward
  seconds   t_gen, gen_q (when q/8 of the batch has finished, q = 1..7: [rows, 7]), t_gen_pieces
            {m: one generate call of B/m sequences}, t_sync, t_reward, t_realloc {role},
            train = TrainSide(t_upd {actor, critic}, t_fwd {actor, critic, ref}, t_adv)
  continuous {k: Continuous(slots, mem_peak, t_gen, train)}: the engine's steady state at staleness k
            and the training side on the batches it hands over (candidates.consumed_side)
`considered` is the number of (layout, micro-batch, remat) combinations priced before memory
pruning: a count for the search's report, not a column.

Callers: costmodel/candidates.py (builds), scoring.py, baselines.py, planner.py, pricing.py,
space.divisible. No JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TrainSide:
    """Seconds of the training-side stages per row: updates and scoring forwards by role, the
    advantage computation."""

    t_upd: dict[str, np.ndarray]  # "actor" [, "critic"]
    t_fwd: dict[str, np.ndarray]  # "actor" [, "critic"] [, "ref"]
    t_adv: np.ndarray


@dataclass(frozen=True)
class Continuous:
    """Continuous admission at one staleness k: the engine's slots per replica, its peak memory
    with KV pages resident beside the training stages, its seconds per step, and the training side
    on the batches it hands over."""

    slots: np.ndarray
    mem_peak: np.ndarray
    t_gen: np.ndarray
    train: TrainSide


@dataclass(frozen=True)
class Admitted:
    """The columns one admission mode prices a step with (Table.admitted)."""

    t_gen: np.ndarray
    train: TrainSide


@dataclass(frozen=True)
class Layouts:
    """The layout columns of candidate rows: groups, generation tensor degree, the training and
    forward meshes with their micro-batches and remat (a Table's first columns)."""

    n_gen: np.ndarray
    n_train: np.ndarray
    t_g: np.ndarray
    d: np.ndarray
    f: np.ndarray
    t: np.ndarray
    fd: np.ndarray
    ff: np.ndarray
    ft: np.ndarray
    e: np.ndarray  # expert degree of the training layout (1: none; a mixture's experts over fsdp)
    fe: np.ndarray  # of the forward layout
    micro: np.ndarray
    remat: np.ndarray
    fmicro: np.ndarray


@dataclass(frozen=True, kw_only=True)
class Table(Layouts):
    considered: int
    slots: np.ndarray
    n_rep: np.ndarray
    mem_peak: np.ndarray
    mem_resident: np.ndarray
    mem_peak_sync: np.ndarray
    mem_gen: np.ndarray
    mem_update: np.ndarray
    mem_forward: np.ndarray
    t_gen: np.ndarray
    gen_q: np.ndarray
    t_sync: np.ndarray
    t_reward: np.ndarray
    t_realloc: dict[str, np.ndarray]
    train: TrainSide
    t_gen_pieces: dict[int, np.ndarray] = field(default_factory=dict)
    continuous: dict[int, Continuous] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.n_gen)

    def take(self, idx) -> Table:
        """The rows `idx` (every column indexed alike)."""
        return _map(self, lambda a: a[idx])

    def admitted(self, k: int | None) -> Admitted:
        """Generation and training-side seconds under step admission (k None) or continuous
        admission at staleness k."""
        if k is None:
            return Admitted(self.t_gen, self.train)
        c = self.continuous[k]
        return Admitted(c.t_gen, c.train)

    def layout_key(self, i: int) -> tuple[int, ...]:
        """Row i's groups and layouts (what tells two candidates apart beyond their settings)."""
        return tuple(int(getattr(self, c)[i]) for c in LAYOUT_COLUMNS)

    def replace(self, **changes) -> Table:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def concat(parts: list[Table]) -> Table:
        """One table of the rows of `parts` in order (`considered` summed)."""
        out = _zip(parts, np.concatenate)
        return dataclasses.replace(out, considered=sum(p.considered for p in parts))


LAYOUT_COLUMNS = ("n_gen", "n_train", "t_g", "d", "f", "t", "fd", "ff", "ft", "e", "fe")


def _map(x, fn):
    """`fn` applied to every column of a Table / Continuous / TrainSide / dict of columns."""
    if isinstance(x, np.ndarray):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(
            x, **{f.name: _map(getattr(x, f.name), fn) for f in dataclasses.fields(x) if f.name != "considered"}
        )
    raise TypeError(f"not a table column: {type(x).__name__}")


def _zip(xs: list, fn):
    """`fn` applied to the list of every column's values across the tables `xs` (same structure)."""
    x0 = xs[0]
    if isinstance(x0, np.ndarray):
        return fn(xs)
    if isinstance(x0, dict):
        keys = x0.keys()
        for x in xs[1:]:
            if x.keys() != keys:
                raise ValueError(f"tables of different columns: {sorted(keys)} vs {sorted(x.keys())}")
        return {k: _zip([x[k] for x in xs], fn) for k in keys}
    if dataclasses.is_dataclass(x0):
        return dataclasses.replace(
            x0,
            **{
                f.name: _zip([getattr(x, f.name) for x in xs], fn)
                for f in dataclasses.fields(x0)
                if f.name != "considered"
            },
        )
    raise TypeError(f"not a table column: {type(x0).__name__}")
