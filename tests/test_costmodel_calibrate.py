"""Calibration: fitting measured micro-benchmarks into a valid profile, and the `rpeg calibrate`
command end to end (tiny sizes)."""

import dataclasses
import os
import subprocess
import sys

import pytest

from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel import planner as P
from rpeg_jax.costmodel.hardware import check_table, interp_eff, load_hardware
from rpeg_jax.costmodel.microfit import _monotone_table, fit


def synthetic():
    return {
        "matmul": [(2 * 64**3, 1e9), (2 * 256**3, 8e9), (2 * 1024**3, 2e10)],
        "memory": [(1e5, 2e9), (1e7, 1e10), (1e8, 8e9)],
        "overheads": {"dispatch_s": 5e-5, "layer_s": 3e-6, "decode_step_s": 1e-6},
        "allreduce": [(4096.0, 1e-4, 8), (1 << 20, 2e-3, 8)],
    }


def test_fit_cpu_sets_measured_peaks_and_valid_tables():
    base = load_hardware("cpu", calibrated=False)
    prof = fit(base, synthetic())
    assert prof.device.peak_flops == 2e10 and prof.device.memory_bw == 1e10
    e = prof.efficiency
    for t in (e.matmul, e.memory, e.intra_node):
        check_table(t, "t")
    assert interp_eff(e.matmul, 2 * 1024**3) == pytest.approx(1.0)
    assert interp_eff(e.matmul, 2 * 64**3) == pytest.approx(1e9 / 2e10)
    assert e.dispatch_s == 5e-5 and e.layer_s == 3e-6
    # all-reduce busbw = 2(n-1)/n · S / t; the link rate is the best one measured.
    assert prof.node.link_bw == pytest.approx(2 * 7 / 8 * (1 << 20) / 2e-3)


def test_fit_gpu_keeps_nominal_peak():
    base = load_hardware("h200", calibrated=False)
    meas = synthetic()
    meas["matmul"] = [(1e9, 3e14), (1e11, 7e14)]
    prof = fit(base, meas)
    assert prof.device.peak_flops == base.device.peak_flops
    assert interp_eff(prof.efficiency.matmul, 1e11) == pytest.approx(7e14 / base.device.peak_flops)


def test_kv_attend_copy_is_the_samplers_chunk_attention():
    # calibrate's jnp copy of sampling/chunk_attention.attend_dense_t (costmodel imports no sampler
    # code) computes the same thing: what bench_kv_attend times is what the sampler runs.
    import jax
    import numpy as np

    from rpeg_jax.calibration.micro import attend_dense_t as ours
    from rpeg_jax.sampling.chunk_attention import attend_dense_t as sampler

    k = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k[0], (5, 4, 8))
    kt = jax.random.normal(k[1], (2, 5, 8, 12))
    v = jax.random.normal(k[2], (2, 5, 12, 8))
    kv_len = jax.numpy.asarray([12, 3, 0, 7, 1], jax.numpy.int32)
    np.testing.assert_allclose(np.asarray(ours(q, kt, v, kv_len)), np.asarray(sampler(q, kt, v, kv_len)), atol=1e-5)
    assert not np.allclose(np.asarray(ours(q, kt, v, kv_len)), np.asarray(ours(q, kt, v, kv_len + 1)))


def test_kv_attend_rate_is_fitted_and_prices_the_cpu_decode_step():
    from rpeg_jax.calibration.micro import bench_kv_attend
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel import stages as S

    small = dict(B=8, K=2, H=4, E=16, L=2)
    assert bench_kv_attend(1, shape=small, widths=(16, 64), steps=2) > 0
    base = load_hardware("cpu", calibrated=False)
    assert fit(base, synthetic()).efficiency.kv_attend_bw is None  # not measured: the memory table
    prof = fit(base, {**synthetic(), "kv_attend": 5e9})
    assert prof.efficiency.kv_attend_bw == 5e9
    ctx = CX.make_context(load_config(None, ["model.preset=tiny"]), 1, prof)
    ms = CX.roles_of(ctx, ctx.base).actor
    slow = S.decode_step_time(ctx.st, ms, 1, 1, 64, 200.0)
    faster = dataclasses.replace(prof, efficiency=dataclasses.replace(prof.efficiency, kv_attend_bw=1e10))
    fast = S.decode_step_time(dataclasses.replace(ctx.st, hw=faster), ms, 1, 1, 64, 200.0)
    kv = 64 * 200.0 * ms.kv_bytes_per_token * S.kv_read_factor(ctx.st)  # float64: the KV part halves
    assert slow - fast == pytest.approx(kv / 5e9 - kv / 1e10, rel=1e-9)


def test_monotone_table_drops_time_reversals():
    t = _monotone_table([(1e3, 0.01), (2e3, 0.5), (1e6, 0.9)])
    check_table(t, "t")  # 50x the efficiency at 2x the size would make time go backwards
    assert t[1][1] == pytest.approx(0.02)


def test_calibrated_profile_changes_predictions():
    from rpeg_jax.config import load_config

    base = load_hardware("cpu", calibrated=False)
    slow = fit(base, {**synthetic(), "matmul": [(2 * 1024**3, 1e9)]})
    cfg = load_config(None, [])
    a = P.search(cfg, 8, base).chosen.step_time_s
    b = P.search(cfg, 8, slow).chosen.step_time_s
    assert b > a


def test_rpeg_calibrate_command(tmp_path):
    out = tmp_path / "cpu.yaml"
    env = dict(os.environ, RPEG_CACHE=str(tmp_path / "cache"))
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rpeg_jax.cli",
            "calibrate",
            "--quick",
            "--no-stages",
            "--devices",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "calibrated cpu" in r.stdout
    prof = load_hardware(str(out))
    assert prof.device.peak_flops > 1e8 and prof.node.link_bw > 0 and prof.calibrated


def test_stage_fit_recovers_known_factors():
    # Synthetic "measurements" made by a profile with a known elementwise factor, layer cost and a
    # 2x slower matmul rate: the fit must find them back from the uncalibrated profile.
    import dataclasses

    from rpeg_jax.costmodel import stages as S
    from rpeg_jax.costmodel.lengths import LengthDist
    from rpeg_jax.costmodel.microfit import STAGE_SHAPES, fit_stages, synthetic_shape

    base = load_hardware("cpu", calibrated=False)
    truth = dataclasses.replace(
        base,
        device=dataclasses.replace(
            base.device, peak_flops=base.device.peak_flops / 2, peak_flops_fp32=base.device.peak_flops_fp32 / 2
        ),
        efficiency=dataclasses.replace(base.efficiency, elementwise_factor=1.7, layer_s=4e-5, backward_factor=1.6),
    )
    meas = []
    for kind, L, B, T, n, D in STAGE_SHAPES:
        ms = synthetic_shape(L, D)
        st = S.Setting(
            hw=truth,
            B=B,
            P=0,
            R=T,
            G=1,
            dist=LengthDist.fixed(T),
            causal_skip=False,
            dense_scores=True,
            packing=False,
            budget_bytes=1e12,
        )
        fn = S.forward_stage if kind == "forward" else S.train_stage
        args = {"micro": 1} if kind == "forward" else {"micro": 1, "remat": "none"}
        meas.append(
            {
                "kind": kind,
                "L": L,
                "B": B,
                "T": T,
                "devices": n,
                "D": D,
                "seconds": float(fn(st, ms, busy=n, d=n, f=1, t=1, **args)[0]),
            }
        )
    fitted, resid = fit_stages(base, meas)
    assert fitted.device.peak_flops == pytest.approx(truth.device.peak_flops, rel=0.05)
    assert fitted.efficiency.elementwise_factor == pytest.approx(1.7, rel=0.1)  # weak prior b = 1
    assert fitted.efficiency.layer_s == pytest.approx(4e-5, rel=0.1)
    assert fitted.efficiency.backward_factor == pytest.approx(1.6, rel=0.05)
    assert resid["stage_fit_mape"] < 0.02


def _points(hw):
    """Stage points (costmodel/fit.py format) whose 'measurements' are `hw`'s own predictions."""
    import dataclasses

    from rpeg_jax.costmodel.fit import predict_point
    from rpeg_jax.costmodel.shape import ModelShape

    def dims(L, D, H, K, F, V):
        E = D // H
        layer = D * H * E + 2 * D * K * E + H * E * D + 3 * D * F + 2 * D
        return dataclasses.asdict(
            ModelShape(
                num_params=2 * V * D + L * layer + D,
                L=L,
                D=D,
                H=H,
                K=K,
                E=E,
                F=F,
                V=V,
                param_bytes_per=4,
                act_bytes_per=4,
                dtype="float32",
            )
        )

    small, wide = dims(4, 256, 4, 2, 768, 128), dims(6, 512, 8, 4, 1536, 2048)
    cfgs = [
        ("forward", small, 16, (1, 1, 1), 1, "none"),
        ("forward", wide, 16, (4, 2, 1), 1, "none"),
        ("forward", small, 64, (4, 1, 1), 1, "none"),
        ("forward", wide, 8, (1, 4, 2), 1, "none"),
        ("train", small, 16, (1, 1, 1), 1, "none"),
        ("train", wide, 16, (4, 2, 1), 1, "full"),
        ("train", small, 32, (1, 4, 2), 2, "none"),
        ("train", wide, 8, (1, 1, 1), 1, "dots"),
        ("generate", small, 32, (1, 1, 1), 8, "-"),
        ("generate", small, 64, (4, 1, 1), 8, "-"),
        ("generate", wide, 16, (2, 1, 2), 4, "-"),
        ("generate", wide, 16, (1, 1, 1), 4, "-"),
    ]
    pts = []
    for kind, d, B, mesh, micro, remat in cfgs:
        p = {
            "kind": kind,
            "dims": d,
            "B": B,
            "P": 16,
            "R": 32,
            "mesh": list(mesh),
            "remat": remat,
            "micro": micro if kind != "generate" else 1,
            "G": micro if kind == "generate" else 1,
        }
        sec, mem = predict_point(hw, p)
        pts.append({**p, "seconds": sec, "memory": mem if kind != "generate" else None})
    return pts


def test_fit_points_recovers_a_known_profile():
    # 'Measurements' from a profile with known factors (3x slower FLOPs, layer and decode-step
    # costs, a backward factor, optimizer traffic, hoisted FSDP gathers, activation working-set
    # factors): fitted from the uncalibrated profile, the predictions must match them and the
    # memory mode and factors must be found.
    import dataclasses

    from rpeg_jax.costmodel.fit import fit_points, predict_point

    base = load_hardware("cpu", calibrated=False)
    truth = dataclasses.replace(
        base,
        device=dataclasses.replace(
            base.device, peak_flops=base.device.peak_flops / 3, peak_flops_fp32=base.device.peak_flops_fp32 / 3
        ),
        efficiency=dataclasses.replace(
            base.efficiency,
            layer_s=2e-4,
            decode_step_s=1e-3,
            backward_factor=1.5,
            fsdp_gather="model",
            update_streams=12.0,
            act_memory_factor=1.3,
            fwd_act_memory_factor=0.5,
        ),
    )
    pts = _points(truth)
    before = max(abs(predict_point(base, p)[0] / p["seconds"] - 1) for p in pts)
    fitted, resid = fit_points(base, pts, multistart=False)  # (one start: keeps the test short)
    after = max(abs(predict_point(fitted, p)[0] / p["seconds"] - 1) for p in pts)
    assert before > 0.3 and after < 0.05 and resid["fit_time_mape"] < 0.03
    assert fitted.efficiency.fsdp_gather == "model" and resid["fit_memory_mape"] < 1e-9
    assert fitted.efficiency.act_memory_factor == pytest.approx(1.3, rel=1e-6)
    assert fitted.efficiency.fwd_act_memory_factor == pytest.approx(0.5, rel=1e-6)
    assert fitted.device.peak_flops == pytest.approx(truth.device.peak_flops, rel=0.15)


def test_rpeg_calibrate_fits_saved_points(tmp_path, monkeypatch):
    # `rpeg calibrate` hands the points saved beside the profile to fit_points (same clock only)
    # and records how many it fitted (the fit itself is tested above).
    import json

    from rpeg_jax.costmodel import fit as F
    from rpeg_jax.costmodel.microfit import fit_saved_points

    base = load_hardware("cpu", calibrated=False)
    seen = []
    monkeypatch.setattr(F, "fit_points", lambda hw, pts: (seen.append(pts) or hw, {"fit_time_mape": 0.01}))
    pts = [{"kind": "forward", "seconds": 1.0}] * 3
    path = tmp_path / "cpu.points.json"
    path.write_text(json.dumps({"clock": "cpu", "points": pts}))
    prof = fit_saved_points(base, str(path), "cpu")
    assert seen == [pts] and prof.calibrated["stage_points"] == 3 and prof.calibrated["fit_time_mape"] == 0.01
    assert fit_saved_points(base, str(path), "wall") is base  # measured on another clock: not mixed


def test_fit_steps_recovers_the_runtime_host_costs():
    # Whole steps 'measured' with known per-piece, per-sequence and per-step host costs around the
    # sampler: the fit finds them back (one plan streams 8 pieces, so pieces separate; two batch
    # sizes, so sequences and steps separate).
    import dataclasses

    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel.fit import fit_steps, predict_step

    base = load_hardware("cpu", calibrated=False)
    truth = dataclasses.replace(
        base, efficiency=dataclasses.replace(base.efficiency, piece_s=0.05, host_seq_s=2e-3, host_step_s=0.1)
    )
    kn = {
        "staleness": 0,
        "share_actor_critic": False,
        "fuse": [],
        "elide_old_forward": False,
        "placement": "split",
        "split_sizes": [1, 1],
    }
    lay = {
        "groups": {"gen": 1, "train": 1},
        "generate": {"tensor": 1},
        "train": {"data": 1, "fsdp": 1, "tensor": 1, "micro_batches": 1, "remat": "none"},
        "forward": {"data": 1, "fsdp": 1, "tensor": 1},
    }
    steps = []
    for over in (
        ["data.prompts_per_step=8", "rollout.max_new_tokens=8"],
        ["data.prompts_per_step=16", "rollout.max_new_tokens=8"],
    ):
        res = P.search(load_config(None, over), 4, base, 1)
        steps.append({"overrides": over, "knobs": res.chosen.knobs, "layout": res.chosen.layout, "num_devices": 4})
        steps += [{"overrides": over, "knobs": {**kn, "pieces": m}, "layout": lay, "num_devices": 4} for m in (1, 8)]
    for sp in steps:
        sp["seconds"] = predict_step(truth, sp)
    fitted, resid = fit_steps(base, steps)
    # 6 steps, 3 factors, a very weak prior toward 0: the steps within 1%, the factors within 5%.
    assert resid["fit_step_mape"] < 0.01
    assert fitted.efficiency.piece_s == pytest.approx(0.05, rel=0.05)
    assert fitted.efficiency.host_seq_s == pytest.approx(2e-3, rel=0.05)
    assert fitted.efficiency.host_step_s == pytest.approx(0.1, rel=0.05)


def test_fit_steps_leaves_the_stage_factors_to_the_stage_points():
    # Steps that generate on tensor 2 whose 'measured' times carry a 3x larger sampler TP cost
    # than the stage fit's: the step fit moves only the host costs (piece_s, host_seq_s,
    # host_step_s), never decode_tp_factor or another stage factor (before commit 1d2b422 a step
    # refit took it from 12.7 to 109.8 and priced every tensor-parallel generation stage 5-9x too slow).
    import dataclasses

    from rpeg_jax.config import load_config  # noqa: F401  (predict_step loads the overrides)
    from rpeg_jax.costmodel.fit import STEP_FACTORS, fit_steps, predict_step

    base = load_hardware("cpu", calibrated=False)
    base = dataclasses.replace(base, efficiency=dataclasses.replace(base.efficiency, decode_tp_factor=4.0))
    truth = dataclasses.replace(
        base, efficiency=dataclasses.replace(base.efficiency, decode_tp_factor=12.0, host_step_s=0.05)
    )
    kn = {
        "staleness": 0,
        "share_actor_critic": False,
        "fuse": [],
        "elide_old_forward": False,
        "placement": "split",
        "split_sizes": [2, 2],
        "pieces": 1,
    }
    steps = []
    for over in (
        ["data.prompts_per_step=8", "rollout.max_new_tokens=8"],
        ["data.prompts_per_step=16", "rollout.max_new_tokens=8"],
    ):
        lay = {
            "groups": {"gen": 2, "train": 2},
            "generate": {"tensor": 2},
            "train": {"data": 1, "fsdp": 2, "tensor": 1, "micro_batches": 1, "remat": "none"},
            "forward": {"data": 2, "fsdp": 1, "tensor": 1},
        }
        steps.append({"overrides": over, "knobs": kn, "layout": lay, "num_devices": 4})
    for sp in steps:
        sp["seconds"] = predict_step(truth, sp)
    fitted, _ = fit_steps(base, steps)
    moved = {n for n, _ in STEP_FACTORS}
    for f in dataclasses.fields(base.efficiency):
        if f.name not in moved:
            assert getattr(fitted.efficiency, f.name) == getattr(base.efficiency, f.name), f.name
    assert fitted.efficiency.host_step_s > 0.05  # the TP miss lands in the host costs instead


def test_validation_measuring_order_spreads_each_kind_over_the_calibration_batches():
    """bench/costmodel_validate.py measures both sets in one order, in batches of 7: every config
    once, kind by kind, and each validation config in a batch with calibration configs of its kind
    (zipped lists put the generation configs in different batches: a 21% bias in the run of
    2026-12-01, bench/NOTES.md session 6)."""
    import os
    import sys

    from rpeg_jax.calibration import stages as CS

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    sys.path.insert(0, bench)
    try:
        from costmodel_validate import interleave
    finally:
        sys.path.remove(bench)
    order = interleave(CS.CALIBRATION, CS.VALIDATION)
    assert sorted(order) == sorted(CS.CALIBRATION + CS.VALIDATION)
    kinds = [c[0] for c in order]
    assert kinds == sorted(kinds, key=["forward", "train", "generate"].index)
    for i in range(0, len(order), 7):
        batch = order[i : i + 7]
        for v in (c for c in batch if c in CS.VALIDATION):
            assert any(c in CS.CALIBRATION and c[0] == v[0] for c in batch), (i // 7, v)


def test_accelerator_rates_are_not_the_dispatch(monkeypatch):
    # A simulated device: each call costs a 0.15 ms dispatch plus k units of work at 700 TFLOP/s (an
    # H200's bf16 matmul). One 4096^2 matmul is 0.2 ms of work: a call of it alone times the dispatch
    # as much as the matmul. The accelerator path sizes k from a first timing so that one call lasts
    # about CALL_TARGET_S (dispatch ~1%); the CPU path keeps its fixed work target (k = 1 here).
    from rpeg_jax.calibration import micro as C

    rate, dispatch, work = 7e14, 1.5e-4, 2.0 * 4096**3

    class Made:
        def __init__(self, k):
            self.k = k

    monkeypatch.setattr(C, "_timeit", lambda f, *a, repeats: dispatch + f.k * work / rate)
    got = C._looped_rate(Made, (), work, 3, accelerator=True)
    assert got == pytest.approx(rate, rel=0.02)
    cpu = C._looped_rate(Made, (), work, 3, accelerator=False)
    assert cpu == pytest.approx(work / (dispatch + work / rate)) and cpu < 0.6 * rate


def test_rpeg_calibrate_measures_the_real_stages_and_fits_them(tmp_path, monkeypatch):
    # `rpeg calibrate` on its own: the real model/update stages measured now (two tiny
    # configurations here), written beside the profile with the whole-step points an earlier bench
    # run saved there (same clock only), and fitted (stage_points counts them).
    import json

    from rpeg_jax import calibration as CAL
    from rpeg_jax.calibration import stages as CS
    from rpeg_jax.costmodel.microfit import fit_saved_points

    for quick in (True, False):
        cal = CAL.stage_configs("cpu", quick)
        assert cal and set(cal) <= set(CS.CALIBRATION) and not set(cal) & set(CS.VALIDATION)
        assert {c[0] for c in cal} == {"forward", "train", "generate"}
    assert set(CAL.stage_configs("h200", False)) == set(CS.GPU_CALIBRATION)
    tiny = [("forward", "T", 4, 8, 8, (1, 1, 1), 1, "none"), ("train", "T", 4, 8, 8, (1, 1, 1), 1, "none")]
    monkeypatch.setattr(CAL, "stage_configs", lambda kind, quick: tiny)
    pts = CAL.measure_stage_points("cpu", True, "cpu", log=lambda *_: None)
    assert [p["kind"] for p in pts] == ["forward", "train"] and all(p["seconds"] > 0 for p in pts)
    path = tmp_path / "cpu.points.json"
    path.write_text(json.dumps({"clock": "cpu", "points": [], "steps": [{"seconds": 1.0}]}))
    CAL.save_points(str(path), "cpu", pts)
    saved = json.loads(path.read_text())
    assert saved["steps"] == [{"seconds": 1.0}] and len(saved["points"]) == 2
    CAL.save_points(str(path), "wall", pts)  # another clock: the old step points are not mixed in
    assert json.loads(path.read_text())["steps"] == []
    base = load_hardware("cpu", calibrated=False)
    prof = fit_saved_points(base, str(path), "wall")
    assert prof.calibrated["stage_points"] == 2 and prof != base
