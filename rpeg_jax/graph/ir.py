"""The RPEG intermediate representation: state, data and stage nodes joined by versioned edges.

Pure Python (no JAX): the cost model plans a 256-GPU cluster on a laptop from this, the passes
(graph/passes.py) rewrite it, graph/compile.py binds each stage to a jitted program, and the
runtime, traces and metrics name stages by `Stage.name` (= a `StageKind` value unless fused).

Key API (what the cost model, planner, compiler and runtime use):

    g = build_graph(cfg)                      # graph/algorithms.py: GRPO or PPO from a RunConfig
    g = apply_pipeline(g, cfg.pipeline)   # graph/passes.py
    g.validate()                              # GraphError(node, why) naming the node
    g.topo_order() -> list[str]               # stage names, dependencies first (one step)
    g.stage(name) -> Stage                    # .kind, .workload (op, models, tokens...), .parts
    g.deps(name) -> list[Dep]                 # Dep(stage, step_offset <= 0, via, streamed)
    g.inputs(name) / g.outputs(name) -> list[Edge]; g.producer(node); g.consumers(node)
    g.sizes                                   # {"N": prompts, "G": group, "B": N*G, "P", "R", "S"}
    TIMING_NAMES[StageKind.GENERATE] == "gen" # verl-compatible metric names

    # graph/passes.py: bounded_async(g, k), share_actor_critic(g), elide_old_forward(g),
    #   fuse(g, [names], name=None), fuse_named(g, "forwards"|"advantage"), stream_pieces(g, stage, n),
    #   place(g, "colocated"|"split"), apply_pipeline(g, cfg.pipeline)
    # graph/plan.py: Plan (groups, per-stage group/mesh/rules/pieces, knobs), plan_from_config,
    #   plan_for_config, graph_for_plan;  graph/export.py: to_json/from_json, to_dot, to_mermaid

Pricing a stage: `stage.workload` (op, models' dims, B, P, R, G, heads, epochs x minibatches,
bytes moved); a fused stage has workload None and prices as its `parts` run as one program.
Where it runs (devices, mesh, rules, pieces) is in the Plan, keyed by `stage.name`.

Versions. The graph describes one RL step t. A stage at step t reads state node X at version
t + edge.offset and writes version t + 1 (write edges have offset +1). So the writer of version
v is the writing stage at step v - 1, and a read with offset o depends on the writer at step
t + o - 1: offset 0 -> the previous step, offset +1 -> the same step (e.g. weight_sync reads the
actor just updated), offset -k -> k+1 steps back (generate reads rollout_weights @ t-k under
bounded asynchrony). Versions below 1 are the initial state (no dependency). Data nodes live
within one step (offset 0). A streamed edge (`stream=True`) lets the consumer process piece i
as soon as the producer finished piece i (both stages have the same `pieces`).

Readers of a state version finish before it is overwritten in place: within a step that order
already follows from data edges (old_forward's logprobs feed actor_update). Under bounded
asynchrony the sampler serves θ_{t-k} while newer versions arrive; the runtime installs them
between generation pieces (rollout.on_weight_update). The bound k is the graph's own
(`Graph.staleness`, set by bounded_async; the one place every reader takes it from); the rollout
buffer state node is checkpointed with the version of every admitted rollout, so a resumed run
admits rollouts under the same bound.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Iterator


class StageKind(str, enum.Enum):
    """THE stage names: metrics `timing_s/<name>`, trace spans and plan entries use these."""

    GENERATE = "generate"
    REWARD = "reward"
    REF_FORWARD = "ref_forward"
    OLD_FORWARD = "old_forward"
    CRITIC_FORWARD = "critic_forward"
    ADVANTAGE = "advantage"
    ACTOR_UPDATE = "actor_update"
    CRITIC_UPDATE = "critic_update"
    WEIGHT_SYNC = "weight_sync"
    FUSED = "fused"  # a fused stage; its constituents are in Stage.parts


# verl's `timing_s/<name>` for each stage kind, so step breakdowns compare apples to apples.
TIMING_NAMES: dict[StageKind, str] = {
    StageKind.GENERATE: "gen",
    StageKind.REWARD: "reward",
    StageKind.REF_FORWARD: "ref",
    StageKind.OLD_FORWARD: "old_log_prob",
    StageKind.CRITIC_FORWARD: "values",
    StageKind.ADVANTAGE: "adv",
    StageKind.ACTOR_UPDATE: "update_actor",
    StageKind.CRITIC_UPDATE: "update_critic",
    StageKind.WEIGHT_SYNC: "update_weights",
}


class StateKind(str, enum.Enum):
    """State that lives in the runtime across steps (and in checkpoints)."""

    ACTOR = "actor"  # θ_t, training layout
    CRITIC = "critic"  # φ_t
    REFERENCE = "reference"  # θ_ref (frozen)
    ACTOR_OPT = "actor_opt"
    CRITIC_OPT = "critic_opt"
    ROLLOUT_WEIGHTS = "rollout_weights"  # the sampler's copy of θ (generation layout)
    DATA_ITERATOR = "data_iterator"
    ROLLOUT_BUFFER = "rollout_buffer"  # admitted rollouts in flight (bounded asynchrony)


class Op(str, enum.Enum):
    """Kind of computation a stage does (what the cost model prices)."""

    GENERATE = "generate"  # prefill P + decode R tokens per sequence (KV cache)
    FORWARD = "forward"  # one forward over B x S tokens
    TRAIN = "train"  # forward + backward + optimizer, epochs x minibatches
    HOST = "host"  # Python on the host (reward verifiers)
    ELEMENTWISE = "elementwise"  # small array math (advantages)
    TRANSFER = "transfer"  # move/reshard parameters (weight sync)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int8": 1, "bool": 1}


class GraphError(ValueError):
    """An invalid graph or an illegal pass; `str(err)` names the node."""

    def __init__(self, node: str, why: str):
        self.node, self.why = node, why
        super().__init__(f"graph error at {node!r}: {why}")


@dataclass(frozen=True)
class DataSpec:
    """Shape with symbolic dims (letters of Graph.sizes), dtype and logical axes per dim."""

    dims: tuple[str, ...]  # e.g. ("B", "R")
    shape: tuple[int, ...]  # concrete sizes, e.g. (128, 8)
    dtype: str
    axes: tuple[str | None, ...]  # logical axes (sharding/axes.py), e.g. ("batch", None)

    @property
    def bytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n

    def __str__(self) -> str:
        return f"{self.dtype}[{'x'.join(self.dims)}={'x'.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class ModelDims:
    """Everything the cost model needs about a model a stage touches."""

    role: str  # actor | critic | reference
    num_params: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    param_dtype: str
    dtype: str  # compute dtype
    value_head: bool = False
    num_experts: int = 0  # X: a mixture of experts in `sparse_layers` of the layers (0: dense)
    num_experts_per_tok: int = 0  # k
    expert_size: int = 0  # Fe: each expert's SwiGLU width
    sparse_layers: int = 0  # layers whose MLP is the mixture

    @property
    def param_bytes(self) -> int:
        return self.num_params * DTYPE_BYTES[self.param_dtype]


@dataclass(frozen=True)
class Workload:
    """What a stage computes, enough to price it from the node alone."""

    op: Op
    models: tuple[ModelDims, ...] = ()
    n_seqs: int = 0  # B sequences
    prompt_len: int = 0  # P
    response_len: int = 0  # R (max new tokens)
    group_size: int = 1  # G (generation shares a prompt's KV across its group)
    heads: tuple[str, ...] = ()  # outputs of a forward/train: "logp", "values", "entropy"
    epochs: int = 1  # train: passes over the batch
    minibatches: int = 1  # train: optimizer steps per epoch
    bytes_moved: int = 0  # transfer: parameter bytes

    @property
    def tokens(self) -> int:
        """Tokens processed once (B x S); generation decodes B x R of them."""
        return self.n_seqs * (self.prompt_len + self.response_len)

    @property
    def optimizer_steps(self) -> int:
        return self.epochs * self.minibatches if self.op == Op.TRAIN else 0


@dataclass(frozen=True)
class StateNode:
    name: str
    kind: StateKind
    bytes: int = 0
    frozen: bool = False  # never written (reference): one version for all steps
    placement: str = "all"  # device-group name ("all" | "gen" | "train")


@dataclass(frozen=True)
class DataNode:
    name: str
    spec: DataSpec


@dataclass(frozen=True)
class StageOptions:
    """How a stage computes, as the passes set it and the kernels (runtime/kernels.py) read it."""

    value_loss: bool = False  # share_actor_critic: the actor update also minimises c_v·L_v (value head)
    proximal_from_update: bool = False  # π_old = stop_gradient(π_θ) of the update's own forward
    values_from_update: bool = False  # fused advantage+update: the update's forward gives V(s_t) for GAE
    tis: bool = False  # truncated importance sampling (rl.tis_cap): the update reads behav_logp at k = 0 too
    internal: tuple[str, ...] = ()  # fused stage: data produced and consumed inside its one program


def merge_options(options, internal: tuple[str, ...] = ()) -> StageOptions:
    """One StageOptions whose flags are on where any of `options` has them on."""
    flags = {
        f.name: any(getattr(o, f.name) for o in options)
        for f in dataclasses.fields(StageOptions)
        if f.name != "internal"
    }
    return StageOptions(**flags, internal=tuple(internal))


@dataclass(frozen=True)
class Stage:
    name: str
    kind: StageKind
    workload: Workload | None = None  # None only for FUSED (see parts)
    placement: str = "all"
    pieces: int = 1  # pieces the stage processes its batch in
    parts: tuple[Stage, ...] = ()  # FUSED: constituents, in execution order
    options: StageOptions = StageOptions()

    @property
    def effective_options(self) -> StageOptions:
        """What the stage computes: its own options with its parts' switched-on flags (a fused
        stage does what its parts do); `internal` is the stage's own."""
        return merge_options((self.options, *(p.options for p in self.parts)), self.options.internal)

    @property
    def constituents(self) -> tuple[str, ...]:
        """Names of the stages this one stands for (itself unless fused)."""
        return tuple(p.name for p in self.parts) if self.parts else (self.name,)

    def timing_names(self) -> tuple[str, ...]:
        """verl timing names of the constituents."""
        kinds = [p.kind for p in self.parts] if self.parts else [self.kind]
        return tuple(TIMING_NAMES[k] for k in kinds)


Node = StateNode | DataNode | Stage


@dataclass(frozen=True)
class Edge:
    """src -> dst. One end is a stage, the other a data or state node.

    offset: for state reads, the version read is t + offset; state writes have offset +1.
    port: the name the stage knows this input/output by (e.g. 'old_logp' wired to behav_logp).
    expect: the spec the consuming stage expects (checked against the data node's spec).
    stream: the consumer may start piece i when the producer finished piece i.
    """

    src: str
    dst: str
    offset: int = 0
    port: str = ""
    expect: DataSpec | None = None
    stream: bool = False


@dataclass(frozen=True)
class Dep:
    """Stage `stage` at step t + step_offset must finish first; if `streamed`, piece i of the
    dependent stage only waits for piece i of `stage` (same step, same number of pieces)."""

    stage: str
    step_offset: int
    via: str
    streamed: bool = False


@dataclass
class Graph:
    """An RPEG: nodes by name (insertion ordered), edges, symbolic sizes and applied knobs."""

    nodes: dict[str, Node] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)  # algorithm, staleness, passes, ...

    # ---- construction -------------------------------------------------------------------
    def add(self, node: Node) -> Node:
        if node.name in self.nodes:
            raise GraphError(node.name, "duplicate node name")
        self.nodes[node.name] = node
        return node

    def connect(self, src: str, dst: str, **kw) -> Edge:
        kw.setdefault("port", src if isinstance(self.nodes.get(src), (DataNode, StateNode)) else dst)
        e = Edge(src, dst, **kw)
        self.edges.append(e)
        return e

    def copy(self) -> Graph:
        return Graph(dict(self.nodes), list(self.edges), dict(self.sizes), _deepcopy(self.attrs))

    def replace_node(self, node: Node) -> None:
        if node.name not in self.nodes:
            raise GraphError(node.name, "no such node")
        self.nodes[node.name] = node

    def remove(self, name: str) -> None:
        """Remove a node and every edge touching it."""
        self.nodes.pop(name)
        self.edges = [e for e in self.edges if name not in (e.src, e.dst)]

    # ---- queries ------------------------------------------------------------------------
    @property
    def staleness(self) -> int:
        """k: generation at step t reads the actor of version t - k (0: synchronous on-policy)."""
        return int(self.attrs.get("staleness", 0))

    @property
    def generation_ahead(self) -> int:
        """Steps generation runs ahead of training: generate reads rollout_weights at t - ahead
        (ahead = k, or 0 under continuous admission; 0 without a generate stage)."""
        gen = self.find(StageKind.GENERATE)
        offs = [e.offset for e in self.inputs(gen.name) if e.src == "rollout_weights"] if gen is not None else []
        return -min(offs) if offs else 0

    @property
    def decode_ahead(self) -> bool:
        """Continuous admission whose engine decodes the next step's groups while training runs this
        step's update (graph/passes.decode_ahead; rollout.decode_ahead): generation one step ahead
        (generate at t reads rollout_weights at t - 1) under split placement."""
        return bool(self.attrs.get("decode_ahead"))

    @property
    def admission(self) -> str:
        """rollout.admission this graph runs: "continuous" where generation keeps the staleness bound
        k >= 1 without running ahead (graph/passes.bounded_async(k, ahead=0): one engine across
        steps, runtime/rollout/continuous.py) or one step ahead with `decode_ahead`, else "step".
        Every reader takes it from here, as k."""
        return "continuous" if self.staleness and (not self.generation_ahead or self.decode_ahead) else "step"

    def stages(self) -> list[Stage]:
        return [self.nodes[n] for n in self.topo_order()]

    def stage(self, name: str) -> Stage:
        node = self.nodes.get(name)
        if not isinstance(node, Stage):
            raise GraphError(name, f"no such stage; stages: {', '.join(self.stage_names())}")
        return node

    def stage_names(self) -> list[str]:
        return [n for n, v in self.nodes.items() if isinstance(v, Stage)]

    def has(self, name: str) -> bool:
        return name in self.nodes

    def find(self, kind: StageKind) -> Stage | None:
        """The stage of this kind, also when it sits inside a fused stage (returns the fused one)."""
        for s in self.nodes.values():
            if isinstance(s, Stage) and (s.kind == kind or any(p.kind == kind for p in s.parts)):
                return s
        return None

    def of_type(self, cls: type) -> Iterator:
        return (v for v in self.nodes.values() if isinstance(v, cls))

    def inputs(self, stage: str) -> list[Edge]:
        return [e for e in self.edges if e.dst == stage]

    def outputs(self, stage: str) -> list[Edge]:
        return [e for e in self.edges if e.src == stage]

    def producer(self, node: str) -> str | None:
        """The stage writing a data node or a state node (None: a graph input)."""
        srcs = [e.src for e in self.edges if e.dst == node]
        return srcs[0] if srcs else None

    def consumers(self, node: str) -> list[str]:
        return [e.dst for e in self.edges if e.src == node]

    def deps(self, stage: str) -> list[Dep]:
        """Stages that must run before `stage` at step t, at step t + step_offset (<= 0).

        Data inputs: their producer, same step (streamed or not). State reads with offset o:
        the writer of version t+o, i.e. at step t+o-1 (no dependency for frozen state)."""
        out = []
        for e in self.inputs(stage):
            node, writer = self.nodes[e.src], self.producer(e.src)
            if writer is None:
                continue
            if isinstance(node, DataNode):
                out.append(Dep(writer, 0, e.src, e.stream))
            elif writer != stage or e.offset <= 0:
                out.append(Dep(writer, e.offset - 1, e.src))
        return out

    def topo_order(self) -> list[str]:
        """Stage names in an order where every same-step dependency comes first."""
        names = self.stage_names()
        indeg = {n: 0 for n in names}
        succ: dict[str, list[str]] = {n: [] for n in names}
        for n in names:
            for d in self.deps(n):
                if d.step_offset == 0 and d.stage != n:
                    indeg[n] += 1
                    succ[d.stage].append(n)
        ready = [n for n in names if indeg[n] == 0]
        order = []
        while ready:
            n = ready.pop(0)
            order.append(n)
            for m in succ[n]:
                indeg[m] -= 1
                if indeg[m] == 0:
                    ready.append(m)
        if len(order) != len(names):
            stuck = [n for n in names if n not in order]
            raise GraphError(stuck[0], f"cycle among stages {stuck} within one step")
        return order

    def validate(self) -> Graph:
        validate_graph(self)
        return self

    def describe(self) -> str:
        """A plain-text listing: one line per stage with inputs and outputs."""
        lines = [
            f"RPEG {self.attrs.get('algorithm', '?')}  sizes {self.sizes}  knobs "
            f"{ {k: v for k, v in self.attrs.items() if k != 'algorithm'} }"
        ]
        for s in self.stages():
            ins = ", ".join(_edge_label(e, e.src) for e in self.inputs(s.name))
            outs = ", ".join(_edge_label(e, e.dst) for e in self.outputs(s.name))
            extra = f" parts={list(s.constituents)}" if s.parts else ""
            mb = f" x{s.pieces}" if s.pieces > 1 else ""
            lines.append(f"  {s.name}{mb} [{s.placement}]{extra}: ({ins}) -> ({outs})")
        return "\n".join(lines)


def _edge_label(e: Edge, name: str) -> str:
    v = f"@t{e.offset:+d}" if e.offset else ""
    port = f"{e.port}=" if e.port and e.port != name else ""
    return f"{port}{name}{v}{'~' if e.stream else ''}"


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


def replace(node: Node, **changes) -> Node:
    return dataclasses.replace(node, **changes)


# ---- validation: structure, producers, versions, specs, cycles, streaming and knobs ----------
# Called by `Graph.validate()` (and after every pass). Each failure raises `GraphError(node, why)`
# naming the offending node, so a broken rewrite or hand-built graph points at what to fix.
# Part of the IR (not a module of its own) because it needs every node class and Graph needs it.
def validate_graph(g: Graph) -> None:
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
                raise GraphError(
                    d.name, f"data edge {e.src}->{e.dst} has version offset {e.offset}; data lives within one step"
                )
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
        if st.pieces < 1:
            raise GraphError(st.name, f"pieces={st.pieces} must be >= 1")
        if st.kind == StageKind.FUSED:
            if len(st.parts) < 2:
                raise GraphError(st.name, "a fused stage needs at least two parts")
        elif st.parts or st.workload is None:
            raise GraphError(st.name, "only fused stages have parts; others need a workload")
        for e in g.inputs(st.name):
            if e.stream:
                src = g.nodes[g.producer(e.src)]
                if src.pieces != st.pieces:
                    raise GraphError(
                        st.name,
                        f"streams {e.src!r} from {src.name!r} with {src.pieces} pieces but runs {st.pieces}",
                    )


def _check_staleness(g: Graph) -> None:
    """The generate edge reads rollout_weights at t - k, and a rollout buffer exists iff k >= 1."""
    k, ahead = g.staleness, g.generation_ahead
    if not 0 <= ahead <= k:
        raise GraphError("generate", f"runs {ahead} steps ahead, outside [0, staleness k={k}]")
    if g.has("rollout_buffer") != (ahead > 0):
        raise GraphError("rollout_buffer", f"generation {ahead} steps ahead needs a rollout buffer exactly when >= 1")
    if g.decode_ahead:
        if k < 1 or ahead != 1:
            raise GraphError("generate", f"decode_ahead runs generation 1 step ahead at k >= 1 (runs {ahead}, k={k})")
