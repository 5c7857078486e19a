"""rpeg_jax.sharding: meshes, logical-axis rules, the user extension point, resharding, multi-host.

Public API (what the runtime, `rpeg shardings` and users call):
  meshes       make_mesh, abstract_mesh, sub_meshes, canonical_spec, mesh_scope (mesh.py)
  rules        Rule, Rules, resolve, PRESETS, register_rules, get_rules,
               activation_resolver, ShardingError                           (rules.py)
  extension    tactic, ParamContext, parse_overrides (tactics.py); plugins: config/registry.py
  parameters   param_specs, param_shardings, shard_model, shard_params      (params.py)
  stages       stage_layout, layout_for, StageLayout                        (layouts.py)
  resharding   Resharder, reshard_bytes, reshard_bytes_abstract             (reshard.py)
  multi-host   process start-up lives in rpeg_jax.runtime.distributed (resolve_spec, initialize, Watchdog)
Model code imports only rpeg_jax.sharding.axes (LOGICAL_AXES, constrain, use_resolver).
"""

from rpeg_jax.sharding.axes import LOGICAL_AXES, constrain, use_resolver
from rpeg_jax.sharding.layouts import StageLayout, layout_for, load_extensions, stage_layout
from rpeg_jax.sharding.mesh import (
    MESH_AXES,
    MeshError,
    abstract_mesh,
    canonical_spec,
    make_mesh,
    mesh_scope,
    sub_meshes,
)
from rpeg_jax.sharding.params import ParamInfo, param_infos, param_shardings, param_specs, shard_model, shard_params
from rpeg_jax.sharding.reshard import Resharder, ReshardPlan, reshard_bytes, reshard_bytes_abstract
from rpeg_jax.sharding.rules import (
    PRESETS,
    Rule,
    Rules,
    ShardingError,
    activation_resolver,
    get_rules,
    register_rules,
    resolve,
)
from rpeg_jax.sharding.tactics import ParamContext, parse_overrides, tactic

__all__ = [
    "LOGICAL_AXES",
    "constrain",
    "use_resolver",
    "StageLayout",
    "layout_for",
    "load_extensions",
    "stage_layout",
    "MESH_AXES",
    "MeshError",
    "abstract_mesh",
    "canonical_spec",
    "make_mesh",
    "mesh_scope",
    "sub_meshes",
    "ParamInfo",
    "param_infos",
    "param_shardings",
    "param_specs",
    "shard_model",
    "shard_params",
    "Resharder",
    "ReshardPlan",
    "reshard_bytes",
    "reshard_bytes_abstract",
    "PRESETS",
    "Rule",
    "Rules",
    "ShardingError",
    "activation_resolver",
    "get_rules",
    "register_rules",
    "resolve",
    "ParamContext",
    "parse_overrides",
    "tactic",
]
