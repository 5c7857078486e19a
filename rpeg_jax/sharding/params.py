"""Parameter layouts: logical axes (nnx.Param metadata `axes`) + rules + overrides -> shardings.

Callers: layouts.py (`StageLayout.params`: the shardings runtime/placement.py moves state and
stage inputs into), runtime/setup.py (`shard_model` for a sharded init that never materialises
the model on one device), `rpeg shardings` (`param_table` on an abstract model and an abstract
mesh), calibration/stages.py, tests.

A tree is anything `jax.tree` walks: an nnx.Module, an nnx.State from `nnx.split`, or a plain
dict whose leaves are nnx.Variable (with `axes` metadata) or arrays / ShapeDtypeStructs (no axes:
replicated unless an override says otherwise). Returned trees have one PartitionSpec or
NamedSharding where each Variable (or array) was, which is a valid prefix for jit shardings of
the same tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rpeg_jax.config.base import ConfigError
from rpeg_jax.sharding.rules import Rules, mesh_axes_tuple, resolve
from rpeg_jax.sharding.tactics import Override, ParamContext, check_spec, parse_overrides


@dataclass(frozen=True)
class ParamInfo:
    name: str  # dotted path, e.g. "layers.wq"
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...] | None  # logical axes; None when the leaf carries none


def _is_variable(x: Any) -> bool:
    try:
        from flax import nnx
    except ImportError:  # plain pytrees only
        return False
    return isinstance(x, nnx.Variable)


def _value(v: Any) -> Any:
    return v.get_value() if hasattr(v, "get_value") else v.value


def path_name(keypath: Sequence[Any]) -> str:
    """jax key path -> 'layers.wq' (a Variable's trailing `.value` is dropped)."""
    parts = []
    for k in keypath:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    if parts and parts[-1] == "value":
        parts.pop()
    return ".".join(parts)


def _axes_of(leaf: Any) -> tuple[str | None, ...] | None:
    if not _is_variable(leaf):
        return None
    meta = leaf.get_metadata() if hasattr(leaf, "get_metadata") else {}
    for key in ("axes", "sharding_names", "sharding"):
        if meta.get(key) is not None:
            return tuple(meta[key])
    return None


def _info(keypath, leaf) -> ParamInfo:
    value = _value(leaf) if _is_variable(leaf) else leaf
    return ParamInfo(
        path_name(keypath), tuple(getattr(value, "shape", ())), getattr(value, "dtype", None), _axes_of(leaf)
    )


def _as_tree(tree: Any) -> Any:
    try:
        from flax import nnx
    except ImportError:
        return tree
    return nnx.state(tree) if isinstance(tree, nnx.Module) else tree


def map_params(fn: Callable[[ParamInfo], Any], tree: Any) -> Any:
    """Apply fn(ParamInfo) at every Variable/array of `tree`; same structure, fn's results as leaves."""
    import jax

    return jax.tree_util.tree_map_with_path(lambda p, leaf: fn(_info(p, leaf)), _as_tree(tree), is_leaf=_is_variable)


def param_infos(tree: Any) -> list[ParamInfo]:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(_as_tree(tree), is_leaf=_is_variable)[0]
    return [_info(p, leaf) for p, leaf in flat]


def param_specs(
    tree: Any, mesh: Any, rules: Rules, overrides: Sequence[Any] = (), *, unmatched_ok: bool = False
) -> Any:
    """A tree of PartitionSpecs for `tree` on `mesh` (Mesh or AbstractMesh): the first override
    whose pattern matches a parameter's whole path decides it, else the logical-axis rules.
    Override patterns that match nothing, or only parameters that earlier patterns took, raise
    a ConfigError naming them (unless `unmatched_ok`, for trees that hold part of the model)."""
    compiled = overrides if overrides and isinstance(overrides[0], Override) else parse_overrides(overrides)
    matched: dict[int, list[str]] = {o.index: [] for o in compiled}
    decided: dict[int, list[str]] = {o.index: [] for o in compiled}

    def spec_of(info: ParamInfo):
        axes = info.axes if info.axes is not None else (None,) * len(info.shape)
        ctx = ParamContext(info.name, info.shape, axes, info.dtype, mesh, rules)
        hits = [o for o in compiled if o.regex.fullmatch(info.name)]
        for o in hits:
            matched[o.index].append(info.name)
        if not hits:
            return resolve(axes, info.shape, mesh, rules, info.name)
        first = hits[0]
        decided[first.index].append(info.name)
        spec = first.tactic(ctx) if first.tactic is not None else first.partition
        return check_spec(spec, ctx, f"{first.key} ({first.pattern!r} -> {first.action!r})")

    specs = map_params(spec_of, tree)
    if not unmatched_ok:
        report_unused(compiled, matched, decided)
    return specs


def report_unused(compiled: Sequence[Override], matched: dict[int, list[str]], decided: dict[int, list[str]]) -> None:
    for o in compiled:
        if not matched[o.index]:
            raise ConfigError(o.key, o.pattern, "pattern matches no parameter")
        if not decided[o.index]:
            takers = sorted(
                {
                    x.pattern
                    for x in compiled
                    if x.index < o.index and any(x.regex.fullmatch(n) for n in matched[o.index])
                }
            )
            raise ConfigError(
                o.key,
                o.pattern,
                f"conflicts with earlier override(s) {takers}, which already "
                f"decide every parameter it matches ({', '.join(matched[o.index][:4])})",
            )


def param_shardings(
    tree: Any, mesh: Any, rules: Rules, overrides: Sequence[Any] = (), *, unmatched_ok: bool = False
) -> Any:
    """Like `param_specs`, with NamedSharding(mesh, spec) leaves (mesh must be concrete)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    specs = param_specs(tree, mesh, rules, overrides, unmatched_ok=unmatched_ok)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params: Any, shardings: Any) -> Any:
    """Place an existing tree onto `shardings` (host arrays or other layouts; same process)."""
    import jax

    return jax.device_put(params, shardings)


def shard_model(
    make_model: Callable[[], Any], mesh: Any, rules: Rules, overrides: Sequence[Any] = (), *, unmatched_ok: bool = False
):
    """Build an nnx model directly in its sharded layout: the init runs under jit with
    out_shardings, so each device only ever holds its own shards."""
    import jax
    from flax import nnx

    abstract = nnx.eval_shape(make_model)
    graphdef, state = nnx.split(abstract)
    shardings = param_shardings(state, mesh, rules, overrides, unmatched_ok=unmatched_ok)

    def init():
        return nnx.split(make_model())[1]

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def shard_shape(shape: Sequence[int], spec: Any, mesh: Any) -> tuple[int, ...]:
    """The per-device block shape of an array of `shape` laid out by `spec` on `mesh`."""
    sizes = dict(mesh.shape)
    out = list(shape)
    for dim, entry in enumerate(tuple(spec)):
        out[dim] //= math.prod(sizes[a] for a in mesh_axes_tuple(entry))
    return tuple(out)


def bytes_per_device(info: ParamInfo, spec: Any, mesh: Any) -> int:
    import numpy as np

    try:
        itemsize = np.dtype(info.dtype).itemsize
    except TypeError:  # PRNG key dtypes and the like
        itemsize = getattr(info.dtype, "itemsize", 4)
    return math.prod(shard_shape(info.shape, spec, mesh)) * itemsize


def param_table(
    tree: Any, mesh: Any, rules: Rules, overrides: Sequence[Any] = (), *, unmatched_ok: bool = False
) -> list[tuple[ParamInfo, Any, int]]:
    """[(ParamInfo, PartitionSpec, bytes per device)] for every parameter (for `rpeg shardings`)."""
    import jax
    from jax.sharding import PartitionSpec

    specs = jax.tree.leaves(
        param_specs(tree, mesh, rules, overrides, unmatched_ok=unmatched_ok),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    infos = param_infos(tree)
    return [(i, s, bytes_per_device(i, s, mesh)) for i, s in zip(infos, specs)]
