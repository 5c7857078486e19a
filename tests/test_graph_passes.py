"""Each RPEG pass on its own: structure before/after, invariants, idempotence, illegal uses."""

import itertools

import pytest

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.graph.algorithms import build_graph
from rpeg_jax.graph.ir import DataNode, DataSpec, GraphError, StageKind, StateNode
from rpeg_jax.graph.passes import (
    apply_pipeline,
    bounded_async,
    elide_old_forward,
    fuse,
    fuse_named,
    place,
    share_actor_critic,
    stream_pieces,
    values_from_critic_update,
)

SIZES = ["data.prompts_per_step=4", "rl.group_size=2", "data.max_prompt_len=5", "rollout.max_new_tokens=7"]


def graph(*overrides):
    return build_graph(load_config(None, [*SIZES, *overrides]))


def ppo(*extra):
    return graph("rl.algorithm=ppo", "rl.kl_coef=0.1", *extra)


def srcs(g, stage, port=None):
    return {e.src for e in g.inputs(stage) if port is None or e.port == port}


def same_structure(a, b):
    return a.nodes == b.nodes and a.edges == b.edges


def kinds(g):
    """Multiset of the stage kinds a graph computes (fused stages count their parts)."""
    return sorted(p.kind.value for s in g.stages() for p in (s.parts or (s,)))


# ---- bounded_async ----------------------------------------------------------------------------
def test_bounded_async_zero_is_the_synchronous_graph():
    g = graph()
    assert same_structure(bounded_async(g, 0), g)
    assert bounded_async(g, 0).attrs["passes"] == []  # nothing changed, nothing recorded


def test_bounded_async_reads_stale_weights_and_bounds_the_buffer():
    g = graph()
    a = bounded_async(g, 2)
    (e,) = [e for e in a.edges if (e.src, e.dst) == ("rollout_weights", "generate")]
    assert e.offset == -2 and a.staleness == 2 and g.staleness == 0
    assert isinstance(a.nodes["rollout_buffer"], StateNode)  # a state node, so it is checkpointed
    assert a.producer("rollout_buffer") == "generate" and "rollout_buffer" in srcs(a, "generate")
    assert "behav_logp" in srcs(a, "actor_update", "behav_logp") and "old_logp" in srcs(a, "actor_update", "old_logp")
    assert "old_forward" in a.stage_names()  # the proximal policy is recomputed
    assert kinds(a) == kinds(g)
    assert "rollout_buffer" not in g.nodes  # input untouched


def test_bounded_async_is_idempotent_and_reversible():
    g = graph()
    a = bounded_async(g, 1)
    assert bounded_async(a, 1) == a
    back = bounded_async(a, 0)
    assert same_structure(back, g)
    assert bounded_async(bounded_async(a, 3), 1).nodes == a.nodes


def test_bounded_async_keeps_the_tis_input_when_going_back_to_sync():
    g = graph("rl.tis_cap=2.0")
    assert "behav_logp" in srcs(g, "actor_update")
    assert same_structure(bounded_async(bounded_async(g, 2), 0), g)


def test_bounded_async_illegal_uses():
    with pytest.raises(GraphError, match="k=-1") as e:
        bounded_async(graph(), -1)
    assert e.value.node == "generate"
    with pytest.raises(GraphError, match="recomputed") as e:
        bounded_async(elide_old_forward(graph()), 1)
    assert e.value.node == "old_forward"


# ---- share_actor_critic -----------------------------------------------------------------------
def test_share_actor_critic_on_grpo_is_an_error():
    with pytest.raises(GraphError, match="needs a critic.*grpo") as e:
        share_actor_critic(graph())
    assert e.value.node == "critic"


def test_share_actor_critic_merges_forwards_and_updates():
    g = ppo()
    s = share_actor_critic(g)
    gone = {"critic", "critic_opt", "critic_forward", "critic_update"}
    assert gone <= set(g.nodes) and not gone & set(s.nodes)
    assert s.producer("values") == "old_forward"
    assert set(s.stage("old_forward").workload.heads) == {"logp", "values"}
    assert {"values", "returns", "advantages", "old_logp"} <= srcs(s, "actor_update")
    assert s.stage("actor_update").options.value_loss and not g.stage("actor_update").options.value_loss
    (m,) = s.stage("actor_update").workload.models
    (a,) = g.stage("actor_update").workload.models
    assert m.value_head and m.num_params == a.num_params + a.hidden_size + 1  # value_w [D] + value_b []
    assert s.nodes["actor"].bytes == m.num_params * 4
    assert share_actor_critic(s) == s  # idempotent


def test_share_after_elide_reads_values_from_the_actor():
    s = share_actor_critic(elide_old_forward(ppo()))
    assert srcs(s, "critic_forward") == {"actor", "completions"}
    assert s.stage("critic_forward").workload.models[0].role == "actor"


def test_share_after_fusing_critic_stages_is_an_error():
    with pytest.raises(GraphError, match="before fuse"):
        share_actor_critic(fuse_named(ppo(), "forwards"))


# ---- elide_old_forward ------------------------------------------------------------------------
def test_elide_old_forward_wires_behaviour_logprobs():
    g = graph()
    e = elide_old_forward(g)
    assert "old_forward" not in e.nodes and "old_logp" not in e.nodes
    assert srcs(e, "actor_update", "old_logp") == {"behav_logp"}
    assert kinds(e) == sorted(k for k in kinds(g) if k != "old_forward")
    assert elide_old_forward(e) == e


def test_elide_checks_the_spec_of_the_behaviour_logprobs():
    g = graph()
    g.replace_node(DataNode("behav_logp", DataSpec(("B", "R"), (8, 7), "bfloat16", ("batch", None))))
    with pytest.raises(GraphError, match="expects") as e:
        elide_old_forward(g)
    assert e.value.node == "actor_update"


def test_elide_illegal_under_staleness_or_shared_backbone():
    with pytest.raises(GraphError, match="recomputed"):
        elide_old_forward(bounded_async(graph(), 1))
    with pytest.raises(GraphError, match="before share_actor_critic"):
        elide_old_forward(share_actor_critic(ppo()))


# ---- fuse -------------------------------------------------------------------------------------
def test_fuse_forwards_records_parts_and_keeps_outputs():
    g = ppo()
    f = fuse_named(g, "forwards")
    st = f.stage("forwards")
    assert st.kind == StageKind.FUSED
    assert st.constituents == ("ref_forward", "old_forward", "critic_forward")
    assert st.timing_names() == ("ref", "old_log_prob", "values")
    assert {e.dst for e in f.outputs("forwards")} == {"ref_logp", "old_logp", "values"}
    assert srcs(f, "forwards") == {"reference", "actor", "critic", "completions"}
    assert sum(e.src == "completions" for e in f.inputs("forwards")) == 1  # one pass over the tokens
    assert kinds(f) == kinds(g)
    assert fuse_named(f, "forwards") == f
    assert fuse(f, ["ref_forward", "old_forward", "critic_forward"], "forwards") == f


def test_fuse_advantage_into_update_makes_advantages_internal():
    g = ppo()
    f = fuse_named(g, "advantage")
    st = f.stage("advantage+actor_update")
    assert "advantages" not in f.nodes and st.options.internal == ("advantages",)
    assert f.producer("returns") == st.name  # still consumed by critic_update
    assert f.topo_order().index(st.name) < f.topo_order().index("critic_update")
    assert fuse_named(f, "advantage") == f


def test_fuse_update_and_weight_sync_drops_the_internal_state_read():
    f = fuse(graph(), ["actor_update", "weight_sync"])
    assert not any(e.offset == 1 and e.dst == "actor_update+weight_sync" for e in f.inputs("actor_update+weight_sync"))
    assert f.producer("rollout_weights") == "actor_update+weight_sync"


def test_fuse_of_fused_flattens_parts():
    f = fuse(fuse(ppo(), ["ref_forward", "old_forward"]), ["ref_forward+old_forward", "critic_forward"])
    assert f.stage("ref_forward+old_forward+critic_forward").constituents == (
        "ref_forward",
        "old_forward",
        "critic_forward",
    )


@pytest.mark.parametrize(
    "stages, node, why",
    [
        (["generate", "advantage"], "reward", "cycle"),  # generate -> reward -> advantage
        (["old_forward", "nope"], "nope", "no such stage"),
        (["old_forward"], "old_forward", "two distinct"),
    ],
)
def test_fuse_illegal(stages, node, why):
    with pytest.raises(GraphError, match=why) as e:
        fuse(graph(), stages)
    assert e.value.node == node


def test_fuse_rejects_mixed_placements():
    g = place(ppo(), "split")
    with pytest.raises(GraphError, match="placement"):
        fuse(g, ["reward", "ref_forward"])


# ---- stream_pieces (pipeline.pieces) -------------------------------------------------------------------
def test_microbatch_streams_to_per_sequence_consumers():
    g = ppo()
    m = stream_pieces(g, "generate", 4)
    for s in ("generate", "reward", "ref_forward", "old_forward", "critic_forward"):
        assert m.stage(s).pieces == 4, s
    for s in ("advantage", "actor_update", "critic_update", "weight_sync"):
        assert m.stage(s).pieces == 1, s
    streamed = {(e.src, e.dst) for e in m.edges if e.stream}
    assert streamed == {("completions", s) for s in ("reward", "ref_forward", "old_forward", "critic_forward")}
    assert stream_pieces(m, "generate", 4) == m
    assert same_structure(stream_pieces(m, "generate", 1), g)


def test_microbatch_without_streaming_and_on_fused_stages():
    m = stream_pieces(graph(), "generate", 2, stream=False)
    assert not any(e.stream for e in m.edges) and m.stage("reward").pieces == 1
    f = stream_pieces(fuse_named(ppo(), "forwards"), "generate", 2)
    assert f.stage("forwards").pieces == 2


def test_microbatch_keeps_groups_whole():
    with pytest.raises(GraphError, match="N=4") as e:
        stream_pieces(graph(), "generate", 8)  # divides B=8 but splits GRPO groups
    assert e.value.node == "generate"
    with pytest.raises(GraphError, match="divide the batch"):
        stream_pieces(graph(), "actor_update", 3)


# ---- place ------------------------------------------------------------------------------------
def test_place_split_puts_generation_and_training_apart():
    s = place(ppo(), "split")
    assert {st.name for st in s.stages() if st.placement == "gen"} == {"generate", "reward"}
    assert s.nodes["rollout_weights"].placement == "gen" and s.nodes["actor"].placement == "train"
    assert place(s, "colocated").nodes == ppo().nodes
    with pytest.raises(GraphError, match="colocated | split"):
        place(ppo(), "scattered")


# ---- the whole pipeline -----------------------------------------------------------------------
COMBOS = list(
    itertools.product(
        ["grpo", "ppo"],
        [0, 2],
        [False, True],
        [(), ("forwards",), ("forwards", "advantage")],
        [False, True],
        [1, 2],
        ["colocated", "split"],
    )
)


def test_apply_pipeline_every_legal_combination():
    seen = 0
    for algo, k, share, fusions, elide, mb, placement in COMBOS:
        over = [
            f"rl.algorithm={algo}",
            "rl.kl_coef=0.1",
            f"pipeline.staleness={k}",
            f"pipeline.share_actor_critic={share}",
            f"pipeline.fuse=[{','.join(fusions)}]",
            f"pipeline.elide_old_forward={elide}",
            f"pipeline.pieces={mb}",
            f"pipeline.placement={placement}",
            "pipeline.split_sizes=[2,2]",
        ]
        try:
            cfg = load_config(None, [*SIZES, *over])
        except ConfigError:
            continue  # an illegal knob combination is caught by config validation
        base = build_graph(cfg)
        g = apply_pipeline(base, cfg.pipeline)
        seen += 1
        assert apply_pipeline(g, cfg.pipeline) == g  # idempotent as a whole
        assert g.staleness == k
        removed = ({"old_forward"} if elide else set()) | ({"critic_forward", "critic_update"} if share else set())
        if share and elide:
            removed.discard("critic_forward")  # values then come from a forward of the shared backbone
        assert kinds(g) == sorted(x for x in kinds(base) if x not in removed), (over, kinds(g))
        gen = g.find(StageKind.GENERATE)
        assert gen.pieces == mb and gen.placement == ("all" if placement == "colocated" else "gen")
    assert seen > 40


def test_fusing_a_fused_stage_keeps_what_it_computes():
    """values_from_critic_update's fused advantage+critic_update computes the values itself; fusing
    it again (with the actor update) must keep that option, or the kernels would compose the parts
    and nothing would produce the values."""
    g = values_from_critic_update(ppo())
    again = fuse(g, ["advantage+critic_update", "actor_update"])
    (st,) = [s for s in again.stages() if s.parts and len(s.parts) == 3]
    assert st.options.values_from_update and st.effective_options.values_from_update
    assert "values" in st.options.internal


def test_decode_ahead_runs_continuous_generation_one_step_ahead_on_split_placement():
    from rpeg_jax.config.pipeline import PipelineConfig
    from rpeg_jax.graph.passes import decode_ahead

    split = PipelineConfig(staleness=2, placement="split", split_sizes=(1, 1))
    turns = apply_pipeline(graph(), split, "continuous", False)
    ahead = apply_pipeline(graph(), split, "continuous", None)  # null: on for split + continuous
    assert (turns.decode_ahead, turns.generation_ahead, turns.admission) == (False, 0, "continuous")
    assert (ahead.decode_ahead, ahead.generation_ahead, ahead.admission) == (True, 1, "continuous")
    assert ahead.has("rollout_buffer") and not turns.has("rollout_buffer")
    assert ahead.staleness == 2 and "decode_ahead" in ahead.attrs["passes"]
    # step admission at k = 1 also runs one ahead, but it is not continuous
    step1 = apply_pipeline(graph(), PipelineConfig(staleness=1, placement="split", split_sizes=(1, 1)), "step", None)
    assert (step1.decode_ahead, step1.generation_ahead, step1.admission) == (False, 1, "step")
    assert same_structure(decode_ahead(ahead), ahead)  # idempotent
    coloc = PipelineConfig(staleness=1, placement="colocated")
    assert not apply_pipeline(graph(), coloc, "continuous", None).decode_ahead  # null: off when colocated
    with pytest.raises(GraphError, match="placement split"):
        apply_pipeline(graph(), coloc, "continuous", True)
    with pytest.raises(GraphError, match="continuous"):
        apply_pipeline(graph(), PipelineConfig(staleness=1, placement="split", split_sizes=(1, 1)), "step", True)
    with pytest.raises(GraphError, match="k >= 1"):
        decode_ahead(graph())
    # the graph's JSON round trip keeps the flag (export/load is lossless)
    from rpeg_jax.graph.export import graph_from_dict, graph_to_dict

    assert graph_from_dict(graph_to_dict(ahead)).decode_ahead
