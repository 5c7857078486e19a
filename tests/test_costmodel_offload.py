"""costmodel/offload.py: host-link bandwidths, offloaded bytes, the update's device memory with the
optimizer state offloaded, and transfer seconds, against hand-computed numbers."""

import dataclasses
import types

import numpy as np
import pytest

from rpeg_jax.costmodel import offload as OFF
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.costmodel.shape import ModelShape

GH = load_hardware("gh200", calibrated=False)


def shape(n=1_000_000_000, p=4, a=4):
    return ModelShape(
        num_params=n,
        L=8,
        D=1024,
        H=8,
        K=8,
        E=128,
        F=4096,
        V=1000,
        param_bytes_per=p,
        act_bytes_per=a,
        dtype="float32" if a == 4 else "bfloat16",
    )


def test_host_link_bandwidths():
    assert OFF.host_link_bw(GH) == 450e9  # NVLink-C2C, per direction
    for name in ("h100", "h200"):
        assert OFF.host_link_bw(load_hardware(name, calibrated=False)) == 55e9  # PCIe Gen5 x16, effective
    cpu = load_hardware("cpu", calibrated=False)
    assert OFF.host_link_bw(cpu) == cpu.device.memory_bw / 2
    other = types.SimpleNamespace(name="mi300", kind="gpu", device=types.SimpleNamespace(host_link_bw=None))
    with pytest.raises(ValueError, match="device.host_link_bw"):
        OFF.host_link_bw(other)


def test_bad_offload_value_is_named():
    with pytest.raises(ValueError, match="train.offload='cpu'"):
        OFF.offloads_optimizer("cpu")


def test_offloaded_bytes_and_resident():
    ms, ref = shape(), shape(n=500_000_000, a=2)
    # Adam m, v in float32: 8 bytes per parameter; the reference in its compute dtype (2 bytes)
    assert OFF.resident_bytes("none", ms) == 12e9 and OFF.resident_bytes("optimizer", ms) == 4e9
    assert float(OFF.offloaded_bytes_per_device("none", [ms], ref, 4, 2)) == 0.0
    assert float(OFF.offloaded_bytes_per_device("optimizer", [ms], ref, 4, 2)) == 8e9 / 4
    assert float(OFF.offloaded_bytes_per_device("optimizer+reference", [ms, ms], ref, 4, 2)) == 16e9 / 4 + 1e9 / 2
    assert float(OFF.offloaded_bytes_per_device("optimizer+reference", [ms], None, 4, 2)) == 8e9 / 4


def test_update_transient_full_precision():
    ms = shape()  # N = 1e9, p = a = 4: full precision, the guarded copies and accumulator count
    plain = 30e9  # plain update's transients per device at f = t = 1
    assert float(OFF.update_transient("none", ms, plain, 1, 1, 1, 1)) == 30e9
    # several optimizer steps: the state is held through the update
    assert float(OFF.update_transient("optimizer", ms, plain, 1, 1, 1, 2)) == 38e9
    # one step: max(backward = 30 - 8 (new m, v), step = 4 grads + 8 m, v + 8 new m, v)
    assert float(OFF.update_transient("optimizer", ms, plain, 1, 1, 1, 1)) == 22e9
    # micro-batching adds the float32 accumulator to the step window: 4 + 4 + 8 + 8 = 24
    assert float(OFF.update_transient("optimizer", ms, 25e9, 1, 1, 2, 1)) == 24e9
    # sharded over f·t = 4: the state and copies are per device
    assert float(OFF.update_transient("optimizer", ms, 4e9, 2, 2, 1, 1)) == pytest.approx(5e9)


def test_update_transient_mixed_precision_and_never_above_plain():
    ms = shape(p=4, a=2)  # mixed precision: grads in bfloat16, no guarded copies
    assert float(OFF.update_transient("optimizer", ms, 30e9, 1, 1, 4, 1)) == 30e9  # backward window dominates
    assert float(OFF.update_transient("optimizer", ms, 5e9, 1, 1, 4, 1)) == 2e9 + 8e9  # grads + m, v
    rng = np.random.default_rng(0)
    for m in (shape(), shape(p=4, a=2)):
        for plain in rng.uniform(0, 60e9, 20):
            for micro in (1, 4):
                s = OFF.opt_state_bytes(m)
                off = float(OFF.update_transient("optimizer", m, plain + m.update_state_bytes(micro), 1, 1, micro, 1))
                assert off <= plain + float(m.update_state_bytes(micro)) + s + 1e-3


def test_transfer_seconds():
    ms = shape()
    # in and out: 2 x 8 GB over f·t = 8 at 450 GB/s
    assert float(OFF.update_transfer_seconds("optimizer", GH, ms, 4, 2)) == pytest.approx(2 * 8e9 / 8 / 450e9)
    assert float(OFF.update_transfer_seconds("none", GH, ms, 4, 2)) == 0.0
    ref = shape(a=2)
    assert float(OFF.reference_transfer_seconds("optimizer+reference", GH, ref, 2, 2)) == pytest.approx(2e9 / 4 / 450e9)
    assert float(OFF.reference_transfer_seconds("optimizer", GH, ref, 2, 2)) == 0.0
    assert float(OFF.reference_transfer_seconds("optimizer+reference", GH, None, 2, 2)) == 0.0


# ---- the hook: candidates.py prices train.offload in every row, the planner uses it ------------
P1_32B = ["model.preset=qwen2-32b", "data.prompts_per_step=8"]  # configs/p1.yaml, B = 8 x 16 = 128


def _table(offload, n=8):
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel import context as CX
    from rpeg_jax.costmodel import scoring as SC

    cfg = load_config("configs/p1.yaml", P1_32B + [f"train.offload={offload}"])
    ctx = CX.make_context(cfg, n, GH)
    ctx = dataclasses.replace(ctx, st=dataclasses.replace(ctx.st, budget_bytes=np.inf))  # keep every row
    roles = CX.roles_of(ctx, ctx.base)
    return SC.family_table(ctx, ctx.base, "colocated", {}), roles


def test_rows_drop_the_offloaded_state_and_pay_the_transfer():
    """Same rows (an unlimited budget keeps them all), offload=optimizer vs none: generation's
    memory drops by exactly the Adam moments per device, the update pays 2 x their bytes / 450 GB/s,
    and with +reference the reference's weights move from resident to its forward."""
    (a, roles), (b, _), (c, _) = _table("none"), _table("optimizer"), _table("optimizer+reference")
    key = lambda t: list(zip(t.d, t.f, t.t, t.fd, t.ff, t.ft, t.t_g, t.slots))  # noqa: E731
    assert key(a) == key(b) == key(c) and len(a.d) > 10
    ms, ref = roles.actor, roles.ref
    ft, fft = a.f * a.t, a.ff * a.ft
    s = 2.0 * ms.num_params * 4 / ft  # float32 m, v per device
    np.testing.assert_allclose(a.mem_gen - b.mem_gen, s, rtol=1e-9)
    np.testing.assert_allclose(b.mem_gen - c.mem_gen, ref.num_params * 2 / fft, rtol=1e-9)
    np.testing.assert_allclose(b.train.t_upd["actor"] - a.train.t_upd["actor"], 2 * s / 450e9, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(c.train.t_fwd["ref"] - b.train.t_fwd["ref"], ref.num_params * 2 / fft / 450e9, rtol=1e-9)
    np.testing.assert_allclose(b.train.t_fwd["actor"], a.train.t_fwd["actor"])  # the actor's forward moves nothing
    assert np.all(b.mem_update <= a.mem_update + 1e-3)  # never worse at the update either
    assert np.any(b.mem_update < a.mem_update - 1e9)


def test_32b_on_8_gh200_plans_only_with_offload():
    """configs/p1.yaml with qwen2-32b at B = 128 (8 prompts x 16) on 8 GH200: nothing fits without
    offload; the planner searches train.offload (the config leaves it at none) and the plan it
    chooses carries it, within the 84.6 GB budget. The config's own offload is kept too. All of it
    planned as one process, and as the two processes one per node that launch on 8 GH200: their
    generation is tensor-parallel inside each process (a whole 32B copy per device would not fit)."""
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel import context as CX
    from rpeg_jax.costmodel import planner as P
    from rpeg_jax.costmodel import scoring as SC

    cfg = load_config("configs/p1.yaml", P1_32B)
    two = P.search(cfg, 8, GH)  # one process per node: 2
    assert two.processes == 2 and two.chosen.layout["generate"]["tensor"] in (2, 4)
    assert two.chosen.plan.settings["train.offload"] in ("optimizer", "optimizer+reference")
    assert SC.score(CX.make_context(cfg, 8, GH), {})[0] == []  # no candidate fits without offload
    res = P.search(cfg, 8, GH, processes=1)
    assert res.chosen.plan.settings["train.offload"] in ("optimizer", "optimizer+reference")
    assert res.chosen.memory_per_gpu_gb * 1e9 <= 0.9 * GH.hbm_bytes + 1e-3
    assert any(n.startswith("offload: train.offload=") for n in res.notes)
    res = P.search(load_config("configs/p1.yaml", P1_32B + ["train.offload=optimizer"]), 8, GH, processes=1)
    assert res.chosen.plan.settings["train.offload"] == "optimizer"
    assert res.chosen.memory_per_gpu_gb * 1e9 <= 0.9 * GH.hbm_bytes + 1e-3


def test_offload_is_not_searched_on_a_cpu():
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel import planner as P

    plan = P.search(load_config(None, []), 1, load_hardware("cpu", calibrated=False)).chosen.plan
    assert plan.settings["train.offload"] == "none"
