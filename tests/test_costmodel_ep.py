"""The cost model's expert parallelism (issue 33 item 3): the all-to-all bytes of the runtime's
dropless dispatch and combine against a float64 formula written here from the Hugging Face config's
fields, the all-to-alls counted per pass, the experts left out of the FSDP gathers, the dispatch
buffers in the activations, and the planner choosing an expert degree where the gathers it saves
outweigh the tokens it moves (and not on P1's long responses)."""

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.config.model import model_preset
from rpeg_jax.costmodel import candidates as C
from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.comm import collective_time
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.costmodel.planner import search
from rpeg_jax.costmodel.pricing import price
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.graph.algorithms import model_dims

GH = load_hardware("gh200", calibrated=False)
A3B = model_preset("qwen3-30b-a3b", dtype="bfloat16", param_dtype="float32")
MS = ModelShape.of(model_dims(A3B, "actor"))
# a short-response workload (small micro-batches: the tokens an all-to-all moves are few) on a
# 12-layer Qwen3-30B-A3B, whose expert matrices an FSDP pass would gather every layer
SHORT = [
    "model.preset=qwen3-30b-a3b",
    "model.num_layers=12",
    "train.pack_sequences=false",
    "data.prompts_per_step=8",
    "rl.group_size=4",
    "data.max_prompt_len=128",
    "costmodel.prompt_len=128",
    "rollout.max_new_tokens=256",
    "costmodel.response_len_min=64",
    "costmodel.response_len_median=128",
    "costmodel.response_len_sigma=0.3",
    "costmodel.tensor_sizes=[1]",
]


def a2a_reference(tokens: float, e: int, ids: bool) -> float:
    """One device's all-to-all buffer, from the HF config's fields: e destinations, each a buffer
    of C = tokens x num_experts_per_tok rows (models/moe.py's dropless capacity) of hidden_size
    bfloat16 values (+ an int32 expert id per row on the dispatch)."""
    rows = np.float64(e) * np.float64(tokens) * np.float64(A3B.num_experts_per_tok)
    return float(rows * (np.float64(A3B.hidden_size) * 2.0 + (4.0 if ids else 0.0)))


@pytest.mark.parametrize("tokens,e", [(1.0, 2), (4096.0, 8), (12345.0, 16), (8192.0, 64)])
def test_all_to_all_bytes_follow_the_dispatch_buffers(tokens, e):
    assert float(MS.a2a_bytes(tokens, e)) == pytest.approx(a2a_reference(tokens, e, False), rel=1e-12)
    assert float(MS.a2a_bytes(tokens, e, ids=True)) == pytest.approx(a2a_reference(tokens, e, True), rel=1e-12)
    assert float(MS.a2a_bytes(tokens, 1)) == 0.0  # no expert parallelism, no all-to-all


@pytest.mark.parametrize("e,stride", [(4, 1), (8, 1), (16, 2)])
def test_all_to_all_seconds_count_dispatch_and_combine_per_pass(e, stride):
    """Per sparse layer: forward = dispatch + combine; backward adds their two transposes (rows of
    D, no ids); full remat runs the forward's two again. Node and network tiers come from
    collective_time over the e devices (stride = the tensor degree: fsdp lies outside it)."""
    tok = 3000.0
    disp = float(collective_time(GH, "all_to_all", a2a_reference(tok, e, True), e, stride))
    comb = float(collective_time(GH, "all_to_all", a2a_reference(tok, e, False), e, stride))
    Ls = A3B.num_layers  # every layer of Qwen3-30B-A3B is sparse
    got = lambda **kw: float(S.expert_a2a_time(GH, MS, tok, e, stride, **kw))  # noqa: E731
    assert got(backward=False) == pytest.approx(Ls * (disp + comb), rel=1e-12)
    assert got(backward=True) == pytest.approx(Ls * (disp + 3 * comb), rel=1e-12)
    assert got(backward=True, remat="full") == pytest.approx(Ls * (2 * disp + 4 * comb), rel=1e-12)
    assert float(S.expert_a2a_time(GH, MS, tok, 1, stride, backward=True)) == 0.0
    # the network tier: 8 devices over 2 nodes of 4 move half of each buffer over the NICs
    if e == 8 and stride == 1:
        one_node = float(collective_time(GH, "all_to_all", a2a_reference(tok, 4, False) * 2, 4, 1))
        assert comb > one_node


def test_experts_leave_the_fsdp_gathers_and_add_dispatch_buffers():
    """Expert parallelism keeps the experts where they are (the gathers hold attention and router
    only: X x D beats the attention matrices here) and saves (e + 1) k rows of D per token of a
    sparse layer, while the expert MLP's activations run on e k rows per token."""
    D, X, Fe, k = A3B.hidden_size, A3B.num_experts, A3B.moe_intermediate_size, A3B.num_experts_per_tok
    q, kv = A3B.num_heads * A3B.head_size, A3B.num_kv_heads * A3B.head_size
    a = 2  # bfloat16 gathers (mixed precision)
    assert float(MS.gather_bytes(1, "matrix", e=1)) == 2.0 * X * D * Fe * a
    assert float(MS.gather_bytes(1, "matrix", e=8)) == 2.0 * max(D * q, D * kv, D * X) * a
    per_layer = D * q + 2 * D * kv + q * D + D * X + 2 * D  # all but the experts
    assert float(MS.gather_bytes(2, "layer", e=8)) == pytest.approx(2.0 * per_layer * a / 2, rel=1e-12)
    none = lambda e: float(MS.act_bytes_per_token_layer(1, "none", e=e))  # noqa: E731
    extra = none(8) - none(1)
    want = a * 3 * (8 - 1) * k * Fe + (8 + 1) * k * D * a  # SwiGLU on 8x the rows + received and combined rows
    assert extra == pytest.approx(want, rel=1e-12)
    assert float(MS.act_bytes_per_token_layer(1, "full", e=8)) == a * D  # full remat: the layer input only


def test_expert_degrees_divide_the_experts():
    """An expert degree is the fsdp size when it divides the experts (the runtime's fsdp_expert
    rules), and a dense model has none."""
    assert MS.expert_degrees(8) == (1, 8)
    assert MS.expert_degrees(1) == (1,)
    assert MS.expert_degrees(3) == (1,)  # 128 % 3
    lay = C.layouts(8, 32, MS, (1, 2))
    assert {tuple(r) for r in lay.tolist()} >= {(1, 8, 1, 8), (1, 8, 1, 1), (2, 4, 1, 4), (1, 4, 2, 4)}
    assert all(r[3] in (1, r[1]) and A3B.num_experts % r[3] == 0 for r in lay.tolist())
    dense = ModelShape.of(model_dims(model_preset("qwen2-1.5b"), "actor"))
    assert set(C.layouts(8, 32, dense, (1, 2))[:, 3].tolist()) == {1}


def test_the_update_with_experts_resident_per_device():
    """The training state per device is the same with and without expert parallelism (the experts
    are split e = f ways, as fsdp splits them), and the update's memory differs by the gathers
    saved and the dispatch buffers added, as the shape's terms say."""
    cfg = load_config("configs/p1.yaml", SHORT)
    ctx = CX.make_context(cfg, 8, GH, 2)
    ms = ModelShape.of(model_dims(cfg.model, "actor"))
    m = {e: float(S.train_memory(ctx.st, ms, d=2, f=4, t=1, micro=1, remat="none", e=e)) for e in (1, 4)}
    seq_tok = float(S.pass_tokens(ctx.st, 2, 4, 1, 1)[0])
    tok = ctx.st.B / 8 * seq_tok
    eff = GH.efficiency
    acts = (
        eff.act_memory_factor
        * ms.L
        * tok
        * (float(ms.act_bytes_per_token_layer(1, "none", e=4)) - float(ms.act_bytes_per_token_layer(1, "none", e=1)))
    )
    gathers = float(ms.gather_bytes(1, eff.fsdp_gather, e=4)) - float(ms.gather_bytes(1, eff.fsdp_gather, e=1))
    assert m[4] - m[1] == pytest.approx(acts + gathers, rel=1e-9)
    assert ms.resident_state_bytes() / 4 == pytest.approx(3 * ms.num_params * 4 / 4)  # same /f either way


def test_the_planner_chooses_expert_parallelism_where_it_pays():
    """Short responses: an update's micro-batch moves a few thousand tokens per device, far less
    than the expert matrices FSDP would gather each layer: the plan's update runs the experts over
    fsdp (rules fsdp_expert). P1's responses (4k-16k tokens, 512 sequences) move ~e x 16 GB per
    all-to-all with the runtime's dropless buffers: no expert degree is chosen there."""
    short = search(load_config("configs/p1.yaml", SHORT), 8, GH).chosen
    tr = short.layout["train"]
    assert tr["experts"] == tr["fsdp"] > 1, short.layout
    upd = [s for s in short.plan.stages if "actor_update" in s.stage][0]
    assert upd.rules == "fsdp_expert"
    again = price(load_config("configs/p1.yaml", SHORT), short.plan, GH)  # the plan's rules carry the degree
    assert again.layout["train"]["experts"] == tr["experts"]
    assert again.step_time_s == pytest.approx(short.step_time_s, rel=1e-9)
    p1 = search(load_config("configs/p1.yaml", ["model.preset=qwen3-30b-a3b", "train.pack_sequences=false"]), 8, GH)
    assert p1.chosen.layout["train"]["experts"] == 1 and p1.chosen.layout["forward"]["experts"] == 1


def test_a_dense_model_has_no_expert_degree():
    """A dense model's candidates are the (d, f, t) rows as before (e = fe = 1) and its plans carry
    no expert fields or rules: their JSON is what it was before expert parallelism was priced."""
    cfg = load_config("configs/p1.yaml", ["model.preset=qwen2-1.5b"])
    res = search(cfg, 8, GH)
    p = res.chosen
    assert "experts" not in p.layout["train"] and "experts" not in p.layout["forward"]
    assert not any(s.rules.startswith("fsdp_expert") for s in p.plan.stages)
