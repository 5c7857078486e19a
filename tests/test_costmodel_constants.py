"""The accelerator constants of configs/hardware (train_matmul_cap, weight sync fixed + per-bucket
cost, host_step_s) and the mixed-precision FSDP memory rule: each against a hand computation, each
shown to reach the planner's step, and bad or missing values rejected naming the field."""

import dataclasses
import math

import numpy as np
import pytest
import yaml
from helpers import load_file

from rpeg_jax.config import load_config
from rpeg_jax.config.base import ConfigError
from rpeg_jax.config.model import model_preset
from rpeg_jax.costmodel import baselines as BL
from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel import hardware as H
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.comm import transfer_time
from rpeg_jax.costmodel.lengths import LengthDist
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.graph.algorithms import model_dims

H100 = H.load_hardware("h100", calibrated=False)


def shape(preset, **kw):
    return ModelShape.of(model_dims(model_preset(preset, **kw), "actor"))


def with_eff(hw, **kw):
    return dataclasses.replace(hw, efficiency=dataclasses.replace(hw.efficiency, **kw))


def setting(hw, B=64, P=512, R=1024):
    return S.Setting(
        hw=hw,
        B=B,
        P=P,
        R=R,
        G=8,
        dist=LengthDist.fixed(R),
        causal_skip=True,
        dense_scores=False,
        packing=False,
        budget_bytes=70e9,
    )


def test_presets_set_the_constants_and_the_model_reads_them():
    for name in ("gh200", "h100", "h200"):
        e = H.load_hardware(name, calibrated=False).efficiency
        assert 0 < e.train_matmul_cap < 1 and e.sync_fixed_s > 0 and e.sync_bucket_s > 0 and e.host_step_s > 0
        assert e.sync_bucket_bytes > 0
    cpu = H.load_hardware("cpu", calibrated=False).efficiency
    assert cpu.train_matmul_cap is None and cpu.sync_fixed_s is None and cpu.matmul_cap == 1.0


def test_weight_sync_colocated_by_hand():
    # Aligned layouts (4 training shards -> generation tensor 4): the reshard moves nothing, so the
    # sync is fixed + buckets x per-bucket + the cast of the shard + one dispatch.
    hw = with_eff(H100, sync_fixed_s=3.0, sync_bucket_bytes=2.5e8, sync_bucket_s=0.05)
    ms = shape("qwen2-7b", dtype="bfloat16", param_dtype="float32")
    st = setting(hw)
    n = ms.num_params
    w = 2.0 * n  # the rollout's bf16 copy
    buckets = math.ceil(w / 2.5e8)
    cast = n * (4 + 2) / 4 / 3.35e12  # read fp32 shard, write bf16 shard, h100 memory_bw
    want = 3.0 + buckets * 0.05 + cast + 1e-4
    got = float(S.weight_sync_stage(st, ms, colocated=True, shards_train=4.0, t_g=4, n_train=8, n_gen=8))
    assert got == pytest.approx(want, rel=1e-12)
    assert buckets == 61  # 7.6e9 params x 2 B / 250 MB: the bucket count is part of the price
    # Split: the transfer priced by comm.transfer_time, plus the same fixed and per-bucket terms.
    move = float(transfer_time(hw, w, 8, 8, 4))
    assert float(
        S.weight_sync_stage(st, ms, colocated=False, shards_train=4.0, t_g=4, n_train=8, n_gen=8)
    ) == pytest.approx(3.0 + buckets * 0.05 + move + 1e-4, rel=1e-12)
    # Unset constants (the CPU profile) cost nothing beyond the data movement.
    cpu = H.load_hardware("cpu", calibrated=False)
    assert float(S.weight_sync_time(cpu, w, 0.25)) == pytest.approx(0.25 + cpu.efficiency.dispatch_s)


def _cfg(*extra):
    return load_config(
        None,
        [
            "model.preset=qwen2-1.5b",
            "model.dtype=bfloat16",
            "model.param_dtype=float32",
            "data.prompts_per_step=32",
            "rl.group_size=16",
            "data.max_prompt_len=512",
            "costmodel.prompt_len=512",
            "rollout.max_new_tokens=2048",
            "costmodel.response_len_median=512",
            *extra,
        ],
    )


def _verl(hw):
    return BL.baseline(CX.make_context(_cfg(), 8, hw), "verl_like", {})


def test_sync_and_framework_costs_add_to_the_synchronous_step():
    base = _verl(H100)
    ms = shape("qwen2-1.5b", dtype="bfloat16", param_dtype="float32")
    buckets = math.ceil(ms.weight_bytes() / H100.efficiency.sync_bucket_bytes)
    assert base.stage_times_s["weight_sync"] > H100.efficiency.sync_fixed_s  # seconds, not ms
    # A colocated synchronous step runs every stage in series: each added second is on the step.
    more = with_eff(
        H100,
        sync_fixed_s=H100.efficiency.sync_fixed_s + 2.0,
        sync_bucket_s=H100.efficiency.sync_bucket_s + 0.01,
        host_step_s=H100.efficiency.host_step_s + 3.0,
    )
    got = _verl(more)
    assert got.layout == base.layout
    assert got.step_time_s - base.step_time_s == pytest.approx(2.0 + buckets * 0.01 + 3.0, rel=1e-9)
    assert got.stage_times_s["weight_sync"] - base.stage_times_s["weight_sync"] == pytest.approx(
        2.0 + buckets * 0.01, rel=1e-9
    )


def test_train_matmul_cap_caps_the_trainer_only():
    hw = with_eff(H100, train_matmul_cap=0.45)
    big, small = 1.3e11, 1.0e6  # table points of h100.yaml: 0.80 and 0.02
    assert float(S.mm_eff(hw, big)) == pytest.approx(0.80)
    assert float(S.mm_eff(hw, big, trainer=True)) == pytest.approx(0.45)
    assert float(S.mm_eff(hw, small, trainer=True)) == pytest.approx(0.02)  # below the cap: the table
    ms = shape("qwen2-7b", dtype="bfloat16", param_dtype="float32")
    st_cap, st_free = setting(hw, B=256, R=2048), setting(with_eff(H100, train_matmul_cap=1.0), B=256, R=2048)
    # A compute-bound update (8 sequences x 2.5k tokens per micro-batch): the matmul part of the
    # update scales by exactly table / cap; decode is not the trainer's and does not move.
    _, p_cap = S.train_stage(st_cap, ms, busy=8, d=1, f=8, t=1, micro=4, remat="none")
    _, p_free = S.train_stage(st_free, ms, busy=8, d=1, f=8, t=1, micro=4, remat="none")
    tokens = 256 / 8 / 4 * (512 + 2048)
    eff = float(S.mm_eff(H100, ms.mm_size(tokens, 1)))
    assert eff > 0.45
    assert float(p_cap["matmul"]) / float(p_free["matmul"]) == pytest.approx(eff / 0.45, rel=1e-9)
    assert float(S.decode_step_time(st_cap, ms, 1, 8, 64, 1500)) == float(
        S.decode_step_time(st_free, ms, 1, 8, 64, 1500)
    )


def test_mixed_precision_update_memory_is_16_bytes_per_param():
    ms = shape("qwen2-7b", dtype="bfloat16", param_dtype="float32")
    n = ms.num_params
    # fp32 master (4) + Adam m, v (8) resident; bf16 gradients (2) + bf16 weight copy (2) in the update.
    assert ms.resident_state_bytes() == 12.0 * n
    for micro in (1, 4):
        assert float(ms.update_state_bytes(micro)) == 4.0 * n
        assert ms.resident_state_bytes() + float(ms.update_state_bytes(micro)) == 16.0 * n
    # Sharded over fsdp x tensor in the update's peak: 16 N / 32 plus activations, logits, gathers.
    st = setting(H100, B=64, R=1024)
    d, f, t, micro = 1, 32, 1, 8
    mem = float(S.train_memory(st, ms, d=d, f=f, t=t, micro=micro, remat="none"))
    gathered = 2.0 * max(ms.D * ms.H * ms.E, ms.D * ms.K * ms.E, ms.D * ms.F) * 2  # two bf16 matrices
    tok = 64 / 32 / 8 * (512 + 1024)
    act = ms.L * tok * float(ms.act_bytes_per_token_layer(1, "none"))
    logits = float(ms.logits_bytes(64 / 32 / 8 * 1024, 1))
    assert mem == pytest.approx(16.0 * n / 32 + act + logits + gathered, rel=1e-12)
    # Full precision (the measured CPU rule) is unchanged: grads + 2 guarded copies (+ accumulator).
    fp = shape("qwen2-7b", dtype="float32", param_dtype="float32")
    assert float(fp.update_state_bytes(1)) == 12.0 * fp.num_params
    assert float(fp.update_state_bytes(4)) == 16.0 * fp.num_params
    assert fp.gather_bytes_per == 4 and ms.gather_bytes_per == 2


def test_fsdp_gathers_move_bf16_under_mixed_precision():
    from rpeg_jax.costmodel.comm import collective_time

    ms = shape("qwen2-7b", dtype="bfloat16", param_dtype="float32")
    st = setting(H100, B=64)
    _, parts = S.forward_stage(st, ms, busy=8, d=1, f=8, t=1, micro=1)
    core = float(parts["compute"])
    gather = ms.L * float(collective_time(H100, "all_gather", ms.layer_params * 2.0, 8, 1))  # bf16
    want = gather - H100.efficiency.overlap * min(gather, core)
    assert float(parts["comm"]) == pytest.approx(want, rel=1e-12)


def _gpu_data():
    with open(H.profile_path("h100")) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize(
    "field, value",
    [
        ("sync_fixed_s", -1.0),
        ("sync_bucket_s", -0.1),
        ("sync_bucket_bytes", 0.0),
        ("train_matmul_cap", 0.0),
        ("train_matmul_cap", 1.5),
        ("host_step_s", -2.0),
    ],
)
def test_bad_constant_names_the_field(field, value):
    d = _gpu_data()
    d["efficiency"][field] = value
    with pytest.raises(ConfigError) as e:
        H.from_dict(d)
    assert f"efficiency.{field}" in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize("field", H.ACCELERATOR_CONSTANTS)
def test_gpu_profile_missing_a_constant_names_it(field, tmp_path):
    d = _gpu_data()
    del d["efficiency"][field]
    with pytest.raises(ConfigError) as e:
        H.from_dict(d)
    assert f"efficiency.{field}" in str(e.value) and "missing" in str(e.value)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match=f"efficiency.{field}"):
        H.load_hardware(str(path))


def test_saved_profiles_round_trip(tmp_path):
    # `rpeg calibrate` saves a copy of the preset with fitted fields (save_hardware): the GPU
    # constants travel with it, and a CPU copy without them (older caches) still loads.
    for name in ("h100", "cpu"):
        prof = H.load_hardware(name, calibrated=False)
        out = H.save_hardware(prof, str(tmp_path / f"{name}.yaml"))
        back = H.load_hardware(out)
        assert back.efficiency == prof.efficiency
    d = yaml.safe_load(open(H.profile_path("cpu")))
    assert not any(k in d["efficiency"] for k in H.ACCELERATOR_CONSTANTS)  # an old calibrated copy's form
    assert H.from_dict(d).efficiency.sync_fixed_s is None
    assert np.isclose(float(S.weight_sync_time(H.from_dict(d), 1e9, 0.0)), d["efficiency"]["dispatch_s"])


def test_anchor_workloads_match_the_published_table():
    # bench/costmodel_anchors.py builds each anchor's config: its batch, lengths and model are the
    # published ones (G-average response length reproduced, 64 x 32 samples, Qwen3-32B's size).
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "costmodel_anchors.py")
    mod = load_file("costmodel_anchors", path, register=True)  # its dataclasses look their module up
    for a in mod.ANCHORS:
        cfg, med = mod.anchor_config(a)
        ctx = CX.make_context(cfg, a.gpus, H100)
        assert ctx.st.B == 2048 and ctx.st.P == 128 and ctx.st.R == 3968 and cfg.rl.minibatches == 4
        assert abs(ctx.st.dist.mean(2048) - a.mean_response) <= 1.0
        n = CX.roles_of(ctx, ctx.base).actor.num_params
        assert n == pytest.approx(32.76e9 if "qwen3" in a.name else 8.03e9, rel=0.005)
