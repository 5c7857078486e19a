"""Placement of the sampler's device data on a mesh: KV pools with kv heads over the `tensor` axis,
per-slot decode state and prefill rows over the `data` axis (sequences are data-parallel).

Used by `Sampler` (sampling/sampler.py). Without a mesh everything stays on the default device and
the numpy inputs are passed to jit as they are. Parameters keep whatever layout the caller gave them
(e.g. the sharding package's rules); XLA inserts the collectives the mixed layouts need. An axis that
is missing from the mesh, or does not divide the dimension, leaves that dimension replicated.

The pools are replicated over `data` (each data shard can read any page); splitting the page pool
per data shard is future work (it needs a per-shard allocator and shard_map'd attention).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P


def _axis(mesh, name: str, size: int) -> str | None:
    if mesh is None or name not in mesh.axis_names:
        return None
    n = mesh.shape[name]
    return name if n > 1 and size % n == 0 else None


class SamplerSharding:
    def __init__(self, mesh: jax.sharding.Mesh | None, kv_heads: int, max_slots: int):
        self.mesh = mesh
        self.pools = None if mesh is None else NamedSharding(mesh, P(None, None, None, _axis(mesh, "tensor", kv_heads), None))
        self.slot_axis = _axis(mesh, "data", max_slots)

    def _put(self, x, axis: str | None) -> Any:
        if self.mesh is None:
            return x
        return jax.device_put(x, NamedSharding(self.mesh, P(axis, *([None] * (x.ndim - 1)))))

    def put_state(self, st):
        """Decode state: every field has the slot dimension first."""
        return type(st)(*(self._put(x, self.slot_axis) for x in st))

    def put_rows(self, *arrays):
        """Prefill inputs (rows first); rows over `data` when they divide evenly."""
        axis = _axis(self.mesh, "data", arrays[0].shape[0])
        return tuple(self._put(x, axis) for x in arrays)
