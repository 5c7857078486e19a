"""The cost model's LoRA terms (issue 33 item 5), against numbers computed by hand here for
Qwen2-7B (D 3584, 28 layers, 28 heads of 128, 4 kv heads, MLP 18944) at rank 16 on every projection:
adapter parameters (PEFT reports 40,370,176 trainable for this model and rank), training state and
update buffers of the adapters only beside the frozen base, an update of forward + one backward to
the activations, the reference as the base (no second copy), and the weight sync's merge."""

import dataclasses

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.config.model import model_preset
from rpeg_jax.costmodel import candidates as C
from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel import offload as OFF
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.graph.algorithms import model_dims
from rpeg_jax.shapes.flops import Dims, lora_params, lora_target_params

GH = load_hardware("gh200", calibrated=False)
Q7 = model_preset("qwen2-7b", dtype="bfloat16", param_dtype="float32")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# per layer, (in + out) of q, k, v, o, gate, up, down: 7168 + 4096 + 4096 + 7168 + 3 x 22528
ADAPTERS = 28 * 16 * 90112  # = 40,370,176
# per layer, in x out of the same: 2 x 3584^2 + 2 x 3584 x 512 + 3 x 3584 x 18944
TARGETED = 28 * 233_046_016
P1 = ["model.preset=qwen2-7b", "model.lora.rank=16"]


def lora_shape() -> ModelShape:
    ms = ModelShape.of(model_dims(Q7, "actor"))
    return CX.with_lora(ms, dataclasses.replace(Q7.lora, rank=16))


def test_adapter_parameters_counted_by_hand():
    d = Dims.of(Q7)
    assert ADAPTERS == 40_370_176
    assert lora_params(d, 16, ALL) == ADAPTERS
    assert lora_params(d, 8, ("q_proj", "v_proj")) == 28 * 8 * (7168 + 4096)
    assert lora_params(d, 0, ALL) == 0
    assert lora_target_params(d, ALL) == TARGETED
    ms = lora_shape()
    assert (ms.adapters, ms.merged, ms.lora_rank, ms.trained_params) == (ADAPTERS, TARGETED, 16, ADAPTERS)


def test_state_and_update_buffers_of_the_adapters_only():
    """Resident: the base in float32 (4 N) + adapters and Adam m, v (12 n); the update adds the
    adapters' bf16 gradients (2 n) and the bf16 copy of the weights the passes read (2 N); the
    optimizer state offload moves 8 n. Full fine-tuning: 12 N + 4 N."""
    ms, full = lora_shape(), ModelShape.of(model_dims(Q7, "actor"))
    N, n = full.num_params, ADAPTERS
    assert ms.resident_state_bytes() == 4.0 * N + 12.0 * n
    assert float(ms.update_state_bytes(4)) == 2.0 * n + 2.0 * N
    assert full.resident_state_bytes() == 12.0 * N and float(full.update_state_bytes(4)) == 4.0 * N
    assert OFF.opt_state_bytes(ms) == 8.0 * n
    assert OFF.resident_bytes("optimizer", ms) == 4.0 * N + 4.0 * n


def test_the_update_runs_one_backward_to_the_activations():
    """FLOPs: forward + dx through the frozen weights = 2 forwards (3 with full remat), against 3
    (4) for full fine-tuning; the optimizer streams the adapters only."""
    cfg = load_config("configs/p1.yaml", P1)
    st = CX.make_context(cfg, 8, GH, 2).st
    ms, full = lora_shape(), ModelShape.of(model_dims(Q7, "actor"))
    for remat, want in (("none", 2.0 / 3.0), ("full", 3.0 / 4.0)):
        a = S.train_stage(st, ms, busy=8, d=2, f=4, t=1, micro=4, remat=remat)[1]
        b = S.train_stage(st, full, busy=8, d=2, f=4, t=1, micro=4, remat=remat)[1]
        assert float(a["flops"]) / float(b["flops"]) == pytest.approx(want, rel=1e-12)
        extra = 1.0 if remat == "full" else 0.0
        assert float(a["passes"]) == 1.0 + extra + 1.0 * GH.efficiency.backward_factor
        assert float(b["passes"]) == 1.0 + extra + 2.0 * GH.efficiency.backward_factor
    a = S.train_stage(st, ms, busy=8, d=2, f=4, t=1, micro=4, remat="none")[1]
    opt = GH.efficiency.update_streams * ADAPTERS * 4.0 / 4  # float32 adapters over f x t = 4
    assert float(a["optimizer"]) == pytest.approx(float(S.mem_time(GH, opt, GH.device.memory_bw)), rel=1e-12)


def test_the_reference_is_the_base_and_the_sync_merges():
    """With rl.kl_coef > 0 the candidate rows hold no reference copy (it is the frozen base): the
    resident bytes are the training state over f·t and the rollout copy over t_g, nothing else.
    The weight sync pays the merge: every float32 parameter read and written once per device
    (memory-bound at rank 16), then the full merged model moves as before."""
    cfg = load_config("configs/p1.yaml", P1)
    ctx = CX.make_context(cfg, 8, GH, 2)
    roles = C.Roles(actor=lora_shape(), critic=None, ref=ModelShape.of(model_dims(Q7, "reference")))
    tab = C.build(ctx.st, roles, allocs=[(8, 8)], placement="colocated", tensor_sizes=(1, 2, 4))
    assert tab is not None and len(tab)
    N = ModelShape.of(model_dims(Q7, "actor")).num_params
    want = (4.0 * N + 12.0 * ADAPTERS) / (tab.f * tab.t) + 2.0 * N / tab.t_g
    np.testing.assert_allclose(tab.mem_resident, want, rtol=1e-12)
    full = dataclasses.replace(roles, actor=ModelShape.of(model_dims(Q7, "actor")))
    tf = C.build(ctx.st, full, allocs=[(8, 8)], placement="colocated", tensor_sizes=(1, 2, 4))
    assert (tf.mem_resident > 2.0 * N / (tf.ff * tf.ft) + 2.0 * N / tf.t_g).all()  # a reference copy there
    ms = lora_shape()
    plain = dataclasses.replace(ms, adapters=0, merged=0, lora_rank=0)
    for shards in (1, 4, 8):
        merge = 2.0 * N * 4.0 / shards / GH.device.memory_bw
        assert merge > 2.0 * 16 * TARGETED / shards / GH.peak("bfloat16")  # memory-bound
        kw = dict(colocated=True, shards_train=shards, t_g=4, n_train=8, n_gen=8)
        extra = float(S.weight_sync_stage(ctx.st, ms, **kw)) - float(S.weight_sync_stage(ctx.st, plain, **kw))
        assert extra == pytest.approx(merge, rel=1e-9)


def test_split_sync_moves_the_adapters_and_the_generation_group_keeps_a_base():
    """On disjoint devices (runtime/setup.AdapterSync) a sync moves the adapters (float32) to the
    generation group and merges there over its t_g shards; the generation devices hold the base
    beside the sampler's copy. Priced by hand from comm.transfer_time and lora_merge_time."""
    from rpeg_jax.costmodel.comm import transfer_time

    cfg = load_config("configs/p1.yaml", P1)
    ctx = CX.make_context(cfg, 16, GH, 4)
    ms = lora_shape()
    N = ModelShape.of(model_dims(Q7, "actor")).num_params
    a = 4.0 * ADAPTERS
    for t_g in (1, 2, 4):
        got = float(S.weight_sync_stage(ctx.st, ms, colocated=False, shards_train=8, t_g=t_g, n_train=8, n_gen=8))
        merge = 2.0 * N * 4.0 / t_g / GH.device.memory_bw
        move = float(transfer_time(GH, a, 8, 8, t_g))
        assert got == pytest.approx(float(S.weight_sync_time(GH, a, move + merge)), rel=1e-9)
        whole = float(S.weight_sync_stage(ctx.st, ms, colocated=True, shards_train=8, t_g=t_g, n_train=8, n_gen=8))
        assert got < whole  # the 40M adapters move, not the 7.6B merged model
    roles = C.Roles(actor=ms, critic=None, ref=ModelShape.of(model_dims(Q7, "reference")))
    full = dataclasses.replace(roles, actor=dataclasses.replace(ms, adapters=0, merged=0, lora_rank=0))
    tab = C.build(ctx.st, roles, allocs=[(8, 8)], placement="split", tensor_sizes=(1, 2, 4))
    tf = C.build(ctx.st, full, allocs=[(8, 8)], placement="split", tensor_sizes=(1, 2, 4))
    assert tab is not None and tf is not None
    checked = 0
    for tg in (1, 2, 4):  # the same generation slots: the base sits beside them
        mine, theirs = tab.mem_gen[tab.t_g == tg], tf.mem_gen[tf.t_g == tg]
        assert len(mine) and len(theirs)
        if tab.slots[tab.t_g == tg].max() == tf.slots[tf.t_g == tg].max():
            np.testing.assert_allclose(mine.max() - theirs.max(), 4.0 * N / tg, rtol=1e-9)
            checked += 1
    assert checked


@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj"), ("down_proj", "k_proj")])
def test_adapter_count_matches_the_runtime_shapes(targets):
    """Against the adapters' shapes as the runtime derives them from HF's layouts
    (models/lora.target_shapes: A [L, r, in], B [L, out, r]) on a GQA model with an odd MLP width."""
    from rpeg_jax.models.lora import target_shapes

    m = model_preset("tiny", hidden_size=96, num_heads=6, num_kv_heads=2, intermediate_size=200, num_layers=3)
    want = sum(int(np.prod(a)) + int(np.prod(b)) for a, b in (target_shapes(m, t, 8) for t in targets))
    assert lora_params(Dims.of(m), 8, targets) == want
