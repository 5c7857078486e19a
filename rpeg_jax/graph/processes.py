"""What a plan may ask of the runtime when the run is P JAX processes: one rule set for both sides.
The planner searches only the candidates it allows (costmodel/space.py), and the runtime refuses
a plan it does not allow before anything is built or compiled (runtime/setup.py `build`).

    bad = why_not(cfg, processes, num_devices, Runs(admission="continuous"))   # Illegal | None
    check_plan(cfg, plan, graph, processes)    # raises NotRunnable (a ConfigError) for an illegal plan

With P > 1 processes (one per node, as SLURM launches them), colocated, every process generates its
own share of a step's prompts on its own devices, data-parallel, and the rollouts are assembled into
global arrays for the training stages (runtime/placement.py); split, the first processes generate
(each its share) and the others train, the rollouts and the weights handed across by collectives
(runtime/split.py). The rules, judged in this order (the first that fails is returned: one line
naming the key and the value):

    costmodel.processes    P >= 1 divides the devices (each process owns N / P of them, in order)
    data.prompts_per_step  colocated: a multiple of P: each process generates whole groups, its share;
                           or, under step admission, a divisor of P with rl.group_size a multiple of
                           s = P / prompts_per_step: each prompt's group is shared by s consecutive
                           processes, process k generating samples [(k % s) G/s, (k % s + 1) G/s) of
                           prompt k // s (`share_of`; sub-groups, as verl gives a data-parallel rank
                           part of a group). Either way every process generates prompts x G / P
                           sequences and the global batch is the one-process batch, in its order
                           (prompt-major: a group's G rows consecutive, as the training stages' prompt
                           sharing and group-wise shuffles read them; GRPO's advantages group rows
                           by group id over the global batch, so a group spanning processes is
                           normalised over all its members). Sub-groups need every piece of the step
                           generated whole on each process: continuous admission, rl.filter_groups,
                           pipeline.pieces > 1 and episodes (env.name) keep whole groups (refused
                           naming data.prompts_per_step; the message names the fix: the next multiple
                           of P)
    rl.filter_groups       none, or rollout.admission=continuous (colocated): under step admission each
                           process would refill its share in its own number of rounds (and only one
                           process's stream cursor would reach the checkpoint); under continuous
                           admission every process's engine runs on its own data shard, decides from
                           seeds, data order and decode-chunk counts only, and checkpoints its whole state
    split: what it does not run yet: rl.filter_groups, pipeline.pieces > 1 (a step's rollouts are handed
                           over whole), eval.path, env.name other than single_turn,
                           train.pack_sequences with more than one training process
    pipeline.placement     colocated or split
    the plan's groups      colocated: every stage on all N devices (no sub-mesh on some processes only);
                           split: whole processes, generation's group on the first ones, every process
                           in one group (named by pipeline.split_sizes for a manual plan), and
                           data.prompts_per_step a multiple of the generating processes
    generation tensor      divides N / P: a tensor group lies inside one process (tensor-parallel
                           decode on its local devices, replicas data-parallel within and across
                           processes); a group spanning processes is not run

The last two are set by the plan's layout, so they name its source: `pipeline.plan` (auto or a
plan file), or for a manual plan `sharding.generate_mesh` (generation's mesh), else `sharding.mesh`.
One process: every plan is legal. A field of Runs left None is not judged: the planner asks about
one part of a candidate at a time.

Callers: costmodel/planner.py and costmodel/space.py (filtering), runtime/setup.py (refusing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.run import RunConfig
from rpeg_jax.graph.ir import Graph, GraphError, StageKind
from rpeg_jax.graph.plan import Plan


class NotRunnable(GraphError, ConfigError):
    """A plan (or a config the planner is asked to plan) the runtime cannot run with this many
    processes. A ConfigError for the commands (one line, exit 2) and a GraphError for the planner's
    callers, as costmodel/planner.NoPlanFits."""

    def __init__(self, key: str, value: Any, why: str):
        ConfigError.__init__(self, key, value, why)
        self.node = "plan"


@dataclass(frozen=True)
class Illegal:
    key: str  # the knob, a dotted config key
    value: Any  # its value
    why: str

    def error(self) -> NotRunnable:
        return NotRunnable(self.key, self.value, self.why)


@dataclass(frozen=True)
class Runs:
    """What a plan (or a part of a candidate) asks of the runtime; None: not judged."""

    placement: str | None = None  # pipeline.placement: colocated | split
    admission: str | None = None  # rollout.admission: step | continuous
    group_sizes: tuple[int, ...] | None = None  # devices of each group a stage runs on, generation's first
    gen_tensor: int | None = None  # the generation mesh's tensor axis
    pieces: int | None = None  # pipeline.pieces: generation streamed to training in that many pieces
    layout: tuple[str, Any] = ("pipeline.plan", "auto")  # (key, value) that set the groups and meshes


def why_not(cfg: RunConfig, processes: int, num_devices: int, runs: Runs | None = None) -> Illegal | None:
    """The first rule (module docstring) that `runs` (default: nothing but the config) breaks with
    `processes` processes owning `num_devices` devices, or None when the runtime runs it."""
    P, N, runs = processes, num_devices, runs or Runs()
    if P < 1 or N % P:
        return Illegal("costmodel.processes", P, f"{P} processes cannot own {N} devices evenly (N / P each, in order)")
    if P == 1:
        return None
    procs = f"with {P} processes"
    split = runs.placement == "split"
    prompts = cfg.data.prompts_per_step
    admission = runs.admission or cfg.rollout.admission
    if prompts % P and not split:
        bad = _sub_groups(cfg, P, admission, runs.pieces or cfg.pipeline.pieces)
        if bad is not None:
            return bad
    if cfg.rl.filter_groups != "none" and (admission != "continuous" or split):
        why = (
            f"{procs} dynamic sampling runs under rollout.admission=continuous only (under step admission each "
            f"process would refill its share in its own number of rounds); use none, or continuous admission"
        )
        if split and admission == "continuous":
            why = f"{procs} and pipeline.placement=split dynamic sampling is not run yet; use none, or colocated"
        return Illegal("rl.filter_groups", cfg.rl.filter_groups, why)
    if split:
        pieces = runs.pieces or cfg.pipeline.pieces
        sizes = list(runs.group_sizes or ())
        train_procs = sum(sizes[1:]) // max(1, N // P) if len(sizes) > 1 else None
        bad = split_unsupported(cfg, train_procs) + ([("pipeline.pieces", pieces, "use 1")] if pieces > 1 else [])
        for key, value, fix in bad:
            return Illegal(key, value, f"{procs} and pipeline.placement=split this is not run yet; {fix}")
    elif runs.placement is not None and runs.placement != "colocated":
        return Illegal("pipeline.placement", runs.placement, f"{procs}: colocated or split")
    key, value = runs.layout
    local = N // P
    sizes = list(runs.group_sizes or ())
    if split and sizes:
        gkey, gvalue = (key, value) if not key.startswith("sharding.") else ("pipeline.split_sizes", None)
        if gvalue is None:  # a manual plan's groups: pipeline.split_sizes
            gvalue = list(cfg.pipeline.split_sizes)
        part = [n for n in sizes if n % local]
        if part or sum(sizes) != N:
            why = (
                f"split groups of {sizes} devices: {procs} ({local} devices each) generation takes whole processes "
                f"and training the others, every process in one group"
            )
            return Illegal(gkey, gvalue, why)
        gen_procs = sizes[0] // local
        if prompts % gen_procs:
            why = (
                f"must be a multiple of the {gen_procs} generating processes (each generates whole groups of its share)"
            )
            return Illegal("data.prompts_per_step", prompts, why)
    small = [n for n in sizes if n != N] if not split else []
    if small:
        why = f"a stage runs on a group of {small[0]} devices; {procs} every stage of a colocated plan runs on all {N}"
        return Illegal(key, value, why)
    if runs.gen_tensor is not None and local % runs.gen_tensor:
        hint = ": sharding.generate_mesh={data: -1, tensor: T}" if key.startswith("sharding.") else ""
        why = (
            f"generation has tensor={runs.gen_tensor}; {procs} a tensor group lies inside one process "
            f"(replicas across processes): tensor must divide its {local} devices"
        )
        return Illegal(key, value, f"{why}{hint}")
    return None


def sharers(prompts: int, group: int, processes: int) -> int | None:
    """How many processes generate each prompt's group under step admission, colocated (module
    docstring): 1 when `prompts` is a multiple of `processes` (whole groups); s = processes / prompts
    when that is a whole number dividing `group` (each process generates group / s samples of one
    prompt); None when the processes cannot share the prompts evenly either way."""
    if prompts < 1 or processes < 1:
        return None
    if prompts % processes == 0:
        return 1
    s = processes // prompts
    return s if processes % prompts == 0 and group % s == 0 else None


@dataclass(frozen=True)
class Share:
    """What generating process `rank` of `processes` generates of each step under step admission:
    prompts [first_prompt, first_prompt + prompts) of the step's batch, samples [first_sample,
    first_sample + samples) of each (the sampler's sample indices: the one-process run's streams).
    Its prompts come from data shard `shard` of `shards` (data/pipeline.py)."""

    first_prompt: int
    prompts: int
    first_sample: int
    samples: int
    shard: int
    shards: int


def share_of(prompts: int, group: int, processes: int, rank: int) -> Share:
    """Process `rank`'s Share (ValueError where `sharers` is None: why_not refuses that first)."""
    s = sharers(prompts, group, processes)
    if s is None or not 0 <= rank < processes:
        raise ValueError(f"{processes} processes cannot share {prompts} prompts x {group} samples (rank {rank})")
    shards = processes // s
    per = prompts // shards
    return Share(
        first_prompt=(rank // s) * per,
        prompts=per,
        first_sample=(rank % s) * (group // s),
        samples=group // s,
        shard=rank // s,
        shards=shards,
    )


def _sub_groups(cfg: RunConfig, P: int, admission: str, pieces: int) -> Illegal | None:
    """The prompt-count rule (colocated, data.prompts_per_step not a multiple of P): None when the
    processes share each prompt's group (sub-groups) and nothing in the run needs whole groups per
    process; else the refusal, naming the fix (the next multiple of P: fewer processes would need a
    process to own devices of several nodes, and one per node is the fewest a cluster launches)."""
    prompts, G = cfg.data.prompts_per_step, cfg.rl.group_size
    up = -(-prompts // P) * P
    fix = f"raise data.prompts_per_step to {up}"
    s = sharers(prompts, G, P)
    if s is None:
        why = f"must be a multiple of the {P} processes (each generates whole groups of its share)"
        if P % prompts == 0:  # sub-groups, but the group does not split evenly
            s = P // prompts
            why += (
                f" or share each group over {s} processes (each generating rl.group_size / {s} samples), "
                f"which rl.group_size={G} does not allow"
            )
        return Illegal("data.prompts_per_step", prompts, f"{why}: {fix}")
    # (what needs whole groups on a process, why, the other fix); dynamic sampling has none but the
    # prompt count (it needs continuous admission on several processes)
    step = ", or use rollout.admission=step" if cfg.rl.filter_groups == "none" else ""
    needs = [
        (admission == "continuous", "rollout.admission=continuous", "each engine completes whole groups", step),
        (cfg.rl.filter_groups != "none", f"rl.filter_groups={cfg.rl.filter_groups}", "it scores whole groups", ""),
        (cfg.env.name != "single_turn", f"env.name={cfg.env.name}", "a group's episodes run on one process", ""),
        (pieces > 1, f"pipeline.pieces={pieces}", "a process's prompts are split into pieces", ""),
    ]
    for hit, what, reason, other in needs:
        if hit:
            why = (
                f"{P} processes share its {prompts} groups, {s} per prompt (each generates {G // s} of its {G} "
                f"samples), which {what} does not run ({reason}): {fix}{other}"
            )
            return Illegal("data.prompts_per_step", prompts, why)
    return None


def split_unsupported(cfg: RunConfig, train_procs: int | None = None) -> list[tuple[str, Any, str]]:
    """(key, value, what to do) of each setting a split placement across processes does not run.
    `train_procs`: the training group's processes (None: not known). Packed updates run with one
    training process (the packing plan reads the batch's segment ids on it, no collective); over
    several the plan's gather would be a collective of every process, which the generating ones do
    not call."""
    out = []
    if cfg.train.pack_sequences and train_procs != 1:
        out.append(("train.pack_sequences", True, "use false, one training process, or colocated"))
    if cfg.eval.path is not None:
        out.append(("eval.path", cfg.eval.path, "evaluate with `rpeg eval` on a checkpoint, or run colocated"))
    if cfg.env.name != "single_turn":
        out.append(("env.name", cfg.env.name, "use single_turn, or colocated"))
    return out


def runs_of(cfg: RunConfig, plan: Plan, graph: Graph) -> Runs:
    """What `plan` asks of the runtime, `cfg` being the config it implies (graph/plan.config_for_plan)."""
    gen = graph.find(StageKind.GENERATE)
    layout = ("pipeline.plan", cfg.pipeline.plan)  # the planner's (auto) or a file's
    if plan.source == "manual":  # generation's mesh: sharding.generate_mesh, else sharding.mesh
        sh = cfg.sharding
        layout = ("sharding.generate_mesh", sh.generate_mesh) if sh.generate_mesh else ("sharding.mesh", sh.mesh)
    used = {s.group for s in plan.stages}
    first = plan.stage(gen.name).group if gen is not None else None  # generation's group first
    groups = sorted((g for g in plan.groups if g.name in used), key=lambda g: g.name != first)
    return Runs(
        placement=cfg.pipeline.placement,
        admission=cfg.rollout.admission,
        group_sizes=tuple(g.size for g in groups),
        gen_tensor=plan.stage(gen.name).mesh.get("tensor", 1) if gen is not None else None,
        pieces=cfg.pipeline.pieces,
        layout=layout,
    )


def check_plan(cfg: RunConfig, plan: Plan, graph: Graph, processes: int) -> None:
    """Raise NotRunnable (one line naming the knob) unless the runtime runs `plan` on `processes`
    processes."""
    bad = why_not(cfg, processes, plan.num_devices, runs_of(cfg, plan, graph))
    if bad is not None:
        raise bad.error()
