"""Checkpoints you can trust, at the Checkpointer: every committed step carries the sha256 of each
of its files, a restore verifies them first and names the step and the file that differs, a
damaged step is moved aside (never deleted), retention never costs the last good step, and a full
disk is one line that says which step survives (and it does).

The damage is done to real files of a real checkpoint (one flipped bit, a truncation, a removal);
the reference for "restored correctly" is the tree that was saved.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rpeg_jax.config.files import write_atomic
from rpeg_jax.runtime.checkpoint import MANIFEST, CheckpointCorrupt, Checkpointer, DiskFull


def _tree(seed: int, n: int = 48):
    k = jax.random.key(seed)
    return {"actor": {"w": jax.random.normal(k, (n, n)), "b": jax.random.normal(jax.random.fold_in(k, 1), (n,))}}


def _saved(tmp_path, steps=(1, 2), keep=2, async_save=True):
    d = str(tmp_path / "ck")
    ck = Checkpointer(d, keep=keep, async_save=async_save)
    for s in steps:
        ck.save(s, _tree(s), {"step": s})
    ck.close()
    return d


def _data_file(d: str, step: int) -> str:
    """The largest array-data file of `step` (what a flipped bit or a short write would hit)."""
    with open(os.path.join(d, str(step), MANIFEST)) as f:
        files = json.load(f)
    rel = max((r for r in files if "/d/" in r), key=lambda r: files[r][0])
    return os.path.join(d, str(step), rel)


def _assert_tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("async_save", [True, False])
def test_every_committed_step_carries_the_checksums_of_its_files(tmp_path, async_save):
    d = _saved(tmp_path, async_save=async_save)
    for step in (1, 2):
        with open(os.path.join(d, str(step), MANIFEST)) as f:
            files = json.load(f)
        on_disk = {
            os.path.relpath(os.path.join(r, n), os.path.join(d, str(step)))
            for r, _, ns in os.walk(os.path.join(d, str(step)))
            for n in ns
        }
        # every file orbax reads is covered; only orbax's own commit markers (written after) are not
        assert on_disk - set(files) == {MANIFEST, "_CHECKPOINT_METADATA", "commit_success.txt"}
        assert any(r.startswith("train/") and "/d/" in r for r in files) and "meta/metadata" in files
        assert Checkpointer(d).verify(step) is None


def test_a_flipped_bit_in_a_data_file_is_detected_on_restore(tmp_path):
    d = _saved(tmp_path)
    path = _data_file(d, 2)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10  # one bit: orbax alone restores this silently, one value wrong
    with open(path, "wb") as f:
        f.write(data)
    ck = Checkpointer(d)
    rel = os.path.relpath(path, os.path.join(d, "2"))
    with pytest.raises(CheckpointCorrupt, match=rf"checkpoint 2 in .*ck is damaged: {rel} does not match its checksum"):
        ck.restore(2, _tree(2))
    with pytest.raises(CheckpointCorrupt, match="checkpoint 2"):  # export and eval read through here
        ck.restore_state(2, "actor", _tree(2)["actor"])
    train, meta, _ = ck.restore(1, _tree(0))  # the step before is untouched
    _assert_tree_equal(train, _tree(1))
    assert meta["step"] == 1


@pytest.mark.parametrize("damage", ["truncate", "remove", "meta"])
def test_a_truncated_or_missing_file_names_the_step_and_the_file(tmp_path, damage):
    d = _saved(tmp_path)
    if damage == "meta":
        path = os.path.join(d, "2", "meta", "metadata")
    else:
        path = _data_file(d, 2)
    size = os.path.getsize(path)
    if damage == "remove":
        os.remove(path)
    else:
        os.truncate(path, size // 2)
    rel = os.path.relpath(path, os.path.join(d, "2"))
    why = f"{rel} is missing" if damage == "remove" else f"{rel} has {size // 2} bytes, {size} were written"
    ck = Checkpointer(d)
    assert ck.verify(2) == why
    with pytest.raises(CheckpointCorrupt, match="checkpoint 2 .*" + why.replace("(", r"\(")):
        ck.restore_meta(2)


def test_a_damaged_step_is_moved_aside_never_deleted_and_its_number_saved_again(tmp_path):
    d = _saved(tmp_path)
    os.truncate(_data_file(d, 2), 10)
    ck = Checkpointer(d)
    dest = ck.quarantine(2)
    assert dest == os.path.join(d, "damaged-2") and os.path.isdir(dest)
    assert ck.all_steps() == [1] and ck.latest_step() == 1
    ck.save(2, _tree(7), {"step": 2})  # orbax refuses an existing step number: the move makes room
    ck.wait()
    _assert_tree_equal(ck.restore(2, _tree(0))[0], _tree(7))
    ck.close()
    assert sorted(os.listdir(d)) == ["1", "2", "damaged-2"]


def test_a_step_without_checksums_still_restores_with_a_warning(tmp_path, caplog):
    """Checkpoints written before the manifest existed keep working."""
    d = _saved(tmp_path)
    os.remove(os.path.join(d, "2", MANIFEST))
    with caplog.at_level("WARNING", logger="rpeg_jax"):
        _assert_tree_equal(Checkpointer(d).restore(2, _tree(0))[0], _tree(2))
    assert "checkpoint 2" in caplog.text and "not verified" in caplog.text


def test_retention_keeps_the_newest_steps_after_they_commit(tmp_path):
    d = _saved(tmp_path, steps=(1, 2, 3, 4), keep=2)
    assert sorted(os.listdir(d)) == ["3", "4"]
    d1 = _saved(tmp_path / "one", steps=(1, 2), keep=1)
    assert sorted(os.listdir(d1)) == ["2"]


def test_older_steps_are_kept_while_the_newest_does_not_verify(tmp_path, monkeypatch, caplog):
    ck = Checkpointer(str(tmp_path / "ck"), keep=1)
    ck.save(1, _tree(1), {"step": 1})
    ck.wait()
    monkeypatch.setattr(ck, "verify", lambda step: "meta/metadata is missing" if step == 2 else None)
    with caplog.at_level("WARNING", logger="rpeg_jax"):
        ck.save(2, _tree(2), {"step": 2})
        ck.wait()
    assert ck.all_steps() == [1, 2]
    assert "checkpoint 2 does not verify (meta/metadata is missing): keeping the older steps [1]" in caplog.text
    monkeypatch.undo()
    ck.save(3, _tree(3), {"step": 3})
    ck.close()
    assert sorted(os.listdir(tmp_path / "ck")) == ["3"]


def test_a_reader_never_deletes_a_runs_steps(tmp_path):
    """eval and export open a run's checkpoints with their own Checkpointer: closing it prunes nothing."""
    d = _saved(tmp_path, steps=(1, 2, 3), keep=3)
    reader = Checkpointer(d, keep=1, async_save=False)
    _assert_tree_equal(reader.restore(3, _tree(0))[0], _tree(3))
    reader.close()
    assert sorted(os.listdir(d)) == ["1", "2", "3"]


def test_an_interrupted_run_file_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = str(tmp_path / "plan.json")
    write_atomic(path, "old\n")
    monkeypatch.setattr(os, "fsync", _raise(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError):
        write_atomic(path, "new and longer\n")
    assert open(path).read() == "old\n" and os.listdir(tmp_path) == ["plan.json"]  # no temp file left
    target = tmp_path / "elsewhere"
    target.write_text("theirs")
    os.symlink(target, tmp_path / "link")
    monkeypatch.undo()
    write_atomic(str(tmp_path / "link"), "ours")  # the link is replaced, its target untouched
    assert target.read_text() == "theirs" and not os.path.islink(tmp_path / "link")


# ---- a full disk ---------------------------------------------------------------------------------
@contextlib.contextmanager
def small_filesystem(path, size: str):
    """A tmpfs of `size` mounted at `path` where this process may mount one (root), else None:
    the caller then fakes the writer."""
    os.makedirs(path, exist_ok=True)
    mounted = False
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


RESOURCE_EXHAUSTED = ValueError(  # what tensorstore raises for ENOSPC (no errno on it)
    'RESOURCE_EXHAUSTED: Error writing "actor.w/0.0" in OCDBT database: Failed to write 152707 bytes to file 4: '
    "No space left on device [os_error_code='28']"
)


def _raise(e):
    def f(*a, **k):
        raise e

    return f


@pytest.mark.parametrize("keep", [1, 2])
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_restores(tmp_path, monkeypatch, keep):
    with small_filesystem(tmp_path / "fs", "200k") as fs:
        d = str((fs or tmp_path) / "ck")
        ck = Checkpointer(d, keep=keep)
        ck.save(1, _tree(1, 8), {"step": 1})  # ~1 KB: fits
        ck.wait()
        if fs is None:  # no mount here: orbax's writer fails as tensorstore does on a full disk
            monkeypatch.setattr(ocp.CheckpointManager, "save", _raise(RESOURCE_EXHAUSTED))
        with pytest.raises(DiskFull) as err:
            ck.save(2, _tree(2, 300), {"step": 2})  # 360 KB of noise: does not
            ck.wait()
        ck.close()  # reported once: closing does not raise it again
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith(f"no space left on device writing the checkpoint of step 2 in {d} (")
        assert msg.endswith("step 1 is intact: free space and run the same command to resume from it")
        monkeypatch.undo()
        again = Checkpointer(d)
        assert again.latest_step() == 1 and again.verify(1) is None
        _assert_tree_equal(again.restore(1, _tree(0, 8))[0], _tree(1, 8))
        again.close()
