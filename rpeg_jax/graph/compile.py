"""The stage compiler: a planned RPEG -> one program per (fused) stage.

    registry = KernelRegistry()                       # the runtime fills it (rl, sampling kernels)
    program = compile_graph(graph, plan, registry, runtime)   # runtime: a StageRuntime
    for cs in program.stages:                         # topological order within a step
        outputs = cs(inputs)                          # {port: value} -> {port: value}

A kernel is `fn(inputs: Mapping[port, value]) -> dict[port, value]`, built by a factory
registered per StageKind (or per tuple of kinds for a dedicated fused kernel, whose factory may
return None for stages it does not handle: the parts are then composed). Ports are the
names on the graph's edges (a state's name, a data node's name, or a renamed port such as the
update's `old_logp` wired to `behav_logp` after `elide_old_forward`). The graph never imports
the kernels: users register their own kernels for existing or new stage kinds.

A jittable stage becomes ONE `jax.jit` program: a fused stage without a dedicated kernel runs
its parts' kernels in order inside that one program (the parts exchange data in a namespace;
internal data never leaves the device program), compiled with the runtime's `compiler_options`
(per-program XLA options, runtime/xla_flags.py). The program is jitted without in/out shardings:
before each call the runtime's `place_inputs` moves the inputs into the stage's layout (explicit,
cached reshards), tracing runs under its `stage_scope` (the layout's activation sharding rules),
and outputs keep the shardings XLA propagates. `StageRuntime` is that whole contract; kernels get
the same object as `StageEnv.context`. Inputs the kernel
donates (e.g. the actor's params and optimizer state in an update) are donated to XLA. Keys
starting with `host_` inside a data value are host-side metadata (prompt texts, answers) and are
not passed into jitted programs. Host stages (the sampler's generate loop, reward verifiers) run as plain Python.

Called by: runtime/trainer.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping, Protocol

import jax

from rpeg_jax.config.registry import Registry
from rpeg_jax.graph.ir import Graph, GraphError, Stage, StageKind, StateNode
from rpeg_jax.graph.plan import Plan, StagePlan


@dataclass(frozen=True)
class Port:
    """One input or output of a stage: the kernel's port name, the graph node, the state offset."""

    name: str
    node: str
    offset: int = 0
    state: bool = False
    stream: bool = False


@dataclass
class Kernel:
    fn: Callable[[Mapping[str, Any]], dict[str, Any]]
    jittable: bool = True
    donate: tuple[str, ...] = ()  # input ports whose buffers the program may reuse
    prepare: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None  # host step before the
    #   program: from the stage's inputs (host_* fields included) extra inputs for it, e.g. a
    #   sequence-packing plan made from the batch's lengths (their shapes are part of its signature)


class StageRuntime(Protocol):
    """What a compiled stage asks of the runtime that runs it (runtime/setup.RuntimeContext)."""

    compiler_options: Mapping[str, str]  # XLA options of every jitted stage program

    def place_inputs(self, stage: CompiledStage, inputs: dict[str, Any]) -> dict[str, Any]:
        """The inputs moved into the stage's layout."""
        ...

    def stage_scope(self, stage: CompiledStage) -> ContextManager:
        """A context active while the stage's program traces and runs (e.g. sharding rules)."""
        ...


class PlainRuntime:
    """A StageRuntime that leaves inputs where they are: for graphs run without a plan's layouts."""

    compiler_options: Mapping[str, str] = {}

    def place_inputs(self, stage: CompiledStage, inputs: dict[str, Any]) -> dict[str, Any]:
        return inputs

    def stage_scope(self, stage: CompiledStage) -> ContextManager:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class StageEnv:
    """What a kernel factory sees: its stage, its plan entry, its ports and the runtime (as
    `context`: the runtime's own object, e.g. runtime/setup.RuntimeContext)."""

    stage: Stage
    plan: StagePlan
    reads: tuple[Port, ...]
    writes: tuple[Port, ...]
    graph: Graph
    context: Any


KernelFactory = Callable[[StageEnv], Kernel]


class KernelRegistry:
    """StageKind -> kernel factory; (kind, kind, ...) -> a dedicated fused kernel factory."""

    def __init__(self):
        self._single = Registry("stage kernel", key="registry")  # config/registry.py's rules
        self._fused = Registry("fused stage kernel", key="registry")

    def register(self, kind: StageKind, factory: KernelFactory, *, overwrite: bool = False) -> None:
        self._single.register(kind, factory, overwrite=overwrite)

    def register_fused(self, kinds: tuple[StageKind, ...], factory: KernelFactory) -> None:
        self._fused.register(tuple(kinds), factory, overwrite=True)

    def kernel(self, env: StageEnv) -> Kernel:
        st = env.stage
        if not st.parts:
            if st.kind not in self._single:
                raise GraphError(st.name, f"no kernel registered for stage kind {st.kind.value!r}")
            return self._single[st.kind](env)
        kinds = tuple(p.kind for p in st.parts)
        if kinds in self._fused:
            kernel = self._fused[kinds](env)
            if kernel is not None:  # a dedicated fused factory may decline (None): compose the parts
                return kernel
        return self._compose(env)

    def _compose(self, env: StageEnv) -> Kernel:
        """Run the parts' kernels in order over one namespace (one program when all jittable)."""
        kernels = []
        for part in env.stage.parts:
            if part.kind not in self._single:
                raise GraphError(part.name, f"no kernel registered for stage kind {part.kind.value!r}")
            kernels.append(
                self._single[part.kind](StageEnv(part, env.plan, env.reads, env.writes, env.graph, env.context))
            )
        outs = [p.name for p in env.writes]

        def fn(inputs):
            space, metrics = dict(inputs), {}
            for k in kernels:
                out = dict(k.fn(space))
                metrics.update(out.pop("metrics", None) or {})
                space.update(out)
            return {**{name: space[name] for name in outs}, "metrics": metrics}

        donate = tuple(sorted({d for k in kernels for d in k.donate}))
        preps = [k.prepare for k in kernels if k.prepare is not None]
        prepare = (lambda inputs: {k: v for p in preps for k, v in p(inputs).items()}) if preps else None
        return Kernel(fn, jittable=all(k.jittable for k in kernels), donate=donate, prepare=prepare)


def stage_ports(graph: Graph, name: str) -> tuple[tuple[Port, ...], tuple[Port, ...]]:
    reads = tuple(
        Port(e.port, e.src, e.offset, isinstance(graph.nodes[e.src], StateNode), e.stream) for e in graph.inputs(name)
    )
    writes = tuple(
        Port(e.port, e.dst, e.offset, isinstance(graph.nodes[e.dst], StateNode)) for e in graph.outputs(name)
    )
    return reads, writes


def device_view(value: Any) -> Any:
    """Drop `host_*` entries of data dicts (host-side metadata never enters a jitted program)."""
    if isinstance(value, dict):
        return {k: device_view(v) for k, v in value.items() if not str(k).startswith("host_")}
    return value


@dataclass
class CompiledStage:
    stage: Stage
    plan: StagePlan
    reads: tuple[Port, ...]
    writes: tuple[Port, ...]
    kernel: Kernel
    _jitted: Callable | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def pieces(self) -> int:
        return self.stage.pieces

    runtime: StageRuntime = field(default_factory=PlainRuntime, repr=False)

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Run the stage: host kernels as they are; device programs on inputs placed in the
        stage's layout, under the runtime's stage scope."""
        if not self.kernel.jittable:
            return self.kernel.fn(inputs)
        extra = self.kernel.prepare(inputs) if self.kernel.prepare is not None else {}
        inputs = self.runtime.place_inputs(self, dict(inputs))
        donated = {k: device_view(v) for k, v in inputs.items() if k in self.kernel.donate}
        kept = {k: device_view(v) for k, v in inputs.items() if k not in self.kernel.donate} | extra
        with self.runtime.stage_scope(self):
            return self._jitted(donated, kept)


@dataclass
class Program:
    graph: Graph
    plan: Plan
    stages: list[CompiledStage]

    def stage(self, name: str) -> CompiledStage:
        for cs in self.stages:
            if cs.name == name:
                return cs
        raise GraphError(name, "not in the compiled program")


def compile_graph(graph: Graph, plan: Plan, registry: KernelRegistry, runtime: StageRuntime | None = None) -> Program:
    """Bind every stage of `graph` (checked against `plan`) to its program, in topological order."""
    plan.check(graph)
    runtime = runtime if runtime is not None else PlainRuntime()
    stages = []
    for st in graph.stages():
        reads, writes = stage_ports(graph, st.name)
        env = StageEnv(st, plan.stage(st.name), reads, writes, graph, runtime)
        kernel = registry.kernel(env)
        cs = CompiledStage(st, env.plan, reads, writes, kernel, runtime=runtime)
        if kernel.jittable:
            fn = kernel.fn
            cs._jitted = jax.jit(
                lambda donated, kept, fn=fn: fn({**donated, **kept}),
                donate_argnums=(0,),
                compiler_options=dict(runtime.compiler_options) or None,
            )
        stages.append(cs)
    return Program(graph, plan, stages)
