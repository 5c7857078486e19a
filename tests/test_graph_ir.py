"""RPEG IR and builders: structure from the config, specs, workloads, versions, validation errors."""

import dataclasses

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.graph.algorithms import build_graph
from rpeg_jax.graph.ir import (
    TIMING_NAMES,
    DataNode,
    DataSpec,
    Dep,
    Edge,
    GraphError,
    Op,
    Stage,
    StageKind,
    StateKind,
    StateNode,
)
from rpeg_jax.graph.passes import bounded_async

# Distinct sizes so a swapped dimension shows: N=3 prompts, G=4, P=5, R=7.
SIZES = ["data.prompts_per_step=3", "rl.group_size=4", "data.max_prompt_len=5", "rollout.max_new_tokens=7"]


def cfg_of(*overrides):
    return load_config(None, [*SIZES, *overrides])


def stage_set(g):
    return set(g.stage_names())


def test_grpo_structure_without_and_with_reference():
    g = build_graph(cfg_of())
    assert stage_set(g) == {"generate", "reward", "old_forward", "advantage", "actor_update", "weight_sync"}
    assert not any(n in g.nodes for n in ("critic", "critic_opt", "reference", "values", "returns"))
    g = build_graph(cfg_of("rl.kl_coef=0.04"))
    assert "ref_forward" in stage_set(g)
    ref = g.nodes["reference"]
    assert ref.frozen and g.producer("reference") is None
    assert "ref_logp" in [e.src for e in g.inputs("actor_update")]


def test_ppo_structure():
    g = build_graph(cfg_of("rl.algorithm=ppo", "rl.kl_coef=0.1"))
    assert stage_set(g) == {
        "generate",
        "reward",
        "ref_forward",
        "old_forward",
        "critic_forward",
        "advantage",
        "actor_update",
        "critic_update",
        "weight_sync",
    }
    assert {e.dst for e in g.outputs("advantage")} == {"advantages", "returns"}
    assert {e.src for e in g.inputs("critic_update")} >= {"critic", "critic_opt", "values", "returns"}
    assert {e.dst for e in g.outputs("critic_update")} == {"critic", "critic_opt"}
    assert all(isinstance(g.nodes[n], StateNode) for n in ("critic", "critic_opt", "actor", "actor_opt"))


def test_every_stage_kind_has_a_verl_timing_name():
    assert set(TIMING_NAMES) == set(StageKind) - {StageKind.FUSED}
    assert TIMING_NAMES[StageKind.GENERATE] == "gen" and TIMING_NAMES[StageKind.OLD_FORWARD] == "old_log_prob"
    g = build_graph(cfg_of())
    assert all(s.name == s.kind.value for s in g.stages())  # unfused stage names are the enum values


def test_specs_have_concrete_shapes_axes_and_bytes():
    g = build_graph(cfg_of("rl.algorithm=ppo"))
    B, S, R = 3 * 4, 5 + 7, 7
    assert g.sizes == {"N": 3, "G": 4, "B": B, "P": 5, "R": R, "S": S}
    want = {
        "completions": ((B, S), np.int32),
        "behav_logp": ((B, R), np.float32),
        "old_logp": ((B, R), np.float32),
        "values": ((B, R), np.float32),
        "rewards": ((B,), np.float32),
        "advantages": ((B, R), np.float32),
        "returns": ((B, R), np.float32),
    }
    for name, (shape, dtype) in want.items():
        spec = g.nodes[name].spec
        assert spec.shape == shape, name
        assert spec.bytes == np.zeros(shape, dtype).nbytes, name
        assert spec.axes[0] == "batch" and len(spec.axes) == len(shape)


def test_workloads_describe_the_computation():
    cfg = cfg_of(
        "rl.algorithm=ppo",
        "rl.ppo_epochs=2",
        "rl.minibatches=3",
        "critic.preset=tiny",
        "critic.hidden_size=128",
        "critic.num_heads=2",
        "critic.num_kv_heads=1",
    )
    g = build_graph(cfg)
    gen = g.stage("generate").workload
    assert gen.op == Op.GENERATE and (gen.n_seqs, gen.prompt_len, gen.response_len, gen.group_size) == (12, 5, 7, 4)
    assert gen.tokens == 12 * 12
    upd = g.stage("actor_update").workload
    assert upd.op == Op.TRAIN and upd.optimizer_steps == 6
    (actor,) = upd.models
    m = cfg.model
    assert (actor.role, actor.hidden_size, actor.num_layers, actor.vocab_size) == (
        "actor",
        m.hidden_size,
        m.num_layers,
        m.vocab_size,
    )
    assert actor.num_params == m.num_params() and not actor.value_head
    (critic,) = g.stage("critic_forward").workload.models
    assert critic.role == "critic" and critic.hidden_size == 128 and critic.value_head
    assert critic.num_params == cfg.critic_model.num_params()
    assert g.nodes["actor"].bytes == m.num_params() * 4  # float32 params
    assert g.nodes["actor_opt"].bytes == m.num_params() * 8  # Adam m and v in float32
    ws = g.stage("weight_sync").workload
    assert ws.op == Op.TRANSFER and ws.bytes_moved == m.num_params() * 4


def test_topo_order_puts_same_step_dependencies_first():
    for extra in ((), ("rl.algorithm=ppo", "rl.kl_coef=0.1")):
        g = build_graph(cfg_of(*extra))
        order = g.topo_order()
        assert set(order) == stage_set(g)
        for s in order:
            for d in g.deps(s):
                if d.step_offset == 0:
                    assert order.index(d.stage) < order.index(s), (d, s)


def test_deps_follow_version_offsets():
    g = build_graph(cfg_of())
    assert Dep("weight_sync", -1, "rollout_weights") in g.deps("generate")  # reads θ_t synced last step
    assert Dep("actor_update", 0, "actor") in g.deps("weight_sync")  # reads θ_{t+1} this step
    assert Dep("actor_update", -1, "actor") in g.deps("old_forward")
    assert Dep("generate", 0, "completions") in g.deps("reward")
    g2 = bounded_async(g, 2)
    assert Dep("weight_sync", -3, "rollout_weights") in g2.deps("generate")  # θ_{t-2}


def _unroll(g, steps, duration=1.0):
    """Independent earliest-start schedule (unbounded devices): finish[(stage, t)]."""
    finish = {}
    for t in range(steps):
        for s in g.topo_order():
            start = 0.0
            for d in g.deps(s):
                if t + d.step_offset >= 0:
                    start = max(start, finish[(d.stage, t + d.step_offset)])
            finish[(s, t)] = start + duration
    return finish


def test_staleness_lets_generation_run_ahead():
    g = build_graph(cfg_of())
    sync, k1 = _unroll(g, 3), _unroll(bounded_async(g, 1), 3)
    # synchronous: generation of step 1 waits for step 0's weight sync (6 stages in a chain)
    assert sync[("generate", 1)] == sync[("weight_sync", 0)] + 1
    # k = 1: generation of step 1 only waits for generation of step 0 (data iterator)
    assert k1[("generate", 1)] == k1[("generate", 0)] + 1
    assert k1[("weight_sync", 2)] < sync[("weight_sync", 2)]


def test_validate_names_a_missing_producer():
    g = build_graph(cfg_of())
    g.remove("reward")
    with pytest.raises(GraphError, match="'rewards'.*no producer.*advantage"):
        g.validate()


def test_validate_names_a_spec_mismatch():
    g = build_graph(cfg_of())
    bad = DataSpec(("B", "S"), (12, 12), "float32", ("batch", None))
    g.replace_node(DataNode("old_logp", bad))
    with pytest.raises(GraphError, match="'actor_update'.*old_logp.*expects"):
        g.validate()


def test_validate_names_a_cycle():
    g = build_graph(cfg_of())
    g.connect("advantages", "reward", port="advantages")
    with pytest.raises(GraphError, match="cycle"):
        g.validate()


@pytest.mark.parametrize(
    "mutate, node, why",
    [
        (lambda g: g.connect("advantage", "actor", offset=1), "actor", "several writers"),
        (
            lambda g: (
                g.add(StateNode("scratch", StateKind.ROLLOUT_BUFFER)),
                g.connect("old_forward", "scratch", offset=0),
            ),
            "old_forward",
            "offset 0",
        ),
        (lambda g: g.connect("actor", "reward", offset=2), "reward", "future"),
        (lambda g: g.connect("data_iterator", "generate", offset=1), "generate", "no other stage writes"),
        (lambda g: g.connect("actor_opt", "generate", offset=1), "generate", "cycle"),
        (lambda g: g.connect("completions", "missing_stage"), "completions", "missing node"),
        (lambda g: g.connect("rewards", "old_logp"), "old_logp", "must join a stage"),
        (lambda g: g.connect("rewards", "weight_sync", offset=-1), "rewards", "data lives within one step"),
        (lambda g: g.replace_node(dataclasses.replace(g.nodes["reward"], pieces=0)), "reward", "pieces"),
    ],
)
def test_validate_errors_name_the_node(mutate, node, why):
    g = build_graph(cfg_of())
    mutate(g)
    with pytest.raises(GraphError, match=why) as e:
        g.validate()
    assert e.value.node == node


def test_frozen_state_may_not_be_written():
    g = build_graph(cfg_of("rl.kl_coef=0.1"))
    g.connect("actor_update", "reference", offset=1)
    with pytest.raises(GraphError, match="frozen") as e:
        g.validate()
    assert e.value.node == "reference"


def test_duplicate_node_names_are_rejected():
    g = build_graph(cfg_of())
    with pytest.raises(GraphError, match="duplicate"):
        g.add(StateNode("actor", StateKind.ACTOR))


def test_stream_edges_need_matching_pieces():
    g = build_graph(cfg_of())
    g.edges = [
        dataclasses.replace(e, stream=True) if (e.src, e.dst) == ("completions", "reward") else e for e in g.edges
    ]
    g.replace_node(dataclasses.replace(g.stage("generate"), pieces=3))
    with pytest.raises(GraphError, match="3 pieces") as e:
        g.validate()
    assert e.value.node == "reward"


def test_fused_stage_needs_parts_and_plain_stage_a_workload():
    g = build_graph(cfg_of())
    g.add(Stage("lonely", StageKind.FUSED))
    with pytest.raises(GraphError, match="at least two parts"):
        g.validate()
    g = build_graph(cfg_of())
    g.replace_node(dataclasses.replace(g.stage("reward"), workload=None))
    with pytest.raises(GraphError, match="workload"):
        g.validate()


def test_edges_default_ports_to_the_node_names():
    g = build_graph(cfg_of())
    assert Edge("actor", "old_forward", 0, "actor") in g.edges
    assert Edge("actor_update", "actor", 1, "actor") in g.edges


def test_graph_package_imports_no_jax():
    """What importing the graph and `rpeg graph` pulls in, transitively (which package may import
    which, function-level imports included: tests/test_layers.py)."""
    import subprocess
    import sys

    code = (
        "import sys, rpeg_jax.graph, rpeg_jax.cli.graph; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
