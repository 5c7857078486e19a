"""The extension point: per-parameter overrides, named tactics and plugin modules.

An override is (parameter-path pattern, action), first match wins (config:
`sharding.overrides: [["layers\\.w(q|k|v)", "P(None, fsdp, tensor, None)"], ["embed", "replicate"]]`).
The pattern is a regular expression matched against the whole dotted parameter path
(`layers.wq`, `embed`, `lm_head`). The action is either

  - a partition: `P(fsdp, None)`, `P()`, `fsdp, None`, with `a+b` or `(a, b)` for a dimension
    sharded over several mesh axes and `None`/`_` for a replicated one; trailing dimensions
    may be left out (replicated); or
  - the name of a tactic: a function (ctx: ParamContext) -> PartitionSpec. Built in:
    `replicate`, `rules` (the logical-axis rules, i.e. no override), `fsdp_largest` (the
    largest dimension divisible by the fsdp axis goes over fsdp).

Users register tactics (and rule presets) in their own module and name it in the config
(`plugins: [my_pkg.rules]` in the run config, imported with it), no edit of rpeg_jax:

    from rpeg_jax.sharding import tactic, register_rules

    @tactic("vocab_over_data")
    def vocab_over_data(ctx):
        return ctx.spec({"vocab": "data"})      # or return jax.P(...)

    register_rules("my_preset", [["batch", ["data", "fsdp"]], ["mlp", "tensor"]])

Callers: params.py (`apply_overrides` inside `param_specs`), `rpeg shardings`, the runtime.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rpeg_jax.config.base import ConfigError, suggest
from rpeg_jax.config.registry import Registry
from rpeg_jax.sharding.rules import Rules, ShardingError, _caller_module, mesh_axes_tuple, resolve


@dataclass(frozen=True)
class ParamContext:
    """What a tactic sees about one parameter."""

    name: str  # dotted path, e.g. "layers.wq"
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axes (None where unknown)
    dtype: Any
    mesh: Any  # Mesh or AbstractMesh
    rules: Rules

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def by_rules(self, rules: Rules | None = None):
        """The spec the logical-axis rules give (optionally other rules)."""
        return resolve(self.axes, self.shape, self.mesh, rules or self.rules, self.name)

    def spec(self, mapping: dict[str, Any]):
        """A spec from {logical axis: mesh axes} for this parameter only (other dims replicated)."""
        return self.by_rules(Rules.from_data([[k, v] for k, v in mapping.items()], f"tactic for {self.name}"))


Tactic = Callable[[ParamContext], Any]
TACTICS = Registry("tactic", key="sharding.overrides")  # name -> fn(ctx) -> PartitionSpec (config/registry.py)


def tactic(name: str, *, origin: str | None = None):
    """Decorator: register `fn(ctx: ParamContext) -> PartitionSpec` as tactic `name`. Registering
    the same name from two different modules is a conflict (one line naming both)."""

    def register(fn: Tactic) -> Tactic:
        return TACTICS.register(name, fn, origin=origin or getattr(fn, "__module__", None) or _caller_module())

    return register


@tactic("replicate")
def _replicate(ctx: ParamContext):
    from jax.sharding import PartitionSpec

    return PartitionSpec()


@tactic("rules")
def _rules(ctx: ParamContext):
    return ctx.by_rules()


@tactic("fsdp_largest")
def _fsdp_largest(ctx: ParamContext):
    from jax.sharding import PartitionSpec

    n = ctx.mesh_sizes.get("fsdp", 1)
    dims = sorted(range(len(ctx.shape)), key=lambda d: -ctx.shape[d])
    for d in dims:
        if n > 1 and ctx.shape[d] % n == 0:
            return PartitionSpec(*[("fsdp" if i == d else None) for i in range(len(ctx.shape))])
    return PartitionSpec()


_NONE = ("", "_", "none", "None", "null", "~")


def parse_partition(text: str):
    """'P(fsdp, None)' | 'fsdp, None' | 'P((data, fsdp), tensor)' | 'data+fsdp' -> PartitionSpec."""
    from jax.sharding import PartitionSpec

    body = text.strip()
    if body.startswith("P(") or body.startswith("PartitionSpec("):
        if not body.endswith(")"):
            raise ValueError(f"unbalanced parentheses in {text!r}")
        body = body[body.index("(") + 1 : -1]
    entries, depth, cur = [], 0, ""
    for ch in body:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            raise ValueError(f"unbalanced parentheses in {text!r}")
        if ch == "," and depth == 0:
            entries.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced parentheses in {text!r}")
    entries.append(cur)
    if len(entries) == 1 and not entries[0].strip():
        return PartitionSpec()
    out = []
    for e in entries:
        e = e.strip().strip("'\"")
        if e.startswith("("):
            parts = [p.strip().strip("'\"") for p in e.strip("()").split(",") if p.strip()]
            out.append(tuple(parts) if len(parts) > 1 else (parts[0] if parts else None))
        elif e in _NONE:
            out.append(None)
        else:
            axes = mesh_axes_tuple(e)
            out.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


@dataclass(frozen=True)
class Override:
    index: int
    pattern: str
    action: str
    regex: Any
    tactic: Tactic | None  # None -> `partition`
    partition: Any

    @property
    def key(self) -> str:
        return f"sharding.overrides[{self.index}]"


def parse_overrides(items: Sequence[Sequence[str]]) -> list[Override]:
    """Compile (pattern, action) pairs; bad regexes and unknown tactics raise ConfigError naming
    the entry. Plugins (the run config's `plugins:`) are imported before, so their tactics are known."""
    out = []
    for i, item in enumerate(items):
        key = f"sharding.overrides[{i}]"
        if len(item) != 2:
            raise ConfigError(key, item, "must be [pattern, tactic or partition]")
        pattern, action = item
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ConfigError(key, pattern, f"bad regular expression: {e}") from None
        if action in TACTICS:
            out.append(Override(i, pattern, action, regex, TACTICS[action], None))
            continue
        if not _looks_like_partition(action):
            raise ConfigError(
                key,
                action,
                "neither a known tactic ("
                + ", ".join(TACTICS)
                + ")"
                + suggest(action, list(TACTICS))
                + " nor a partition like 'P(fsdp, None)'",
            )
        try:
            out.append(Override(i, pattern, action, regex, None, parse_partition(action)))
        except ValueError as e:
            raise ConfigError(key, action, str(e)) from None
    return out


def _looks_like_partition(text: str) -> bool:
    t = text.strip()
    return t.startswith("P(") or t.startswith("PartitionSpec(") or "," in t or "+" in t or t in _NONE


def check_spec(spec: Any, ctx: ParamContext, source: str):
    """Validate a spec from an override or tactic against the parameter and the mesh; pad it to
    the rank. Errors name the parameter and `source` (e.g. "sharding.overrides[2]")."""
    from jax.sharding import PartitionSpec

    sizes = ctx.mesh_sizes
    if not isinstance(spec, PartitionSpec):
        raise ShardingError(
            f"{source} gave {spec!r} for {ctx.name!r}; a tactic must return a PartitionSpec", key=source, value=ctx.name
        )
    entries = tuple(spec)
    if len(entries) > len(ctx.shape):
        raise ShardingError(
            f"{source}: {spec} has {len(entries)} entries but parameter {ctx.name!r} has shape {ctx.shape}",
            key=source,
            value=ctx.name,
        )
    used: set[str] = set()
    for dim, entry in enumerate(entries):
        axes = mesh_axes_tuple(entry)
        for a in axes:
            if a not in sizes:
                raise ShardingError(
                    f"{source}: mesh axis {a!r} in {spec} for {ctx.name!r} is not in the mesh {sizes}",
                    key=source,
                    value=ctx.name,
                )
            if a in used:
                raise ShardingError(
                    f"{source}: mesh axis {a!r} used twice in {spec} for {ctx.name!r}", key=source, value=ctx.name
                )
            used.add(a)
        ways = 1
        for a in axes:
            ways *= sizes[a]
        if ctx.shape[dim] % ways:
            raise ShardingError(
                f"{source}: dimension {dim} of {ctx.name!r} (logical axis {ctx.axes[dim]!r}, size "
                f"{ctx.shape[dim]}) is not divisible by mesh axis {'x'.join(axes)} (size {ways})",
                key=source,
                value=ctx.name,
            )
    return PartitionSpec(*entries, *([None] * (len(ctx.shape) - len(entries))))
