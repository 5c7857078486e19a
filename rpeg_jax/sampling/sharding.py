"""Placement of the sampler's device data on a mesh: KV pools with kv heads over the `tensor` axis,
per-slot decode state and prefill rows over the `data` axis (sequences are data-parallel).

Used by `Sampler` (sampling/sampler.py). Without a mesh everything stays on the default device and
the numpy inputs are passed to jit as they are. Parameters keep whatever layout the caller gave them
(e.g. the sharding package's rules); XLA inserts the collectives the mixed layouts need. An axis that
is missing from the mesh, or does not divide the dimension, leaves that dimension replicated.

Meshes with Explicit axes are relabelled to the same devices with Auto axes (parameters included, no
data movement): the decode loop relies on XLA's sharding propagation (gathers over data-sharded page
tables), which Explicit mode would require spelling out at every indexing op of the model.

KV page pool over `data` (SamplerConfig.kv_pool):
- "sharded" (default): the pools' page axis is split over `data` too, P(None, tensor, data): each of
  the D data shards holds P/D pages of [L, K/T, P/D, S, E] (its own null page at local id 0), so KV
  memory per device shrinks with data parallelism. Slot b lives in shard b // (B/D); its page table
  holds local page ids (host side: `allocator.ShardedPages`, `scheduler.Scheduler`). The device
  functions run per shard under `jax.shard_map` over `data` only (`shard_mesh`; the other axes, e.g.
  kv heads over `tensor`, stay Auto inside), so no pool gather crosses shards and XLA never
  all-gathers the pool (tests/test_sampler_sharded_pool.py checks the shard shapes, and that no
  collective of the compiled decode chunk carries KV pages or crosses data shards).
  With kv heads over `tensor` the page gathers index the head axis as a gather batch dimension
  (`heads_sharded`, paged_attention.gather_pages), so attention needs no collective over the pool
  either way (without it XLA all-gathered a layer's pool over `tensor`, or all-reduced the pages).
- "replicated": every data shard holds the whole pool (one allocator; XLA's propagation handles the
  data-sharded page tables: each decode step all-gathers the new K/V rows and their write targets
  across data shards to keep the copies equal). Used, whatever kv_pool says, when there is no `data` axis > 1 or it does
  not divide max_slots.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


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
    def __init__(self, mesh: jax.sharding.Mesh | None, kv_heads: int, max_slots: int, kv_pool: str = "sharded"):
        mesh = auto_mesh(mesh)
        self.mesh = mesh
        self.slot_axis = _axis(mesh, "data", max_slots)
        sharded = kv_pool == "sharded" and self.slot_axis is not None
        self.pool_shards = mesh.shape["data"] if sharded else 1  # D: page-pool shards
        self.shard_mesh = mesh if sharded else None  # the engine's shard_map mesh (None: no shard_map)
        heads = _axis(mesh, "tensor", kv_heads)
        self.heads_sharded = heads is not None  # static engine flag (paged_attention.gather_pages)
        self.pools = None if mesh is None else NamedSharding(mesh, P(None, heads, "data" if sharded else None))

    def place_params(self, params):
        """Relabel NamedSharding parameters onto the Auto-axes mesh (same devices, same specs)."""
        if self.mesh is None:
            return params

        def one(x):
            sh = getattr(x, "sharding", None)
            if (
                isinstance(sh, NamedSharding)
                and sh.mesh != self.mesh
                and sh.mesh.devices.shape == self.mesh.devices.shape
                and (sh.mesh.devices == self.mesh.devices).all()
            ):
                return jax.device_put(x, NamedSharding(self.mesh, sh.spec))
            return x

        return jax.tree.map(one, params)

    def expert_layout(self, params):
        """Where a mixture's experts are split (`we_gate` [Ls, X, D, F]'s placement: X over the
        expert axes, F over the mlp axes), for models/moe.py's expert-parallel block; the tokens
        are replicated over those axes (slots split over `data` only). None without a mesh, a
        mixture, or experts split over `data` (the engine's own shard_map axis)."""
        if self.mesh is None:
            return None
        from rpeg_jax.sharding.axes import ExpertLayout

        for path, x in jax.tree_util.tree_leaves_with_path(params):
            if "we_gate" not in jax.tree_util.keystr(path):
                continue
            sh = getattr(x, "sharding", None)
            if not isinstance(sh, NamedSharding):
                return None
            spec = tuple(sh.spec) + (None,) * (4 - len(sh.spec))
            names = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)  # noqa: E731
            expert = tuple(a for a in names(spec[1]) if self.mesh.shape[a] > 1)
            if not expert or "data" in expert:
                return None
            mlp = tuple(a for a in names(spec[3]) if self.mesh.shape[a] > 1 and a != "data")
            return ExpertLayout(expert, mlp, (None, None), self.mesh)
        return None

    def _put(self, x, axis: str | None) -> Any:
        if self.mesh is None:
            return x
        return jax.device_put(x, NamedSharding(self.mesh, P(axis, *([None] * (x.ndim - 1)))))

    def put_state(self, st):
        """Decode state: every field has the slot dimension first."""
        return type(st)(*(self._put(x, self.slot_axis) for x in st))

    def put_pages(self, *arrays):
        """Fork copies (src, dst local page ids, D blocks): over `data` with a sharded pool."""
        if self.shard_mesh is None:
            return tuple(jnp.asarray(x) for x in arrays)
        return tuple(self._put(x, "data") for x in arrays)

    def put_rows(self, *arrays):
        """Prefill inputs (rows first); rows over `data` when they divide evenly."""
        axis = _axis(self.mesh, "data", arrays[0].shape[0])
        return tuple(self._put(x, axis) for x in arrays)
