"""Placement of the sampler's device data on a mesh: KV pools with kv heads over the `tensor` axis,
per-slot decode state and prefill rows over the `data` axis (sequences are data-parallel).

Used by `Sampler` (sampling/sampler.py). Without a mesh everything stays on the default device and
the numpy inputs are passed to jit as they are. Parameters keep whatever layout the caller gave them
(e.g. the sharding package's rules); XLA inserts the collectives the mixed layouts need. An axis that
is missing from the mesh, or does not divide the dimension, leaves that dimension replicated.

Meshes with Explicit axes are relabelled to the same devices with Auto axes (parameters included, no
data movement): the decode loop relies on XLA's sharding propagation (gathers over data-sharded page
tables), which Explicit mode would require spelling out at every indexing op of the model.

The pools are replicated over `data` (each data shard can read any page); splitting the page pool
per data shard is future work (it needs a per-shard allocator and shard_map'd attention).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def _axis(mesh, name: str, size: int) -> str | None:
    if mesh is None or name not in mesh.axis_names:
        return None
    n = mesh.shape[name]
    return name if n > 1 and size % n == 0 else None


def auto_mesh(mesh: jax.sharding.Mesh | None) -> jax.sharding.Mesh | None:
    """The same devices and axis names with every axis Auto."""
    if mesh is None or all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def mesh_of(params) -> jax.sharding.Mesh | None:
    """The mesh of the first NamedSharding-placed parameter, if any."""
    for x in jax.tree.leaves(params):
        if isinstance(getattr(x, "sharding", None), NamedSharding):
            return x.sharding.mesh
    return None


class SamplerSharding:
    def __init__(self, mesh: jax.sharding.Mesh | None, kv_heads: int, max_slots: int):
        mesh = auto_mesh(mesh)
        self.mesh = mesh
        self.pools = None if mesh is None else NamedSharding(mesh, P(None, _axis(mesh, "tensor", kv_heads)))
        self.slot_axis = _axis(mesh, "data", max_slots)

    def place_params(self, params):
        """Relabel NamedSharding parameters onto the Auto-axes mesh (same devices, same specs)."""
        if self.mesh is None:
            return params

        def one(x):
            sh = getattr(x, "sharding", None)
            if isinstance(sh, NamedSharding) and sh.mesh != self.mesh and sh.mesh.devices.shape == self.mesh.devices.shape \
                    and (sh.mesh.devices == self.mesh.devices).all():
                return jax.device_put(x, NamedSharding(self.mesh, sh.spec))
            return x
        return jax.tree.map(one, params)

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
