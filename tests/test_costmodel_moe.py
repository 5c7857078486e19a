"""The cost model's mixture-of-experts terms (issue 33 item 3, without an expert axis): FLOPs of the
active parameters against a count written out here layer by layer from the Hugging Face config's
fields, memory of all of them, a decode step reading only the experts its batch touches (against a
Monte Carlo draw of the routing), and the Qwen3-30B-A3B preset against its published sizes."""

import dataclasses

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.config.model import model_preset
from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.costmodel.planner import search
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.graph.algorithms import model_dims
from rpeg_jax.shapes.flops import Dims

GH = load_hardware("gh200", calibrated=False)


def hand_count(m) -> float:
    """Forward matmul FLOPs per token through every layer, one layer at a time (HF Qwen3-MoE's rule:
    layer i is sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
    d, e = m.hidden_size, m.head_size
    total = 0
    for i in range(m.num_layers):
        total += 2 * d * m.num_heads * e  # q
        total += 2 * 2 * d * m.num_kv_heads * e  # k, v
        total += 2 * m.num_heads * e * d  # o
        sparse = m.num_experts > 0 and i not in m.mlp_only_layers and (i + 1) % m.decoder_sparse_step == 0
        if sparse:
            total += 2 * d * m.num_experts  # router
            total += m.num_experts_per_tok * 3 * 2 * d * m.moe_intermediate_size  # gate, up, down of k experts
        else:
            total += 3 * 2 * d * m.intermediate_size
    return total


MIXED = dict(
    arch="qwen3_moe",
    hidden_size=64,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    decoder_sparse_step=2,
    mlp_only_layers=(3,),
    vocab_size=128,
    qk_norm=True,
)


@pytest.mark.parametrize("name", ["mixed", "qwen3-30b-a3b"])
def test_flops_count_the_active_parameters(name):
    m = model_preset("tiny", **MIXED) if name == "mixed" else model_preset(name)
    want = hand_count(m)
    assert Dims.of(m).body_flops == want  # from the model config (the runtime's perf/flops)
    ms = ModelShape.of(model_dims(m, "actor"))  # from the graph's dims (the cost model)
    assert ms.dims.body_flops == want
    dense = dataclasses.replace(m, num_experts=0)
    assert hand_count(dense) != want  # the experts change the count: the test would see them ignored


def test_qwen3_30b_a3b_has_its_published_sizes():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (its model card)."""
    m = model_preset("qwen3-30b-a3b")
    ms = ModelShape.of(model_dims(m, "actor"))
    assert m.num_params() == pytest.approx(30.5e9, rel=0.01)
    active = (ms.dims.body_flops + ms.dims.head_flops) / 2 + m.vocab_size * m.hidden_size  # + the embedding table
    assert active == pytest.approx(3.3e9, rel=0.03)
    assert ms.expert_bytes(1) == 48 * 128 * 3 * 2048 * 768


def test_a_decode_step_reads_the_experts_its_tokens_touch():
    m = model_preset("tiny", **MIXED)
    ms = ModelShape.of(model_dims(m, "actor"))
    rng = np.random.default_rng(0)
    X, k, trials = m.num_experts, m.num_experts_per_tok, 4000
    for b in (1, 2, 5, 16):
        touched = np.mean(
            [len(set(np.concatenate([rng.choice(X, k, replace=False) for _ in range(b)]))) for _ in range(trials)]
        )
        want = ms.weight_bytes() - ms.expert_bytes() + ms.expert_bytes() * touched / X
        assert ms.decode_weight_bytes(b) == pytest.approx(want, rel=0.01), b
    assert ms.decode_weight_bytes(1000) == pytest.approx(ms.weight_bytes(), rel=1e-9)
    dense = ModelShape.of(model_dims(dataclasses.replace(m, num_experts=0), "actor"))
    assert dense.decode_weight_bytes(1) == dense.weight_bytes()


def _update_gpu_seconds(pred) -> float:
    stage = next(s for s in pred.plan.stages if s.stage.endswith("actor_update"))
    group = next(g for g in pred.plan.groups if g.name == stage.group)
    return pred.stage_times_s[stage.stage] * len(group.devices)


def test_the_planner_prices_a_mixture_cheaper_than_a_dense_model_of_its_size():
    """Qwen3-30B-A3B against a dense model with the same parameters (every expert's width as one
    MLP): the mixture computes ~1/9 of the FLOPs, so its update and scoring forward are priced far
    cheaper, while its memory (all parameters) is alike."""
    over = ["data.prompts_per_step=32", "rl.group_size=8", "rollout.max_new_tokens=2048", "model.dtype=bfloat16"]
    over += ["train.pack_sequences=false"]  # both priced unpacked: the comparison is of FLOPs, not packing
    moe = load_config("configs/p1.yaml", over + ["model.preset=qwen3-30b-a3b"])
    wide = dict(num_experts=0, intermediate_size=128 * 768)
    dense = dataclasses.replace(moe, model=dataclasses.replace(moe.model, **wide))
    a = ModelShape.of(model_dims(moe.model, "actor"))
    b = ModelShape.of(model_dims(dense.model, "actor"))
    assert a.num_params == pytest.approx(b.num_params, rel=0.01)
    assert b.dims.body_flops / a.dims.body_flops > 5
    pa, pb = (search(c, 16, GH, 4).chosen for c in (moe, dense))
    # the two plans may place the update on different numbers of GPUs (a mixture's plan can split
    # placement, training on half), so compare the update's GPU-seconds
    upd = [_update_gpu_seconds(p) for p in (pa, pb)]
    assert upd[1] / upd[0] > 3, upd
    ctx = CX.make_context(moe, 16, GH, 4)
    assert pa.memory_per_gpu_gb * 1e9 <= ctx.st.budget_bytes * 1.0001
