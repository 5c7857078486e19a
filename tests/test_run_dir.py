"""Run directories you can trust: a damaged newest checkpoint is reported in one line and the run
resumes from the newest good one, exactly as a run that never stopped; a refused resume (another
model shape, another structure) is one line and leaves every file of the run as it was; the run
never writes through a symbolic link; a resumed run says where it resumed from and its
metrics.jsonl holds each step once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import SKIP, TINY

from rpeg_jax.config import ConfigError, load_config
from rpeg_jax.runtime.checkpoint import MANIFEST, CheckpointCorrupt, Checkpointer
from rpeg_jax.runtime.metrics import read_metrics
from rpeg_jax.runtime.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = TINY + ["train.checkpoint_every=1"]
RUN_FILES = ("config.yaml", "plan.json", "graph.txt", "metrics.jsonl")


def _cfg(run_dir, steps, extra=()):
    return load_config(None, COMMON + [f"train.steps={steps}", f"train.run_dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run with checkpoints 1 and 2; tests work on copies."""
    d = tmp_path_factory.mktemp("finished") / "run"
    train(_cfg(d, 2))
    return d


def _copy(src, tmp_path, name="run"):
    dst = tmp_path / name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _snapshot(d) -> dict[str, bytes]:
    """Every file of a run directory, checkpoints included, by path -> bytes."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


def _data_file(ckpt_dir, step) -> str:
    with open(os.path.join(ckpt_dir, str(step), MANIFEST)) as f:
        files = json.load(f)
    return os.path.join(ckpt_dir, str(step), max((r for r in files if "/d/" in r), key=lambda r: files[r][0]))


def test_a_truncated_newest_checkpoint_falls_back_and_resumes_exactly(tmp_path, caplog):
    want = train(_cfg(tmp_path / "straight", 4), keep_state=True)
    d = tmp_path / "damaged"
    train(_cfg(d, 3))  # checkpoints 2 and 3 kept
    ckpts = d / "checkpoints"
    os.truncate(_data_file(ckpts, 3), 100)  # a short write of the newest step
    with caplog.at_level("INFO", logger="rpeg_jax"):
        got = train(_cfg(d, 4), keep_state=True)
    warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0]
    assert warned[0].startswith("checkpoint 3 is damaged (train/") and "; resuming from step 2" in warned[0]
    assert f"resumed from step 2 of {ckpts}" in caplog.text
    assert os.path.isdir(ckpts / "damaged-3")  # moved aside, not deleted
    assert Checkpointer(str(ckpts)).all_steps() == [3, 4]
    # steps 3 and 4 trained again from step 2: the uninterrupted run's, exactly
    a = {r["step"]: r for r in read_metrics(str(tmp_path / "straight" / "metrics.jsonl"))}
    b = {r["step"]: r for r in read_metrics(str(d / "metrics.jsonl"))}
    for step in (3, 4):
        keys = [k for k in a[step] if not k.startswith(SKIP)]
        assert {k: a[step][k] for k in keys} == {k: b[step].get(k) for k in keys}, step
    for name, tree in want["state"].items():
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got["state"][name]), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    steps = [json.loads(line)["step"] for line in open(d / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]  # each step once, though 3 was written twice


def test_no_usable_checkpoint_is_one_error_and_nothing_moves(finished, tmp_path):
    d = _copy(finished, tmp_path)
    for step in (1, 2):
        os.truncate(_data_file(d / "checkpoints", step), 10)
    before = _snapshot(d)
    with pytest.raises(CheckpointCorrupt, match=r"no usable checkpoint in .*: step 2: .*; step 1: .*nothing moved"):
        train(_cfg(d, 3))
    assert _snapshot(d) == before


@pytest.mark.parametrize(
    "change,key",
    [
        (["model.num_layers=3"], "model.num_layers"),  # named from the run's config.yaml, before anything is built
        (["model.num_layers=3", "-config.yaml"], "train.run_dir"),  # the checkpoint's own shapes, before any read
        (["optim.mu_dtype=bfloat16"], "train.run_dir"),  # another optimizer state (its dtype)
        (["pipeline.staleness=1"], "pipeline.staleness"),  # another structure
    ],
)
def test_a_refused_resume_is_one_line_and_leaves_every_file_as_it_was(finished, tmp_path, change, key):
    d = _copy(finished, tmp_path)
    if "-config.yaml" in change:
        os.remove(d / "config.yaml")
    before = _snapshot(d)
    with pytest.raises(ConfigError) as err:
        train(_cfg(d, 3, [c for c in change if not c.startswith("-")]))
    assert err.value.key == key and "\n" not in str(err.value)
    assert "resume with" in str(err.value) and "new train.run_dir" in str(err.value)
    assert _snapshot(d) == before  # config.yaml, plan.json, graph.txt, metrics.jsonl, checkpoints: byte-equal


def test_the_refusal_names_the_array_the_checkpoint_holds(finished, tmp_path):
    d = _copy(finished, tmp_path)
    os.remove(d / "config.yaml")
    with pytest.raises(ConfigError, match=r"checkpoint 2 holds actor\.\S+ as \(2, .*this config builds \(3, "):
        train(_cfg(d, 3, ["model.num_layers=3"]))


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "checkpoints"])
def test_a_symlink_in_the_run_dir_is_refused_and_its_target_untouched(finished, tmp_path, name):
    d = _copy(finished, tmp_path)
    target = tmp_path / "precious"
    if name == "checkpoints":
        os.rename(d / name, target)
    else:
        target.write_text("not yours\n")
        os.remove(d / name)
    os.symlink(target, d / name)
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError, match=rf"train.run_dir=.*: {name} is a symbolic link \(-> {target}\); refusing"):
        train(_cfg(d, 3))
    assert _snapshot(tmp_path) == before


def test_a_resume_names_its_step_and_metrics_hold_each_step_once(finished, tmp_path, caplog):
    d = _copy(finished, tmp_path)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/mean"')  # a process killed mid-line after step 2's checkpoint
    with caplog.at_level("INFO", logger="rpeg_jax"):
        train(_cfg(d, 3))
    assert f"resumed from step 2 of {d / 'checkpoints'}" in caplog.text
    assert [json.loads(line)["step"] for line in open(d / "metrics.jsonl")] == [1, 2, 3]


def test_resume_never_on_an_earlier_runs_directory_is_one_line(finished, tmp_path):
    d = _copy(finished, tmp_path)
    before = _snapshot(d)
    with pytest.raises(ConfigError, match="train.resume='never': .*holds an earlier run's checkpoints"):
        train(_cfg(d, 3, ["train.resume=never"]))
    assert _snapshot(d) == before


def test_rpeg_train_reports_a_damaged_run_in_one_line(finished, tmp_path):
    d = _copy(finished, tmp_path)
    for step in (1, 2):
        os.truncate(_data_file(d / "checkpoints", step), 10)
    env = {**os.environ, "PYTHONPATH": ROOT}
    args = [sys.executable, "-m", "rpeg_jax.cli", "train", *COMMON, "train.steps=3", f"train.run_dir={d}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rpeg train:")]
    assert len(errors) == 1 and errors[0].startswith("rpeg train: CheckpointCorrupt: no usable checkpoint in ")
