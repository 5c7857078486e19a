"""Checkpoints of everything a resume needs, with orbax: written atomically and asynchronously.

A checkpoint at step t holds three items (what goes in each is chosen by runtime/resume.py):
  - "train":  device arrays: actor and critic params and their optimizer states (resume.py
              TRAIN_STATES), restored into the shardings of an abstract target, so a resume lands
              on the same layout; no PRNG key is saved: every stream is a function of (seed, step);
  - "buffer": the rollouts generated ahead under bounded asynchrony for steps t..t+k-1 (their
              completions arrays and behaviour logprobs, as global device arrays: each process
              writes its shards), omitted when empty;
  - "engine": under continuous admission, the KV of every process's engine pages in use, as
              [processes, ...] arrays (each process writes its row; the sequences in flight
              continue from them bit-exactly), omitted otherwise;
  - "meta":   JSON: step, the version of each train state, the data-iterator state, the
              executor's next lead step per stage, the buffered steps with each buffer array's
              shape and dtype, their pending generate-side metrics, and the weights version
              each buffered step was admitted with.
orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoint intact. Non-finite parameters are refused: a NaN never
reaches a checkpoint. orbax has no checksum of array data (a flipped bit restores silently), so
each step is sealed with MANIFEST (the size and sha256 of each of its files) before it is
renamed into place, and every restore verifies it first. Retention keeps the newest `keep`
committed steps, deleting older ones only after a newer save committed.

Called by: runtime/trainer.py (creates the Checkpointer), runtime/resume.py (save, restore),
cli/export.py (the actor's params alone: `state_shapes`, `restore_state`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from rpeg_jax.config.files import write_atomic
from rpeg_jax.runtime.offload import is_host

log = logging.getLogger("rpeg_jax")


class NonFiniteError(RuntimeError):
    pass


class CheckpointCorrupt(RuntimeError):
    """A checkpoint whose files do not match the checksums written with it."""


class DiskFull(RuntimeError):
    """A checkpoint could not be written for lack of space (what survives is in the message)."""


MANIFEST = "rpeg_manifest.json"  # {path in the step: [size, sha256]} of every file a restore reads
# orbax writes these after the seal (the commit time, the success marker): not covered.
_UNSEALED = frozenset({"_CHECKPOINT_METADATA", "commit_success.txt", MANIFEST})
_CHUNK = 1 << 22


def manifest_of(step_dir: str, only: dict | None = None) -> dict[str, list]:
    """{path relative to `step_dir`: [size, sha256 hex]} of its files (`only`: of those paths)."""
    if only is not None:
        rels = sorted(r for r in only if os.path.isfile(os.path.join(step_dir, r)))
    else:
        rels = sorted(
            os.path.relpath(os.path.join(root, name), step_dir)
            for root, _, files in os.walk(step_dir)
            for name in files
        )
    out = {}
    for rel in rels:
        if rel in _UNSEALED:
            continue
        digest = hashlib.sha256()
        with open(os.path.join(step_dir, rel), "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        out[rel] = [os.path.getsize(os.path.join(step_dir, rel)), digest.hexdigest()]
    return out


def _seal(step_dir: str) -> None:
    write_atomic(os.path.join(step_dir, MANIFEST), json.dumps(manifest_of(step_dir), indent=0, sort_keys=True))


def _is_disk_full(e: BaseException | None) -> bool:
    """Whether `e` or an exception it was raised from is ENOSPC (tensorstore reports it as a
    ValueError "RESOURCE_EXHAUSTED: ... No space left on device", with no errno)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


class _DropDiskFullDumps(logging.Filter):
    """orbax (absl's logger) and asyncio (its writes' tasks nobody awaits once one failed) log a
    failed write's traceback themselves, from several threads (hundreds of lines); for a full disk
    the Checkpointer reports it in one line instead (DiskFull)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (_is_disk_full(exc) or "No space left on device" in record.getMessage())


def _quiet_orbax_disk_full() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropDiskFullDumps) for f in logger.filters):
            logger.addFilter(_DropDiskFullDumps())


def _quiet_closed_loop_debris() -> None:
    """After a failed write or read, tensorstore still completes the other operations in flight
    and calls back into orbax's event loop, closed by then: each callback's RuntimeError("Event loop
    is closed") goes to sys.unraisablehook (a traceback apiece, dozens). Noise beside the one line
    that reports the failure: dropped; every other unraisable exception is shown as before."""
    previous = sys.unraisablehook
    if getattr(previous, "rpeg_closed_loop", False):
        return

    def hook(unraisable):
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        previous(unraisable)

    hook.rpeg_closed_loop = True
    sys.unraisablehook = hook


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
    # a process holding no shard of a leaf (split placement across processes: the training state on a
    # generating process) leaves it to the processes that do
    on_device = [i for i, (_, x) in enumerate(floats) if not is_host(x) and _held(x)]
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


def _held(x) -> bool:
    return not isinstance(x, jax.Array) or bool(x.addressable_shards)


def _host_finite(x) -> bool:
    """Whether this process's shards of an array in host memory are all finite."""
    return all(bool(np.isfinite(np.asarray(sh.data)).all()) for sh in x.addressable_shards)


class Checkpointer:
    """Thin wrapper over ocp.CheckpointManager with the three items above, sealed and verified.

    Every committed step carries MANIFEST, the size and sha256 of each of its files, written after
    all processes finished writing and before orbax renames the step into place (its
    post-finalization callback, on process 0), so a step without one was never committed by this
    code. `verify(step)` rereads the files against it; every restore verifies first and raises
    CheckpointCorrupt naming the step and the file. A step found damaged is moved aside
    (`quarantine`: renamed damaged-<step>, never deleted). Retention is ours, not orbax's: after a
    save has committed, the steps beyond the newest `keep` are deleted, so a failed save never
    costs the previous checkpoint, and older steps go only once the newest verifies. A full disk
    is a DiskFull naming the step and what survives."""

    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True, cleanup_tmp: bool = False):
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self._sealing: int | None = None  # the step whose save is in flight
        self._unlogged: int | None = None  # a save not yet reported as written (runtime log line)
        self._verified: set[int] = set()
        self._broken: BaseException | None = None  # the failure already reported (close() stays quiet)
        async_options = ocp.AsyncOptions(post_finalization_callback=self._seal_in_flight) if async_save else None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # retention: _prune, only after a save has committed
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=cleanup_tmp,  # a step half-written by a killed process
            async_options=async_options,
        )
        self._async = async_save
        _quiet_orbax_disk_full()
        _quiet_closed_loop_debris()
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    @staticmethod
    def has_checkpoint(directory: str) -> bool:
        """Whether `directory` holds a committed checkpoint (orbax names a committed step's folder
        by its number; one being written carries a temporary suffix)."""
        return os.path.isdir(directory) and any(n.isdigit() for n in os.listdir(directory))

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    # ---- writing -----------------------------------------------------------------------------
    def save(self, step: int, train: Any, meta: dict, buffer: dict | None = None, engine: dict | None = None) -> None:
        assert_finite(train, f"checkpoint at step {step}")
        meta = json.loads(json.dumps(meta, default=_json_scalar))  # fail here, not in the async writer
        items = {"train": ocp.args.StandardSave(train), "meta": ocp.args.JsonSave(meta)}
        if buffer:
            items["buffer"] = ocp.args.StandardSave(dict(buffer))
        if engine:
            items["engine"] = ocp.args.StandardSave(dict(engine))
        self.wait()  # the save in flight committed (else its failure is raised here), old steps pruned
        self._sealing, self._unlogged = step, step
        with self._reporting(step):
            self._mngr.save(step, args=ocp.args.Composite(**items), force=True)
            if not self._async and jax.process_index() == 0:
                _seal(os.path.join(self.directory, str(step)))
        if not self._async:
            self._committed()
            self._prune()

    def _seal_in_flight(self) -> None:
        """orbax's post-finalization callback (process 0, every process's writes done, before the
        rename): the manifest goes into the step's temporary directory."""
        tmp = glob.glob(os.path.join(self.directory, f"{self._sealing}.orbax-checkpoint-tmp*"))
        _seal(tmp[0] if len(tmp) == 1 else os.path.join(self.directory, str(self._sealing)))

    def wait(self) -> None:
        """Until the save in flight has committed; then retention (the newest `keep` steps)."""
        if self._broken is not None:
            raise self._broken
        with self._reporting(self._sealing):
            self._mngr.wait_until_finished()
        self._committed()
        self._prune()

    def poll(self) -> None:
        """Without waiting: the line for a save in flight that has committed since (between steps)."""
        busy = getattr(self._mngr, "is_saving_in_progress", lambda: True)
        if self._unlogged is not None and self._broken is None and not busy():
            self._committed()

    def _committed(self) -> None:
        """One line per checkpoint once it is committed (sealed and renamed into place)."""
        step, self._unlogged = self._unlogged, None
        if step is not None and jax.process_index() == 0:
            path = os.path.join(self.directory, str(step))
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            log.info("checkpoint of step %d written: %s (%.1f MB)", step, path, size / 1e6)

    def _prune(self) -> None:
        """Delete the steps beyond the newest `keep`, once the newest verifies (read back against
        its manifest): retention never leaves the run without a verified step."""
        if self._sealing is None:  # a reader (eval, export) never deletes a run's checkpoints
            return
        steps = self.all_steps()
        if len(steps) <= self.keep:
            return
        why = self.verify(steps[-1])
        bad = why is not None
        if jax.process_count() > 1:  # every process deletes (orbax syncs them): all or none
            bad = bool(np.max(multihost_utils.process_allgather(np.int32(bad))))
        if bad:
            log.warning(
                "checkpoint %d does not verify (%s): keeping the older steps %s", steps[-1], why, steps[: -self.keep]
            )
            return
        for s in steps[: -self.keep]:
            self._mngr.delete(s)

    def close(self) -> None:
        try:
            if self._broken is None:
                self.wait()
        finally:
            with contextlib.suppress(Exception):  # already reported: a second raise would replace it
                self._mngr.close()

    @contextlib.contextmanager
    def _reporting(self, step: int | None):
        """Turn a write failure for lack of space into one DiskFull (raised once)."""
        try:
            yield
        except Exception as e:
            if not _is_disk_full(e):
                raise
            self._mngr.reload()
            kept = [s for s in self.all_steps() if s != step]
            free = shutil.disk_usage(self.directory).free if os.path.isdir(self.directory) else 0
            self._broken = DiskFull(
                f"no space left on device writing the checkpoint of step {step} in {self.directory} "
                f"({free / 2**20:.1f} MiB free); "
                + (
                    f"step {kept[-1]} is intact: free space and run the same command to resume from it"
                    if kept
                    else "no earlier checkpoint exists"
                )
            )
            raise self._broken from None

    # ---- reading -----------------------------------------------------------------------------
    def verify(self, step: int) -> str | None:
        """None when every file of checkpoint `step` has the size and sha256 its manifest records,
        else what is wrong (the first file that differs). A step written before checksums (no
        manifest) passes, with a warning."""
        if step in self._verified:
            return None
        step_dir = os.path.join(self.directory, str(step))
        try:
            with open(os.path.join(step_dir, MANIFEST)) as f:
                want = json.load(f)
        except FileNotFoundError:
            log.warning(
                "checkpoint %d in %s has no %s (written before checksums): not verified", step, self.directory, MANIFEST
            )
            self._verified.add(step)
            return None
        except (OSError, ValueError) as e:
            return f"its {MANIFEST} is unreadable ({e})"
        try:
            have = manifest_of(step_dir, only=want)
        except OSError as e:
            return f"{e.filename or step_dir}: {e.strerror or e}"
        for rel, (size, digest) in sorted(want.items()):
            got = have.get(rel)
            if got is None:
                return f"{rel} is missing"
            if got[0] != size:
                return f"{rel} has {got[0]} bytes, {size} were written"
            if got[1] != digest:
                return f"{rel} does not match its checksum (sha256 {got[1][:12]}..., written {digest[:12]}...)"
        self._verified.add(step)
        return None

    def check(self, step: int) -> None:
        """CheckpointCorrupt unless `step` verifies."""
        why = self.verify(step)
        if why is not None:
            raise CheckpointCorrupt(f"checkpoint {step} in {self.directory} is damaged: {why}")

    def quarantine(self, step: int) -> str:
        """Move damaged step `step` out of the run's steps (renamed damaged-<step>, nothing deleted);
        returns its new path. Every process calls it."""
        dest = os.path.join(self.directory, f"damaged-{step}")
        n = 1
        while os.path.lexists(dest):
            n += 1
            dest = os.path.join(self.directory, f"damaged-{step}.{n}")
        if jax.process_count() > 1:  # every process named `dest` before process 0 moves the step there
            multihost_utils.sync_global_devices(f"rpeg_quarantine_named_{step}")
        if jax.process_index() == 0:
            os.rename(os.path.join(self.directory, str(step)), dest)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"rpeg_quarantine_{step}")
        self._mngr.reload()
        self._verified.discard(step)
        return dest

    def restore_meta(self, step: int) -> dict:
        self.check(step)
        out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore(self, step: int, train_target: Any, buffer_target: Any = None) -> tuple[Any, dict, dict]:
        """(train arrays laid out like `train_target`, meta, buffer laid out like `buffer_target`)."""
        self.check(step)
        items = {
            "train": ocp.args.StandardRestore(jax.tree.map(_abstract, train_target)),
            "meta": ocp.args.JsonRestore(),
        }
        if buffer_target:
            items["buffer"] = ocp.args.StandardRestore(buffer_target)
        out = self._mngr.restore(step, args=ocp.args.Composite(**items))
        return out["train"], dict(out["meta"]), dict(out["buffer"]) if buffer_target else {}

    def restore_engine(self, step: int, target: dict) -> dict:
        """The "engine" item of checkpoint `step` (the generation engines' KV pages under continuous
        admission), laid out like `target` (abstract arrays)."""
        self.check(step)
        out = self._mngr.restore(step, args=ocp.args.Composite(engine=ocp.args.StandardRestore(dict(target))))
        return dict(out["engine"])

    def state_shapes(self, step: int, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """{parameter path ('layers.wq'): (shape, dtype)} of train state `name` ("actor") at `step`,
        from the checkpoint's metadata (no array is read)."""
        self.check(step)
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
        self.check(step)
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


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _json_scalar(x):
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    raise TypeError(f"checkpoint meta: {type(x).__name__} is not JSON serialisable")
