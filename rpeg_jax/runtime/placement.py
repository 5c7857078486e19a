"""Where the runtime's arrays live: the plan's per-stage layouts applied to state and data.

Every device stage of the plan gets a StageLayout (its group's devices, its mesh shape and rule
preset; rpeg_jax/sharding). State (params, optimizer states) is kept in the layout of the stage
that writes it; before a stage runs, inputs in another layout are moved into the stage's own
(cached Resharder plans: ReaL-style parameter reallocation when the planner picks different
layouts per stage, a no-op when they match). Rollout batches are sharded over the `data` axis.

Generation is per process: with several processes, every process samples its own share of the
prompts on its local devices (no collective depends on how long its sequences run), on a local
(data, tensor) mesh: the plan's generation tensor axis lies inside a process (graph/processes.py
refuses one that would span processes) and replicas are data-parallel over the rest of the local
devices and across processes. The sampler's weights are resharded from the training layout into a
global twin of that mesh (processes x local data rows, tensor), so each device receives only its
tensor shard (no full copy is gathered), then viewed as arrays on the process's own mesh; the
rollout arrays are then assembled into global arrays for the training stages.

Called by: runtime/setup.py (initial placement, sampler), graph/compile.py via the context
(`place_inputs`), runtime/kernels.py (`put_batch`, `to_rollout`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rpeg_jax.config.run import RunConfig
from rpeg_jax.graph.compile import CompiledStage
from rpeg_jax.graph.ir import Graph, Op, StageKind
from rpeg_jax.graph.plan import Plan
from rpeg_jax.runtime.offload import Offload
from rpeg_jax.sharding import Resharder, StageLayout, layout_for, mesh_scope


def _ops(stage) -> set[Op]:
    return {p.workload.op for p in (stage.parts or (stage,))}


def _local_generation(sp, cfg: RunConfig, devs: list) -> tuple[StageLayout, StageLayout]:
    """Generation's layout on this process's devices of the group, a (data, tensor) mesh with the
    plan's tensor axis, and its global twin: the same rules over every process's devices of the group,
    data = processes x local rows, so that device d holds the same tensor shard in both. A process
    without devices in the group (a training process of a split placement) gets the twin twice."""
    tensor = sp.mesh.get("tensor", 1)
    devs = sorted(devs, key=lambda d: (d.process_index, d.id))
    mine = [d for d in devs if d.process_index == jax.process_index()]
    per = len(devs) // len({d.process_index for d in devs})  # every process of the group owns as many
    spec = {"data": per // tensor, "tensor": tensor} if tensor > 1 else {"data": per}

    def regrid(layout, ds):  # the canonical axes (size-1 ones included), devices in (process, id) order
        m = layout.mesh
        grid = np.array(ds, dtype=object).reshape(tuple(m.shape.values()))  # data before tensor: process-major
        return dataclasses.replace(layout, mesh=Mesh(grid, m.axis_names, axis_types=m.axis_types))

    twin = regrid(layout_for(dict(spec, data=len(devs) // tensor), sp.rules, cfg.sharding, devs, role="generate"), devs)
    if not mine:
        return twin, twin
    return regrid(layout_for(spec, sp.rules, cfg.sharding, mine, role="generate"), mine), twin


class Placement:
    def __init__(self, cfg: RunConfig, graph: Graph, plan: Plan):
        self.cfg, self.graph, self.plan = cfg, graph, plan
        self.multi = jax.process_count() > 1
        devices = jax.devices()
        self.layouts: dict[str, StageLayout] = {}
        self._gen_global: dict[str, StageLayout] = {}  # multi-process: generation's layout over every process
        for st in graph.stages():
            if _ops(st) <= {Op.HOST, Op.TRANSFER}:
                continue
            sp = plan.stage(st.name)
            devs = [devices[i] for i in plan.group(sp.group).devices]
            role = "generate" if Op.GENERATE in _ops(st) else "train"
            if role == "generate" and self.multi:  # this process's share of the group, and its global twin
                self.layouts[st.name], self._gen_global[st.name] = _local_generation(sp, cfg, devs)
                continue
            self.layouts[st.name] = layout_for(sp.mesh, sp.rules, cfg.sharding, devs, role=role)
            gen_mesh = role == "generate" and cfg.sharding.generate_mesh
            mesh_key = "sharding.generate_mesh" if gen_mesh else "sharding.mesh"
            self.layouts[st.name].check_experts(cfg.model.num_experts, mesh_key)
        self.resharder = Resharder()
        self._shardings: dict[tuple[str, str], Any] = {}
        # which processes own each group's devices; with a split placement across processes
        # (runtime/split.py) generation and training run on disjoint sets of processes
        me = jax.process_index()
        owners = {g.name: sorted({devices[i].process_index for i in g.devices}) for g in plan.groups}
        gen = graph.find(StageKind.GENERATE)
        train = graph.find(StageKind.ACTOR_UPDATE)
        self.gen_group = plan.stage(gen.name).group if gen is not None else None
        self.train_group = plan.stage(train.name).group if train is not None else self.gen_group
        self.gen_procs = owners[self.gen_group] if self.gen_group else list(range(jax.process_count()))
        self.train_procs = owners[self.train_group] if self.train_group else self.gen_procs
        self.split = self.multi and not set(self.gen_procs) & set(self.train_procs)
        # generation and training on disjoint devices (split placement, on one process or several)
        self.disjoint = bool(self.gen_group and self.train_group and self.gen_group != self.train_group) and set(
            plan.group(self.gen_group).devices
        ).isdisjoint(plan.group(self.train_group).devices)
        self.local_groups = frozenset(name for name, procs in owners.items() if me in procs)
        self.generates_here = me in self.gen_procs
        self.trains_here = me in self.train_procs
        # this process's place among the generating processes (its share of every step's prompts)
        self.gen_count = len(self.gen_procs)
        self.gen_rank = self.gen_procs.index(me) if self.generates_here else 0
        self.offload = Offload.for_run(cfg, jax.local_devices())  # train.offload (runtime/offload.py)

    # ---- layouts of the graph's roles ----------------------------------------------------------
    def layout_of(self, kind: StageKind) -> StageLayout:
        holder = self.graph.find(kind)
        if holder is None or holder.name not in self.layouts:
            return self.train
        return self.layouts[holder.name]

    @property
    def train(self) -> StageLayout:
        return self.layout_of(StageKind.ACTOR_UPDATE)

    @property
    def generate(self) -> StageLayout:
        return self.layout_of(StageKind.GENERATE)

    def state_layout(self, name: str) -> StageLayout:
        """Layout a state node is kept in: the stage writing it (reference: its forward)."""
        kind = {
            "critic": StageKind.CRITIC_UPDATE,
            "critic_opt": StageKind.CRITIC_UPDATE,
            "reference": StageKind.REF_FORWARD,
        }.get(name, StageKind.ACTOR_UPDATE)
        return self.layout_of(kind)

    # ---- state -----------------------------------------------------------------------------------
    def shardings(self, layout: StageLayout, key: str, tree) -> Any:
        cache_key = (id(layout), key)
        if cache_key not in self._shardings:
            self._shardings[cache_key] = layout.params(tree)
        return self._shardings[cache_key]

    def put_params(self, name: str, params) -> Any:
        layout = self.state_layout(name)
        return self.resharder(params, self.shardings(layout, name, params))

    def init_opt_state(self, tx, params) -> Any:
        """tx.init under jit: moments take the parameters' shardings; scalars (step counts,
        injected hyperparameters) are replicated on the same mesh, so a restored state lands
        on the same devices as the parameters."""
        mesh = next(x.sharding.mesh for x in jax.tree.leaves(params) if isinstance(x.sharding, NamedSharding))
        with mesh_scope(mesh):
            state = jax.jit(tx.init)(params)
        replicated = NamedSharding(mesh, P())
        return jax.tree.map(
            lambda x: (
                x
                if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
                else jax.device_put(x, replicated)
            ),
            state,
        )

    # ---- data ------------------------------------------------------------------------------------
    def batch_sharding(self, layout: StageLayout, shape) -> NamedSharding:
        return layout.sharding(("batch",) + (None,) * (len(shape) - 1), shape)

    @property
    def rollout_layout(self) -> StageLayout:
        """Where the rollout batch is assembled: the training layout, or with a split placement across
        processes the generation group's global layout (handed to training by runtime/split.py)."""
        return self._gen_global[self.graph.find(StageKind.GENERATE).name] if self.split else self.train

    def put_batch(self, local: np.ndarray) -> jax.Array:
        """This process's rows -> a global array sharded over `data` of the rollout layout (every
        generating process holds the same number of rows)."""
        local = np.asarray(local)
        shape = (local.shape[0] * self.gen_count,) + local.shape[1:]
        sharding = self.batch_sharding(self.rollout_layout, shape)
        if not self.multi:
            return jax.device_put(local, sharding)
        return jax.make_array_from_process_local_data(sharding, local, shape)

    # ---- stages ----------------------------------------------------------------------------------
    def place_inputs(self, cs: CompiledStage, inputs: dict) -> dict:
        """Move state inputs of `cs` into its layout when they sit elsewhere."""
        layout = self.layouts.get(cs.name)
        if layout is None:
            return inputs
        out = dict(inputs)
        for port in cs.reads:
            if port.state and port.node in ("actor", "critic", "reference", "actor_opt", "critic_opt"):
                if port.node.endswith("_opt"):
                    continue  # optimizer states never leave their update's layout
                if self.offload.offloaded(port.node):
                    continue  # kept in this stage's layout in host memory; the program fetches it
                out[port.name] = self.resharder(inputs[port.name], self.shardings(layout, port.node, inputs[port.name]))
        return out

    def place_state(self, cs: CompiledStage, key: str, tree) -> Any:
        """A state not on the graph (model.lora's frozen base) in stage `cs`'s layout."""
        layout = self.layouts.get(cs.name)
        return tree if layout is None else self.resharder(tree, self.shardings(layout, key, tree))

    def to_rollout(self, params, key: str = "rollout") -> Any:
        """Training layout -> the sampler's (generation) layout. `key` names the tree's kind (its
        shardings are cached under it): the model, or with model.lora the base or the adapters."""
        layout = self.generate
        if not self.multi:
            return self.resharder(params, self.shardings(layout, key, params))
        holder = self.graph.find(StageKind.GENERATE)
        twin = self._gen_global[holder.name]
        spread = self.resharder(params, self.shardings(twin, key + "_global", params))  # tensor shards, per device
        local = self.shardings(layout, key, params)

        def localise(x, sh):  # the same per-device buffers, as an array on this process's own mesh
            bufs = {s.device: s.data for s in x.addressable_shards}
            devs = [d for d in sh.mesh.devices.flat]
            return jax.make_array_from_single_device_arrays(x.shape, sh, [bufs[d] for d in devs])

        if not self.generates_here:  # a training process: it holds none of the sampler's weights
            return spread
        arrays, treedef = jax.tree.flatten(spread)
        return jax.tree.unflatten(treedef, [localise(x, sh) for x, sh in zip(arrays, jax.tree.leaves(local))])

    def host_rows(self, x) -> np.ndarray:
        """This process's rows of a global batch array, as numpy."""
        if not self.multi:
            return np.asarray(x)
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
        rows, seen = [], set()
        for s in shards:
            start = s.index[0].start or 0
            if start not in seen:
                seen.add(start)
                rows.append(np.asarray(s.data))
        return np.concatenate(rows)

    def saved(self, tree) -> Any:
        """The layout a checkpoint writes `tree` (training state) in: itself, or with a split placement
        across processes spread over every device (orbax writes from each process the shards it holds,
        and a generating process holds none of the training layout's): the first dimension that the
        device count divides is sharded over all of them (else replicated), moved by the Resharder's
        collective. `Placement.restored` takes it back."""
        if not self.split:
            return tree
        return self.resharder(tree, jax.tree.map(self._everywhere, tree))

    def restored(self, tree, like) -> Any:
        """A tree read in the `saved` layout, back in the layout of `like` (the run's own state)."""
        if not self.split:
            return tree
        return self.resharder(tree, jax.tree.map(lambda x: x.sharding, like))

    def saved_sharding(self, x) -> NamedSharding:
        return self._everywhere(x) if self.split else x.sharding

    def _everywhere(self, x) -> NamedSharding:
        devices = jax.devices()
        n = len(devices)
        dims = [i for i, s in enumerate(x.shape) if s % n == 0]
        spec = P(*[("all" if i == dims[0] else None) for i in range(len(x.shape))]) if dims else P()
        return NamedSharding(Mesh(np.array(devices, dtype=object), ("all",)), spec)

    def gen_allgather(self, x) -> np.ndarray:
        """[each generating process's `x`] (stacked), called by the generating processes only: a
        program over one device of each of them (with a colocated plan every process generates, and
        this is multihost_utils.process_allgather)."""
        x = np.asarray(x)
        if not self.multi:
            return x[None]
        if not self.split:
            return np.asarray(multihost_utils.process_allgather(x))
        devices = jax.devices()
        firsts = [min((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in self.gen_procs]
        mesh = Mesh(np.array(firsts, dtype=object), ("p",))
        mine = next(d for d in firsts if d.process_index == jax.process_index())
        rows = jax.make_array_from_single_device_arrays(
            (len(firsts), *x.shape), NamedSharding(mesh, P("p")), [jax.device_put(x[None], mine)]
        )
        out = _gathered(NamedSharding(mesh, P()))(rows)
        return np.asarray(out.addressable_shards[0].data)


_GATHERS: dict[Any, Any] = {}


def _gathered(replicated: NamedSharding):
    """The identity program replicating its input over `replicated`'s mesh (an all-gather), cached."""
    if replicated not in _GATHERS:
        _GATHERS[replicated] = jax.jit(lambda a: a, out_shardings=replicated)
    return _GATHERS[replicated]
