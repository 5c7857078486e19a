"""What a run prints when its output goes to a file (SLURM, nohup): one plain line per logged step
(step, reward, losses, s/step, tokens/s, ETA), the held-out metrics when computed, a line for each
checkpoint written, for a resume, and for each program compiled after the first step; no library
INFO noise (orbax logs every save at INFO)."""

import logging
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from helpers import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rpeg_train(tmp_path, name, extra):
    log_path = tmp_path / f"{name}.log"
    args = [sys.executable, "-m", "rpeg_jax.cli", "train", "--config", "configs/default.yaml", *TINY, *extra]
    with open(log_path, "w") as out:  # a file, not a terminal
        rc = subprocess.run(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
    text = log_path.read_text()
    assert rc == 0, text[-3000:]
    return text


def test_a_run_logged_to_a_file_reads_step_by_step(tmp_path):
    evals = tmp_path / "held_out.jsonl"
    evals.write_text("".join(f'{{"prompt": "{i}+{i}=", "answer": "{2 * i}"}}\n' for i in range(1, 4)))
    common = [
        "data.task=add",
        "train.progress=true",  # TINY turns the bar off; to a file it is plain lines
        "train.log_every=1",
        "train.checkpoint_every=2",
        f"train.run_dir={tmp_path / 'run'}",
        f"eval.path={evals}",
        "eval.every=2",
        "eval.n=1",
    ]
    first = rpeg_train(tmp_path, "first", common + ["train.steps=4"])
    for step in range(1, 5):
        line = re.search(rf"step {step}/4 \| reward \S+ \|.* s/step [\d.]+ \| tok/s \d+", first)
        assert line, f"no line for step {step}:\n{first[-3000:]}"
    assert re.search(r"step 3/4 .*\| eta \d+m\d\ds", first)  # the ETA of the steps left
    assert re.search(r"step 2 held-out: .*val-core/\S+/reward/mean@1=", first)
    assert re.search(r"checkpoint of step 2 written: \S+/checkpoints/2 \([\d.]+ MB\)", first)
    assert "CheckpointManager" not in first and "absl" not in first  # orbax's INFO lines stay out
    again = rpeg_train(tmp_path, "again", common + ["train.steps=6"])
    assert re.search(r"resumed from step 4 of \S+/checkpoints", again)
    assert re.search(r"step 6/6 \| reward", again)


def test_a_compile_after_the_first_step_is_one_line(caplog, monkeypatch):
    from rpeg_jax.runtime import trainer

    monkeypatch.setattr(trainer._CompileLog, "MIN_S", 0.0)
    trainer._COMPILES.register()
    monkeypatch.setattr(trainer._COMPILES, "step", 3)
    with caplog.at_level(logging.INFO, logger="rpeg_jax"):

        def a_new_program(x):
            return jnp.tanh(x) * 3.0 + 1.0

        jax.jit(a_new_program)(jnp.arange(5.0)).block_until_ready()
    assert any(re.match(r"step 3: compiled .*a_new_program.* in [\d.]+ s", r.getMessage()) for r in caplog.records)
    monkeypatch.setattr(trainer._COMPILES, "step", None)  # outside the loop: quiet
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rpeg_jax"):
        jax.jit(lambda x: x - 2.0)(jnp.arange(3.0)).block_until_ready()
    assert not [r for r in caplog.records if "compiled" in r.getMessage()]
