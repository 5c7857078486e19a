"""Device meshes: from a spec like `{data: -1, fsdp: 4, tensor: 1}` over the global devices.

Callers: layouts.py (`layout_for`: one mesh per stage layout for runtime/placement.py, abstract
meshes without devices for `rpeg shardings`), runtime/placement.py (`mesh_scope`), tests.

Layout. Axes are laid out in the order given, the LAST axis changing fastest. Devices are taken
in (process index, device id) order, which is the order in which processes sit on nodes under
SLURM's default block distribution, so consecutive devices share a node. With the canonical
order `data, fsdp, tensor` (see `canonical_spec`), a tensor-parallel group is a run of
consecutive devices and stays on one node's NVLink whenever `tensor` divides the devices per
node; `make_mesh(..., devices_per_node=n)` checks that.

Sub-meshes (`sub_meshes`) split the devices into disjoint, contiguous groups (split placements:
e.g. training on 6 nodes, generation on 2), each with its own spec.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

MESH_AXES = ("data", "fsdp", "tensor")  # canonical order: outermost .. innermost (fastest)

MeshSpec = Mapping[str, int]


class MeshError(ValueError):
    """A mesh spec that does not fit the devices (message names the axis and the sizes)."""


def canonical_spec(spec: MeshSpec) -> dict[str, int]:
    """`spec` with every canonical axis present (missing ones get size 1) in canonical order;
    non-canonical axes keep their given order and come first (outermost)."""
    extra = {k: int(v) for k, v in spec.items() if k not in MESH_AXES}
    return {**extra, **{a: int(spec.get(a, 1)) for a in MESH_AXES}}


def fill_spec(spec: MeshSpec, num_devices: int) -> dict[str, int]:
    """Resolve the one `-1` axis (if any) so that the sizes multiply to `num_devices`."""
    spec = {k: int(v) for k, v in spec.items()}
    fill = [k for k, v in spec.items() if v == -1]
    if len(fill) > 1:
        raise MeshError(f"mesh {spec}: at most one axis may be -1, got {fill}")
    for k, v in spec.items():
        if v != -1 and v < 1:
            raise MeshError(f"mesh {spec}: axis {k!r} has size {v}; sizes are -1 (fill) or >= 1")
    fixed = math.prod(v for v in spec.values() if v != -1)
    if fill:
        if num_devices % fixed:
            raise MeshError(
                f"mesh {spec}: the fixed axes use {fixed} devices, which does not divide "
                f"the {num_devices} devices available, so axis {fill[0]!r}=-1 cannot fill them"
            )
        spec[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(f"mesh {spec} uses {fixed} devices but {num_devices} are given; set one axis to -1 to fill")
    return spec


def _device_key(d: Any) -> tuple[int, int]:
    return (int(getattr(d, "process_index", 0)), int(d.id))


def device_grid(
    spec: MeshSpec,
    devices: Sequence[Any],
    devices_per_node: int | None = None,
    all_devices: Sequence[Any] | None = None,
) -> np.ndarray:
    """The devices arranged as an array of the mesh shape (pure: works on any objects with `id`
    and `process_index`). With `devices_per_node`, raises MeshError if a tensor group would span
    nodes; a device's node is its position in `all_devices` (default `devices`), in (process, id)
    order, divided by `devices_per_node`."""
    sizes = fill_spec(spec, len(devices))
    ordered = sorted(devices, key=_device_key)
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered
    grid = grid.reshape(tuple(sizes.values()))
    if devices_per_node and sizes.get("tensor", 1) > 1:
        everyone = sorted(all_devices if all_devices is not None else devices, key=_device_key)
        check_within_node(grid, list(sizes), "tensor", everyone, devices_per_node)
    return grid


def check_within_node(
    grid: np.ndarray, names: list[str], axis: str, ordered: Sequence[Any], devices_per_node: int
) -> None:
    """Raise MeshError unless every group of devices along mesh `axis` sits on one node (node =
    position in (process, id) order // devices_per_node)."""
    node = {id(d): i // devices_per_node for i, d in enumerate(ordered)}
    groups = np.moveaxis(grid, names.index(axis), -1).reshape(-1, grid.shape[names.index(axis)])
    for g in groups:
        nodes = {node[id(d)] for d in g}
        if len(nodes) > 1:
            raise MeshError(
                f"mesh axis {axis!r} of size {len(g)} spans nodes {sorted(nodes)} with "
                f"{devices_per_node} devices per node; choose a {axis} size that divides "
                f"{devices_per_node} so its collectives stay on the intra-node link"
            )


def _axis_types(names: Sequence[str], axis_types: str | Sequence[Any]):
    from jax.sharding import AxisType

    if isinstance(axis_types, str):
        if axis_types not in ("auto", "explicit"):
            raise MeshError(f"axis_types={axis_types!r}: must be 'auto' or 'explicit'")
        t = AxisType.Auto if axis_types == "auto" else AxisType.Explicit
        return (t,) * len(names)
    return tuple(axis_types)


def make_mesh(
    spec: MeshSpec,
    devices: Sequence[Any] | None = None,
    *,
    axis_types: str | Sequence[Any] = "auto",
    devices_per_node: int | None = None,
):
    """A `jax.sharding.Mesh` of shape `spec` (one axis may be -1) over `devices` (default: all
    global devices). `axis_types` is 'auto' (the partitioner propagates shardings; models
    annotate with `constrain`) or 'explicit' (sharding in types; `jax.reshard`)."""
    import jax
    from jax.sharding import Mesh

    everyone = jax.devices()
    devices = list(everyone if devices is None else devices)
    if not set(devices) <= set(everyone):  # e.g. CPU devices on a GPU host
        everyone = devices
    grid = device_grid(spec, devices, devices_per_node, all_devices=everyone)
    names = tuple(spec.keys())
    return Mesh(grid, names, axis_types=_axis_types(names, axis_types))


def abstract_mesh(spec: MeshSpec, num_devices: int, *, axis_types: str | Sequence[Any] = "auto"):
    """A device-free `jax.sharding.AbstractMesh` (for resolving rules and counting bytes)."""
    from jax.sharding import AbstractMesh

    sizes = fill_spec(spec, num_devices)
    names = tuple(sizes)
    return AbstractMesh(tuple(sizes.values()), names, axis_types=_axis_types(names, axis_types))


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """{axis name: size} of a Mesh or AbstractMesh."""
    return dict(mesh.shape)


def split_devices(groups: Sequence[tuple[str, int]], devices: Sequence[Any]) -> dict[str, list[Any]]:
    """Split `devices` (taken in (process, id) order) into contiguous named groups of the given
    sizes; at most one size may be -1 (the rest)."""
    ordered = sorted(devices, key=_device_key)
    sizes = dict(groups)
    if len(sizes) != len(groups):
        raise MeshError(f"sub-mesh names must be unique: {[g for g, _ in groups]}")
    fixed = sum(n for n in sizes.values() if n != -1)
    rest = [g for g, n in sizes.items() if n == -1]
    if len(rest) > 1 or any(n != -1 and n < 1 for n in sizes.values()):
        raise MeshError(f"sub-mesh sizes {sizes}: each >= 1, at most one -1")
    if fixed > len(ordered) or (rest and fixed == len(ordered)):
        raise MeshError(f"sub-meshes {sizes} need more than the {len(ordered)} devices available")
    if rest:
        sizes[rest[0]] = len(ordered) - fixed
    out, start = {}, 0
    for name, n in sizes.items():
        out[name] = ordered[start : start + n]
        start += n
    return out


def sub_meshes(
    groups: Mapping[str, tuple[int, MeshSpec]],
    devices: Sequence[Any] | None = None,
    *,
    axis_types: str | Sequence[Any] = "auto",
    devices_per_node: int | None = None,
) -> dict[str, Any]:
    """Disjoint meshes for a split placement: `{"train": (6, {"fsdp": -1}), "generate": (-1,
    {"data": -1, "tensor": 2})}` -> {name: Mesh}. Groups take contiguous device ranges in the
    order given, so a group whose size is a multiple of the node size owns whole nodes."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    parts = split_devices([(name, n) for name, (n, _) in groups.items()], devices)
    return {
        name: make_mesh(groups[name][1], parts[name], axis_types=axis_types, devices_per_node=devices_per_node)
        for name in groups
    }


def mesh_scope(mesh):
    """`jax.set_mesh(mesh)` when some axis of this concrete mesh is Explicit (sharding in types needs
    the current mesh for jit, reshard and out_sharding); a no-op context otherwise."""
    import contextlib

    import jax
    from jax.sharding import AbstractMesh, AxisType

    explicit = any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    if not explicit or isinstance(mesh, AbstractMesh):
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)
