"""Files a run writes: whole or not at all, and never through a symbolic link.

    write_atomic(path, text)          # a temp file beside `path`, fsync, os.replace
    refuse_links(run_dir, RUN_FILES)  # ConfigError("train.run_dir", ...) for a planted link
    f = open_append(path)             # append, refusing a link at `path` (O_NOFOLLOW)

`os.replace` swaps the directory entry, so a crash leaves the old file or the new one (never an
empty or half-written one), and a symbolic link at `path` is replaced rather than written through.
The temp file is created with O_EXCL under a fresh name, so it cannot be a link planted in advance.

A floor below every layer (pure Python): the trainer's run files (runtime/trainer.py), the plan
(graph/plan.py), the trace, the evaluation records and metrics.jsonl (runtime/) use it.
"""

from __future__ import annotations

import os
import tempfile

from rpeg_jax.config.base import ConfigError

# What a run writes in its run directory (runtime/trainer.py, metrics.py, trace.py, evaluation.py).
RUN_FILES = (
    "config.yaml",
    "plan.json",
    "graph.txt",
    "metrics.jsonl",
    "trace.json",
    "timeline.png",
    "tensorboard",
    "checkpoints",
    "eval",
)


def write_atomic(path: str, data: str | bytes) -> None:
    """Write `data` to `path` atomically (temp file in the same directory, fsync, rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make run files unreadable to a team
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def refuse_links(directory: str, names=RUN_FILES, key: str = "train.run_dir") -> None:
    """ConfigError naming the first of `names` in `directory` that is a symbolic link: a run writes
    its own files, never through a link to somewhere else (the directory itself may be a link)."""
    for name in names:
        p = os.path.join(directory, name)
        if os.path.islink(p):
            raise ConfigError(
                key, directory, f"{name} is a symbolic link (-> {os.readlink(p)}); refusing to write through it"
            )


def open_append(path: str):
    """`path` opened for appending text, line-buffered; a symbolic link there is an OSError (ELOOP)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a", buffering=1)
