"""Logical-axis rules as data, the resolver that applies them, and the rule presets.

A rule maps one logical axis name (`embed`, `heads`, ... see axes.py) to a tuple of mesh axes
(empty = replicated). `Rules` is an ordered list of them. Callers: params.py (parameters),
`activation_resolver` (activations, through `axes.use_resolver`; layouts.py's
`StageLayout.activations`, which the runtime enters while a stage's program traces), `rpeg shardings`.

Semantics of `resolve(axes, shape, mesh, rules, name)`, one array at a time:

1. Dimensions are visited left to right. A dimension whose logical name is None, or has no
   rule, is replicated.
2. For a dimension named `n`, the rules for `n` are tried in list order. Mesh axes that the
   mesh lacks or that have size 1 are dropped from a rule (they shard nothing).
3. A rule FITS if none of its (remaining) mesh axes is already used by an earlier dimension of
   the same array (a mesh axis shards at most one dimension per array). A rule that does not
   fit is skipped. The first rule that fits decides the dimension.
4. If the dimension's size is not divisible by the product of the rule's mesh-axis sizes, the
   rule's `indivisible` policy applies: "error" (default) raises a ShardingError naming the
   array, the dimension, the logical axis and the mesh axes; "replicate" replicates the
   dimension; "next" skips to the next rule for `n`.
5. If no rule decides, the dimension is replicated.

Rule presets (`PRESETS`; mesh axes data, fsdp, tensor) are usable for training and generation:
  replicated   everything replicated (the single-device reference)
  data         batch over (data, fsdp); parameters replicated
  fsdp         batch over (data, fsdp); parameters sharded on `embed` over fsdp (ZeRO-3 style)
  tensor       batch over (data, fsdp); heads, kv_heads, mlp, vocab over tensor (Megatron)
  fsdp_tensor  tensor + `embed` over fsdp
  fsdp_expert  fsdp, with a mixture's `expert` dimension over fsdp (expert parallelism: whole
               experts per device; a mesh axis shards one dimension per array, so their `embed`
               stays whole; the tokens reach their experts by an all-to-all, models/moe.py)
  fsdp_expert_tensor  fsdp_expert + the tensor rules (each expert's width over tensor too)
Users add presets with `register_rules(name, data)` (in a plugin module, see tactics.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.registry import Registry
from rpeg_jax.config.sharding import PRESET_DATA
from rpeg_jax.sharding.axes import Axes

POLICIES = ("error", "replicate", "next")


class ShardingError(ConfigError):
    """A layout that cannot be built; the message names the array, the dimension and the axes."""

    def __init__(self, message: str, key: str = "sharding", value: Any = None):
        ValueError.__init__(self, message)
        self.key, self.value, self.why = key, value, message


@dataclass(frozen=True)
class Rule:
    logical: str  # logical axis name (axes.py or a user's own)
    mesh: tuple[str, ...]  # mesh axes, major to minor; () = replicate
    indivisible: str = "error"  # "error" | "replicate" | "next" (see module docstring, step 4)

    def __post_init__(self):
        if self.indivisible not in POLICIES:
            raise ShardingError(f"rule {self.logical!r}: indivisible={self.indivisible!r} must be one of {POLICIES}")


@dataclass(frozen=True)
class Rules:
    rules: tuple[Rule, ...]
    name: str = "custom"

    @classmethod
    def from_data(cls, data: Iterable[Any], name: str = "custom") -> "Rules":
        """From YAML-friendly data: [[logical, mesh], [logical, [m1, m2], "replicate"], ...] or
        dicts {logical: .., mesh: .., indivisible: ..}; mesh None/[] = replicate."""
        out = []
        for i, item in enumerate(data):
            if isinstance(item, Rule):
                out.append(item)
                continue
            if isinstance(item, dict):
                logical, mesh, policy = item.get("logical"), item.get("mesh"), item.get("indivisible", "error")
            elif isinstance(item, (list, tuple)) and len(item) in (2, 3):
                logical, mesh, policy = item[0], item[1], (item[2] if len(item) == 3 else "error")
            else:
                raise ShardingError(f"rules {name!r}[{i}] = {item!r}: expected [logical, mesh_axes(, policy)]")
            if not isinstance(logical, str):
                raise ShardingError(f"rules {name!r}[{i}]: logical axis {logical!r} must be a string")
            out.append(Rule(logical, mesh_axes_tuple(mesh), policy))
        return cls(tuple(out), name)

    def for_axis(self, logical: str) -> tuple[Rule, ...]:
        return _index(self)[logical] if logical in _index(self) else ()

    def __add__(self, other: "Rules") -> "Rules":
        return Rules(self.rules + other.rules, f"{self.name}+{other.name}")


@functools.lru_cache(maxsize=256)
def _index(rules: Rules) -> dict[str, tuple[Rule, ...]]:
    idx: dict[str, list[Rule]] = {}
    for r in rules.rules:
        idx.setdefault(r.logical, []).append(r)
    return {k: tuple(v) for k, v in idx.items()}


def mesh_axes_tuple(mesh: Any) -> tuple[str, ...]:
    """None | 'a' | ['a', 'b'] | 'a+b' -> a tuple of mesh axis names."""
    if mesh is None:
        return ()
    if isinstance(mesh, str):
        return tuple(a for a in mesh.split("+") if a) if mesh not in ("", "none", "None", "null") else ()
    return tuple(mesh)


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def resolve(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Any, rules: Rules, name: str = "array", strict: bool = True
):
    """Logical `axes` of an array of `shape` -> a PartitionSpec on `mesh` (Mesh or AbstractMesh),
    by the semantics in the module docstring. `strict=False` treats "error" as "replicate"
    (activations). Raises ShardingError naming `name`."""
    from jax.sharding import PartitionSpec

    sizes = dict(mesh.shape)
    if len(axes) != len(shape):
        raise ShardingError(f"{name}: {len(axes)} logical axes {tuple(axes)} for shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[Any] = []
    for dim, (logical, size) in enumerate(zip(axes, shape)):
        chosen: tuple[str, ...] = ()
        for rule in rules.for_axis(logical) if logical is not None else ():
            live = tuple(a for a in rule.mesh if sizes.get(a, 1) > 1)
            if used & set(live):
                continue  # step 3: a mesh axis shards at most one dimension
            ways = math.prod(sizes[a] for a in live)
            if size % ways == 0:
                chosen = live
                break
            if rule.indivisible == "next":
                continue
            if rule.indivisible == "error" and strict:
                raise ShardingError(
                    f"{name}: dimension {dim} (logical axis {logical!r}, size {size}) is not divisible by mesh "
                    f"axis {'x'.join(live)} (size {ways}) in rules {rules.name!r}; change the mesh, or give the "
                    f"rule indivisible='replicate', or add an override for {name!r}",
                    value=name,
                )
            break  # replicate
        used.update(chosen)
        spec.append(_entry(chosen))
    return PartitionSpec(*spec)


# The presets' data lives in config/sharding.py (JAX-free: the config checks and the planner read it).
_PRESET_DATA = PRESET_DATA
PRESETS = Registry("rule preset", key="sharding.train_rules")  # name -> Rules (config/registry.py)
for _name, _data in _PRESET_DATA.items():
    PRESETS.register(_name, Rules.from_data(_data, _name), origin=__name__)


def register_rules(name: str, data: Iterable[Any] | Rules, origin: str | None = None) -> Rules:
    """Add a named rule set (usable as `sharding.train_rules: name`). Re-registering a name from a
    different module is a conflict (one line naming both modules: config/registry.py's rules)."""
    rules = data if isinstance(data, Rules) else Rules.from_data(data, name)
    return PRESETS.register(name, Rules(rules.rules, name), origin=origin or _caller_module())


def get_rules(name: str | Rules, key: str = "sharding.rules") -> Rules:
    if isinstance(name, Rules):
        return name
    return PRESETS.get(name, key)


def _caller_module() -> str:
    import inspect

    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__name__", "").startswith("rpeg_jax.sharding"):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


def activation_resolver(mesh: Any, rules: Rules):
    """A resolver for `axes.use_resolver`: (logical axes, shape) -> NamedSharding on `mesh`.
    Activations never raise on indivisible sizes (they replicate that dimension)."""
    from jax.sharding import NamedSharding

    @functools.lru_cache(maxsize=1024)
    def resolver(axes: Axes, shape: tuple[int, ...]):
        return NamedSharding(mesh, resolve(axes, shape, mesh, rules, name=f"activation{axes}", strict=False))

    return resolver
