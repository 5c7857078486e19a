"""Checkpoints of everything a resume needs, with orbax: written atomically and asynchronously.

A checkpoint at step t holds three items (what goes in each is chosen by runtime/resume.py):
  - "train":  device arrays: actor and critic params and their optimizer states (resume.py
              TRAIN_STATES), restored into the shardings of an abstract target, so a resume lands
              on the same layout; no PRNG key is saved: every stream is a function of (seed, step);
  - "buffer": the rollouts generated ahead under bounded asynchrony for steps t..t+k-1 (their
              completions arrays and behaviour logprobs, as global device arrays: each process
              writes its shards), omitted when empty;
  - "meta":   JSON: step, the version of each train state, the data-iterator state, the
              executor's next lead step per stage, the buffered steps with each buffer array's
              shape and dtype, their pending generate-side metrics, and the weights version
              each buffered step was admitted with.
orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoint intact. Non-finite parameters are refused: a NaN never
reaches a checkpoint. Retention keeps the newest `keep` checkpoints.

Called by: runtime/trainer.py (creates the Checkpointer), runtime/resume.py (save, restore),
cli/export.py (the actor's params alone: `state_shapes`, `restore_state`).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from rpeg_jax.runtime.offload import is_host


class NonFiniteError(RuntimeError):
    pass


@jax.jit
def _all_finite(leaves):
    return [jnp.isfinite(x).all() for x in leaves]


def assert_finite(tree: Any, what: str) -> None:
    """Raise NonFiniteError naming the first leaf path holding NaN/inf."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    floats = [(p, x) for p, x in leaves if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    if not floats:
        return
    # One program for the whole tree: a separate small collective program per leaf, dispatched
    # asynchronously by every process, deadlocked 2 processes over gloo (an FSDP-sharded optimizer
    # state across processes hung at the ~38th leaf). Arrays in host memory (train.offload) are
    # checked where they are, shard by shard with numpy (no device copy), and agreed on by one
    # all-gather across processes.
    on_device = [i for i, (_, x) in enumerate(floats) if not is_host(x)]
    ok = [True] * len(floats)
    for i, good in zip(on_device, jax.device_get(_all_finite([floats[i][1] for i in on_device])) if on_device else ()):
        ok[i] = bool(good)
    on_host = [i for i in range(len(floats)) if i not in set(on_device)]
    if on_host:
        local = np.array([_host_finite(floats[i][1]) for i in on_host], dtype=np.int32)
        if jax.process_count() > 1:
            local = np.min(np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(on_host)), axis=0)
        for i, good in zip(on_host, local):
            ok[i] = bool(good)
    for (path, _), good in zip(floats, ok):
        if not bool(good):
            raise NonFiniteError(f"{what}: non-finite values in {jax.tree_util.keystr(path)}; not checkpointed")


def _host_finite(x) -> bool:
    """Whether this process's shards of an array in host memory are all finite."""
    return all(bool(np.isfinite(np.asarray(sh.data)).all()) for sh in x.addressable_shards)


class Checkpointer:
    """Thin wrapper over ocp.CheckpointManager with the three items above."""

    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    @staticmethod
    def has_checkpoint(directory: str) -> bool:
        """Whether `directory` holds a committed checkpoint (orbax names a committed step's folder
        by its number; one being written carries a temporary suffix)."""
        return os.path.isdir(directory) and any(n.isdigit() for n in os.listdir(directory))

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, step: int, train: Any, meta: dict, buffer: dict | None = None) -> None:
        assert_finite(train, f"checkpoint at step {step}")
        meta = json.loads(json.dumps(meta, default=_json_scalar))  # fail here, not in the async writer
        items = {"train": ocp.args.StandardSave(train), "meta": ocp.args.JsonSave(meta)}
        if buffer:
            items["buffer"] = ocp.args.StandardSave(dict(buffer))
        self._mngr.save(step, args=ocp.args.Composite(**items), force=True)

    def restore_meta(self, step: int) -> dict:
        out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore(self, step: int, train_target: Any, buffer_target: Any = None) -> tuple[Any, dict, dict]:
        """(train arrays laid out like `train_target`, meta, buffer laid out like `buffer_target`)."""
        items = {
            "train": ocp.args.StandardRestore(jax.tree.map(_abstract, train_target)),
            "meta": ocp.args.JsonRestore(),
        }
        if buffer_target:
            items["buffer"] = ocp.args.StandardRestore(buffer_target)
        out = self._mngr.restore(step, args=ocp.args.Composite(**items))
        return out["train"], dict(out["meta"]), dict(out["buffer"]) if buffer_target else {}

    def state_shapes(self, step: int, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """{parameter path ('layers.wq'): (shape, dtype)} of train state `name` ("actor") at `step`,
        from the checkpoint's metadata (no array is read)."""
        meta = ocp.PyTreeCheckpointHandler().metadata(pathlib.Path(self.directory) / str(step) / "train")
        tree = meta.tree if hasattr(meta, "tree") else meta
        if name not in tree:
            raise KeyError(f"checkpoint {step} in {self.directory} holds no {name!r} (it has {sorted(tree)})")
        flat = jax.tree_util.tree_flatten_with_path(tree[name], is_leaf=lambda x: hasattr(x, "shape"))[0]
        out = {}
        for path, m in flat:
            keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
            out[".".join(keys[:-1] if keys[-1:] == ["value"] else keys)] = (tuple(m.shape), str(m.dtype))
        return out

    def restore_state(self, step: int, name: str, target: Any) -> Any:
        """One train state (e.g. "actor") of checkpoint `step`, laid out like `target`; the other
        states and items are not read (runtime/evaluation.py restores the actor's params alone)."""
        tree = {name: jax.tree.map(_abstract, target)}
        args = ocp.args.PyTreeRestore(
            tree,
            restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), tree),
            partial_restore=True,
        )
        reader = ocp.PyTreeCheckpointer()  # the "train" item alone, by its folder
        try:
            return reader.restore(os.path.join(self.directory, str(step), "train"), args=args)[name]
        finally:
            reader.close()

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _json_scalar(x):
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    raise TypeError(f"checkpoint meta: {type(x).__name__} is not JSON serialisable")
