"""Sharding section: the mesh, the logical-axis rule presets per stage role, overrides and plugins."""

from __future__ import annotations

from dataclasses import dataclass, field

from rpeg_jax.config.base import check, key

MESH_AXES = ("data", "fsdp", "tensor")


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    mesh: dict[str, int] = field(default_factory=lambda: {"data": -1, "fsdp": 1, "tensor": 1})
    train_rules: str = "fsdp"  # rule preset for training stages
    generate_rules: str = "data"  # rule preset for generation
    overrides: tuple[tuple[str, str], ...] = ()  # (parameter-path regex, tactic or partition), first match wins
    plugins: tuple[str, ...] = ()  # importable modules that register tactics/rules

    def validate(self, path: str) -> None:
        for name, size in self.mesh.items():
            check(name in MESH_AXES, key(path, f"mesh.{name}"), size, f"unknown mesh axis; known: {', '.join(MESH_AXES)}")
            check(size == -1 or size >= 1, key(path, f"mesh.{name}"), size, "must be -1 (fill) or >= 1")
        check(sum(1 for s in self.mesh.values() if s == -1) <= 1, key(path, "mesh"), self.mesh,
              "at most one axis may be -1")
