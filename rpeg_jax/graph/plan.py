"""The plan: where and how every stage runs, as a value that is printed, saved and reloaded.

A Plan holds device groups (the whole mesh, or sub-meshes for split placements), per stage
(or fused stage) the group, the mesh shape (data/fsdp/tensor), the sharding rule preset and the
micro-batch count, plus the structural knobs (the pipeline section) that shaped the graph.
Nothing downstream of the planner re-decides placement.

    plan = plan_from_config(cfg, num_devices)         # manual: from cfg.pipeline + cfg.sharding
    plan = plan_for_config(cfg, n, planner=costmodel_planner)   # honours pipeline.plan
    plan.save("plan.json"); Plan.load("plan.json"); print(plan.describe())
    cfg, changed = config_for_plan(cfg, plan)         # the config the plan implies (what runs)
    graph = graph_for_plan(cfg, plan)                 # the graph the plan's knobs describe

weight_sync runs on its own group (training) and writes into generate's group and mesh: the
destination layout is `plan.stage("generate")`. Callers: costmodel (planner output), runtime
and compile (binding), `rpeg plan` / `rpeg graph`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.files import write_atomic
from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.config.run import RunConfig
from rpeg_jax.config.sharding import MESH_AXES, rules_for_mesh
from rpeg_jax.graph.ir import Graph, GraphError, Op, Stage

# The plan's structure: pipeline knobs (they shape the graph) and settings in other sections (dotted
# config keys in Plan.settings): the admission mode of the rollout engine, and what the planner chose.
KNOBS = (
    "staleness",
    "share_actor_critic",
    "fuse",
    "elide_old_forward",
    "pieces",
    "placement",
    "split_sizes",
    "proximal_from_update",
    "values_from_critic_update",
)
PLAN_SETTINGS = (
    "rl.micro_batches",
    "rl.forward_micro_batches",
    "model.remat",
    "rollout.max_slots",
    "rollout.admission",
    "rollout.decode_ahead",
    "train.offload",
)
PLAN_VERSION = 1


@dataclass(frozen=True)
class DeviceGroup:
    name: str  # "all" | "gen" | "train" | any planner-chosen name
    devices: tuple[int, ...]  # global device indices

    @property
    def size(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class StagePlan:
    stage: str  # Graph stage name (a StageKind value, or a fused stage's name)
    group: str  # DeviceGroup name
    mesh: dict[str, int]  # mesh axis -> size over the group's devices (product = group size)
    rules: str  # sharding rule preset name
    pieces: int = 1  # pieces the stage runs its batch in


@dataclass(frozen=True)
class Plan:
    num_devices: int
    groups: tuple[DeviceGroup, ...]
    stages: tuple[StagePlan, ...]
    knobs: dict[str, Any] = field(default_factory=dict)  # the pipeline knobs (KNOBS)
    settings: dict[str, Any] = field(default_factory=dict)  # dotted config keys of PLAN_SETTINGS
    source: str = "manual"  # manual | planner | a file path
    predicted: dict[str, Any] = field(default_factory=dict)  # planner's breakdown (step_time_s, ...)

    # ---- lookup --------------------------------------------------------------------------
    def stage(self, name: str) -> StagePlan:
        for s in self.stages:
            if s.stage == name:
                return s
        raise GraphError(name, f"no plan entry; planned stages: {', '.join(s.stage for s in self.stages)}")

    def group(self, name: str) -> DeviceGroup:
        for gr in self.groups:
            if gr.name == name:
                return gr
        raise GraphError(name, f"no such device group; groups: {', '.join(g.name for g in self.groups)}")

    def devices_for(self, stage: str) -> tuple[int, ...]:
        return self.group(self.stage(stage).group).devices

    def pipeline_config(self, base: PipelineConfig | None = None) -> PipelineConfig:
        """`base` with this plan's structural knobs (so the graph matches the plan)."""
        unknown = sorted(set(self.knobs) - set(KNOBS))
        if unknown:
            raise GraphError("plan", f"unknown knobs {unknown}; a plan's knobs are {', '.join(KNOBS)}")
        kn = {k: tuple(v) if isinstance(v, list) else v for k, v in self.knobs.items()}
        out = dataclasses.replace(base or PipelineConfig(), **kn)
        out.validate("pipeline")
        return out

    # ---- checks --------------------------------------------------------------------------
    def check(self, graph: Graph | None = None) -> Plan:
        """Devices in range, groups disjoint or nested (one inside the other), mesh products =
        group sizes, and (given a graph) exactly one entry per stage. Errors name the stage or group."""
        for gr in self.groups:
            if not gr.devices or len(set(gr.devices)) != gr.size:
                raise GraphError(gr.name, f"device group must list distinct devices, got {list(gr.devices)}")
            bad = [d for d in gr.devices if not 0 <= d < self.num_devices]
            if bad:
                raise GraphError(gr.name, f"devices {bad} outside [0, {self.num_devices})")
            mine = set(gr.devices)
            for other in self.groups:  # groups are disjoint or nested (a sub-mesh of another)
                theirs = set(other.devices)
                if other.name == gr.name and other is not gr:
                    raise GraphError(gr.name, "device group defined twice")
                if mine & theirs and not (mine <= theirs or theirs <= mine):
                    raise GraphError(gr.name, f"overlaps group {other.name!r} partially on {sorted(mine & theirs)}")
        names = [s.stage for s in self.stages]
        for s in self.stages:
            if names.count(s.stage) > 1:
                raise GraphError(s.stage, "planned twice")
            size = self.group(s.group).size
            unknown = [a for a in s.mesh if a not in MESH_AXES]
            if unknown:
                raise GraphError(s.stage, f"mesh axes {unknown} unknown; known: {', '.join(MESH_AXES)}")
            if _prod(s.mesh.values()) != size or any(v < 1 for v in s.mesh.values()):
                raise GraphError(s.stage, f"mesh {s.mesh} does not cover group {s.group!r} of {size} devices")
            if s.pieces < 1:
                raise GraphError(s.stage, f"pieces={s.pieces} must be >= 1")
        if graph is not None:
            want = set(graph.stage_names())
            for n in want - set(names):
                raise GraphError(n, "stage has no plan entry")
            for n in set(names) - want:
                raise GraphError(n, "plan entry for a stage the graph does not have")
            for s in self.stages:
                if s.pieces != graph.stage(s.stage).pieces:
                    raise GraphError(
                        s.stage,
                        f"planned in {s.pieces} pieces but the graph runs it in "
                        f"{graph.stage(s.stage).pieces} (pipeline.pieces)",
                    )
        return self

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "rpeg-plan",
            "version": PLAN_VERSION,
            "num_devices": self.num_devices,
            "source": self.source,
            "knobs": self.knobs,
            "settings": self.settings,
            "predicted": self.predicted,
            "groups": [{"name": g.name, "devices": list(g.devices)} for g in self.groups],
            "stages": [dataclasses.asdict(s) for s in self.stages],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if d.get("format") != "rpeg-plan" or d.get("version") != PLAN_VERSION:
            raise GraphError("plan", f"not an rpeg-plan v{PLAN_VERSION} document")
        if any("microbatches" in s for s in d.get("stages", ())) or "microbatches" in d.get("knobs", {}):
            raise GraphError(
                "plan",
                "written before pipeline.microbatches was renamed pipeline.pieces: save it again with "
                '`rpeg plan --save-plan`, or rename its "microbatches" fields to "pieces"',
            )
        try:
            return cls(
                num_devices=int(d["num_devices"]),
                source=d.get("source", "manual"),
                knobs=dict(d.get("knobs", {})),
                settings=dict(d.get("settings", {})),
                predicted=dict(d.get("predicted", {})),
                groups=tuple(DeviceGroup(g["name"], tuple(g["devices"])) for g in d["groups"]),
                stages=tuple(StagePlan(**s) for s in d["stages"]),
            ).check()
        except (KeyError, TypeError) as e:
            raise GraphError("plan", f"malformed plan: {e!r}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise GraphError("plan", f"invalid JSON: {e}") from None

    def save(self, path: str) -> None:
        write_atomic(path, self.to_json() + "\n")  # whole or not at all (config/files.py)

    @classmethod
    def load(cls, path: str) -> Plan:
        with open(path) as f:
            plan = cls.from_json(f.read())
        return dataclasses.replace(plan, source=path)

    # ---- display -------------------------------------------------------------------------
    def describe(self) -> str:
        knobs = " ".join(f"{k}={self.knobs[k]}" for k in KNOBS if k in self.knobs)
        lines = [f"plan ({self.source}) for {self.num_devices} devices; {knobs}", "groups:"]
        for g in self.groups:
            lines.append(f"  {g.name:<8} {g.size:>4} devices  {_ranges(g.devices)}")
        lines.append(f"  {'stage':<32} {'group':<8} {'mesh':<26} {'rules':<10} mb")
        for s in self.stages:
            mesh = " ".join(f"{a}={v}" for a, v in s.mesh.items())
            lines.append(f"  {s.stage:<32} {s.group:<8} {mesh:<26} {s.rules:<10} {s.pieces}")
        if self.predicted:
            lines.append("predicted: " + ", ".join(f"{k}={_predicted(k, v)}" for k, v in self.predicted.items()))
        return "\n".join(lines)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _predicted(key: str, v: Any) -> str:
    """A predicted value for the summary line; a utilization above 1 (only a modelling error: an
    uncalibrated profile's placeholder peak) is shown as such, as the plan table does."""
    if key.startswith("utilization") and isinstance(v, float) and v > 1.0:
        return ">1? (above the peak: calibrate the profile)"
    return _short(v)


def _ranges(devs: tuple[int, ...]) -> str:
    """'0-3,6' for (0, 1, 2, 3, 6)."""
    out, start, prev = [], None, None
    for d in sorted(devs) + [None]:
        if start is None:
            start = prev = d
        elif d is not None and d == prev + 1:
            prev = d
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = d
    return ",".join(out)


def knobs_of(p: PipelineConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(p, k)) for k in KNOBS)}


def resolve_mesh(mesh: dict[str, int], size: int, group: str, generate: bool = False) -> dict[str, int]:
    """sharding.mesh (`generate`: sharding.generate_mesh) over a group of `size` devices: -1 fills,
    missing axes are 1."""
    key = "sharding.generate_mesh" if generate else "sharding.mesh"
    out = {a: mesh.get(a, 1) for a in MESH_AXES}
    fixed = _prod(v for v in out.values() if v != -1)
    if -1 in out.values():
        if size % fixed:
            raise ConfigError(key, mesh, f"fixed axes ({fixed}) do not divide group {group!r} of {size} devices")
        out = {a: (size // fixed if v == -1 else v) for a, v in out.items()}
    elif fixed != size:
        raise ConfigError(key, mesh, f"covers {fixed} devices but group {group!r} has {size}")
    return out


def groups_for(cfg: RunConfig, num_devices: int) -> tuple[DeviceGroup, ...]:
    p = cfg.pipeline
    if p.placement == "colocated":
        return (DeviceGroup("all", tuple(range(num_devices))),)
    gen, train = p.split_sizes
    if gen + train != num_devices:
        raise ConfigError(
            "pipeline.split_sizes",
            list(p.split_sizes),
            f"generation + training = {gen + train} but there are {num_devices} devices",
        )
    return (DeviceGroup("gen", tuple(range(gen))), DeviceGroup("train", tuple(range(gen, gen + train))))


def _ops(stage: Stage) -> set:
    return {p.workload.op for p in (stage.parts or (stage,))}


def rules_for(stage: Stage, cfg: RunConfig) -> str:
    ops = _ops(stage)
    if ops == {Op.HOST}:
        return "host"
    return cfg.sharding.generate_rules if Op.GENERATE in ops else cfg.sharding.train_rules


def layout_rules(stage: Stage, cfg: RunConfig, mesh: dict[str, int], priced: bool) -> str:
    """The rule preset `stage` runs with on `mesh`: the config's with `auto` resolved on the mesh;
    `priced` (planner plans) also lifts a built-in preset to shard every mesh axis the cost model
    priced (config/sharding.rules_for_mesh)."""
    rules = rules_for(stage, cfg)
    if rules == "host":
        return rules
    role = "generate" if Op.GENERATE in _ops(stage) else "train"
    return rules_for_mesh(rules, mesh, role, priced=priced)


def config_for_plan(cfg: RunConfig, plan: Plan) -> tuple[RunConfig, dict[str, tuple[Any, Any]]]:
    """`cfg` with the plan's structure, whatever the plan's source (manual, the planner, a file):
    the pipeline knobs and the planner's settings in other sections (PLAN_SETTINGS). Returns the
    validated config and {dotted key: (config's value, plan's value)} for every value the plan
    changed, so the caller can report them. The runtime reads the structure from this config and
    the graph built from it, never from the config it was given."""
    changed: dict[str, tuple[Any, Any]] = {}
    pipeline = plan.pipeline_config(cfg.pipeline)
    for k in KNOBS:
        old, new = getattr(cfg.pipeline, k), getattr(pipeline, k)
        if old != new:
            changed[f"pipeline.{k}"] = (old, new)
    sections = {"pipeline": pipeline}
    for dotted, value in plan.settings.items():
        if dotted not in PLAN_SETTINGS:
            raise ConfigError(
                "pipeline.plan",
                plan.source,
                f"sets {dotted!r}, not one of the settings a plan may carry ({', '.join(PLAN_SETTINGS)})",
            )
        section, name = dotted.split(".")
        current = sections.get(section, getattr(cfg, section))
        if getattr(current, name) != value:
            changed[dotted] = (getattr(current, name), value)
            sections[section] = dataclasses.replace(current, **{name: value})
    out = dataclasses.replace(cfg, **sections)
    for name, section in sections.items():
        section.validate(name)
    out.validate()
    return out, changed


def decode_ahead_setting(graph: Graph) -> dict:
    """The plan's rollout.decode_ahead (resolved, structural: a checkpoint holds a batch made ahead) under
    continuous admission; nothing otherwise (the key has no effect there)."""
    return {"rollout.decode_ahead": graph.decode_ahead} if graph.admission == "continuous" else {}


def graph_for_plan(cfg: RunConfig, plan: Plan | None = None) -> Graph:
    """The config's graph after the passes the plan's knobs (or the config's) ask for."""
    from rpeg_jax.graph.algorithms import build_graph
    from rpeg_jax.graph.passes import apply_pipeline

    pipeline = plan.pipeline_config(cfg.pipeline) if plan is not None else cfg.pipeline
    return apply_pipeline(build_graph(cfg), pipeline, cfg.rollout.admission, cfg.rollout.decode_ahead)


def plan_from_config(cfg: RunConfig, num_devices: int, graph: Graph | None = None) -> Plan:
    """The manual plan: colocated puts every stage on all devices; split puts generation on the
    first split_sizes[0] devices and training on the rest. Meshes from sharding.mesh; generating
    stages' from sharding.generate_mesh when it is set."""
    if num_devices < 1:
        raise ConfigError("num_devices", num_devices, "must be >= 1")
    graph = graph if graph is not None else graph_for_plan(cfg)
    groups = {g.name: g for g in groups_for(cfg, num_devices)}
    stages = []
    for st in graph.stages():
        if st.placement not in groups:
            raise GraphError(st.name, f"placed on {st.placement!r} but the plan's groups are {list(groups)}")
        given = cfg.sharding.generate_mesh if Op.GENERATE in _ops(st) and cfg.sharding.generate_mesh else None
        mesh = resolve_mesh(given or cfg.sharding.mesh, groups[st.placement].size, st.placement, given is not None)
        # `auto` resolved on the stage's mesh; an explicit preset as given
        stages.append(StagePlan(st.name, st.placement, mesh, layout_rules(st, cfg, mesh, priced=False), st.pieces))
    return Plan(
        num_devices=num_devices,
        groups=tuple(groups.values()),
        stages=tuple(stages),
        knobs=knobs_of(cfg.pipeline),
        settings={"rollout.admission": cfg.rollout.admission, **decode_ahead_setting(graph)},
        source="manual",
    ).check(graph)


def widen_generation(
    plan: Plan, graph: Graph, cfg: RunConfig, devices: tuple[int, ...], group: str = "gen_wide"
) -> Plan:
    """`plan` with every generating stage (one whose ops include GENERATE, fused or not) on a data
    mesh of `devices` (a new group `group`), every other stage where it was. The new group must
    nest with the plan's groups (contain them or sit inside them; Plan.check). The weight handoff
    reshards the trained weights into the wider layout. The executor runs each group in its own
    thread: at staleness 0 the data dependencies order generation and training one after the other;
    at k >= 1 they overlap on the devices the groups share. The cost model does not price such a
    plan (costmodel.pricing refuses it).

    Why: on a CPU host whose cores are JAX devices, one device program's small decode GEMMs do not
    fill the cores but one program per core does, while the update's products already use every
    core from one device (bench/rl_step.py: R1 generates on every core, trains on device 0)."""
    wide = DeviceGroup(group, tuple(devices))
    mesh = {"data": wide.size, "fsdp": 1, "tensor": 1}
    by_name = {st.name: st for st in graph.stages()}
    stages = []
    for sp in plan.stages:
        st = by_name.get(sp.stage)
        if st is not None and Op.GENERATE in _ops(st):
            sp = dataclasses.replace(sp, group=group, mesh=mesh, rules=layout_rules(st, cfg, mesh, priced=False))
        stages.append(sp)
    return dataclasses.replace(
        plan, num_devices=max(plan.num_devices, max(devices) + 1), groups=plan.groups + (wide,), stages=tuple(stages)
    ).check(graph)


def plan_for_config(cfg: RunConfig, num_devices: int, planner: Callable[[RunConfig, int], Plan] | None = None) -> Plan:
    """Honour `pipeline.plan`: manual (plan_from_config), auto (the cost model's `planner`, which
    the caller passes in: graph never imports costmodel), or a plan JSON file (checked)."""
    source = cfg.pipeline.plan
    if source == "manual":
        return plan_from_config(cfg, num_devices)
    if source == "auto":
        if planner is None:
            raise ConfigError("pipeline.plan", source, "auto needs the cost model's planner (rpeg plan / runtime)")
        return planner(cfg, num_devices)
    if not os.path.isfile(source):
        raise ConfigError("pipeline.plan", source, "is not manual | auto | an existing plan JSON file")
    try:
        plan = Plan.load(source)
        if plan.num_devices != num_devices:
            raise GraphError("plan", f"made for {plan.num_devices} devices, running on {num_devices}")
        return plan.check(graph_for_plan(cfg, plan))
    except GraphError as e:
        raise ConfigError("pipeline.plan", source, str(e)) from None
