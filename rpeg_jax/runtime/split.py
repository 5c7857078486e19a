"""Split placement across processes (issue 31 item 3): generation on some processes' devices,
training on the others'. Every process runs the same step loop (multi-controller JAX); a stage runs
on the processes owning its group's devices, and the others skip it (runtime/executor.py `Roles`).
Two points are collectives of every process, in the same order on all of them:

    handoff(t)      the rollout batch of step t (completions, behav_logp, rewards) from the
                    generation group's batch layout into the training layout
    weight_sync(t)  the trained weights into the generation layout (Placement.to_rollout)

Both move arrays with the Resharder's `collective` method (sharding/reshard.py: ppermute rounds over
a 1-D mesh of both groups' devices): in this JAX a device_put onto another process's devices is
refused unless the backend supports cross-host transfers (docs/design.md). Small host values
(array specs, the generation side's metrics) travel as JSON through a byte all-gather.

Callers: runtime/trainer.py (Roles for the executor, merged metrics), runtime/setup.py.
"""

from __future__ import annotations

import jax
import numpy as np

from rpeg_jax.runtime.executor import Roles, Store
from rpeg_jax.runtime.resume import every_process


def crossing(program, gen_group: str) -> list[str]:
    """The data nodes the generation group's stages write and another group's stages read."""
    written = {p.node for cs in program.stages if cs.plan.group == gen_group for p in cs.writes if not p.state}
    read = {p.node for cs in program.stages if cs.plan.group != gen_group for p in cs.reads if not p.state}
    return sorted(written & read)


class Handoff:
    """handoff(step): step `step`'s rollout data (crossing()) from the generation group's batch layout
    (Placement.rollout_layout, where the generating processes assembled it) into the training layout,
    on the training processes' store. Every process calls it at the same point of the step (Roles)."""

    def __init__(self, placement, store: Store, nodes: list[str]):
        self.placement, self.store, self.nodes = placement, store, nodes

    def __call__(self, step: int) -> None:
        pl = self.placement
        mine = {}
        if pl.generates_here:
            for node in self.nodes:
                for name, x in _arrays(self.store.get_data(node, step)).items():
                    mine[f"{node}/{name}"] = x
        specs = {k: [list(x.shape), str(x.dtype)] for k, x in mine.items()}
        spec = every_process({"specs": specs})[pl.gen_procs[0]]["specs"]  # every generating process has the same
        moved = {}
        for key in sorted(spec):
            shape, dtype = tuple(spec[key][0]), np.dtype(spec[key][1])
            src = pl.batch_sharding(pl.rollout_layout, shape)
            x = mine[key] if key in mine else jax.make_array_from_single_device_arrays(shape, src, [], dtype=dtype)
            moved[key] = pl.resharder(x, pl.batch_sharding(pl.train, shape))
        if not pl.trains_here:
            return
        for node in self.nodes:
            parts = {k.split("/", 1)[1]: v for k, v in moved.items() if k.split("/", 1)[0] == node}
            self.store.put_data(node, step, parts[""] if set(parts) == {""} else parts)


def _arrays(value) -> dict:
    """A data value's device arrays by name ('' for a bare array); host_* columns stay where they are."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if not k.startswith("host_")}
    return {"": value}


def roles(placement, program, store: Store) -> Roles | None:
    """The executor's Roles for a split placement across processes, else None."""
    if not placement.split:
        return None
    nodes = crossing(program, placement.gen_group)
    return Roles(local=placement.local_groups, gen_group=placement.gen_group, handoff=Handoff(placement, store, nodes))


def merged_metrics(placement, metrics: dict) -> dict:
    """A step's metrics as every process recorded them, merged (split placement across processes: the
    generating processes record generation's, the training processes training's): for each scalar,
    the first training process's value, else the first generating process's."""
    scalars = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
    every = every_process(scalars)
    out = {}
    for p in [*placement.train_procs, *placement.gen_procs]:
        for k, v in every[p].items():
            out.setdefault(k, v)
    return {**metrics, **out}
