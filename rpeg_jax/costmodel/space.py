"""The planner's search space: structural options (pipeline knobs), device-group options, and
which candidate meshes may shard the batches of a graph.

    structural_options(ctx, placement, share)  # PipelineConfigs tried: k, elision, fusion, pieces
    is_algorithmic(staleness, share)           # knobs that change the algorithm (gains.algorithmic)
    admissions(ctx, pipe)                      # rollout.admission modes tried with one of them
    one_step_rewrites(cfg, share)              # the one-step rewrites every candidate gets when legal
    families(ctx)                              # (placement, shared backbone) families
    allocations(ctx, placement)                # (n_gen, n_train) device-group options
    divisible(ctx, graph, tab)                 # rows whose mesh axes divide what they shard
    runnable(ctx, **runs)                      # the runtime runs it with ctx.processes processes
    generation_tensor_sizes(ctx, ours)         # tensor degrees generation may take

Only candidates the runtime runs with the context's processes are searched: every option above is
filtered with the one rule set the runtime refuses plans by (graph/processes.why_not). The
baselines (verl-like, ReaL-like) are other systems under their own rules, not filtered.

Callers: costmodel/planner.py (search), costmodel/pricing.py, tests.
"""

from __future__ import annotations

import itertools

import numpy as np

from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.config.run import RunConfig
from rpeg_jax.costmodel.candidates import PIECES
from rpeg_jax.graph.ir import Graph
from rpeg_jax.graph.processes import Runs, why_not


def sampler_is_trainer(cfg: RunConfig) -> bool:
    """The sampler's logprobs are the trainer's (same tempered distribution, no truncation), so
    they may serve as π_old on-policy (elide_old_forward)."""
    r = cfg.rollout
    return r.temperature > 0 and r.top_k == 0 and r.top_p >= 1.0 and r.min_p == 0.0


def is_algorithmic(staleness: int, share: bool) -> bool:
    """Whether a plan's knobs change the algorithm the learner runs (as opposed to how the same
    algorithm is run): staleness k >= 1 (the learner trains on data from a policy up to k updates
    old) or one shared actor-critic backbone (another model). Placement, layouts, fusion, elision
    of a forward whose result another pass already has, streamed pieces and the overlap they give
    at k = 0 are systems changes: the learner sees the same data and the same models."""
    return bool(staleness) or bool(share)


def structural_options(ctx, placement: str, share: bool, equal_algorithm: bool = False) -> list[PipelineConfig]:
    """The pipeline knobs tried in a placement family. `equal_algorithm`: only options at the
    synchronous algorithm (k = 0; the caller passes share=False), whatever the config pins: the
    reference for the systems gain (planner.search)."""
    cfg, c = ctx.cfg, ctx.cfg.costmodel
    fuses = [()] + ([("forwards",), ("advantage",), ("forwards", "advantage")] if c.search_fusion else [])
    # k >= 1 pays colocated only with continuous admission (admissions() below): sequences run on
    # across weight updates, so the engine stays full instead of draining every step. Staleness
    # changes the data the learner sees, so it is searched only with costmodel.search_algorithmic.
    ks = list(range(0, c.max_staleness + 1)) if c.search_algorithmic else [0]
    if (cfg.pipeline.staleness or cfg.rollout.admission == "continuous") and not equal_algorithm:
        ks = [cfg.pipeline.staleness]  # a bound the config sets is the user's: plan around it
    if equal_algorithm:
        ks = [0]
    # Eliding old_forward (k = 0 only) removes a forward over the batch: π_old = behav_logp.
    elides = [False] + ([True] if c.search_elide_old_forward and sampler_is_trainer(cfg) else [])
    if cfg.pipeline.elide_old_forward:
        elides, ks = [True], [0]
    if equal_algorithm:
        share = False
    # Pieces split each process's prompts evenly (runtime/rollout/sources.generate_piece); a split
    # across processes hands a step's rollouts over whole (runnable: pipeline.pieces)
    prompts = ctx.base.sizes["N"] // ctx.processes
    pieces = [1] if placement == "colocated" else [m for m in (1, *PIECES) if prompts % m == 0]
    pieces = [m for m in pieces if runnable(ctx, placement=placement, pieces=m)]
    prox, vals = one_step_rewrites(cfg, share)
    out = []
    for k, el, fz, m in itertools.product(ks, elides, fuses, pieces):
        if el and k:
            continue
        out.append(
            PipelineConfig(
                staleness=k,
                share_actor_critic=share,
                fuse=fz,
                elide_old_forward=el,
                pieces=m,
                placement=placement,
                split_sizes=(1, 1) if placement == "split" else (),
                plan="manual",
                proximal_from_update=prox and not el,
                values_from_critic_update=vals and (not share or el or prox),
            )
        )
    return out


def runnable(ctx, **runs) -> bool:
    """Whether the runtime runs a candidate (the parts of graph/processes.Runs given) with the
    context's processes."""
    return why_not(ctx.cfg, ctx.processes, ctx.N, Runs(**runs)) is None


def generation_tensor_sizes(ctx, ours: bool = True) -> tuple[int, ...]:
    """Tensor degrees generation is priced at: costmodel.tensor_sizes, those the runtime runs for
    our plans (with several processes: degrees dividing a process's devices), all of them for the baselines'
    own engines."""
    sizes = ctx.cfg.costmodel.tensor_sizes
    return tuple(t for t in sizes if runnable(ctx, gen_tensor=t)) if ours else sizes


def continuous_searched(ctx, ours: bool = True, placement: str | None = None) -> bool:
    """Whether any option (of `placement`, None: colocated) may run rollout.admission=continuous: k >= 1
    can be planned and, for `ours`, the runtime runs it with the context's processes (space.runnable;
    e.g. not colocated where processes share each prompt's group, graph/processes.sharers, while a
    split's generating processes may still hold whole groups)."""
    k = max(ctx.cfg.costmodel.max_staleness, ctx.cfg.pipeline.staleness)
    if placement == "split":  # judged with its device groups (e.g. packed updates: one training process)
        allocs = allocations(ctx, placement)
        legal = any(runnable(ctx, admission="continuous", placement=placement, group_sizes=a) for a in allocs)
    else:
        legal = runnable(ctx, admission="continuous", placement=placement)
    legal = legal or not ours
    return k >= 1 and legal and not ctx.cfg.pipeline.elide_old_forward


def admissions(ctx, pipe: PipelineConfig) -> list[str]:
    """rollout.admission modes tried with a structural option, searched like k: the config's
    `continuous` is the user's (kept; options it cannot run with get none); the default `step`
    leaves it to the planner. Continuous needs k >= 1, one generation piece (a step's batch is the
    first groups to complete) and a runtime that runs it (runnable). Colocated step
    admission at k >= 1 is tried only for a k the config sets: it runs generation ahead on the
    devices training uses, so it only adds the proximal forward to the synchronous plan. (A config
    pinning continuous on several processes never gets here: planner.make_context refuses it.)"""
    cfg = ctx.cfg
    if not pipe.staleness:
        return ["step"]
    cont = ["continuous"] if pipe.pieces == 1 and continuous_searched(ctx, placement=pipe.placement) else []
    if cfg.rollout.admission == "continuous":
        return cont
    step = ["step"] if pipe.placement == "split" or cfg.pipeline.staleness else []
    return step + cont


def one_step_rewrites(cfg: RunConfig, share: bool) -> tuple[bool, bool]:
    """(proximal_from_update, values_from_critic_update) for every candidate: with one optimizer
    step per batch they are exact and only remove a forward pass, so they are on whenever legal
    (not a search dimension; costmodel.search_one_step_rewrites=false keeps the passes)."""
    r, p = cfg.rl, cfg.pipeline
    search = cfg.costmodel.search_one_step_rewrites and r.ppo_epochs * r.minibatches == 1
    prox = p.proximal_from_update or (search and not (r.kl_in_reward and r.kl_coef > 0))
    vals = (
        (p.values_from_critic_update or search)
        and r.algorithm == "ppo"
        and r.advantage_estimator == "gae"
        and (not share or r.micro_batches == 1 or not r.whiten_advantages)
    )  # shared: needs old_forward gone too
    return prox, vals


def families(ctx, equal_algorithm: bool = False) -> list[tuple[str, bool]]:
    """(placement, shared backbone) families searched: a shared backbone only with
    costmodel.search_algorithmic (PPO, search_share_actor_critic) or when the config pins it;
    `equal_algorithm`: separate models whatever the config says (see structural_options)."""
    c = ctx.cfg.costmodel
    shares = [False]
    if ctx.cfg.rl.algorithm == "ppo" and c.search_share_actor_critic and c.search_algorithmic:
        shares.append(True)
    if ctx.cfg.pipeline.share_actor_critic:
        shares = [True]
    if equal_algorithm:
        shares = [False]
    places = ["colocated"] + (["split"] if allocations(ctx, "split") else [])
    return [(p, s) for p in places for s in shares]


def allocations(ctx, placement: str, ours: bool = True) -> list[tuple[int, int]]:
    """(generation devices, training devices) of each device-group option; `ours`: only those the
    runtime runs with the context's processes (runnable; with several, colocated on all N devices,
    each process generating its share on its own devices, or a split of whole processes: generation
    on the first ones, training on the others, runtime/split.py), else every option (the baselines).

    Accelerators: colocated uses all N; a split partitions N (whole nodes when there are several).
    Shared host (forced CPU devices slicing one machine's cores): every device added to a group
    adds a device program that costs host time, and idle devices cost nothing, so groups of any
    size that fits are tried (colocated on n <= N, splits with n_gen + n_train <= N)."""
    N = ctx.N
    if placement == "colocated":
        out = [(n, n) for n in range(1, N + 1)] if ctx.hw.shared_host else [(N, N)]
    elif ctx.hw.shared_host:
        out = [(g, t) for g in range(1, N) for t in range(1, N - g + 1)]
    else:
        node = ctx.hw.node.devices
        step = node if N >= 2 * node else 1
        out = [(g, N - g) for g in range(step, N, step)]
    if not ours:
        return out
    return [(g, t) for g, t in out if runnable(ctx, placement=placement, group_sizes=(g, t))]


def divisible(ctx, graph: Graph, tab) -> np.ndarray:
    """Rows whose mesh axes divide the batch dimensions they shard in this graph: the sequences
    of one piece (B / pieces) over the generation replicas (the sampler's slot axis), the
    forward layout's data x fsdp (streamed forwards) and the training layout's data x fsdp (the
    rollout arrays are put in the training layout piece by piece)."""
    B = ctx.st.B
    m = max((s.pieces for s in graph.stages()), default=1)
    if B % m:
        return np.zeros(len(tab.n_gen), bool)
    piece = B // m
    reps = tab.n_gen // tab.t_g
    ok = (piece % reps == 0) & (piece % (tab.d * tab.f) == 0) & (piece % (tab.fd * tab.ff) == 0)
    return ok
