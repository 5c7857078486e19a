"""Graph -> graph rewrites: the RPEG structural choices and execution optimizations.

Each pass takes a Graph and returns a new validated Graph (the input is never modified), is a
no-op when its effect is already present (idempotent), and raises GraphError naming the node
when the rewrite is illegal. `apply_pipeline` applies what `cfg.pipeline` asks for, in the
one order that keeps every combination legal:

    elide_old_forward | proximal_from_update -> share_actor_critic -> values_from_critic_update
        -> bounded_async(k) -> decode_ahead -> fuse(...) -> stream_pieces -> place

The two one-step rewrites (proximal_from_update, values_from_critic_update) are legal only when
the update they lean on takes ONE optimizer step per batch (workload epochs x minibatches = 1):
its first forward then runs at exactly the parameters of the pass it replaces.

Callers: `rpeg graph`, the planner (costmodel) for every candidate, and the runtime.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from rpeg_jax.graph.ir import (
    DataNode,
    Graph,
    GraphError,
    ModelDims,
    Stage,
    StageKind,
    StageOptions,
    StateKind,
    StateNode,
    merge_options,
    replace,
)

K = StageKind
# Stages that work sequence by sequence, so they can consume finished pieces of generation.
STREAMABLE = (K.REWARD, K.REF_FORWARD, K.OLD_FORWARD, K.CRITIC_FORWARD)
FORWARDS = (K.REF_FORWARD, K.OLD_FORWARD, K.CRITIC_FORWARD)


def graph_pass(fn: Callable[..., Graph]) -> Callable[..., Graph]:
    """Run `fn` on a copy; record it in attrs['passes'] only if it changed something; validate."""

    @functools.wraps(fn)
    def wrapper(g: Graph, *args, **kw) -> Graph:
        out = fn(g.copy(), *args, **kw)
        same = out.nodes == g.nodes and out.edges == g.edges and out.attrs == g.attrs
        if same:
            return g.copy()
        label = fn.__name__ + (f"({', '.join(map(repr, args))})" if args else "")
        out.attrs["passes"] = list(g.attrs.get("passes", [])) + [label]
        return out.validate()

    return wrapper


# ---- helpers ----------------------------------------------------------------------------------
def _part(g: Graph, kind: StageKind) -> tuple[Stage | None, Stage | None]:
    """(the graph stage holding `kind`, the stage of that kind itself — a part when fused)."""
    holder = g.find(kind)
    if holder is None:
        return None, None
    if holder.kind == kind:
        return holder, holder
    return holder, next(p for p in holder.parts if p.kind == kind)


def _update_part(g: Graph, kind: StageKind, **changes) -> None:
    holder, st = _part(g, kind)
    new = replace(st, **changes)
    if holder is st:
        g.replace_node(new)
    else:
        g.replace_node(replace(holder, parts=tuple(new if p is st else p for p in holder.parts)))


def _plain(g: Graph, kind: StageKind, pass_name: str) -> Stage | None:
    """The stage of `kind` if it is not fused (passes that rewrite it must run before fuse)."""
    holder, st = _part(g, kind)
    if holder is not None and holder is not st:
        raise GraphError(holder.name, f"{pass_name} must be applied before fuse ({kind.value} is fused)")
    return st


def _rewire(g: Graph, old: str, new: str, *, src: bool) -> None:
    """Move edges whose src (or dst) is `old` onto `new`, dropping exact duplicates."""
    edges = []
    for e in g.edges:
        if src and e.src == old:
            e = dataclasses.replace(e, src=new)
        elif not src and e.dst == old:
            e = dataclasses.replace(e, dst=new)
        if e not in edges:
            edges.append(e)
    g.edges = edges


# ---- passes -----------------------------------------------------------------------------------
@graph_pass
def bounded_async(g: Graph, k: int, ahead: int | None = None) -> Graph:
    """Bound every consumed token's staleness by k (k = 0: synchronous on-policy RL).

    k becomes the graph's `staleness` (the one value every reader of the bound uses). Generation
    runs `ahead` steps ahead of training (default k: generate at step t reads the actor at version
    t - k, a whole step's batch generated ahead). With ahead < k (continuous admission,
    runtime/rollout/continuous.py: ahead 0) generate reads the newest weights and sequences may run on
    across up to k weight updates. For ahead >= 1 a rollout buffer (checkpointed state) holds the
    rollouts made ahead of their update: the runtime admits a rollout only while it will be
    consumed within k versions. For k >= 1 the actor update
    takes behaviour logprobs and applies the decoupled-PPO correction (rl/losses.py, whenever
    behav_logp is in its batch): ratio to the proximal π_old (recomputed, or the update's own with
    proximal_from_update), weighted by π_old/π_behav capped at rl.behav_weight_cap."""
    gen = _plain(g, K.GENERATE, "bounded_async")
    if gen is None or not g.has("rollout_weights"):
        raise GraphError("generate", "bounded_async needs a generate stage reading rollout_weights")
    ahead = k if ahead is None else ahead
    if k < 0 or not 0 <= ahead <= k:
        raise GraphError(gen.name, f"staleness k={k} must be >= 0 and generation ahead={ahead} in [0, k]")
    if k > 0 and g.attrs.get("elided_old_forward"):
        raise GraphError(
            "old_forward", f"staleness k={k} needs the proximal policy recomputed; do not elide old_forward"
        )
    g.edges = [
        dataclasses.replace(e, offset=-ahead) if (e.src, e.dst) == ("rollout_weights", gen.name) else e for e in g.edges
    ]
    holder, upd = _part(g, K.ACTOR_UPDATE)
    has_behav = any(e.src == "behav_logp" and e.port == "behav_logp" for e in g.inputs(holder.name))
    if ahead > 0 and not g.has("rollout_buffer"):
        g.add(StateNode("rollout_buffer", StateKind.ROLLOUT_BUFFER, placement=gen.placement))
        g.connect("rollout_buffer", gen.name)
        g.connect(gen.name, "rollout_buffer", offset=1)
    elif ahead == 0 and g.has("rollout_buffer"):
        g.remove("rollout_buffer")
    if k > 0:
        if not has_behav:
            g.connect("behav_logp", holder.name, port="behav_logp", expect=g.nodes["behav_logp"].spec)
    else:
        if has_behav and not upd.options.tis:
            g.edges = [
                e for e in g.edges if not (e.src == "behav_logp" and e.dst == holder.name and e.port == "behav_logp")
            ]
    g.attrs["staleness"] = k
    return g


@graph_pass
def share_actor_critic(g: Graph) -> Graph:
    """One backbone with policy and value heads: the critic's state, forward and update disappear.

    Values come out of the actor's forward (old_forward, or critic_forward on the actor's
    weights when old_forward was elided), and the actor update minimises L_pg + c_v·L_v."""
    if g.attrs.get("shared"):
        return g
    if not g.has("critic"):
        raise GraphError(
            "critic",
            f"share_actor_critic needs a critic (rl.algorithm=ppo); this graph is {g.attrs.get('algorithm')!r}",
        )
    cf = _plain(g, K.CRITIC_FORWARD, "share_actor_critic")
    cu = _plain(g, K.CRITIC_UPDATE, "share_actor_critic")
    old = _plain(g, K.OLD_FORWARD, "share_actor_critic")
    au = _plain(g, K.ACTOR_UPDATE, "share_actor_critic")
    shared = _shared_dims(g)
    if old is not None:  # one forward yields logits and values
        _rewire(g, cf.name, old.name, src=True)
        _rewire(g, cf.name, old.name, src=False)
        g.remove(cf.name)
    else:  # values from the shared backbone, reading the actor
        g.edges = [
            dataclasses.replace(e, src="actor", port="actor") if (e.src, e.dst) == ("critic", cf.name) else e
            for e in g.edges
        ]
    _rewire(g, cu.name, au.name, src=False)  # the update reads values and returns
    g.remove(cu.name)
    for name in ("critic", "critic_opt"):
        g.remove(name)
    for st in list(g.of_type(Stage)):
        if st.workload and any(m.role in ("actor", "critic") for m in st.workload.models):
            heads = st.workload.heads
            if st.name in (au.name, old.name if old else cf.name) and "values" not in heads:
                heads = heads + ("values",)
            w = dataclasses.replace(st.workload, models=(shared,), heads=heads)
            opts = dataclasses.replace(st.options, value_loss=True) if st.name == au.name else st.options
            g.replace_node(replace(st, workload=w, options=opts))
    for name, per_param in (("actor", None), ("actor_opt", 8), ("rollout_weights", None)):
        node = g.nodes[name]
        g.replace_node(replace(node, bytes=shared.param_bytes if per_param is None else shared.num_params * per_param))
    g.attrs["shared"] = True
    return g


def _shared_dims(g: Graph) -> ModelDims:
    actor = next(m for st in g.of_type(Stage) if st.workload for m in st.workload.models if m.role == "actor")
    if actor.value_head:
        return actor
    return dataclasses.replace(actor, value_head=True, num_params=actor.num_params + actor.hidden_size + 1)


@graph_pass
def elide_old_forward(g: Graph) -> Graph:
    """Use the sampler's behaviour logprobs as π_old (legal only on-policy, k = 0, and when the
    sampler computes the same numbers as the trainer). old_forward and old_logp disappear; every
    consumer's `old_logp` port is wired to behav_logp."""
    if g.attrs.get("elided_old_forward"):
        return g
    old = _plain(g, K.OLD_FORWARD, "elide_old_forward")
    if old is None:
        raise GraphError("old_forward", "no old_forward stage to elide")
    k = g.staleness
    if k > 0:
        raise GraphError(old.name, f"with staleness k={k} the proximal policy must be recomputed")
    if "values" in old.workload.heads:
        raise GraphError(
            old.name,
            "old_forward also yields values (shared backbone); apply elide_old_forward before share_actor_critic",
        )
    g.edges = [dataclasses.replace(e, src="behav_logp") if e.src == "old_logp" else e for e in g.edges]
    g.remove(old.name)
    g.remove("old_logp")
    g.attrs["elided_old_forward"] = True
    return g


def _one_step(st: Stage, pass_name: str) -> None:
    w = st.workload
    if w.epochs * w.minibatches != 1:
        raise GraphError(
            st.name,
            f"{pass_name} needs one optimizer step per batch; this update takes "
            f"epochs={w.epochs} x minibatches={w.minibatches} (rl.ppo_epochs, rl.minibatches)",
        )


@graph_pass
def proximal_from_update(g: Graph) -> Graph:
    """π_old / π_prox = stop_gradient(π_θ) of the actor update's own forward; old_forward goes.

    Exact when the update takes one optimizer step: its forward runs at θ_t, the parameters
    old_forward reads, so the ratio π_θ/π_prox (value 1, gradient ∇log π_θ), the clip, and under
    bounded asynchrony the behaviour weight π_prox/π_behav are the same numbers (decoupled PPO,
    AReaL eq. 5: π_prox is the current actor). Legal for any k, unlike elide_old_forward. The
    update gets options.proximal_from_update; consumers other than the update are illegal.
    Metrics: actor/ppo_kl and actor/pg_clipfrac (KL and clipping between π_θ and π_old) are then
    exactly 0; with a recomputed old_forward they are 0 up to the rounding between two programs."""
    if g.attrs.get("proximal_from_update"):
        return g
    if g.attrs.get("elided_old_forward"):
        raise GraphError("old_forward", "elide_old_forward already replaced π_old; pick one of the two")
    old = _plain(g, K.OLD_FORWARD, "proximal_from_update")
    if old is None:
        raise GraphError("old_forward", "no old_forward stage to replace")
    if "values" in old.workload.heads:
        raise GraphError(
            old.name,
            "old_forward also yields values (shared backbone); apply proximal_from_update before share_actor_critic",
        )
    upd = _plain(g, K.ACTOR_UPDATE, "proximal_from_update")
    _one_step(upd, "proximal_from_update")
    others = [c for c in g.consumers("old_logp") if c != upd.name]
    if others:
        raise GraphError(
            others[0],
            "reads π_old before the actor update (e.g. rl.kl_in_reward); proximal_from_update cannot serve it",
        )
    g.remove(old.name)
    g.remove("old_logp")
    g.replace_node(replace(upd, options=dataclasses.replace(upd.options, proximal_from_update=True)))
    g.attrs["proximal_from_update"] = True
    return g


@graph_pass
def values_from_critic_update(g: Graph) -> Graph:
    """V_φ(s_t) for GAE = stop_gradient of the critic update's own forward; critic_forward goes.

    advantage and critic_update become one fused stage (one program): the critic's forward
    gives the values, GAE turns them into advantages and returns, the value loss uses those
    returns, its backward and the optimizer step follow; the advantages go to the actor update.
    Exact when the critic takes one optimizer step (its forward runs at φ_t, the parameters
    critic_forward reads; the clipped value loss around V_old = sg(V) has the same value and
    gradient; critic/vf_clipfrac is exactly 0, 0 up to rounding with critic_forward).
    With a shared backbone (after share_actor_critic, once old_forward is gone so that the values
    come from a critic_forward on the actor) the shared actor-critic update does the same:
    advantage+actor_update, whose loss computes the advantages and returns from its own values."""
    if g.attrs.get("values_from_critic_update"):
        return g
    shared = bool(g.attrs.get("shared"))
    cf = _plain(g, K.CRITIC_FORWARD, "values_from_critic_update")
    upd = _plain(g, K.ACTOR_UPDATE if shared else K.CRITIC_UPDATE, "values_from_critic_update")
    adv = _plain(g, K.ADVANTAGE, "values_from_critic_update")
    if cf is None:
        why = (
            ("the shared backbone's values ride on old_forward; apply proximal_from_update or elide_old_forward first")
            if shared
            else "needs critic_forward and critic_update (rl.algorithm=ppo)"
        )
        raise GraphError("critic_forward", why)
    _one_step(upd, "values_from_critic_update")
    others = [c for c in g.consumers("values") if c not in (adv.name, upd.name)]
    if others:
        raise GraphError(others[0], "reads the values outside advantage / the update")
    g.remove(cf.name)
    g.remove("values")
    g = fuse.__wrapped__(g, [adv.name, upd.name])
    fused = g.stage(f"{adv.name}+{upd.name}")
    opts = dataclasses.replace(fused.options, internal=fused.options.internal + ("values",), values_from_update=True)
    g.replace_node(replace(fused, options=opts))
    g.attrs["values_from_critic_update"] = True
    return g


@graph_pass
def fuse(g: Graph, stages: Sequence[str], name: str | None = None) -> Graph:
    """Run `stages` as one stage (one jitted program): e.g. ref_forward + old_forward +
    critic_forward as one pass over the same tokens, or advantage folded into actor_update.

    The fused stage keeps its constituents in `parts` (traces and the cost model show both);
    data produced and consumed only inside it become internal (options.internal)."""
    if _already_fused(g, stages) or (
        name
        and isinstance(g.nodes.get(name), Stage)
        and g.nodes[name].parts
        and set(g.nodes[name].constituents) == set(stages)
    ):
        return g
    members = _fusion_members(g, stages)
    parts = tuple(p for m in members for p in (m.parts or (m,)))
    fname = name or "+".join(p.name for p in parts)
    first = members[0]
    for m in members[1:]:
        if (m.placement, m.pieces) != (first.placement, first.pieces):
            raise GraphError(
                m.name,
                f"cannot fuse with {first.name!r}: placement/pieces differ "
                f"({m.placement}/{m.pieces} vs {first.placement}/{first.pieces})",
            )
    _check_no_path_outside(g, [m.name for m in members])
    internal = list(first.options.internal) if first.parts else []
    for m in members[1:]:
        internal += m.options.internal
    names = {m.name for m in members}
    fused = Stage(fname, K.FUSED, placement=first.placement, pieces=first.pieces, parts=parts)
    if fname in g.nodes:
        raise GraphError(fname, "a node of this name exists already; give the fused stage another name")
    # The fused stage takes its first member's place, so listings and exports keep their order.
    g.nodes = {(fname if n == first.name else n): (fused if n == first.name else v) for n, v in g.nodes.items()}
    written = {e.dst for e in g.edges if e.src in names and isinstance(g.nodes[e.dst], StateNode)}
    for m in members:
        _rewire(g, m.name, fname, src=True)
        _rewire(g, m.name, fname, src=False)
        if m.name != first.name:
            del g.nodes[m.name]
    # Reads of state written inside at t+1 (e.g. weight_sync after actor_update) become internal.
    g.edges = [e for e in g.edges if not (e.dst == fname and e.src in written and e.offset == 1)]
    for d in [e.dst for e in g.outputs(fname) if isinstance(g.nodes[e.dst], DataNode)]:
        if all(c == fname for c in g.consumers(d)):
            internal.append(d)
            g.remove(d)
    # A fused member's own options (e.g. values_from_update) carry over; plain members keep theirs as parts.
    own = merge_options([m.options for m in members if m.parts], internal)
    if own != StageOptions():
        g.replace_node(replace(g.nodes[fname], options=own))
    return g


def _already_fused(g: Graph, stages: Sequence[str]) -> bool:
    return any(set(s.constituents) == set(stages) for s in g.of_type(Stage) if s.parts)


def _fusion_members(g: Graph, stages: Sequence[str]) -> list[Stage]:
    if len(set(stages)) < 2:
        raise GraphError(",".join(stages) or "fuse", "fuse needs at least two distinct stages")
    for s in stages:
        if not isinstance(g.nodes.get(s), Stage):
            raise GraphError(s, f"no such stage to fuse; stages: {', '.join(g.stage_names())}")
    order = g.topo_order()
    return sorted((g.stage(s) for s in set(stages)), key=lambda st: order.index(st.name))


def _check_no_path_outside(g: Graph, members: list[str]) -> None:
    """Fusing A and B is illegal if A -> X -> B with X outside (the fused stage would wait on X
    while X waits on it)."""
    succ: dict[str, set[str]] = {n: set() for n in g.stage_names()}
    for n in succ:
        for d in g.deps(n):
            if d.step_offset == 0 and d.stage != n:
                succ[d.stage].add(n)
    for m in members:
        stack, seen = [x for x in succ[m] if x not in members], set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            for y in succ[x]:
                if y in members:
                    raise GraphError(x, f"fusing {members} would create a cycle: {m} -> {x} -> {y}")
                stack.append(y)


@graph_pass
def stream_pieces(g: Graph, stage: str, n: int, stream: bool = True) -> Graph:
    """Run `stage` in n pieces. With stream=True its per-sequence consumers (reward, forwards)
    also run in n pieces and start on piece i as soon as it is finished (fine-grained schedule:
    rewards and logprobs of completed sequences while generation continues)."""
    st = g.stage(stage)
    b, groups = g.sizes.get("B", n), g.sizes.get("N", n)
    if n < 1 or b % n:
        raise GraphError(stage, f"pieces={n} must be >= 1 and divide the batch B={b}")
    if _is_kind(st, (K.GENERATE,)) and groups % n:
        raise GraphError(
            stage, f"pieces={n} must divide the prompts per step N={groups} (a GRPO group stays in one piece)"
        )
    _set_pieces(g, st, n, stream)
    return g


def _is_kind(st: Stage, kinds: tuple[StageKind, ...]) -> bool:
    return all(p.kind in kinds for p in (st.parts or (st,)))


def _set_pieces(g: Graph, st: Stage, n: int, stream: bool) -> None:
    g.replace_node(replace(st, pieces=n))
    for d in [e.dst for e in g.outputs(st.name) if isinstance(g.nodes[e.dst], DataNode)]:
        for c in g.consumers(d):
            cst = g.stage(c)
            flows = stream and n > 1 and _is_kind(cst, STREAMABLE)
            was = any(e.stream for e in g.edges if (e.src, e.dst) == (d, c))
            g.edges = [dataclasses.replace(e, stream=flows) if (e.src, e.dst) == (d, c) else e for e in g.edges]
            if flows or was:
                _set_pieces(g, g.stage(c), n if flows else 1, stream)


@graph_pass
def place(g: Graph, placement: str) -> Graph:
    """colocated: every stage and state on all devices. split: generation (generate, reward, the
    sampler's weights, the rollout buffer) on group 'gen', training stages on group 'train';
    weight_sync runs on 'train' and reshards into 'gen'."""
    if placement not in ("colocated", "split"):
        raise GraphError("pipeline.placement", f"{placement!r} is not colocated | split")
    if g.decode_ahead and placement != "split":
        raise GraphError("generate", f"decode_ahead overlaps disjoint groups: needs placement split ({placement})")
    gen_side = {K.GENERATE, K.REWARD}
    gen_state = {StateKind.ROLLOUT_WEIGHTS, StateKind.ROLLOUT_BUFFER, StateKind.DATA_ITERATOR}
    for node in list(g.nodes.values()):
        if isinstance(node, Stage):
            side = "gen" if all(p.kind in gen_side for p in (node.parts or (node,))) else "train"
        elif isinstance(node, StateNode):
            side = "gen" if node.kind in gen_state else "train"
        else:
            continue
        g.replace_node(replace(node, placement="all" if placement == "colocated" else side))
    g.attrs["placement"] = placement
    return g


def fuse_named(g: Graph, fusion: str) -> Graph:
    """The config's named fusions: 'forwards' (ref/old/critic forwards as one pass; a no-op when
    fewer than two exist) and 'advantage' (folded into the actor update)."""
    if fusion == "forwards":
        names = [s.name for s in g.of_type(Stage) if s.kind in FORWARDS]
        return fuse(g, names, "forwards") if len(names) >= 2 else g
    if fusion == "advantage":
        adv, upd = g.find(K.ADVANTAGE), g.find(K.ACTOR_UPDATE)
        if adv is None or upd is None:
            raise GraphError("advantage", "fuse=advantage needs advantage and actor_update stages")
        if adv.options.values_from_update:  # GAE runs inside the critic update's program already
            return g
        return g if adv is upd else fuse(g, [adv.name, upd.name])
    raise GraphError("pipeline.fuse", f"unknown fusion {fusion!r} (forwards | advantage)")


@graph_pass
def decode_ahead(g: Graph) -> Graph:
    """Continuous admission that decodes ahead (rollout.decode_ahead): after step t's batch is
    handed to training, the engine decodes step t+1's groups with the weights it has (version t)
    while training runs step t's update, so generation and training overlap on their disjoint
    groups (split placement; runtime/rollout/continuous.py). Generation then runs one step ahead
    (generate at t reads rollout_weights at t - 1, the batch made ahead waits in the rollout buffer);
    the weights the sync publishes are installed before the engine's next decode chunk, and the bound
    k holds per token as under continuous admission (a token of version t - 1 enters a batch of step
    t' only while t' - (t - 1) <= k). Needs staleness k >= 1 and continuous admission (generation
    not ahead); `place` must then put it on a split placement (validate_graph checks)."""
    gen = _plain(g, K.GENERATE, "decode_ahead")
    k = g.staleness
    if gen is None or k < 1:
        raise GraphError("generate", f"decode_ahead needs continuous admission at staleness k >= 1 (k={k})")
    if g.decode_ahead:
        return g
    if g.generation_ahead != 0:
        raise GraphError(gen.name, f"decode_ahead needs continuous admission (generation {g.generation_ahead} ahead)")
    g = bounded_async.__wrapped__(g, k, 1)
    g.attrs["decode_ahead"] = True
    return g


def resolve_decode_ahead(value: bool | None, placement: str, admission: str) -> bool:
    """rollout.decode_ahead as it runs: null is on exactly when placement is split and admission continuous."""
    if value is None:
        return placement == "split" and admission == "continuous"
    return bool(value)


def apply_pipeline(g: Graph, pipeline, admission: str = "step", decode_ahead_value: bool | None = False) -> Graph:
    """Apply the passes a PipelineConfig asks for, in the legal order (see module docstring).
    `admission` (rollout.admission): continuous generation does not run ahead of training, unless
    `decode_ahead_value` (rollout.decode_ahead; None: on for split placement, resolve_decode_ahead)
    runs it one step ahead, overlapping the update (decode_ahead)."""
    if pipeline.elide_old_forward:
        g = elide_old_forward(g)
    if pipeline.proximal_from_update:
        g = proximal_from_update(g)
    if pipeline.share_actor_critic:
        g = share_actor_critic(g)
    if pipeline.values_from_critic_update:
        g = values_from_critic_update(g)
    if pipeline.staleness:
        g = bounded_async(g, pipeline.staleness, 0 if admission == "continuous" else None)
    if resolve_decode_ahead(decode_ahead_value, pipeline.placement, admission):
        if admission != "continuous":
            raise GraphError("generate", f"decode_ahead needs rollout.admission=continuous (it is {admission})")
        g = decode_ahead(g)
    for fusion in pipeline.fuse:
        g = fuse_named(g, fusion)
    if pipeline.pieces > 1:
        g = stream_pieces(g, g.find(K.GENERATE).name, pipeline.pieces)
    return place(g, pipeline.placement)
