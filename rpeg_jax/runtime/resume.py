"""What a checkpoint holds and how a run continues from one, exactly.

After step t the run's future depends on: the training state (actor/critic params and optimizer
states, with their versions), the data iterator, and, under bounded asynchrony (k >= 1), the
rollouts already generated for steps t..t+k-1 with the weights they were made with (the rollout
buffer) plus the generate-side metrics of those steps. Everything else is a function of these
and of (seed, step): sampler streams, minibatch permutations, the sampler's weights.

Rollout arrays are saved as global device arrays (each process writes its shards). Host-side
fields (prompt texts, answers, records) are not saved: the data iterator state saved is the one
*before* the buffered steps were drawn, and a resume draws them again (each process its own
share) to rebuild those fields, ending in the same iterator state. Under dynamic sampling with
step admission (rl.filter_groups) a step's groups come from anywhere in the stream: the checkpoint
holds the stream's cursor (data step, index) and each buffered group's place in the stream.

Called by: runtime/trainer.py.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from rpeg_jax.config.base import ConfigError
from rpeg_jax.runtime.checkpoint import CheckpointCorrupt, Checkpointer, _json_scalar
from rpeg_jax.runtime.executor import Executor, Store
from rpeg_jax.runtime.rollout.layout import host_fields, saved_host_fields, stream_host_fields

log = logging.getLogger("rpeg_jax")
TRAIN_STATES = ("actor", "actor_opt", "critic", "critic_opt")
BUFFERED = ("completions", "behav_logp")


def save(ckpt: Checkpointer, store: Store, ex: Executor, step: int, engine=None, placement=None) -> None:
    """Checkpoint the run after `step` completed steps (call only between steps: every state is
    then at version `step`, and with generation k steps ahead the rollouts of steps step..step+k-1
    are buffered). Under continuous admission the `engine`'s whole state is saved without
    disturbing it (ContinuousRollouts.snapshot: its queues, groups, sequences and KV pages), so a
    checkpoint the uninterrupted run did not take (the one a signal writes) changes nothing."""
    k = ex.generation_ahead
    train = {name: store.latest(name)[1] for name in TRAIN_STATES if name in store.state}
    versions = {n: store.latest(n)[0] for n in TRAIN_STATES if n in store.state}
    if any(v != step for v in versions.values()):
        raise RuntimeError(f"checkpoint of step {step} would hold state versions {versions}: not a step boundary")
    if placement is not None:  # split placement across processes: spread over every device (Placement.saved)
        train = placement.saved(train)
    prompts = store.latest("data_iterator")[1]
    buffered = list(range(step, step + k))
    engine_state, engine_arrays = None, None
    if engine is not None or ex.graph.admission == "continuous":
        # every process's engine; each one's stream resumes by drawing its next data step again. A
        # training process of a split placement (runtime/split.py) runs none: its rows are empty
        state, arrays, data_state = None, {}, prompts.state()
        if engine is not None:
            d = engine.data_step
            data_state = prompts.state_before(d) if d in prompts.before else prompts.state()
            state, arrays = engine.snapshot()  # the KV of the pages in use [L, K, n, S, E]; the sequences' tokens [T]
        specs = {name: [list(x.shape), str(x.dtype)] for name, x in arrays.items()}
        # decoding ahead (rollout.decode_ahead): the host columns of the batches made ahead (their groups
        # come from anywhere in this process's stream, so a resume cannot draw them again)
        held = (
            {str(s): _host_of(store.get_data("completions", s), engine.group_size) for s in buffered}
            if engine is not None
            else {}
        )
        entries = every_process({"engine": state, "data_iterator": data_state, "specs": specs, "buffered_host": held})
        for name, (shape, dtype) in next((e["specs"] for e in entries if e["specs"]), {}).items():
            if name not in arrays:
                axis = 2 if len(shape) == 5 else 0
                arrays[name] = np.zeros([0 if i == axis else n for i, n in enumerate(shape)], jax.numpy.dtype(dtype))
        engine_state = [
            {"engine": e["engine"], "data_iterator": e["data_iterator"], "buffered_host": e.get("buffered_host", {})}
            for e in entries
        ]
        engine_arrays = {name: with_process_axis(x, axis=2 if x.ndim == 5 else 0) for name, x in sorted(arrays.items())}
    elif prompts.cursor_before:  # dynamic sampling: the stream continues at a (data step, index) cursor
        start = prompts.cursor_before[step] if k else prompts.cursor
        data_state = prompts.state_at(start)
    else:  # with generation ahead, the buffered steps' prompts are drawn again on restore
        data_state = prompts.state_before(step) if k else prompts.state()
    meta = {
        "step": step,
        "versions": versions,
        "structure": {**ex.program.plan.knobs, **ex.program.plan.settings},  # checked on restore
        "data_iterator": data_state,
        "engine": engine_state,
        "engine_specs": {k: [list(x.shape), str(x.dtype)] for k, x in (engine_arrays or {}).items()},
        "next_ahead_step": dict(ex.next_ahead_step),
        "buffer_steps": buffered,
        "buffer_specs": {},
        "pending_metrics": ex.pending_metrics(buffered),
    }
    if engine is None and prompts.cursor_before:  # where each buffered group came from, and the cursor
        steps = {str(s): [list(prompts.cursor_before[s]), prompts.sources[s], prompts.filtered[s]] for s in buffered}
        meta["filter"] = {"cursor": list(prompts.cursor), "steps": steps}
    if "rollout_buffer" in store.state:
        meta["admitted"] = {str(s): v for s, v in store.latest("rollout_buffer")[1].admitted.items()}
    buffer = _buffered_arrays(store, placement, meta["buffer_steps"])
    meta["buffer_specs"] = {name: [list(arr.shape), str(arr.dtype)] for name, arr in buffer.items()}
    ckpt.save(step, train, meta, buffer=buffer, engine=engine_arrays)


def _buffered_arrays(store: Store, placement, steps: list[int]) -> dict:
    """The device arrays of the rollouts buffered for `steps` ({step/node/key: array}). With a split
    placement across processes they live on the generating processes' devices only (in the rollout
    layout): every process gets their specs, the training processes stand in arrays holding no shard,
    and all move them spread over every device (Placement.saved), as orbax writes each process's shards."""
    split = placement is not None and placement.split
    local = {}
    if not split or placement.generates_here:
        for s in steps:
            for node in BUFFERED:
                value = store.get_data(node, s)
                for key, arr in value.items() if isinstance(value, dict) else [("", value)]:
                    if not key.startswith("host_"):
                        local[f"{s}/{node}/{key}"] = arr
    if not split:
        return local
    specs = {name: [list(x.shape), str(x.dtype)] for name, x in local.items()}
    spec = every_process({"specs": specs})[placement.gen_procs[0]]["specs"]
    tree = {}
    for name in sorted(spec):
        shape, dtype = tuple(spec[name][0]), np.dtype(spec[name][1])
        src = placement.batch_sharding(placement.rollout_layout, shape)
        tree[name] = local.get(name, None)
        if tree[name] is None:
            tree[name] = jax.make_array_from_single_device_arrays(shape, src, [], dtype=dtype)
    return placement.saved(tree)


def _host_of(comps: dict, G: int) -> dict:
    """A buffered batch's host columns, one entry per group (its G rows share them) for the prompt,
    answer and record, per row for the scores dynamic sampling cached (JSON)."""
    out = {k: list(comps[f"host_{k}"][::G]) for k in ("prompt", "answer", "record")}
    for k in ("rewards", "reward_errors", "truncated"):
        if f"host_{k}" in comps:
            x = np.asarray(comps[f"host_{k}"])
            out[k] = [x.tolist(), str(x.dtype)]
    return out


def restore(ckpt: Checkpointer, store: Store, ex: Executor, ctx) -> int:
    """Load the newest usable checkpoint into `store`/`ex`; returns the step to continue from (0:
    none). A step whose files fail their checksums is skipped for the one before it, and once one
    restores the skipped ones are moved aside (damaged-<step>, each reported in one line); when
    none is usable, CheckpointCorrupt and nothing is moved. A step written under another structure
    or with other state shapes is a ConfigError (a refusal, not damage): nothing is read."""
    target = {name: store.latest(name)[1] for name in TRAIN_STATES if name in store.state}
    damaged: list[tuple[int, str]] = []
    for step in reversed(ckpt.all_steps()):
        why = _agreed(ckpt.verify(step))
        if why is not None:
            damaged.append((step, why))
            continue
        meta_only = ckpt.restore_meta(step)
        check_structure(meta_only, step, {**ex.program.plan.knobs, **ex.program.plan.settings})
        check_shapes(ckpt, step, target)
        for bad, why in damaged:
            dest = ckpt.quarantine(bad)
            if jax.process_index() == 0:
                log.warning("checkpoint %d is damaged (%s): moved to %s; resuming from step %d", bad, why, dest, step)
        _load(ckpt, store, ex, ctx, step, target, meta_only)
        if jax.process_index() == 0:
            log.info("resumed from step %d of %s", step, ckpt.directory)
        return step
    if damaged:
        raise CheckpointCorrupt(
            f"no usable checkpoint in {ckpt.directory}: "
            + "; ".join(f"step {s}: {why}" for s, why in damaged)
            + " (nothing moved; train.resume=never with a new train.run_dir starts over)"
        )
    return 0


def _agreed(why: str | None) -> str | None:
    """A step is damaged for every process when it is for one (each verified it itself)."""
    if jax.process_count() == 1:
        return why
    bad = multihost_utils.process_allgather(np.int32(why is not None))
    return why if why is not None else ("damaged as another process read it" if np.max(bad) else None)


def check_structure(meta: dict, step: int, ours: dict) -> None:
    """ConfigError naming the first structural knob the checkpoint was written under otherwise."""
    for knob, theirs in meta.get("structure", {}).items():
        if ours.get(knob) != theirs:  # another structure: other state trees, other buffers
            raise ConfigError(
                knob if "." in knob else f"pipeline.{knob}",
                ours.get(knob),
                f"the newest checkpoint (step {step}) of this run was written with {knob}={theirs}; "
                f"resume with that plan (the run's plan.json) or start a new train.run_dir",
            )


def check_shapes(ckpt: Checkpointer, step: int, target: dict) -> None:
    """ConfigError naming the first array of the train states whose shape or dtype in checkpoint
    `step` is not this run's (read from the checkpoint's metadata, before any array)."""
    for name, tree in target.items():
        saved = ckpt.state_shapes(step, name)
        ours = {path: (tuple(x.shape), str(x.dtype)) for path, x in leaf_paths(tree).items()}
        for path in sorted(set(saved) | set(ours)):
            if saved.get(path) != ours.get(path):
                raise ConfigError(
                    "train.run_dir",
                    ckpt.directory.rsplit(os.sep, 1)[0],
                    f"checkpoint {step} holds {name}.{path} as {_shape(saved.get(path))}, this config builds "
                    f"{_shape(ours.get(path))}: resume with the run's config.yaml or start a new train.run_dir",
                )


def leaf_paths(tree) -> dict[str, Any]:
    """{'layers.wq': array} of a state tree, keyed as Checkpointer.state_shapes keys the saved one."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        out[".".join(keys[:-1] if keys[-1:] == ["value"] else keys)] = x
    return out


def _shape(s) -> str:
    return "nothing" if s is None else f"{s[0]} {s[1]}"


def _load(ckpt: Checkpointer, store: Store, ex: Executor, ctx, step: int, target: dict, meta_only: dict) -> None:
    layout = ctx.placement.train
    pl = ctx.placement  # split placement across processes: read in the spread layout (Placement.saved)
    buffer_target = {
        name: jax.ShapeDtypeStruct(
            tuple(shape),
            np.dtype(dtype),
            sharding=pl.saved_sharding(jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)))
            if pl.split
            else pl.batch_sharding(layout, tuple(shape)),
        )
        for name, (shape, dtype) in meta_only.get("buffer_specs", {}).items()
    }
    spread = {
        n: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=pl.saved_sharding(x)), t)
        for n, t in target.items()
    }
    train, meta, buffer = ckpt.restore(step, spread, buffer_target or None)
    if pl.split and buffer:  # back from the spread layout to where the generating processes made them
        buffer = pl.resharder(
            buffer, {n: pl.batch_sharding(pl.rollout_layout, tuple(x.shape)) for n, x in buffer.items()}
        )
    continuous = ctx.engine is not None or ex.graph.admission == "continuous"
    entries = meta.get("engine")
    mine = (
        entries[jax.process_index()]
        if continuous and isinstance(entries, list) and len(entries) == jax.process_count()
        else {}
    )
    train = {name: pl.restored(value, target[name]) for name, value in train.items()}
    for name, value in train.items():
        store.put_state(name, meta["versions"][name], value)
    version, actor = store.latest("actor")
    store.put_state("rollout_weights", version, ctx.rollout_params(actor))
    buffered = list(meta["buffer_steps"])
    prompts = store.latest("data_iterator")[1]
    prompts.pipeline.set_state(meta["data_iterator"])
    filt = meta.get("filter")
    for s in buffered:  # draw the buffered steps' prompts again (host fields)
        if pl.split and not pl.generates_here:  # a training process: handoff(s) brings the batch
            continue
        arrays = {k.split("/", 2)[2]: v for k, v in buffer.items() if k.startswith(f"{s}/completions/")}
        comps = dict(arrays)
        rows = ctx.placement.host_rows(arrays["tokens_BxS"]), ctx.placement.host_rows(arrays["response_mask_BxR"])
        if continuous:  # decoding ahead: the groups' host columns as saved (buffered_host)
            comps.update(saved_host_fields(mine.get("buffered_host", {})[str(s)], *rows))
        elif filt is not None:  # dynamic sampling: the groups the step kept, wherever in the stream
            before, sources, filtered = filt["steps"][str(s)]
            sources = [(int(d), int(i)) for d, i in sources]
            comps.update(stream_host_fields(prompts, sources, *rows))
            prompts.cursor_before[s], prompts.sources[s], prompts.filtered[s] = tuple(before), sources, int(filtered)
        else:
            batch = prompts.get(s)
            comps.update(host_fields(batch, 0, len(batch.prompt_tokens), *rows))
        store.put_data("completions", s, comps)
        store.put_data("behav_logp", s, buffer[f"{s}/behav_logp/"])
    if filt is not None:
        prompts.cursor = tuple(int(x) for x in filt["cursor"])
    if continuous:  # a split's training process: no engine
        if not isinstance(entries, list) or len(entries) != jax.process_count():
            held = (
                f"the engines of {len(entries)} processes"
                if isinstance(entries, list)
                else "no engine state"
                if not entries
                else "an engine state of an older format (its sequences in flight were not saved)"
            )
            raise ConfigError(
                "rollout.admission",
                "continuous",
                f"checkpoint {step} holds {held}; this run has {jax.process_count()} processes",
            )
        target = {
            name: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=_process_sharding())
            for name, (shape, dtype) in meta["engine_specs"].items()
        }
        arrays = {name: own_row(x) for name, x in ckpt.restore_engine(step, target).items()}  # padded: the
        # sampler cuts them to what its state says
        prompts.pipeline.set_state(mine["data_iterator"])  # this process's stream (its shard's own position)
        if ctx.engine is not None:
            ctx.engine.restore(mine["engine"], arrays)
    store.put_state("data_iterator", step + len(buffered), prompts)
    if "admitted" in meta and "rollout_buffer" in store.state:
        buf = store.latest("rollout_buffer")[1]
        buf.admitted = {int(s): int(v) for s, v in meta["admitted"].items()}
        store.put_state("rollout_buffer", step + len(buffered), buf)
    ex.resume_at(step, buffered, meta["pending_metrics"], meta["next_ahead_step"])


# ---- per-process engine state (continuous admission: every process runs its own engine) -----------
def every_process(obj: dict) -> list[dict]:
    """[each process's `obj`] on every process (JSON through a padded byte all-gather): the meta item
    is written by one process, and a resume picks its own entry."""
    if jax.process_count() == 1:
        return [json.loads(json.dumps(obj, default=_json_scalar))]
    raw = np.frombuffer(json.dumps(obj, default=_json_scalar).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(raw.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(rows[i, : int(n)].tobytes()) for i, n in enumerate(sizes)]


def _process_sharding():
    """[processes, ...] with row p on process p's devices (replicated over them)."""
    devices = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    mesh = jax.sharding.Mesh(np.array(devices), ("process", "local"))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("process"))


def with_process_axis(x: np.ndarray, axis: int) -> jax.Array:
    """A process-local array (one process's engine pages or tokens) as row p of a global
    [processes, ...] array, so that every process writes its own row of the checkpoint; `axis` is
    padded to the longest of the processes' (every row has one shape, at least 1 long)."""
    x = np.asarray(x)
    n = (
        int(np.max(multihost_utils.process_allgather(np.int32(x.shape[axis]))))
        if jax.process_count() > 1
        else x.shape[axis]
    )
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, max(n, 1) - x.shape[axis])
    local = np.pad(x, widths)[None]
    sharding = _process_sharding()
    shards = [jax.device_put(local, d) for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays((jax.process_count(), *local.shape[1:]), sharding, shards)


def own_row(x: jax.Array) -> np.ndarray:
    """This process's row of a restored [processes, ...] array (host memory)."""
    return np.asarray(x.addressable_shards[0].data)[0]
