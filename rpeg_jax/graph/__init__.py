"""rpeg_jax.graph: the RPEG IR, its builders and passes, the Plan value and the exports.

Pure Python (no JAX import), so the cost model can plan a cluster on a laptop. graph/compile.py
(which does import JAX) is not re-exported here; import it explicitly. See graph/ir.py for the API.
"""

from rpeg_jax.graph.algorithms import build_graph, build_grpo, build_ppo
from rpeg_jax.graph.export import from_json, to_dot, to_json, to_mermaid
from rpeg_jax.graph.ir import (
    TIMING_NAMES,
    DataNode,
    DataSpec,
    Dep,
    Edge,
    Graph,
    GraphError,
    ModelDims,
    Op,
    Stage,
    StageKind,
    StateKind,
    StateNode,
    Workload,
)
from rpeg_jax.graph.passes import (
    apply_pipeline,
    bounded_async,
    elide_old_forward,
    fuse,
    fuse_named,
    place,
    share_actor_critic,
    stream_pieces,
)
from rpeg_jax.graph.plan import DeviceGroup, Plan, StagePlan, graph_for_plan, plan_for_config, plan_from_config

__all__ = [
    "build_graph",
    "build_grpo",
    "build_ppo",
    "from_json",
    "to_dot",
    "to_json",
    "to_mermaid",
    "TIMING_NAMES",
    "DataNode",
    "DataSpec",
    "Dep",
    "Edge",
    "Graph",
    "GraphError",
    "ModelDims",
    "Op",
    "Stage",
    "StageKind",
    "StateKind",
    "StateNode",
    "Workload",
    "apply_pipeline",
    "bounded_async",
    "elide_old_forward",
    "fuse",
    "fuse_named",
    "stream_pieces",
    "place",
    "share_actor_critic",
    "DeviceGroup",
    "Plan",
    "StagePlan",
    "graph_for_plan",
    "plan_for_config",
    "plan_from_config",
]
