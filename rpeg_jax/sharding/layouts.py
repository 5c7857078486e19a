"""One stage's layout (mesh + rules + overrides) built from the config: what the runtime calls
(runtime/placement.py builds one per planned stage).

    from rpeg_jax.sharding import stage_layout
    train = stage_layout(cfg.sharding, "train")                  # all global devices
    gen = stage_layout(cfg.sharding, "generate", devices=gen_devs) # or a sub-mesh
    shardings = train.params(model_state)                        # NamedSharding tree
    with train.activations():                                    # model's constrain() calls
        ...                                                      # now shard activations
    gen_params = resharder(params, gen.params(params_state))

`layout_for(mesh_spec, rules_name, cfg.sharding, devices)` does the same for a planner's stage
(graph Plan: StagePlan.mesh, StagePlan.rules). With `num_devices` instead of devices the mesh is
abstract (no devices; `rpeg shardings`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.sharding import ShardingConfig, rules_for_mesh
from rpeg_jax.sharding import axes as _axes
from rpeg_jax.sharding.mesh import MeshError, abstract_mesh, canonical_spec, make_mesh, mesh_scope
from rpeg_jax.sharding.params import param_shardings, param_specs, param_table
from rpeg_jax.sharding.rules import PRESETS, Rules, activation_resolver, get_rules, register_rules, resolve
from rpeg_jax.sharding.tactics import Override, parse_overrides

ROLES = ("train", "generate")


def load_extensions(cfg: ShardingConfig) -> None:
    """Register the config's own rule sets (idempotent; plugins were imported with the config)."""
    for name, data in cfg.rules.items():
        current = PRESETS[name] if name in PRESETS else None
        new = Rules.from_data(data, name)
        if current is None or current.rules != new.rules:
            register_rules(name, new, origin="config sharding.rules")


@dataclass(frozen=True)
class StageLayout:
    role: str
    mesh: Any  # jax Mesh, or AbstractMesh when built without devices
    rules: Rules
    overrides: tuple[Override, ...]

    def param_specs(self, tree: Any, unmatched_ok: bool = False) -> Any:
        return param_specs(tree, self.mesh, self.rules, list(self.overrides), unmatched_ok=unmatched_ok)

    def params(self, tree: Any, unmatched_ok: bool = False) -> Any:
        """NamedSharding tree for a model / nnx.State / pytree of nnx.Variables."""
        return param_shardings(tree, self.mesh, self.rules, list(self.overrides), unmatched_ok=unmatched_ok)

    def table(self, tree: Any, unmatched_ok: bool = False):
        return param_table(tree, self.mesh, self.rules, list(self.overrides), unmatched_ok=unmatched_ok)

    def spec(self, logical: Sequence[str | None], shape: Sequence[int], name: str = "array", strict: bool = False):
        """PartitionSpec of a data array (e.g. a batch: ('batch', 'seq'))."""
        return resolve(tuple(logical), tuple(shape), self.mesh, self.rules, name, strict=strict)

    def sharding(self, logical: Sequence[str | None], shape: Sequence[int], name: str = "array"):
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, self.spec(logical, shape, name))

    def check_experts(self, num_experts: int, key: str) -> None:
        """A ConfigError naming `key` (the stage's mesh key) when this layout's rules split a
        mixture's `num_experts` experts over mesh axes whose size does not divide it (expert
        parallelism; config/run.py checks the meshes the config fixes, this the resolved ones)."""
        if num_experts <= 0:
            return
        sizes = dict(self.mesh.shape)
        for rule in self.rules.for_axis("expert"):
            live = tuple(a for a in rule.mesh if sizes.get(a, 1) > 1)
            ways = 1
            for a in live:
                ways *= sizes[a]
            if num_experts % ways and rule.indivisible == "error":
                raise ConfigError(
                    key,
                    sizes,
                    f"rules {self.rules.name!r} split the model.num_experts={num_experts} experts over "
                    f"{'x'.join(live)} = {ways} devices (expert parallelism): must divide {num_experts}",
                )
            if num_experts % ways == 0 or rule.indivisible != "next":
                return

    @contextlib.contextmanager
    def activations(self):
        """Within: `axes.constrain` in model code applies this layout's rules; with explicit axis
        types the mesh is also the current one (`jax.set_mesh`), which sharding in types needs."""
        with mesh_scope(self.mesh), _axes.use_resolver(activation_resolver(self.mesh, self.rules)):
            yield


def layout_for(
    mesh_spec: dict[str, int],
    rules: str | Rules,
    cfg: ShardingConfig,
    devices: Sequence[Any] | None = None,
    *,
    num_devices: int | None = None,
    role: str = "train",
) -> StageLayout:
    """A stage layout on `devices` (default all) or, with `num_devices`, on an abstract mesh."""
    load_extensions(cfg)
    key = "sharding.generate_rules" if role == "generate" else "sharding.train_rules"
    spec = canonical_spec(mesh_spec)
    try:
        if num_devices is not None:
            mesh = abstract_mesh(spec, num_devices, axis_types=cfg.axis_types)
        else:
            mesh = make_mesh(spec, devices, axis_types=cfg.axis_types, devices_per_node=cfg.devices_per_node)
    except MeshError as e:
        mesh_key = "sharding.generate_mesh" if role == "generate" and cfg.generate_mesh else "sharding.mesh"
        raise ConfigError(mesh_key, dict(mesh_spec), str(e)) from None
    if rules == "auto":  # the built-in preset that puts every axis of this mesh to work
        rules = rules_for_mesh(rules, dict(mesh.shape), role)
    return StageLayout(role, mesh, get_rules(rules, key), tuple(parse_overrides(cfg.overrides)))


def stage_layout(
    cfg: ShardingConfig, role: str, devices: Sequence[Any] | None = None, *, num_devices: int | None = None
) -> StageLayout:
    """The layout of training ("train") or generation ("generate") stages from the config."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: must be one of {ROLES}")
    if role == "generate":
        mesh, rules = cfg.generate_mesh or cfg.mesh, cfg.generate_rules
    else:
        mesh, rules = cfg.mesh, cfg.train_rules
    return layout_for(mesh, rules, cfg, devices, num_devices=num_devices, role=role)
