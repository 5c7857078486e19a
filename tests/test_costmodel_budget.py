"""The CPU planner budgets what the machine has (costmodel/devices.py host_budget): the host's
available RAM (a fake /proc/meminfo here) for one device, split between N forced devices; and
"no plan fits" is one line naming the need, the budget and the knob, exit 2 (rpeg plan, rpeg train).
References: the meminfo numbers written by the test, and params + Adam m, v = 12 bytes per float32
parameter (ModelConfig.num_params) for the state that must fit."""

import re

import pytest

from rpeg_jax.cli import main as rpeg
from rpeg_jax.config import load_config, model_preset
from rpeg_jax.costmodel import devices
from rpeg_jax.costmodel.hardware import GB, load_hardware
from rpeg_jax.costmodel.planner import NoPlanFits, search
from rpeg_jax.graph.ir import GraphError

KB = 1024


@pytest.fixture
def meminfo(tmp_path, monkeypatch):
    """Set the RAM this host reports available, in bytes (no cgroup limit)."""

    def set_available(nbytes: int):
        f = tmp_path / "meminfo"
        f.write_text(f"MemTotal:       99999999 kB\nMemFree:          1000 kB\nMemAvailable:   {nbytes // KB} kB\n")
        monkeypatch.setattr(devices, "MEMINFO", str(f))
        monkeypatch.setattr(devices, "CGROUP_FILES", ())

    return set_available


@pytest.mark.parametrize("n", [1, 8])
def test_the_cpu_budget_is_the_available_ram_split_between_devices(meminfo, n):
    meminfo(24 * 1024**3)
    cfg = load_config(None, [])
    hw, count, _ = devices.resolve(cfg, n, "cpu", 1)
    assert count == n
    assert hw.device.usable_memory_gb == pytest.approx(24 * 1024**3 / n / GB)
    assert hw.hbm_bytes == pytest.approx(24 * 1024**3 / n)
    meminfo(3 * 1024**3)  # read when planning, not once
    assert devices.resolve(cfg, n, "cpu", 1)[0].hbm_bytes == pytest.approx(3 * 1024**3 / n)


def test_a_cgroup_limit_caps_it_and_the_profile_is_the_fallback(meminfo, tmp_path, monkeypatch):
    meminfo(24 * 1024**3)
    (tmp_path / "max").write_text(f"{4 * 1024**3}\n")
    (tmp_path / "current").write_text(f"{1024**3}\n")
    monkeypatch.setattr(devices, "CGROUP_FILES", ((str(tmp_path / "max"), str(tmp_path / "current")),))
    assert devices.host_memory() == 3 * 1024**3
    monkeypatch.setattr(devices, "MEMINFO", str(tmp_path / "absent"))
    monkeypatch.setattr(devices.os, "sysconf", lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert devices.host_memory() is None
    profile = load_hardware("cpu")
    assert devices.resolve(load_config(None, []), 1, "cpu", 1)[0].device == profile.device
    assert devices.resolve(load_config(None, []), 1, profile, 1)[0] is profile  # an object is used as given


@pytest.mark.parametrize("n", [1, 8])
def test_the_planner_plans_with_it(meminfo, n):
    # qwen2-0.5b keeps 12 B/param of state, 5.9 GB: more than the profile's fixed 2.5 GB per device
    state = 12 * model_preset("qwen2-0.5b").num_params()
    ram = 24 * 1024**3
    meminfo(ram)
    chosen = search(load_config(None, ["model.preset=qwen2-0.5b"]), n, "cpu", 1).chosen
    assert state / n / GB <= chosen.memory_per_gpu_gb <= 0.9 * ram / n / GB
    if n == 1:
        assert chosen.memory_per_gpu_gb > load_hardware("cpu", calibrated=False).device.memory_gb
    meminfo(ram // 16)
    with pytest.raises(NoPlanFits) as e:
        search(load_config(None, ["model.preset=qwen2-0.5b"]), n, "cpu", 1)
    assert isinstance(e.value, GraphError) and "no plan fits" in str(e.value)


def test_no_plan_fits_is_one_line_with_the_need_the_budget_and_the_knob(meminfo, capsys):
    meminfo(512 * 1024**2)
    need = 12 * model_preset("small").num_params() / GB  # params + Adam m, v, float32, one device
    budget = 0.9 * 512 * 1024**2 / GB
    assert rpeg(["plan", "--devices", "1", "--hardware", "cpu", "model.preset=small"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith("config error: pipeline.plan='auto': no plan fits: ")
    assert f"need {need:.2f} GB per device" in out.err and f"the budget is {budget:.2f} GB per device" in out.err
    assert "use a smaller model" in out.err and "costmodel.memory_budget" in out.err


def test_no_plan_fits_names_the_stage_when_activations_are_the_problem(meminfo, capsys):
    meminfo(64 * 1024**3)
    # B = 65536: even 64 micro-batches of the update and of the scoring forwards are too big
    big = ["data.prompts_per_step=8192", "rollout.max_new_tokens=512", "data.max_prompt_len=512"]
    assert rpeg(["plan", "--devices", "1", "--hardware", "cpu", "model.preset=small", *big]) == 2
    err = capsys.readouterr().err
    # The stage whose least need (micro-batches and remat searched) is largest: the update, or the
    # scoring forwards where they cannot be split as finely.
    m = re.search(r"no plan fits: (the update needs|the scoring forwards need) ([0-9.]+) GB per device", err)
    assert err.count("\n") == 1 and m, err
    need = float(m.group(2))
    assert need > 0.9 * 64 * 1024**3 / GB  # more than the budget it names
    assert "lower data.prompts_per_step (B=65536 sequences) or rollout.max_new_tokens=512" in err


def test_rpeg_train_exits_2_in_one_line_when_no_plan_fits(meminfo, capsys, tmp_path):
    meminfo(256 * 1024**2)
    args = ["train", "model.preset=small", "costmodel.hardware=cpu", f"train.run_dir={tmp_path / 'run'}"]
    assert rpeg(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no plan fits" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing written
