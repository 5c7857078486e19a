"""Per-stage formulas against independent hand computations (float64 numpy / plain Python)."""

import dataclasses

import numpy as np
import pytest

from rpeg_jax.config.model import model_preset
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.costmodel.lengths import LengthDist, gen_schedule
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.graph.algorithms import model_dims


def shape(preset, **kw):
    return ModelShape.of(model_dims(model_preset(preset, **kw), "actor"))


def setting(hw="gh200", B=64, P=512, R=1024, dense=False, **kw):
    return S.Setting(
        hw=load_hardware(hw, calibrated=False),
        B=B,
        P=P,
        R=R,
        G=8,
        dist=LengthDist.fixed(R),
        causal_skip=not dense,
        dense_scores=dense,
        packing=False,
        budget_bytes=80e9,
        **kw,
    )


def test_megatron_gpt_layer_flops():
    # GPT-style shape (MHA, E = D/H, SwiGLU with F = 8D/3 has the same 8D² MLP params as 4D GELU):
    # Megatron's forward per token per layer = 24 D² + 4 s D (attention over context s).
    D, H = 3072, 24
    ms = shape(
        "tiny",
        hidden_size=D,
        num_heads=H,
        num_kv_heads=H,
        intermediate_size=8 * D // 3,
        num_layers=1,
        vocab_size=256,
        max_position_embeddings=8192,
        bos_id=1,
        eos_id=2,
    )
    assert ms.layer_matmul_flops == 24 * D * D
    s = 2048
    dense_attn = float(ms.attn_flops(s * s, causal_skip=False))
    assert dense_attn == pytest.approx(4 * s * D * s)  # 4 s D per token, s tokens
    assert float(ms.attn_flops(s * s, causal_skip=True)) == pytest.approx(dense_attn / 2)


@pytest.mark.parametrize("preset", ["qwen2-7b", "qwen3-32b"])  # qwen3-32b: H·E = 8192 != D = 5120
def test_qwen_flops_against_parameter_count(preset):
    # For a decoder the forward matmul FLOPs per token are 2 × (non-embedding matmul params) + 2DV.
    cfg = model_preset(preset)
    ms = ModelShape.of(model_dims(cfg, "actor"))
    d, e, f, L, V = cfg.hidden_size, cfg.head_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    q, kv = cfg.num_heads * e, cfg.num_kv_heads * e
    matmul_params = L * (d * q + 2 * d * kv + q * d + 3 * d * f)
    fwd = float(ms.forward_flops(tokens=1, scored=1, sum_sq=0, causal_skip=True))
    assert fwd == 2 * matmul_params + 2 * d * V
    # 6N rule: training FLOPs per token ≈ 6 × params (within the share of norms/biases/embedding).
    st = setting(B=8, P=0, R=2)
    t, parts = S.train_stage(st, ms, busy=1, d=1, f=1, t=1, micro=1, remat="none")
    tokens = st.B * st.seq_tokens
    assert float(parts["flops"]) / tokens == pytest.approx(6 * (matmul_params + d * V), rel=0.02)
    assert 6 * cfg.num_params() / (float(parts["flops"]) / tokens) == pytest.approx(1.0, rel=0.12)


def test_kv_bytes_per_token_table():
    # 2 (K, V) · L · kv_heads · head_dim · 2 bytes (bf16): Qwen2.5-7B 28·4·128 -> 56 KiB,
    # Qwen2.5-32B 64·8·128 -> 256 KiB, Llama-3-70B 80·8·128 -> 320 KiB; Qwen3 (head_dim 128 whatever
    # D / H is) 0.6B 28·8·128 -> 112 KiB, 8B 36·8·128 -> 144 KiB, 32B 64·8·128 -> 256 KiB.
    table = [("qwen2-7b", 56), ("qwen2-32b", 256), ("llama3-70b", 320)]
    table += [("qwen3-0.6b", 112), ("qwen3-8b", 144), ("qwen3-32b", 256)]
    for preset, kib in table:
        ms = shape(preset, dtype="bfloat16")
        assert ms.kv_bytes_per_token == kib * 1024


# Qwen/Qwen3-*'s model cards: parameters and non-embedding parameters (billions, as printed there),
# layers, query heads and kv heads (GQA).
QWEN3_CARDS = {
    "qwen3-0.6b": ("0.6", "0.44", 28, 16, 8),
    "qwen3-1.7b": ("1.7", "1.4", 28, 16, 8),
    "qwen3-4b": ("4.0", "3.6", 36, 32, 8),
    "qwen3-8b": ("8.2", "6.95", 36, 32, 8),
    "qwen3-14b": ("14.8", "13.2", 40, 40, 8),
    "qwen3-32b": ("32.8", "31.2", 64, 64, 8),
}


@pytest.mark.parametrize("preset", sorted(QWEN3_CARDS))
def test_qwen3_presets_against_the_model_cards(preset):
    """What the planner prices for a Qwen3 preset: its parameter counts to the card's printed digits
    (independent of the preset's fields: a wrong width, head_dim or tying moves them)."""
    total, non_embedding, layers, heads, kv_heads = QWEN3_CARDS[preset]
    cfg = model_preset(preset)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (layers, heads, kv_heads)
    body = cfg.num_params(with_lm_head=False) - cfg.vocab_size * cfg.hidden_size  # no embedding, no lm_head
    for got, printed in ((cfg.num_params(), total), (body, non_embedding)):
        places = len(printed.split(".")[1])
        assert round(got / 1e9, places) == float(printed), (got, printed)
    assert shape(preset).num_params == cfg.num_params()


def test_train_state_memory_replicated_fsdp_tensor():
    ms = shape("qwen2-1.5b", param_dtype="float32")
    st = setting(B=64)
    n = ms.num_params
    # float32: params, m, v resident (12 B/param) + during the update the gradients and the new
    # m, v beside the old (rl/update.py's NaN guard): 6 copies = 24 B/param; plus a float32
    # gradient accumulator (4 B/param) with micro-batches > 1.
    assert ms.resident_state_bytes() == 12.0 * n
    assert float(ms.update_state_bytes(1)) == 12.0 * n and float(ms.update_state_bytes(4)) == 16.0 * n
    rep = float(S.train_memory(st, ms, d=8, f=1, t=1, micro=1, remat="full"))
    fsdp = float(S.train_memory(st, ms, d=1, f=8, t=1, micro=1, remat="full"))
    tp = float(S.train_memory(st, ms, d=1, f=1, t=8, micro=8, remat="full"))
    state = 24.0 * n
    act_rep = rep - state
    assert act_rep > 0
    # + FSDP gather buffers: two of the largest weight matrices (the MLP's D x F) in float32.
    assert fsdp - state / 8 == pytest.approx(act_rep + 2 * ms.D * ms.F * 4, rel=1e-6)
    assert tp - (state + 4.0 * n) / 8 < act_rep  # tensor parallelism also splits activations
    assert tp < rep


def test_activation_memory_remat_and_tensor_split():
    ms = shape("qwen2-1.5b", dtype="bfloat16")
    a, D, q, kv, F = 2, ms.D, ms.H * ms.E, ms.K * ms.E, ms.F
    none = float(ms.act_bytes_per_token_layer(1, "none"))
    assert none == a * (4 * D + 2 * q + 2 * kv + 3 * F)
    assert float(ms.act_bytes_per_token_layer(2, "none")) == a * (4 * D + (2 * q + 2 * kv + 3 * F) / 2)
    assert float(ms.act_bytes_per_token_layer(1, "full")) == a * D
    # Dense attention keeps f32 scores and probabilities: 8 bytes per head per context position.
    assert float(ms.act_bytes_per_token_layer(1, "none", 100)) == none + 8 * ms.H * 100


def test_decode_memory_bound_small_batch_compute_bound_large():
    st = setting(B=4096)
    ms = shape("qwen2-7b", dtype="bfloat16")
    hw = st.hw
    t1 = float(S.decode_step_time(st, ms, 1, 1, 1, 1))
    # Batch 1: the weights are read once per step at the memory bandwidth.
    w = ms.weight_bytes() / (hw.device.memory_bw * 0.85)
    assert t1 == pytest.approx(w + hw.efficiency.decode_step_s + ms.L * hw.efficiency.layer_s, rel=0.05)
    times = np.array([float(S.decode_step_time(st, ms, 1, 1, b, 1)) for b in (1, 8, 64, 2048, 4096)])
    assert times[1] / times[0] < 1.2  # memory-bound: 8x the batch costs almost nothing
    assert times[4] / times[3] == pytest.approx(2.0, rel=0.15)  # compute-bound: linear in batch
    # The crossover sits near peak/bandwidth: bf16 decode does 2 FLOPs per parameter per token and
    # reads 2 bytes per parameter per step, so ~989e12 / 4e12 ≈ 250 tokens per step on GH200.
    b = np.arange(16, 2048, 16)
    flops = ms.decode_flops(b, 1) / (hw.peak("bfloat16") * 0.78)
    cross = b[np.argmax(flops > ms.weight_bytes() / (hw.device.memory_bw * 0.85))]
    assert 150 <= cross <= 450


def test_decode_grows_with_context():
    st = setting()
    ms = shape("qwen2-7b", dtype="bfloat16")
    short = float(S.decode_step_time(st, ms, 1, 1, 64, 512))
    long = float(S.decode_step_time(st, ms, 1, 1, 64, 16384))
    kv = 64 * (16384 - 512) * ms.kv_bytes_per_token * st.hw.efficiency.kv_read_factor
    assert long - short == pytest.approx(kv / (st.hw.device.memory_bw * 0.85), rel=0.1)


def test_forward_roofline_and_fsdp_comm():
    st = setting(B=64, P=512, R=512)
    ms = shape("qwen2-7b", dtype="bfloat16", param_dtype="float32")
    t, parts = S.forward_stage(st, ms, busy=64, d=64, f=1, t=1, micro=1)
    flops = float(ms.forward_flops(1024, 512, 1024**2, True))
    assert float(parts["flops"]) == pytest.approx(flops)
    assert float(parts["compute"]) >= flops / st.hw.peak("bfloat16")
    _, p8 = S.forward_stage(st, ms, busy=64, d=8, f=8, t=1, micro=1)
    assert float(p8["comm"]) > 0 and float(parts["comm"]) == 0


def test_generation_tail_and_async():
    st = setting(B=64, P=128, R=4096)
    st = dataclasses.replace(st, dist=LengthDist(max_len=4096, min_len=64, median=512, sigma=1.0))
    ms = shape("qwen2-1.5b", dtype="bfloat16")
    sync, parts, finished_at, asy = S.generate_stage(st, ms, n_gen=8, t=[1], slots=[64], async_ks=(1,))
    lens = st.dist.lengths(64)
    # The synchronous stage lasts at least the longest response's decode steps at batch 1.
    floor = lens.max() * float(S.decode_step_time(st, ms, 1, 8, 1, st.P))
    assert sync[0] >= floor * 0.99
    # Completion curve: monotone, ending at the stage end.
    qs = [finished_at(q)[0] for q in (0.25, 0.5, 0.75, 1.0)]
    assert np.all(np.diff(qs) >= 0) and qs[-1] <= sync[0] + 1e-9
    assert asy[1][0] < sync[0]  # continuous admission hides the tail


def test_gen_schedule_continuous_batching():
    d = LengthDist(max_len=100, min_len=1, median=20, sigma=0.8)
    lens = d.lengths(32)
    full = gen_schedule(d, 32, 1, 32, 10)
    assert full.critical[0].total_steps == lens.max()
    assert full.critical[0].batch[0] == pytest.approx(32, rel=0.2)
    few = gen_schedule(d, 32, 1, 4, 10)
    assert few.critical[0].total_steps >= lens.sum() / 4
    # Σ over bins of steps × batch = Σ lengths (every token decoded once).
    for sch in (full, few):
        p = sch.critical[0]
        assert float(np.sum(p.steps * p.batch)) == pytest.approx(lens.sum())
    assert np.all(np.diff(full.finish_step) >= 0) and len(full.finish_step) == 32


def test_pass_weights_unrolled_vs_scanned_and_logits_split():
    # Unrolled layers (<= 4, models/): a forward holds one whole copy of the weights in its tensor
    # layout, W/t, with or without FSDP; a training step only under FSDP (the gathered model).
    # Scanned layers: FSDP gathers by mode plus the fitted copies of the shard. Hand counts.
    tiny = shape("tiny")  # 4 layers: unrolled
    assert not tiny.scanned and shape("tiny", num_layers=6).scanned
    W = tiny.num_params * 4.0
    assert float(tiny.pass_weight_bytes(1, 2, "matrix", 0.0, train=False)) == pytest.approx(W / 2)
    assert float(tiny.pass_weight_bytes(4, 2, "matrix", 0.0, train=False)) == pytest.approx(W / 2)
    assert float(tiny.pass_weight_bytes(1, 2, "matrix", 0.0, train=True)) == 0.0
    assert float(tiny.pass_weight_bytes(4, 1, "matrix", 0.0, train=True)) == pytest.approx(W)
    # ... and a second gathered copy when the step loops over micro-batches or recomputes (FSDP only)
    assert float(tiny.pass_weight_bytes(4, 2, "matrix", 0.0, train=True, looped=True)) == pytest.approx(W)
    assert float(tiny.pass_weight_bytes(1, 2, "matrix", 0.0, train=True, looped=True)) == 0.0
    deep = dataclasses.replace(tiny, scanned=True)
    d, f_, layer = deep.D, deep.F, deep.layer_params
    assert float(deep.pass_weight_bytes(1, 1, "layer", 0.0, train=True)) == 0.0
    assert float(deep.pass_weight_bytes(4, 2, "model", 0.0, train=False)) == pytest.approx(deep.L * layer * 4 / 2)
    assert float(deep.pass_weight_bytes(4, 1, "matrix", 0.5, train=False)) == pytest.approx(
        2 * max(d * deep.H * deep.E, d * f_) * 4 + 0.5 * W / 4
    )
    # The vocabulary is split over the tensor axis: a device holds V/t logits columns.
    assert float(tiny.logits_bytes(100, 4)) == pytest.approx(3 * 4 * 100 * tiny.V / 4)


def test_shared_host_collectives_and_decode_serialise():
    # On the CPU profile (8 devices sharing a host of `host_cores` cores) every device's collective
    # runs on the same cores: a forward's FSDP gathers cost busy/cores x one device's (overlap 0),
    # and a decode step adds compute and memory time instead of taking their max.
    from rpeg_jax.costmodel.comm import collective_time
    from rpeg_jax.costmodel.hardware import interp_eff

    st = setting("cpu", B=16, P=16, R=32)
    hw, ms = st.hw, shape("tiny")
    assert hw.shared_host and hw.efficiency.overlap == 0.0
    _, parts = S.forward_stage(st, ms, busy=8, d=1, f=8, t=1, micro=1)
    one = ms.L * collective_time(hw, "all_gather", ms.layer_params * ms.param_bytes_per, 8, 1)
    assert float(parts["comm"]) == pytest.approx(float(one) * 8 / hw.host_cores)
    b, ctx, busy = 4, 40, 8
    rate, bw = hw.peak(ms.dtype) / busy, hw.device.memory_bw / busy
    flops = float(ms.decode_flops(b, ctx))
    nbytes = (
        ms.weight_bytes()
        + b * ctx * ms.kv_bytes_per_token / min(1, ms.K) * hw.efficiency.kv_read_factor
        + b * ms.V * 4.0
    )
    comp = flops / (rate * float(interp_eff(hw.efficiency.matmul, 2.0 * b * ms.D * ms.F)))
    mem = nbytes / (bw * float(interp_eff(hw.efficiency.memory, nbytes * busy)))
    fixed = (hw.efficiency.decode_step_s + ms.L * hw.efficiency.decode_layer) * busy / hw.host_cores
    assert float(S.decode_step_time(st, ms, 1, busy, b, ctx)) == pytest.approx(comp + mem + fixed, rel=1e-9)
    gpu = dataclasses.replace(hw, shared_host=False)  # elsewhere: the roofline's max
    stg = dataclasses.replace(st, hw=gpu)
    fixed1 = hw.efficiency.decode_step_s + ms.L * hw.efficiency.decode_layer
    c1 = flops / (hw.peak(ms.dtype) * float(interp_eff(hw.efficiency.matmul, 2.0 * b * ms.D * ms.F)))
    m1 = nbytes / (hw.device.memory_bw * float(interp_eff(hw.efficiency.memory, nbytes)))
    assert float(S.decode_step_time(stg, ms, 1, busy, b, ctx)) == pytest.approx(max(c1, m1) + fixed1, rel=1e-9)


def test_shared_host_roofline_adds_and_fsdp_gathers_by_layer_loop():
    # Shared host: a layer kernel costs compute + memory (one CPU's GEMM of a few rows does not hide
    # its weight stream); elsewhere the max. FSDP in a training step: scanned layers gather every
    # layer forward and backward per micro-batch; unrolled ones gather the whole model once per
    # optimizer step (loop-invariant, held: pass_weight_bytes); gradients reduce-scatter per
    # micro-batch either way. Hand counts from collective_time.
    from rpeg_jax.costmodel.comm import collective_time
    from rpeg_jax.costmodel.hardware import interp_eff

    st = setting("cpu", B=16, P=16, R=32)
    hw = st.hw
    flops, nbytes, size = 3e9, 2e8, 1e7
    c = flops / (hw.peak("float32") * float(interp_eff(hw.efficiency.matmul, size)))
    m = nbytes / (hw.device.memory_bw * float(interp_eff(hw.efficiency.memory, nbytes)))
    assert float(S.roofline(hw, flops, nbytes, size, hw.peak("float32"), hw.device.memory_bw)) == pytest.approx(c + m)
    gpu = dataclasses.replace(hw, shared_host=False)
    assert float(S.roofline(gpu, flops, nbytes, size, hw.peak("float32"), hw.device.memory_bw)) == pytest.approx(
        max(c, m)
    )

    f = 4
    for scanned in (False, True):
        ms = dataclasses.replace(shape("tiny"), scanned=scanned)
        layer_p = ms.layer_params * ms.param_bytes_per
        ag = ms.L * float(collective_time(hw, "all_gather", layer_p, f, 1))
        rs = ms.L * float(collective_time(hw, "reduce_scatter", layer_p, f, 1))
        for micro in (1, 2):
            _, parts = S.train_stage(st, ms, busy=f, d=1, f=f, t=1, micro=micro, remat="none")
            gathers = 2 * micro if scanned else 1
            assert float(parts["comm"]) == pytest.approx((gathers * ag + micro * rs) * f / hw.host_cores), (
                scanned,
                micro,
            )


def test_group_prompt_counted_once_where_the_runtime_shares_it():
    # runtime/kernels.shared_prompt_groups runs a group's prompt once when every piece is whole
    # groups and the groups per piece split evenly over the batch devices: tokens per sequence
    # P/G + R instead of P + R, attention rows P²/G + R(P + R) instead of (P + R)². Hand counts.
    st = dataclasses.replace(setting("cpu", B=64, P=16, R=32), prompt_sharing=True)  # G = 8: 8 groups
    tok, sq = S.shared_tokens(st, d=np.array([1, 2, 8, 16]), f=1, pieces=1)
    shared_tok, shared_sq = 16 / 8 + 32, 16**2 / 8 + 32 * (16 + 32)
    assert tok.tolist() == pytest.approx([shared_tok, shared_tok, shared_tok, 48])  # 16 devices: half groups
    assert sq.tolist() == pytest.approx([shared_sq, shared_sq, shared_sq, 48**2])
    # the runtime counts the stage's whole mesh (kernels._devices): 8 groups over 2 x 1 x 8 = 16 devices
    tok, _ = S.shared_tokens(st, d=np.array([2, 2]), f=1, pieces=1, t=np.array([4, 8]))
    assert tok.tolist() == pytest.approx([shared_tok, 48])
    tok, _ = S.shared_tokens(st, 1, 1, pieces=16)  # 4 sequences per piece: not whole groups
    assert float(tok) == 48
    off = dataclasses.replace(st, prompt_sharing=False)
    assert float(S.shared_tokens(off, 1, 1, 1)[0]) == 48
    # ... and the training stage's FLOPs follow them
    ms = shape("tiny")
    _, on = S.train_stage(st, ms, busy=1, d=1, f=1, t=1, micro=1, remat="none")
    _, plain = S.train_stage(off, ms, busy=1, d=1, f=1, t=1, micro=1, remat="none")
    ratio = float(on["flops"]) / float(plain["flops"])
    lin = float(ms.forward_flops(64 * shared_tok, 64 * 32, 64 * shared_sq, st.causal_skip)) / float(
        ms.forward_flops(64 * 48, 64 * 32, 64 * 48**2, st.causal_skip)
    )
    assert ratio == pytest.approx(lin) and ratio < 0.85


def test_sampler_tensor_parallel_collectives_fitted_factor_and_shared_host_bytes():
    # Decode step on tensor t = 2 minus the same step on t = 1 (everything else equal except the
    # per-device work split) must be the TP term, by hand: decode_tp_factor x 2 all-reduces per
    # layer of the rows' hidden state, on a shared host priced per byte at link_bw (2(t-1)/t S / bw
    # + 2 log2(t) alpha, no message-size efficiency) x the devices busy (host_cores = 1 here).
    st = setting("cpu", B=192, P=16, R=6)
    hw0 = dataclasses.replace(st.hw, host_cores=1)
    hw = dataclasses.replace(hw0, efficiency=dataclasses.replace(hw0.efficiency, decode_tp_factor=7.0))
    ms, rows, busy = shape("tiny"), 192, 2
    S_b = rows * ms.D * 4.0
    ar = 2.0 * (2 - 1) / 2 * S_b / hw.node.link_bw + 2.0 * 1.0 * hw.node.latency_s
    want = 7.0 * 2.0 * ms.L * ar * busy
    st7, st1 = dataclasses.replace(st, hw=hw), dataclasses.replace(st, hw=hw0)
    got = float(S.decode_step_time(st7, ms, 2, busy, rows, 20)) - float(S.decode_step_time(st1, ms, 2, busy, rows, 20))
    assert got == pytest.approx(want - want / 7.0, rel=1e-9)
    assert float(S.sampler_tp_time(hw, ms, rows, 2)) == pytest.approx(7.0 * 2.0 * ms.L * ar, rel=1e-9)
    assert float(S.sampler_tp_time(hw, ms, rows, 1)) == 0.0
    # prefill carries the same term over its tokens (B/G prompts of P tokens)
    tok = (192 // 8) * 16
    d_pf = S._prefill_time(st7, ms, 2, busy, 192 // 8, 16) - S._prefill_time(st1, ms, 2, busy, 192 // 8, 16)
    ar_p = 2.0 * 0.5 * tok * ms.D * 4.0 / hw.node.link_bw + 2.0 * hw.node.latency_s
    assert d_pf == pytest.approx(6.0 * 2.0 * ms.L * ar_p * busy, rel=1e-9)
    # an accelerator keeps the size-dependent collective table (comm.collective_time)
    from rpeg_jax.costmodel.comm import collective_time

    gpu = load_hardware("h200", calibrated=False)
    assert float(S.sampler_tp_time(gpu, ms, rows, 2)) == pytest.approx(
        2.0 * ms.L * float(collective_time(gpu, "all_reduce", S_b, 2, 1)), rel=1e-9
    )


def test_generation_memory_whole_pages_and_cpu_chunk_working_set():
    # Hand count per device: weights / t + slots x whole pages of KV (ceil((P+R)/page) pages of
    # `page` tokens, kv heads split over min(t, K)) + gen_memory_factor x the gathered KV (CPU:
    # every layer's pages of every slot; accelerator: one layer's; both split like the pool)
    # + 2 float32 logits rows per slot.
    ms = shape("tiny")
    cpu = load_hardware("cpu", calibrated=False)
    cpu = dataclasses.replace(cpu, efficiency=dataclasses.replace(cpu.efficiency, gen_memory_factor=1.5))
    st = S.Setting(
        hw=cpu,
        B=64,
        P=16,
        R=40,
        G=8,
        dist=LengthDist.fixed(40),
        causal_skip=False,
        dense_scores=True,
        packing=False,
        budget_bytes=1e9,
        kv_replicated=True,
        page_size=16,
    )
    kv_tok = 2 * ms.L * ms.K * ms.E * 4  # K and V, float32
    tokens = 64  # 56 tokens -> 4 pages of 16
    t, slots = 2, 64
    want = ms.weight_bytes() / t + (1 + 1.5) * slots * tokens * kv_tok / min(t, ms.K) + slots * ms.V * 8.0
    assert float(S.generate_memory(st, ms, t, slots)) == pytest.approx(want, rel=1e-12)
    gpu = dataclasses.replace(st, hw=load_hardware("h200", calibrated=False), page_size=1)
    want_gpu = ms.weight_bytes() / t + slots * 56 * kv_tok / min(t, ms.K) * (1 + 1 / ms.L) + slots * ms.V * 8.0
    assert float(S.generate_memory(gpu, ms, t, slots)) == pytest.approx(want_gpu, rel=1e-12)
    # max_slots inverts the same count: the slots it returns fit, one more does not
    free = 3e7
    n = int(S.max_slots(st, ms, t, free))
    assert float(S.generate_memory(st, ms, t, n)) <= free < float(S.generate_memory(st, ms, t, n + 1))


def test_trainer_prices_the_runtime_length_bucket_sampler_the_decoded_steps():
    # runtime/rollout/layout.py pads the response window to a multiple of LENGTH_BUCKET (8) unless shapes
    # are fixed: max_new_tokens=12 trains on 16 columns, 6 on 8; the sampler still decodes 12 / 6.
    ms = shape("tiny")
    for R, padded in ((12, 16), (6, 8), (8, 8)):
        bucketed = setting("cpu", B=64, P=16, R=R, dense=True, length_bucket=8)
        plain = setting("cpu", B=64, P=16, R=padded, dense=True)
        assert bucketed.R_train == padded and bucketed.seq_tokens == 16 + padded
        assert bucketed.seq_scored == padded and bucketed.seq_sumsq == (16 + padded) ** 2
        # training and scoring passes: exactly the plain setting at the padded width
        assert float(S.train_stage(bucketed, ms, busy=1, d=1, f=1, t=1, micro=1, remat="none")[0]) == pytest.approx(
            float(S.train_stage(plain, ms, busy=1, d=1, f=1, t=1, micro=1, remat="none")[0]), rel=1e-12
        )
        assert float(S.forward_stage(bucketed, ms, busy=1, d=1, f=1, t=1, micro=1)[0]) == pytest.approx(
            float(S.forward_stage(plain, ms, busy=1, d=1, f=1, t=1, micro=1)[0]), rel=1e-12
        )
        # generation: R decode steps, as without the bucket
        unpadded = setting("cpu", B=64, P=16, R=R, dense=True)
        assert S.generate_stage(bucketed, ms, n_gen=1, t=[1], slots=[64])[0][0] == pytest.approx(
            S.generate_stage(unpadded, ms, n_gen=1, t=[1], slots=[64])[0][0], rel=1e-12
        )


def test_planner_setting_uses_the_length_bucket_unless_shapes_are_fixed():
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel.context import make_context

    hw = load_hardware("cpu", calibrated=False)
    st = make_context(load_config(None, ["rollout.max_new_tokens=12"]), 1, hw).st
    assert (st.R, st.R_train) == (12, 16)
    fixed = make_context(load_config(None, ["rollout.max_new_tokens=12", "pipeline.pieces=2"]), 1, hw).st
    assert (fixed.R, fixed.R_train) == (12, 12)  # runtime/setup.py: fixed_shapes when pieces > 1


@pytest.mark.parametrize("task,digits", [("reverse", 3), ("add", 5), ("sort", 9)])
def test_planner_prices_the_prompt_columns_the_runtime_pads_to(task, digits):
    """The model's P is what runtime/rollout/layout lays out: the longest tokenized prompt of the data,
    bucketed (not data.max_prompt_len); fixed shapes keep max_prompt_len; an override is bucketed."""
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel.context import make_context
    from rpeg_jax.data import CharTokenizer, make_records
    from rpeg_jax.shapes.buckets import length_bucket

    over = [
        f"data.task={task}",
        f"data.max_digits={digits}",
        "data.min_digits=1",
        "data.max_prompt_len=48",
        "data.num_examples=256",
    ]
    cfg = load_config(None, over)
    tok = CharTokenizer()
    longest = max(len([tok.bos_id] + tok.encode(r["prompt"])) for r in make_records(cfg.data, "train"))
    hw = load_hardware("cpu", calibrated=False)
    assert make_context(cfg, 1, hw).st.P == length_bucket(longest)
    assert make_context(load_config(None, over + ["pipeline.pieces=2"]), 1, hw).st.P == 48
    assert make_context(load_config(None, over + ["costmodel.prompt_len=17"]), 1, hw).st.P == 24
    with pytest.raises(Exception, match="prompt_len"):
        load_config(None, ["costmodel.prompt_len=0"])


def test_generation_prices_the_samplers_host_cost_per_sequence():
    """gen_seq_s adds B x gen_seq_s to a synchronous batch and to every steady-state (async) step,
    whatever the mesh: the sampler's Python work per sequence runs once, on the host."""
    ms = shape("tiny")
    base = setting("cpu", B=96, P=16, R=12, dense=True)
    hw = base.hw
    costly = dataclasses.replace(
        base, hw=dataclasses.replace(hw, efficiency=dataclasses.replace(hw.efficiency, gen_seq_s=4e-4))
    )
    for n, t, slots in ((1, 1, 96), (8, 1, 12), (4, 2, 48)):
        a = S.generate_stage(base, ms, n_gen=n, t=[t], slots=[slots], async_ks=(1,))
        b = S.generate_stage(costly, ms, n_gen=n, t=[t], slots=[slots], async_ks=(1,))
        assert b[0][0] - a[0][0] == pytest.approx(96 * 4e-4, rel=1e-9)
        assert b[3][1][0] - a[3][1][0] == pytest.approx(96 * 4e-4, rel=1e-9)


@pytest.mark.parametrize(
    "B,P,R,micro,devices",
    [(128, 16, 256, 1, 1), (128, 16, 256, 2, 1), (128, 16, 256, 4, 2), (64, 64, 128, 1, 1), (256, 8, 512, 8, 4)],
)
def test_packed_rows_are_the_runtimes_plan(B, P, R, micro, devices):
    """stages.packed_per_seq (what a packed pass computes per sequence) against the plan the
    runtime makes (rl/packing.update_plan on the same lengths in the rollout layout: prompt of P
    real tokens, response of its drawn length): rows N and scored positions K."""
    from rpeg_jax.rl import packing

    dist = LengthDist(max_len=R, min_len=4, median=24, sigma=1.0)
    st = dataclasses.replace(setting("cpu", B=B, P=P, R=R), dist=dist, packing=True)
    lens = dist.lengths(B)
    S_ = P + st.R_train
    seg = (np.arange(S_)[None, :] < (P + lens)[:, None]).astype(np.int32)
    plan = packing.update_plan(seg, st.R_train, epochs=1, minibatches=1, micro_batches=micro, devices=devices)
    b = B // micro
    rows, tokens = plan["seg_NxT"].shape[-2], plan["pred_K"].shape[-1]
    tok, sumsq, scored = S.packed_per_seq(st, b, devices)
    assert tok == pytest.approx(rows * S_ / b)
    assert sumsq == pytest.approx(rows * S_**2 / b)
    assert scored == pytest.approx(tokens / b)
    assert tok < S_  # a gain over the padded pass
    got, _, _ = S.pass_tokens(st, np.array([1, 1]), 1, np.array([micro, micro]), devices, packed=True)
    np.testing.assert_allclose(got, [rows * S_ / b] * 2)


def test_decode_kv_read_follows_the_attention():
    # rollout.attention resolving to "kernel" on a GPU profile (auto there) reads the KV pages in
    # place: decode moves the cached KV bytes once (kv_read_factor 1), gather the profile's factor
    # (2 on the GPU presets: the pages are copied, then read). Hand roofline of a memory-bound step.
    from rpeg_jax.config import load_config
    from rpeg_jax.costmodel.context import make_context
    from rpeg_jax.costmodel.hardware import interp_eff

    st, ms = setting("h200"), shape("tiny")
    hw = st.hw
    assert hw.efficiency.kv_read_factor == 2.0
    b, ctx = 64, 4096

    def hand(factor):
        nbytes = ms.weight_bytes() + b * ctx * ms.kv_bytes_per_token / min(1, ms.K) * factor + b * ms.V * 4.0
        comp = float(ms.decode_flops(b, ctx)) / (
            hw.peak(ms.dtype) * float(interp_eff(hw.efficiency.matmul, 2.0 * b * ms.D * ms.F))
        )
        mem = nbytes / (hw.device.memory_bw * float(interp_eff(hw.efficiency.memory, nbytes)))
        assert mem > comp  # memory-bound: the KV read shows in the step time
        return mem + hw.efficiency.decode_step_s + ms.L * hw.efficiency.decode_layer

    gather = float(S.decode_step_time(st, ms, 1, 1, b, ctx))
    kernel = float(S.decode_step_time(dataclasses.replace(st, kv_read="once"), ms, 1, 1, b, ctx))
    chunk = float(S.decode_step_time(dataclasses.replace(st, kv_read="chunk", chunk_steps=32), ms, 1, 1, b, ctx))
    assert gather == pytest.approx(hand(2.0), rel=1e-9) and kernel == pytest.approx(hand(1.0), rel=1e-9)
    # the chunk attention: pages copied once per chunk (read + write), the buffers read every step
    assert chunk == pytest.approx(hand(1.0 + 2.0 / 32), rel=1e-9)
    assert kernel < chunk < 0.75 * gather
    # What the planner sets from the run's config and the profile.
    cpu = load_hardware("cpu", calibrated=False)
    for attention, kind_hw, read, extra in [
        ("auto", hw, "once", []),
        ("auto", hw, "copy", ["rollout.page_size=8"]),  # the kernel's blocks do not fit: auto is gather
        ("kernel", hw, "once", []),
        ("gather", hw, "copy", []),
        ("blocked", hw, "copy", []),
        ("chunk", hw, "chunk", []),
        ("auto", cpu, "chunk", []),  # auto on a CPU is the chunk attention
        ("gather", cpu, "copy", []),
        ("kernel", cpu, "copy", []),  # the interpreter on a CPU: no GPU kernel
    ]:
        cfg = load_config(
            None,
            [f"rollout.attention={attention}"]
            + (["rollout.kernel_interpret=true"] if kind_hw is cpu and attention == "kernel" else [])
            + extra,
        )
        assert make_context(cfg, 8, kind_hw).st.kv_read == read, (attention, kind_hw.kind)
