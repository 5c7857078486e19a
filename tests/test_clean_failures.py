"""Clean failures: each way a run can fail for a reason outside the code ends with one line that
names what and where, a non-zero exit, and nothing lost. A full disk (a small tmpfs where this
process may mount one, else orbax's writer failing as tensorstore does on ENOSPC), a truncated
weights file, a page pool too small for one sequence, dynamic sampling under step admission on several local
processes, and SIGTERM / SIGINT before training started.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from helpers import HF, TINY

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.runtime.checkpoint import Checkpointer
from rpeg_jax.runtime.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def small_filesystem(path, size: str):
    """A tmpfs of `size` at `path` where this process may mount one (root), else None."""
    os.makedirs(path, exist_ok=True)
    mounted = False
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


# `python -c FULL fake|real key=value ...`: `rpeg train`; with "fake", orbax's writer fails from the
# checkpoint of step 2 on as tensorstore does when the disk is full.
FULL = textwrap.dedent("""
    import sys
    import orbax.checkpoint as ocp
    if sys.argv[1] == "fake":
        save = ocp.CheckpointManager.save
        def full(self, step, *a, **k):
            if step >= 2:
                raise ValueError('RESOURCE_EXHAUSTED: Error writing "actor.w/0.0" in OCDBT database: Failed to '
                                 "write 152707 bytes to file 4: No space left on device [os_error_code='28']")
            return save(self, step, *a, **k)
        ocp.CheckpointManager.save = full
    from rpeg_jax.cli import main
    sys.exit(main(["train", *sys.argv[2:]]))
""")


def test_a_full_disk_is_one_line_and_the_run_resumes_from_the_checkpoint_before(tmp_path, caplog):
    with small_filesystem(tmp_path / "fs", "1800k") as fs:  # a checkpoint or two fit, not three
        run_dir = (fs or tmp_path) / "run"
        # an entropy bonus moves the parameters every step, so the optimizer's moments are not zeros
        # that compress to nothing whether or not a completion earns a reward
        args = [*TINY, "rl.entropy_coef=0.01", "train.steps=3", "train.checkpoint_every=1", f"train.run_dir={run_dir}"]
        proc = subprocess.run(
            [sys.executable, "-c", FULL, "real" if fs else "fake", *args],
            capture_output=True,
            text=True,
            timeout=600,
            env=ENV,
            cwd=ROOT,
        )
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        (line,) = [ln for ln in proc.stderr.splitlines() if "space" in ln]
        m = re.fullmatch(
            rf"rpeg train: DiskFull: no space left on device writing the checkpoint of step (\d) in "
            rf"{run_dir}/checkpoints \(\d+\.\d MiB free\); step (\d) is intact: free space and run the same "
            r"command to resume from it",
            line,
        )
        assert m and int(m[2]) == int(m[1]) - 1, line
        intact = int(m[2])
        kept = tmp_path / "kept"
        shutil.copytree(run_dir, kept)  # "free space": the same run on a disk with room
    assert Checkpointer(str(kept / "checkpoints")).verify(intact) is None
    with caplog.at_level("INFO", logger="rpeg_jax"):
        out = train(load_config(None, [*TINY, "train.steps=3", "train.checkpoint_every=1", f"train.run_dir={kept}"]))
    assert out["steps"] == 3 and f"resumed from step {intact} of {kept / 'checkpoints'}" in caplog.text


def test_a_truncated_weights_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(os.path.join(HF, "llama_tiny"), path)
    os.truncate(path / "model.safetensors", os.path.getsize(path / "model.safetensors") // 2)
    overrides = [o for o in TINY if not o.startswith("model.")] + [
        f"model.path={path}",
        "train.steps=1",
        f"train.run_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(ConfigError) as err:
        train(load_config(None, overrides))
    assert err.value.key == "model.path" and "\n" not in str(err.value)
    assert str(err.value).startswith(
        f"config error: model.path='{path}': model.safetensors is not a readable safetensors file ("
    )
    assert not os.path.exists(tmp_path / "run" / "config.yaml")


def test_a_page_pool_too_small_for_one_sequence_names_rollout_num_pages(tmp_path):
    cfg = load_config(None, TINY + ["rollout.num_pages=2", "train.steps=1", f"train.run_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert err.value.key == "rollout.num_pages" and err.value.value == 2
    assert "cannot hold one sequence of max_seq_len=" in err.value.why


def test_dynamic_sampling_under_step_admission_on_local_processes_is_one_line_before_any_starts(tmp_path):
    """Continuous admission runs on several processes (tests/test_multihost_continuous.py); dynamic
    sampling does only under it: with step admission each process would refill its share in its own
    number of rounds. The launcher says so once, before it starts any process."""
    from rpeg_jax.costmodel import planner

    args = [a for a in TINY if not a.startswith("pipeline.plan")]  # the default plan: auto
    over = ["rl.filter_groups=zero_variance", f"train.run_dir={tmp_path / 'run'}"]
    cmd = [sys.executable, os.path.join(ROOT, "launch", "multihost.py"), "--local-processes", "2", *args, *over]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        "config error: rl.filter_groups='zero_variance': with 2 processes dynamic sampling runs under "
        "rollout.admission=continuous only (under step admission each process would refill its share in its own "
        "number of rounds); use none, or continuous admission"
    )
    assert not os.path.exists(tmp_path / "run")
    # Several processes started otherwise (SLURM, --num-processes): the planner says the same, as a ConfigError.
    with pytest.raises(ConfigError, match="rl.filter_groups='zero_variance': with 2 processes dynamic sampling"):
        planner.choose_plan(load_config(None, args + over), 8, "cpu", 2)


# `python -c EARLY launcher|cli key=value ...`: SIGTERM arrives while the config loads, before
# training has started (what a scheduler's stop during a slow start-up does).
EARLY = textwrap.dedent("""
    import os, runpy, signal, sys
    import rpeg_jax.config, rpeg_jax.config.run
    load = rpeg_jax.config.run.load_config
    def loading(*a, **k):
        os.kill(os.getpid(), getattr(signal, os.environ["SIG"]))
        return load(*a, **k)
    rpeg_jax.config.load_config = rpeg_jax.config.run.load_config = loading
    if sys.argv[1] == "launcher":
        sys.argv = ["launch/multihost.py"] + sys.argv[2:]
        runpy.run_path(os.path.join(os.environ["ROOT"], "launch", "multihost.py"), run_name="__main__")
    else:
        from rpeg_jax.cli import main
        sys.exit(main(["train", *sys.argv[2:]]))
""")


@pytest.mark.parametrize("entry,sig,who", [("launcher", "SIGTERM", "rpeg train"), ("cli", "SIGINT", "rpeg train")])
def test_a_signal_before_training_starts_is_one_line_and_a_nonzero_exit(tmp_path, entry, sig, who):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-c", EARLY, entry, *TINY, f"train.run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**ENV, "SIG": sig, "ROOT": ROOT})
    signum = {"SIGTERM": 15, "SIGINT": 2}[sig]
    assert proc.returncode == 128 + signum, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.strip() == (
        f"{who}: stopped by {sig} during start-up, before any training step: nothing was written; "
        "run the same command to start"
    )
    assert not os.path.exists(run_dir)


# `python -c SWALLOWED key=value ...`: `rpeg train`, SIGTERM while the config loads, delivered inside
# a finalizer, where Python cannot raise the start-up handler's exception (what bench/chaos.py met
# in a garbage-collection callback): only print it, and go on.
SWALLOWED = textwrap.dedent("""
    import os, signal, sys
    import rpeg_jax.config.run
    load = rpeg_jax.config.run.load_config
    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
    def loading(*a, **k):
        Finalizer()
        return load(*a, **k)
    rpeg_jax.config.run.load_config = loading
    from rpeg_jax.cli import main
    sys.exit(main(["train", *sys.argv[1:]]))
""")


def test_a_start_up_signal_python_swallowed_still_stops_before_the_first_step(tmp_path):
    cmd = [sys.executable, "-c", SWALLOWED, *TINY, "train.steps=2", f"train.run_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert "stopped by SIGTERM after step 0: no step ran, nothing new to save" in proc.stderr
    assert not Checkpointer.has_checkpoint(str(tmp_path / "checkpoints"))


# `python -c LATE key=value ...`: `rpeg train`, SIGTERM once training returned (a scheduler's stop
# while the process shuts down).
LATE = textwrap.dedent("""
    import os, signal, sys
    import rpeg_jax.cli.train as T
    plain = T.plain
    def returned(x):
        os.kill(os.getpid(), signal.SIGTERM)
        return plain(x)
    T.plain = returned
    from rpeg_jax.cli import main
    sys.exit(main(["train", *sys.argv[1:]]))
""")


def test_a_signal_after_training_ended_is_one_line_and_everything_is_committed(tmp_path):
    cmd = [sys.executable, "-c", LATE, *TINY, "train.steps=2", f"train.run_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 128 + 15, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "stopped by" in ln]
    assert line == "rpeg train: stopped by SIGTERM after training ended: every checkpoint is committed"
    ck = Checkpointer(str(tmp_path / "checkpoints"))
    assert ck.latest_step() == 2 and ck.verify(2) is None
