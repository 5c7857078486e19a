"""Graph validation: structure, producers, versions, specs, cycles, streaming and knobs.

Called by `Graph.validate()` (and after every pass). Each failure raises `GraphError(node, why)`
naming the offending node, so a broken rewrite or hand-built graph points at what to fix.
"""

from __future__ import annotations

from rpeg_jax.graph.ir import DataNode, Graph, GraphError, StageKind, StateKind, StateNode, Stage


def validate(g: Graph) -> None:
    _check_edges(g)
    _check_data(g)
    _check_state(g)
    _check_stages(g)
    g.topo_order()  # raises on a cycle within a step
    _check_staleness(g)


def _check_edges(g: Graph) -> None:
    for e in g.edges:
        for end in (e.src, e.dst):
            if end not in g.nodes:
                other = e.dst if end == e.src else e.src
                raise GraphError(other, f"edge {e.src}->{e.dst} names a missing node {end!r}")
        a, b = g.nodes[e.src], g.nodes[e.dst]
        if isinstance(a, Stage) == isinstance(b, Stage):
            raise GraphError(e.dst, f"edge {e.src}->{e.dst} must join a stage and a data/state node")
        if e.stream and not (isinstance(a, DataNode) or isinstance(b, DataNode)):
            raise GraphError(e.dst, f"edge {e.src}->{e.dst}: only data edges can stream")


def _check_data(g: Graph) -> None:
    for d in g.of_type(DataNode):
        writers = [e for e in g.edges if e.dst == d.name]
        readers = [e for e in g.edges if e.src == d.name]
        if not writers:
            who = readers[0].dst if readers else d.name
            raise GraphError(d.name, f"data node has no producer (consumed by {who!r})")
        if len(writers) > 1:
            raise GraphError(d.name, f"data node has several producers {[e.src for e in writers]}")
        if len(d.spec.shape) != len(d.spec.dims) or len(d.spec.axes) != len(d.spec.dims):
            raise GraphError(d.name, f"spec {d.spec} has inconsistent dims/shape/axes")
        for e in writers + readers:
            if e.offset != 0:
                raise GraphError(d.name, f"data edge {e.src}->{e.dst} has version offset {e.offset}; "
                                         "data lives within one step")
            if e.expect is not None and e.expect != d.spec:
                stage = e.dst if e.src == d.name else e.src
                raise GraphError(stage, f"port {e.port!r} expects {e.expect} but {d.name!r} is {d.spec}")


def _check_state(g: Graph) -> None:
    for s in g.of_type(StateNode):
        writes = [e for e in g.edges if e.dst == s.name]
        reads = [e for e in g.edges if e.src == s.name]
        if s.frozen and writes:
            raise GraphError(s.name, f"frozen state is written by {writes[0].src!r}")
        if len(writes) > 1:
            raise GraphError(s.name, f"state has several writers {[e.src for e in writes]}")
        for e in writes:
            if e.offset != 1:
                raise GraphError(e.src, f"writes {s.name!r} at offset {e.offset}; writes produce t+1")
        for e in reads:
            if e.offset > 1:
                raise GraphError(e.dst, f"reads {s.name!r}@t{e.offset:+d}, a version from the future")
            if e.offset == 1 and (not writes or writes[0].src == e.dst):
                raise GraphError(e.dst, f"reads {s.name!r}@t+1 which no other stage writes this step")


def _check_stages(g: Graph) -> None:
    for st in g.of_type(Stage):
        if st.microbatches < 1:
            raise GraphError(st.name, f"microbatches={st.microbatches} must be >= 1")
        if st.kind == StageKind.FUSED:
            if len(st.parts) < 2:
                raise GraphError(st.name, "a fused stage needs at least two parts")
        elif st.parts or st.workload is None:
            raise GraphError(st.name, "only fused stages have parts; others need a workload")
        for e in g.inputs(st.name):
            if e.stream:
                src = g.nodes[g.producer(e.src)]
                if src.microbatches != st.microbatches:
                    raise GraphError(st.name, f"streams {e.src!r} from {src.name!r} with "
                                              f"{src.microbatches} pieces but runs {st.microbatches}")


def _check_staleness(g: Graph) -> None:
    """The generate edge reads rollout_weights at t - k, and a rollout buffer exists iff k >= 1."""
    k = g.staleness
    if g.has("rollout_buffer") != (k > 0):
        raise GraphError("rollout_buffer", f"staleness k={k} needs a rollout buffer exactly when k >= 1")
    gen = g.find(StageKind.GENERATE)
    if gen is None:
        return
    for e in g.inputs(gen.name):
        node = g.nodes[e.src]
        if isinstance(node, StateNode) and node.kind == StateKind.ROLLOUT_WEIGHTS and e.offset != -k:
            raise GraphError(gen.name, f"reads {e.src}@t{e.offset:+d} but staleness k={k} needs t-{k}")
