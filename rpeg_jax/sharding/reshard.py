"""Resharding a tree between layouts and meshes (training <-> generation, between sub-meshes).

Callers: runtime/placement.py's Placement, through one `Resharder()` called as
`resharder(tree, dst_shardings)`: `put_params` (state into the layout of the stage that writes
it), `place_inputs` (a stage's parameter inputs into that stage's layout), `to_rollout` (the
trained weights into the sampler's generation layout: the weight_sync stage). `plan(...)`
(its methods and `bytes_moved`), `reshard_bytes` and `reshard_bytes_abstract` are called by
tests only (tests/test_reshard.py, tests/test_multihost.py); the cost model prices resharding with
its own formula (costmodel/comm.py `reshard_time`), not with these.

A plan is built once per (tree structure, shapes, dtypes, source shardings, destination
shardings) and cached; it records per leaf the method and the bytes each destination device
must receive (its block minus what the same device already holds).

Methods:
  keep        source and destination layouts are equal: nothing moves.
  device_put  the same device set (any mesh shape/spec), or everything in one process:
              `jax.device_put` does it.
  collective  different device sets in multi-controller JAX (disjoint per-process sub-meshes,
              where a plain device_put fails). Both sides are viewed as one array over a 1-D
              "union" mesh of all devices involved, each device holding one block (its source
              block, or zeros), and a shard_map of `ppermute` rounds moves the blocks:
                1. on the source devices, reshard to a transfer layout that splits one dimension
                   into m blocks (m divides both device counts), replicated r_A = |A|/m times;
                2. round j = 0 .. r_B-1 sends block k from source device (k, j mod r_A) to
                   destination device (k, j) of a (m, r_B) view of the destination devices;
                3. on the destination devices, reshard from the transfer layout to the target.
              Every process must call the Resharder (it is an SPMD step); a process only
              touches the devices it owns, and gets arrays without local shards for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rpeg_jax.sharding.rules import ShardingError

METHODS = ("auto", "device_put", "collective")


@dataclass
class LeafPlan:
    method: str  # "keep" | "device_put" | "collective"
    nbytes: int  # global size of the array
    bytes_moved: int  # bytes received by destination devices (see module docstring)
    transfer: Any = None  # _Transfer for "collective"


@dataclass
class ReshardPlan:
    leaves: list[LeafPlan]
    bytes_total: int
    bytes_moved: int
    methods: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"reshard: {len(self.leaves)} arrays, {self.bytes_total / 2**20:.2f} MiB, "
            f"{self.bytes_moved / 2**20:.2f} MiB moved, methods {self.methods}"
        )


def _broadcast_shardings(dst: Any, tree: Any) -> list[Any]:
    """One destination sharding per leaf of `tree` (`dst` may be a prefix tree, e.g. one
    sharding per nnx.Variable, or a single sharding)."""
    import jax
    from jax.sharding import Sharding

    is_s = lambda x: isinstance(x, Sharding)  # noqa: E731
    if is_s(dst):
        return [dst] * len(jax.tree.leaves(tree))
    expanded = jax.tree.map(lambda s, sub: [s] * len(jax.tree.leaves(sub)), dst, tree, is_leaf=is_s)
    return jax.tree.leaves(expanded, is_leaf=is_s)


def _itemsize(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return getattr(dtype, "itemsize", 4)


def _block_bytes(index: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    return math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape))


def _overlap(a: tuple[slice, ...], b: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    total = 1
    for sa, sb, n in zip(a, b, shape):
        ra, rb = range(*sa.indices(n)), range(*sb.indices(n))
        total *= max(0, min(ra.stop, rb.stop) - max(ra.start, rb.start))
    return total


def bytes_received(shape: tuple[int, ...], dtype: Any, src: Any, dst: Any) -> int:
    """Bytes the destination devices must receive: each one's block minus the part of it the
    same device already holds under `src`."""
    src_map = src.devices_indices_map(shape)
    total = 0
    for d, idx in dst.devices_indices_map(shape).items():
        have = _overlap(idx, src_map[d], shape) if d in src_map else 0
        total += _block_bytes(idx, shape) - have
    return total * _itemsize(dtype)


def reshard_bytes(shapes: Any, src: Any, dst: Any) -> int:
    """Bytes moved to go from shardings `src` to `dst` for a tree of arrays/ShapeDtypeStructs."""
    import jax

    leaves = jax.tree.leaves(shapes)
    srcs, dsts = _broadcast_shardings(src, shapes), _broadcast_shardings(dst, shapes)
    return sum(bytes_received(tuple(x.shape), x.dtype, s, d) for x, s, d in zip(leaves, srcs, dsts))


def _blocks(shape: tuple[int, ...], spec: Any, sizes: dict[str, int]) -> list[tuple[slice, ...]]:
    """Each device's block (row-major device positions) of an array laid out by `spec` on a mesh
    of `sizes`: what `devices_indices_map` gives, without devices."""
    from rpeg_jax.sharding.rules import mesh_axes_tuple

    names, dims = list(sizes), list(sizes.values())
    entries = list(tuple(spec)) + [None] * (len(shape) - len(tuple(spec)))
    out = []
    for k in range(math.prod(dims)):
        coord = dict(zip(names, np.unravel_index(k, dims))) if dims else {}
        block = []
        for n, entry in zip(shape, entries):
            axes = mesh_axes_tuple(entry)
            ways = math.prod(sizes[a] for a in axes)
            idx = int(np.ravel_multi_index([coord[a] for a in axes], [sizes[a] for a in axes])) if axes else 0
            block.append(slice(idx * (n // ways), (idx + 1) * (n // ways)))
        out.append(tuple(block))
    return out


def reshard_bytes_abstract(
    shape: tuple[int, ...],
    itemsize: int,
    src_spec: Any,
    src_sizes: dict[str, int],
    dst_spec: Any,
    dst_sizes: dict[str, int],
    shared_devices: bool,
) -> int:
    """`bytes_received` without devices (for meshes larger than the machine): the two
    meshes are either over the same devices in the same order (`shared_devices`, a colocated
    layout change) or over disjoint devices (a split placement)."""
    shape = tuple(shape)
    src, dst = _blocks(shape, src_spec, src_sizes), _blocks(shape, dst_spec, dst_sizes)
    if shared_devices and len(src) != len(dst):
        raise ShardingError(f"shared_devices needs meshes of one size, got {src_sizes} and {dst_sizes}")
    total = 0
    for k, idx in enumerate(dst):
        total += _block_bytes(idx, shape) - (_overlap(idx, src[k], shape) if shared_devices else 0)
    return total * itemsize


class _Transfer:
    """The collective method for one (shape, dtype, src, dst); see the module docstring."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, src: Any, dst: Any):
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.shape, self.dtype, self.dst = shape, dtype, dst
        a, b = _devices(src), _devices(dst)
        self.scalar = len(shape) == 0
        shp = (1,) if self.scalar else shape
        m, d = _transfer_split(shp, math.gcd(len(a), len(b)))
        r_a, r_b = len(a) // m, len(b) // m
        spec = lambda name: P(*[name if i == d else None for i in range(len(shp))])  # noqa: E731
        self.t_src = NamedSharding(Mesh(np.array(a, dtype=object).reshape(m, r_a), ("xfer", "rep")), spec("xfer"))
        self.t_dst = NamedSharding(Mesh(np.array(b, dtype=object).reshape(m, r_b), ("xfer", "rep")), spec("xfer"))
        union = a + [x for x in b if x not in set(a)]
        pos = {x: i for i, x in enumerate(union)}
        self.block = tuple(n // m if i == d else n for i, n in enumerate(shp))
        self.union_shape = tuple(n * len(union) if i == d else n for i, n in enumerate(self.block))
        self.union = NamedSharding(Mesh(np.array(union, dtype=object), ("u",)), spec("u"))
        self.a_set, self.b_set = set(a), set(b)
        rounds = [[(pos[a[k * r_a + j % r_a]], pos[b[k * r_b + j]]) for k in range(m)] for j in range(r_b)]

        def kernel(block):
            me = jax.lax.axis_index("u")
            out = jax.numpy.zeros_like(block)
            for pairs in rounds:  # each round: distinct senders, distinct receivers
                got = jax.lax.ppermute(block, "u", pairs)
                mine = jax.numpy.any(me == jax.numpy.asarray([q for _, q in pairs]))
                out = jax.numpy.where(mine, got, out)
            return out

        self.fn = jax.jit(jax.shard_map(kernel, mesh=self.union.mesh, in_specs=spec("u"), out_specs=spec("u")))

    def __call__(self, x):
        import jax
        import jax.numpy as jnp

        pid = jax.process_index()
        local = [d for d in _devices(self.union) if d.process_index == pid]
        if not local:  # this process takes no part in the transfer
            return jax.make_array_from_single_device_arrays(self.shape, self.dst, [], dtype=self.dtype)
        xa, have = None, {}
        if any(d in self.a_set for d in local):
            xa = jax.block_until_ready(jax.device_put(x.reshape(1) if self.scalar else x, self.t_src))
            have = {s.device: s.data for s in xa.addressable_shards}
        blocks = [have[d] if d in self.a_set else jnp.zeros(self.block, self.dtype, device=d) for d in local]
        z = jax.make_array_from_single_device_arrays(self.union_shape, self.union, blocks)
        out = jax.block_until_ready(self.fn(z))
        mine = [s.data for s in out.addressable_shards if s.device in self.b_set]
        if not mine:  # this process owns no destination device
            return jax.make_array_from_single_device_arrays(self.shape, self.dst, [], dtype=self.dtype)
        yb = jax.make_array_from_single_device_arrays((1,) if self.scalar else self.shape, self.t_dst, mine)
        return jax.device_put(yb.reshape(()) if self.scalar else yb, self.dst)


def _devices(sharding: Any) -> list[Any]:
    """A sharding's devices in its own order (a NamedSharding's mesh order)."""
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and hasattr(mesh, "devices"):
        return list(mesh.devices.flat)
    return list(sharding._device_assignment)


def _transfer_split(shape: tuple[int, ...], g: int) -> tuple[int, int]:
    """The largest m dividing g for which some dimension divides by m, and that dimension (the
    largest such)."""
    for m in sorted((k for k in range(1, g + 1) if g % k == 0), reverse=True):
        dims = [i for i, n in enumerate(shape) if n % m == 0]
        if dims:
            return m, max(dims, key=lambda i: shape[i])
    return 1, 0


class Resharder:
    """Moves trees between layouts; plans are built once per signature and cached.

        rs = Resharder()
        gen_params = rs(train_params, gen_shardings)     # training -> generation
        rs.plan(train_params, gen_shardings).bytes_moved  # bytes the destination devices receive

    `method`: "auto" (device_put where it works, else collective), or force one (tests)."""

    def __init__(self, method: str = "auto"):
        if method not in METHODS:
            raise ShardingError(f"Resharder method={method!r}: must be one of {METHODS}")
        self.method = method
        self._plans: dict[Any, ReshardPlan] = {}
        self.plans_built = 0

    def _key(self, tree: Any, dst: Any):
        import jax

        leaves, treedef = jax.tree.flatten(tree)
        dsts = _broadcast_shardings(dst, tree)
        return treedef, tuple((tuple(x.shape), str(x.dtype), x.sharding, s) for x, s in zip(leaves, dsts))

    def plan(self, tree: Any, dst: Any) -> ReshardPlan:
        key = self._key(tree, dst)
        if key not in self._plans:
            self._plans[key] = self._build(key[1])
            self.plans_built += 1
        return self._plans[key]

    def _build(self, sig) -> ReshardPlan:
        import jax

        multi = jax.process_count() > 1
        leaves, methods = [], {}
        for shape, dtype, src, dst in sig:
            nbytes = math.prod(shape) * _itemsize(dtype)
            moved = bytes_received(shape, dtype, src, dst)
            if src == dst or src.is_equivalent_to(dst, len(shape)):
                leaf = LeafPlan("keep", nbytes, 0)
            elif self.method == "device_put" or (
                self.method == "auto" and (src.device_set == dst.device_set or not multi)
            ):
                leaf = LeafPlan("device_put", nbytes, moved)
            else:
                leaf = LeafPlan("collective", nbytes, moved, _Transfer(shape, dtype, src, dst))
            methods[leaf.method] = methods.get(leaf.method, 0) + 1
            leaves.append(leaf)
        return ReshardPlan(leaves, sum(p.nbytes for p in leaves), sum(p.bytes_moved for p in leaves), methods)

    def __call__(self, tree: Any, dst: Any) -> Any:
        import jax

        plan = self.plan(tree, dst)
        leaves, treedef = jax.tree.flatten(tree)
        dsts = _broadcast_shardings(dst, tree)
        out = list(leaves)
        batch = [i for i, p in enumerate(plan.leaves) if p.method == "device_put"]
        if batch:  # one batched device_put for all such leaves
            moved = jax.device_put([leaves[i] for i in batch], [dsts[i] for i in batch])
            for i, y in zip(batch, moved):
                out[i] = y
        # With several processes, one collective program at a time: each transfer runs up to three
        # programs over different subsets of the processes (the source's reorder, the union's
        # exchange, the destination's reorder), and with several of them in flight the processes of
        # a split placement deadlocked in the checkpoint's move to every device (1 run in 3 under
        # load: each process idle inside a different leaf's program)
        multi = jax.process_count() > 1
        if batch and multi and any(p.method == "collective" for p in plan.leaves):
            jax.block_until_ready([out[i] for i in batch])
        for i, p in enumerate(plan.leaves):
            if p.method == "collective":
                out[i] = p.transfer(leaves[i])
                if multi:
                    jax.block_until_ready(out[i])
        return jax.tree.unflatten(treedef, out)
