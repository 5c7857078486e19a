"""The metrics sinks: metrics.jsonl gets every step, TensorBoard and the console every
train.log_every steps (and the last); perf/mfu is the step's useful FLOPs over the hardware
profile's peak."""

import os

import yaml
from helpers import TINY

from rpeg_jax.config import load_config
from rpeg_jax.runtime.metrics import MetricsWriter, read_metrics
from rpeg_jax.runtime.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Recorder:
    def __init__(self):
        self.steps = []

    def add_scalar(self, tag, value, step):
        if tag == "loss":
            self.steps.append(step)

    def update(self, step, record):
        self.steps.append(step)

    def close(self):
        pass


def test_log_every_sets_the_tensorboard_and_console_cadence_not_the_jsonl(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False, progress=False, log_every=3)
    w._tb, w._bar = Recorder(), Recorder()
    for step in range(1, 8):
        w.write(step, {"loss": float(step)}, last=step == 7)
    w.close()
    assert w._tb.steps == [3, 6, 7] and w._bar.steps == [3, 6, 7]
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == list(range(1, 8))
    # A run that stops before its last step still shows the newest step it wrote, once.
    w = MetricsWriter(str(tmp_path / "stopped"), tensorboard=False, progress=False, log_every=3)
    w._tb, w._bar = Recorder(), Recorder()
    for step in range(1, 5):
        w.write(step, {"loss": float(step)})
    w.close()
    assert w._tb.steps == [3, 4] and w._bar.steps == [3, 4]


def test_mfu_is_useful_flops_over_the_profile_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("RPEG_CACHE", str(tmp_path / "no-calibration"))  # the shipped profile, not a fitted copy
    with open(os.path.join(ROOT, "configs", "hardware", "cpu.yaml")) as f:
        prof = yaml.safe_load(f)
    assert prof["shared_host"]  # the host's peak, whatever the number of forced devices
    # A calibrated CPU profile (a fitted copy carries `calibrated`), with a generous peak: perf/mfu
    prof["calibrated"] = {"time": 1.0, "matmul_peak_measured": 4e12}
    prof["device"]["peak_flops_fp32"] = peak = 4e12
    fitted = tmp_path / "cpu_fitted.yaml"
    fitted.write_text(yaml.safe_dump(prof))
    cfg = load_config(
        None, TINY + [f"costmodel.hardware={fitted}", "train.steps=2", f"train.run_dir={tmp_path / 'run'}"]
    )
    train(cfg)
    for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")):
        assert 0 < r["perf/mfu"] < 1
        assert abs(r["perf/mfu"] - r["perf/flops"] / r["timing_s/step"] / peak) < 1e-9 * r["perf/mfu"] + 1e-12
    # The shipped CPU profile's peak is a placeholder: no perf/mfu (it read 1.3-1.5 on this machine)
    cfg = load_config(None, TINY + ["costmodel.hardware=cpu", "train.steps=1", f"train.run_dir={tmp_path / 'plain'}"])
    train(cfg)
    assert all(
        "perf/mfu" not in r and r["perf/flops"] > 0 for r in read_metrics(str(tmp_path / "plain" / "metrics.jsonl"))
    )
