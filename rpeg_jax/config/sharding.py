"""Sharding section: the mesh, the logical-axis rule presets per stage role, overrides and plugins.

Pure Python (no JAX): the rules themselves and their semantics live in rpeg_jax/sharding/rules.py;
the extension point (overrides, tactics, plugins) in rpeg_jax/sharding/tactics.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rpeg_jax.config.base import check, key

MESH_AXES = ("data", "fsdp", "tensor")  # outermost .. innermost (fastest-changing, kept inside a node)


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    mesh: dict[str, int] = field(default_factory=lambda: {"data": -1, "fsdp": 1, "tensor": 1})  # axis -> size, -1 fills
    generate_mesh: dict[str, int] | None = None  # mesh of generation stages; None -> `mesh`
    train_rules: str = "auto"  # rule preset for training stages (auto|replicated|data|fsdp|tensor|fsdp_tensor|
    #   fsdp_expert|fsdp_expert_tensor|custom)
    generate_rules: str = "auto"  # rule preset for generation; auto: see `rules_for_mesh`
    rules: dict[str, Any] = field(default_factory=dict)  # custom presets: name -> [[logical, mesh axes(, policy)], ...]
    overrides: tuple[tuple[str, str], ...] = ()  # (parameter-path regex, tactic or partition), first match wins
    axis_types: Literal["auto", "explicit"] = "auto"  # AxisType of all mesh axes (explicit: see docs/sharding.md)
    devices_per_node: int | None = None  # e.g. 4 on GH200 nodes: checks that `tensor` stays inside a node

    def validate(self, path: str) -> None:
        for name, mesh in (("mesh", self.mesh), ("generate_mesh", self.generate_mesh)):
            if mesh is not None:
                _check_mesh(mesh, key(path, name))
        for name, data in self.rules.items():
            check(name != "auto", key(path, f"rules.{name}"), name, "'auto' is reserved (the preset chosen by mesh)")
            _check_rules(data, key(path, f"rules.{name}"))
        for i, pair in enumerate(self.overrides):
            try:
                re.compile(pair[0])
            except re.error as e:
                check(False, key(path, f"overrides[{i}]"), pair[0], f"bad regular expression: {e}")
        if self.devices_per_node is not None:
            check(self.devices_per_node >= 1, key(path, "devices_per_node"), self.devices_per_node, "must be >= 1")


# The built-in rule presets as data ([logical axis, mesh axes(, policy)]; semantics and the table in
# rpeg_jax/sharding/rules.py, which registers them). Kept here, JAX-free, so that the config checks
# (an expert split that must divide model.num_experts) and the planner read the same presets.
_BATCH = [("batch", ("data", "fsdp"))]
_TENSOR = [("heads", "tensor"), ("kv_heads", "tensor", "replicate"), ("mlp", "tensor"), ("vocab", "tensor")]
PRESET_DATA: dict[str, list] = {
    "replicated": [],
    "data": _BATCH,
    "fsdp": _BATCH + [("embed", "fsdp")],
    "tensor": _BATCH + _TENSOR,
    "fsdp_tensor": _BATCH + _TENSOR + [("embed", "fsdp")],
    # expert parallelism for a mixture of experts: each fsdp shard holds whole experts (X / fsdp of
    # them) rather than a slice of every expert, the tokens reach them by an all-to-all
    # (models/moe.py); the other weights as fsdp (+ tensor)
    "fsdp_expert": _BATCH + [("expert", "fsdp"), ("embed", "fsdp")],
    "fsdp_expert_tensor": _BATCH + [("expert", "fsdp")] + _TENSOR + [("embed", "fsdp")],
}
# the presets a priced plan may lift to fit its mesh (`rules_for_mesh`): all built-in ones
BUILTIN_RULES = tuple(PRESET_DATA)
EXPERT_RULES = ("fsdp_expert", "fsdp_expert_tensor")
AUTO_BASE = {"train": "fsdp", "generate": "data"}  # what `auto` is on a mesh of data replicas only


def expert_axes(rules: str, cfg: ShardingConfig) -> tuple[str, ...] | None:
    """The mesh axes the rule set named `rules` splits a mixture's `expert` dimension over (its
    first rule for `expert`; () when it has none), from the built-in presets or the config's own
    `sharding.rules`; None for a name registered by a plugin (known only at run time)."""
    data = cfg.rules.get(rules, PRESET_DATA.get(rules))
    if data is None:
        return None
    for item in data:
        if item[0] == "expert":
            mesh = item[1]
            axes = [mesh] if isinstance(mesh, str) else list(mesh or [])
            return tuple(p for a in axes for p in str(a).split("+") if p)
    return ()


def rules_for_mesh(rules: str, mesh: dict[str, int], role: str, *, priced: bool = False) -> str:
    """The rule preset a stage runs with on `mesh` (sizes per axis; role "train" | "generate").

    `auto` is the built-in preset that puts every mesh axis above 1 to work: `tensor` shards heads,
    MLP and vocabulary, `fsdp` shards the training weights (ZeRO-3; generation keeps whole weights
    per replica and splits only the batch over it), nothing is computed twice. With `priced` (the
    planner's plans) a built-in preset is lifted the same way, since the cost model priced the
    mesh as exactly that; without, an explicit preset stands as given. A user's own preset is
    always kept. Why lifted: with `fsdp` / `data` whatever the mesh, a (fsdp 2, tensor 2) update
    runs replicated over `tensor`, 2x the work (measured on 2026-12-01, bench/NOTES.md session 7:
    0.96 vs 0.52 CPU s per step)."""
    if rules == "auto":
        rules, priced = AUTO_BASE[role], True
    if not priced or rules not in BUILTIN_RULES:
        return rules
    d, f, t = (mesh.get(a, 1) > 1 for a in ("data", "fsdp", "tensor"))
    if rules in EXPERT_RULES:  # expert parallelism over fsdp kept; tensor put to work when there is one
        return "fsdp_expert_tensor" if t or rules == "fsdp_expert_tensor" else "fsdp_expert"
    if role == "train" and f:
        return "fsdp_tensor" if t or rules == "fsdp_tensor" else "fsdp"
    if t:
        return "fsdp_tensor" if rules == "fsdp_tensor" else "tensor"
    return "data" if rules == "replicated" and (d or f) else rules


def _check_mesh(mesh: dict[str, int], path: str) -> None:
    for name, size in mesh.items():
        check(name in MESH_AXES, key(path, name), size, f"unknown mesh axis; known: {', '.join(MESH_AXES)}")
        check(size == -1 or size >= 1, key(path, name), size, "must be -1 (fill) or >= 1")
    check(sum(1 for s in mesh.values() if s == -1) <= 1, path, mesh, "at most one axis may be -1")


def _check_rules(data: Any, path: str) -> None:
    check(isinstance(data, (list, tuple)), path, data, "must be a list of [logical, mesh axes(, policy)]")
    for i, item in enumerate(data):
        ok = isinstance(item, (list, tuple)) and len(item) in (2, 3) and isinstance(item[0], str)
        check(ok, f"{path}[{i}]", item, "must be [logical axis, mesh axes or null(, error|replicate|next)]")
        mesh = item[1]
        axes = [mesh] if isinstance(mesh, str) else list(mesh or [])
        for a in axes:
            for part in str(a).split("+"):
                check(part in MESH_AXES, f"{path}[{i}]", item, f"unknown mesh axis {part!r}; known: {MESH_AXES}")
        if len(item) == 3:
            check(
                item[2] in ("error", "replicate", "next"),
                f"{path}[{i}]",
                item,
                "policy must be error, replicate or next",
            )
