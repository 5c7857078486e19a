"""Time and memory per device of each stage kind under a parallel layout (vectorised).

A layout is arrays over candidates: a training/forward stage runs on `n` devices as
data d × fsdp f × tensor t (tensor innermost), with `micro` micro-batches per optimizer step
and a remat mode; generation runs n/t replicas of t-way tensor parallelism with `slots`
concurrent sequences each. Times are rooflines with the profile's efficiencies:

    t_core   = max(FLOPs / (peak · eff_mm(matmul size)), bytes / (bw · eff_mem(bytes)))
               (shared host: the sum of the two, see `roofline`)
    t_stage  = t_core + exposed comm + optimizer + fixed overheads
    exposed  = tensor collectives + overlappable (fsdp/data) − overlap · min(overlappable, t_core)
    t_decode = Σ_bins steps · [max(compute(b, c), (W/t + b·c·KV/min(t,K)) / bw) + TP all-reduces + step cost]
               (shared host: compute + memory, not max: one CPU's kernels run one after another;
               b = all the engine's slots on a CPU, Setting.static_rows)

On a `shared_host` profile (the 8 forced CPU devices) a group's devices share one host's FLOP/s
and bandwidth, so per-device rates are divided by the devices busy at once; their collectives are
memory copies and reductions by the same cores, so a collective's time is multiplied by the
devices busy at once beyond the cores (`ovh`), like the fixed per-layer costs.

Callers: costmodel/planner.py (thousands of layouts at once), bench/costmodel_validate.py, tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rpeg_jax.costmodel.comm import collective_time, reshard_time, transfer_time
from rpeg_jax.costmodel.hardware import HardwareProfile, interp_eff
from rpeg_jax.costmodel.lengths import Admission, LengthDist, admission, gen_schedule
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.shapes.buckets import MIN_TABLE_WIDTH, round_up
from rpeg_jax.shapes.packing import first_fit_decreasing, packed_shape, prompt_groups_fit

REMAT_EXTRA_FWD = {"none": 0.0, "dots": 0.0, "full": 1.0}  # extra forwards of the layers in backward


@dataclass(frozen=True)
class Setting:
    """What does not vary over candidate plans: hardware, batch sizes, lengths, kernels."""

    hw: HardwareProfile
    B: int  # sequences per step
    P: int  # prompt length (padded)
    R: int  # max response length (padded)
    G: int  # group size (prompts share their KV pages across a group)
    dist: LengthDist
    causal_skip: bool  # attention kernel skips the masked half (flash) or not (dense)
    dense_scores: bool  # attention materialises [T, T] scores (dense) and saves them
    packing: bool  # training passes pack sequences (train.pack_sequences: the updates and scoring forwards)
    budget_bytes: float  # memory per device plans may use
    kv_replicated: bool = False  # the sampler's page pool is replicated over the generation data axis
    prompt_sharing: bool = False  # training passes run a group's prompt once (models/prefix.py) where
    #   the layout allows it (`shared_tokens`)
    page_size: int = 1  # tokens per KV page of the sampler (rollout.page_size): a sequence holds whole pages
    length_bucket: int = 1  # the runtime pads the rollout's response window to a multiple of this
    #   (shapes/buckets.LENGTH_BUCKET, unless shapes are fixed): the trainer computes on R_train columns.
    #   Under continuous admission the runtime's window is max_new_tokens itself (runtime/rollout/layout.lay_out),
    #   R_train its bucket: the same unless max_new_tokens is not a multiple of 8 (priced as step
    #   admission: the Setting is shared by candidates of both admissions)
    chunk_steps: int = 64  # rollout.chunk_steps: decode steps per chunk at most (continuous admission)
    min_chunk_steps: int = 8  # rollout.min_chunk_steps: a chunk ends early (to admit) only after these
    table_growth: float = 2.0  # rollout.table_width_growth: the sampler's page-table width buckets
    recompute_kv: bool = False  # continuous admission with rollout.on_weight_update=recompute: the KV of
    #   the sequences in flight is rebuilt at each weight update
    kv_read: str = "copy"  # how the sampler's decode attention reads the cached KV (planner.kv_read_of):
    #   "copy": the profile's kv_read_factor per step (gather / blocked copy the pages, then read the
    #   copy); "once": in place, 1 per step (rollout.attention resolving to "kernel" on a GPU profile:
    #   sampling/kernel_attention.py); "chunk": the chunk attention (auto on a CPU,
    #   sampling/chunk_attention.py) copies the pages into dense buffers once per chunk of
    #   chunk_steps decode steps and reads the buffers once per step: 1 + 2 / chunk_steps
    static_rows: bool = False  # a decode step costs what all its slots cost, busy or not: the sampler's
    #   decode program always runs max_slots rows, and on a CPU (planner: hw.kind == "cpu") their work
    #   is the step's cost (R2, 2026-12-01: ~23 ms per step at occupancy 0.16 and ~26 ms at 0.89); on
    #   accelerators the step is priced by its busy rows (memory-bound: weights + the busy rows' KV)

    @property
    def R_train(self) -> int:
        """Response columns of the trainer's batch: R rounded up to the runtime's length bucket
        (max_new_tokens=12 trains on 16 columns, 6 on 8; the sampler still decodes R steps)."""
        return round_up(self.R, self.length_bucket)

    @property
    def seq_tokens(self) -> float:
        """Tokens per sequence of a padded pass (without train.pack_sequences)."""
        return self.P + self.R_train

    @property
    def seq_sumsq(self) -> float:
        return float((self.P + self.R_train) ** 2)

    @property
    def seq_scored(self) -> float:
        """Positions with logits per sequence (the response window)."""
        return float(self.R_train)


def packed_per_seq(st: Setting, b: int, devices: int) -> tuple[float, float, float]:
    """(tokens computed, Σ context² of attention, scored positions) per sequence of an update that
    packs its micro-batches of b sequences (train.pack_sequences, rl/packing.py): every
    micro-batch runs as N rows of S = P + R_train columns, N the most any micro-batch of the
    step needs (the sample of st.dist split into strided micro-batches, each packed
    first-fit-decreasing), rounded up as shapes/packing.packed_shape rounds the runtime's: all
    N·S slots are computed, and the dense attention over a packed row is S² whatever its
    segments. K scored positions: the most real response tokens of a micro-batch, rounded up
    the same way."""
    b = max(int(b), 1)
    S = st.P + st.R_train
    n = max(int(st.B // b), 1) * b
    lens = st.dist.lengths(n).reshape(b, -1).T  # strided pieces, as rl/layout.split_tree splits
    rows_needed = max(len(first_fit_decreasing(st.P + piece, S)) for piece in lens)
    rows, scored = packed_shape(rows_needed, int(lens.sum(axis=1).max()), b, st.R_train, devices)
    return rows * S / b, rows * float(S) ** 2 / b, scored / b


def pass_tokens(st: Setting, d, f, pieces, t=1, packed: bool = False):
    """(tokens, Σ context², scored positions) per sequence of a training/scoring pass over `pieces`
    micro-batches on a d x f x t mesh: packed (an update under train.pack_sequences: no prompt
    sharing there) or padded (`shared_tokens`)."""
    d, f, pieces, t = (np.asarray(x, np.float64) for x in (d, f, pieces, t))
    if not packed:
        tok, sq = shared_tokens(st, d, f, pieces, t)
        return tok, sq, st.seq_scored + 0.0 * tok
    d, f, pieces, t = np.broadcast_arrays(d, f, pieces, t)
    keys = np.stack([np.ravel(st.B / pieces), np.ravel(d * f * t)], axis=1)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    vals = np.array([packed_per_seq(st, int(round(bb)), int(round(dv))) for bb, dv in uniq])
    out = vals[np.ravel(inv)].reshape(*d.shape, 3)
    return out[..., 0], out[..., 1], out[..., 2]


def shared_tokens(st: Setting, d, f, pieces, t=1):
    """(tokens, Σ context² for attention) per sequence of a training/scoring pass over `pieces`
    micro-batches on a d x f x t mesh. With `prompt_sharing` the runtime runs a GRPO group's prompt
    once (runtime/kernels.shared_prompt_groups: G >= 2, every piece whole groups, groups per piece
    a multiple of the stage's devices, which the runtime counts as the whole mesh d·f·t
    (kernels._devices)): a sequence then carries P/G prompt tokens instead of P, and the prompt's
    P² attention rows once per group; its response rows still see the prompt."""
    d, f, pieces, t = (np.asarray(x, np.float64) for x in (d, f, pieces, t))
    tok, sq = st.seq_tokens, st.seq_sumsq
    if not st.prompt_sharing or st.G < 2 or st.R_train < 2:  # the rollout's response columns, as the runtime
        return tok + 0.0 * d, sq + 0.0 * d
    ok = prompt_groups_fit(st.B, st.G, pieces.astype(np.int64), (d * f * t).astype(np.int64))
    # prompt rows: P x P once per group (were P x (P + response)); response rows unchanged
    return (np.where(ok, tok - st.P * (1.0 - 1.0 / st.G), tok), np.where(ok, sq - st.P * tok + st.P**2 / st.G, sq))


def rates(hw: HardwareProfile, dtype: str, busy):
    """(FLOP/s, bytes/s, overhead multiplier) per device when `busy` devices work at once.

    Shared host: the devices split the host's rates, and beyond `host_cores` device programs the
    host loses throughput to their contention (threads time-sliced over the cores, caches
    thrashed): total rate × (host_cores / busy)^contention (fitted; 0 = none)."""
    busy = np.asarray(busy, np.float64)
    if hw.shared_host and hw.process_hosts and hw.local_devices:  # a group of whole processes: each its own cores
        busy = np.minimum(busy, float(hw.local_devices))
    if hw.shared_host:
        share = np.maximum(busy, 1.0)
        loss = np.maximum(busy / hw.host_cores, 1.0) ** hw.efficiency.contention
        return (
            hw.peak(dtype) / share / loss,
            hw.device.memory_bw / share / loss,
            np.maximum(busy / hw.host_cores, 1.0),
        )
    one = np.ones_like(busy)
    return hw.peak(dtype) * one, hw.device.memory_bw * one, one


def mm_eff(hw: HardwareProfile, mm_size, trainer: bool = False):
    """Fraction of peak a matmul of `mm_size` FLOPs reaches: the profile's table, its size
    dependence scaled by the fitted `matmul_size_exponent` (log-log: eff^exponent). In the
    trainer's passes (`trainer`: updates and scoring forwards) at most the profile's
    train_matmul_cap: what real trainers reach end to end (configs/hardware/*.yaml cite the MFU
    figures), below the isolated-GEMM table."""
    eff = interp_eff(hw.efficiency.matmul, mm_size) ** hw.efficiency.matmul_size_exponent
    return np.minimum(eff, hw.efficiency.matmul_cap) if trainer else eff


def mem_time(hw: HardwareProfile, nbytes, bw, busy=1.0):
    """Seconds to stream `nbytes` per device. The efficiency is looked up by the working set of
    the whole host on a shared-host profile (8 CPU devices streaming 10 MB each miss the caches
    that one device's 10 MB would hit)."""
    ws = np.asarray(busy, np.float64) if hw.shared_host else 1.0
    return nbytes / (bw * interp_eff(hw.efficiency.memory, np.asarray(nbytes, np.float64) * ws))


def roofline(hw: HardwareProfile, flops, nbytes, mm_size, rate, bw, busy=1.0, trainer: bool = False):
    """max(compute, memory) on an accelerator. On a shared host (one CPU's cores run every
    device's kernels) the two ADD, as in the decode step: a CPU GEMM of a few dozen rows does not
    hide streaming its weights behind its FLOPs, and with 8 replicas of the weights (data-parallel
    meshes) the stream leaves the last-level cache. On the CPU calibration points of 2026-11-30
    (bench/NOTES.md, "Cost model") the sum instead of the max took forward validation MAPE from
    18.9% to 15.1% and train from 13.3% to 11.5%, and the 2-fold check (fit on validation, predict
    calibration) improved the same way."""
    t_c = flops / (rate * mm_eff(hw, mm_size, trainer))
    t_m = mem_time(hw, nbytes, bw, busy)
    return t_c + t_m if hw.shared_host else np.maximum(t_c, t_m)


def layer_core(hw: HardwareProfile, flops, w_bytes, ew_bytes, mm_size, rate, bw, busy=1.0, trainer: bool = False):
    """(seconds, matmul part, elementwise part) of the layers' kernels: matmuls are a roofline of
    their FLOPs and weight reads; the elementwise kernels between them (norms, RoPE, softmax,
    SwiGLU, residuals) are separate memory-bound kernels, so their time adds (× the profile's
    fitted elementwise_factor). `trainer`: a pass of the trainer (mm_eff's cap applies)."""
    mm = roofline(hw, flops, w_bytes, mm_size, rate, bw, busy, trainer)
    ew = hw.efficiency.elementwise_factor * mem_time(hw, ew_bytes, bw, busy)
    return mm + ew, mm, ew


def elementwise_bytes(st: Setting, ms: ModelShape, t, tokens):
    """Activation bytes written and read once by a forward's elementwise kernels."""
    dense_ctx = st.P + st.R_train if st.dense_scores else 0.0
    return 2.0 * ms.L * tokens * ms.act_bytes_per_token_layer(t, "none", dense_ctx)


def _exposed(hw: HardwareProfile, core, overlappable, serial):
    return serial + overlappable - hw.efficiency.overlap * np.minimum(overlappable, core)


def train_stage(
    st: Setting,
    ms: ModelShape,
    *,
    busy,
    d,
    f,
    t,
    micro,
    remat: str,
    epochs: int = 1,
    minibatches: int = 1,
    heads: int = 1,
    e=1,
):
    """(seconds, parts dict) of forward + backward + optimizer over the batch on one layout.
    `e`: the expert degree (a mixture's experts over the fsdp axis, `expert_a2a_time`)."""
    hw = st.hw
    d, f, t, micro = (np.asarray(x, np.float64) for x in (d, f, t, micro))
    seqs = st.B / (d * f)  # sequences per device per epoch
    n_mb = minibatches * micro
    seq_tok, seq_sq, scored = pass_tokens(st, d, f, n_mb, t, packed=st.packing)
    tok_mb = seqs * seq_tok / n_mb
    fwd = ms.forward_flops(seqs * seq_tok, seqs * scored * heads, seqs * seq_sq, st.causal_skip) / t
    rate, bw, ovh = rates(hw, ms.dtype, busy)
    # One forward's kernels; the backward does twice the work at the profile's backward_factor
    # (1 on GPUs; more where transposed matmuls and weight-gradient reductions run slower), and
    # full remat adds one more forward of the layers.
    f_core, f_mm, f_ew = layer_core(
        hw,
        fwd,
        n_mb * ms.weight_bytes() / t,
        elementwise_bytes(st, ms, t, seqs * seq_tok),
        ms.mm_size(tok_mb, t, e),
        rate,
        bw,
        busy,
        trainer=True,
    )
    # LoRA (ms.adapters): the backward still runs through the frozen weights to the activations
    # (dx) but forms no weight gradient for them: one forward's work instead of two (the adapters'
    # own products, rank r, are not counted, as in shapes/flops)
    bwd = 1.0 if ms.adapters else 2.0
    passes = 1.0 + REMAT_EXTRA_FWD[remat] + bwd * hw.efficiency.backward_factor
    flops = epochs * (1.0 + bwd + REMAT_EXTRA_FWD[remat]) * fwd
    core, mm, ewt = epochs * passes * f_core, epochs * passes * f_mm, epochs * passes * f_ew
    # Collectives per micro-batch: FSDP gathers each layer twice (forward, backward) and
    # reduce-scatters its gradient; TP all-reduces 2 activations per layer per direction. Mixed
    # precision gathers the weights and reduces the gradients in the compute dtype
    # (ModelShape.gather_bytes_per / grad_bytes_per).
    layer_p = ms.gathered_layer_params(e) if ms.X else ms.layer_params  # expert parallelism: experts stay put
    gather = ms.L * collective_time(hw, "all_gather", layer_p * ms.gather_bytes_per / t, f, t)
    grad_p = ms.adapters / ms.L if ms.adapters else layer_p  # LoRA: the adapters' gradients only
    scatter = ms.L * collective_time(hw, "reduce_scatter", grad_p * ms.grad_bytes_per / t, f, t)
    n_tp = 4.0 + (2.0 if remat == "full" else 0.0)
    tp = n_tp * ms.L * collective_time(hw, "all_reduce", tok_mb * ms.D * ms.act_bytes_per, t, 1)
    if ms.X:  # the expert-parallel dispatch and combine: on the critical path, like the TP all-reduces
        tp = tp + expert_a2a_time(hw, ms, tok_mb, e, t, backward=True, remat=remat)
    dp = collective_time(hw, "all_reduce", ms.trained_params * ms.grad_bytes_per / (f * t), d, f * t)
    # Scanned layers gather each layer inside the loop, forward and backward, per micro-batch.
    # Unrolled layers: the whole model is gathered once per optimizer step and held (the gather
    # is loop-invariant, XLA hoists it out of the micro-batch loop; memory: pass_weight_bytes).
    fsdp = np.where(ms.scanned, 2.0 * n_mb, minibatches) * gather + n_mb * scatter
    fsdp, tp, dp = fsdp * ovh, tp * ovh, dp * ovh  # shared host: every device's copies on the same cores
    overl = epochs * (fsdp + minibatches * dp)
    comm = _exposed(hw, core, overl, epochs * n_mb * tp)
    opt_bytes = hw.efficiency.update_streams * ms.trained_params * ms.param_bytes_per / (f * t)
    opt = epochs * minibatches * mem_time(hw, opt_bytes, bw, busy)
    over = epochs * (minibatches * hw.efficiency.dispatch_s + passes * n_mb * ms.L * hw.efficiency.layer_s * ovh)
    total = core + comm + opt + over
    return total, {
        "compute": core,
        "matmul": mm,
        "elementwise": ewt,
        "comm": comm,
        "optimizer": opt,
        "overhead": over,
        "flops": flops,
        "forward_core": epochs * f_core,
        "passes": passes,
    }


def expert_a2a_time(hw: HardwareProfile, ms: ModelShape, tokens, e, t, backward: bool, remat: str = "none"):
    """Seconds of a pass's expert-parallel all-to-alls over `tokens` tokens per device (a
    micro-batch) with expert degree `e` (the fsdp axis, stride t: tensor is innermost), per sparse
    layer (models/moe.py _dispatched_experts): forward, the dispatch (rows of D + an expert id) and
    the combine; backward (`backward`), their transposes (two all-to-alls of rows of D); full remat,
    the forward's two again. 0 for e <= 1."""
    dispatch = collective_time(hw, "all_to_all", ms.a2a_bytes(tokens, e, ids=True), e, t)
    combine = collective_time(hw, "all_to_all", ms.a2a_bytes(tokens, e), e, t)
    fwd = dispatch + combine
    n_fwd = (2.0 if remat == "full" else 1.0) if backward else 1.0
    total = n_fwd * fwd + (2.0 * combine if backward else 0.0)
    return np.where(np.asarray(e) > 1, ms.Ls * total, 0.0)


def train_memory(st: Setting, ms: ModelShape, *, d, f, t, micro, remat: str, minibatches: int = 1, e=1):
    """Peak bytes per device of a training stage: resident state + update buffers + activations."""
    d, f, t, micro = (np.asarray(x, np.float64) for x in (d, f, t, micro))
    seqs_mb = st.B / (d * f) / (minibatches * micro)
    seq_tok, _, scored = pass_tokens(st, d, f, minibatches * micro, t, packed=st.packing)
    tok_mb = seqs_mb * seq_tok
    dense_ctx = st.P + st.R_train if st.dense_scores else 0.0
    eff = st.hw.efficiency
    act = ms.L * tok_mb * ms.act_bytes_per_token_layer(t, remat, dense_ctx, e=e)
    if remat != "none":  # one layer's full working set while it is recomputed
        act = act + tok_mb * ms.act_bytes_per_token_layer(t, "none", dense_ctx, e=e)
    weights = ms.pass_weight_bytes(
        f, t, eff.fsdp_gather, eff.weight_copies, train=True, looped=(micro > 1) | (remat != "none"), e=e
    )
    logits = ms.logits_bytes(seqs_mb * scored, t)
    state = (ms.resident_state_bytes() + ms.update_state_bytes(micro)) / (f * t)
    return state + eff.act_memory_factor * (act + logits) + weights


def forward_stage(st: Setting, ms: ModelShape, *, busy, d, f, t, micro, heads: int = 1, e=1):
    """(seconds, parts) of one forward over the batch (logprobs and/or values); `e` the expert
    degree (train_stage)."""
    hw = st.hw
    d, f, t, micro = (np.asarray(x, np.float64) for x in (d, f, t, micro))
    seqs = st.B / (d * f)
    seq_tok, seq_sq, scored = pass_tokens(st, d, f, micro, t, packed=st.packing)
    tok_mb = seqs * seq_tok / micro
    flops = ms.forward_flops(seqs * seq_tok, seqs * scored * heads, seqs * seq_sq, st.causal_skip) / t
    rate, bw, ovh = rates(hw, ms.dtype, busy)
    ew = elementwise_bytes(st, ms, t, seqs * seq_tok)
    core, mm, ewt = layer_core(
        hw, flops, micro * ms.weight_bytes() / t, ew, ms.mm_size(tok_mb, t, e), rate, bw, busy, trainer=True
    )
    layer_p = (ms.gathered_layer_params(e) if ms.X else ms.layer_params) * ms.gather_bytes_per / t
    fsdp = (micro if ms.scanned else 1) * ms.L * collective_time(hw, "all_gather", layer_p, f, t)
    tp = micro * 2.0 * ms.L * collective_time(hw, "all_reduce", tok_mb * ms.D * ms.act_bytes_per, t, 1)
    if ms.X:
        tp = tp + micro * expert_a2a_time(hw, ms, tok_mb, e, t, backward=False)
    comm = _exposed(hw, core, fsdp * ovh, tp * ovh)
    over = hw.efficiency.dispatch_s + micro * ms.L * hw.efficiency.layer_s * ovh
    return core + comm + over, {
        "compute": core,
        "matmul": mm,
        "elementwise": ewt,
        "comm": comm,
        "overhead": over,
        "flops": flops,
    }


def forward_memory(st: Setting, ms: ModelShape, *, d, f, t, micro, e=1):
    """Transient bytes per device of a forward (weights are counted by the caller)."""
    d, f, t, micro = (np.asarray(x, np.float64) for x in (d, f, t, micro))
    seqs_mb = st.B / (d * f) / micro
    seq_tok, _, scored = pass_tokens(st, d, f, micro, t, packed=st.packing)
    tok_mb = seqs_mb * seq_tok
    dense_ctx = st.P + st.R_train if st.dense_scores else 0.0
    eff = st.hw.efficiency
    live = tok_mb * ms.act_bytes_per_token_layer(t, "none", dense_ctx, score_arrays=1, e=e)  # one layer's
    weights = ms.pass_weight_bytes(f, t, eff.fsdp_gather, eff.weight_copies, train=False, e=e)
    return eff.fwd_act_memory_factor * (live + ms.logits_bytes(seqs_mb * scored, t)) + weights


def kv_bytes_per_seq(st: Setting, ms: ModelShape, t):
    """KV pages one sequence holds at the maximum length (whole pages), per device of its replica."""
    page = max(int(st.page_size), 1)
    return -(-(st.P + st.R) // page) * page * ms.kv_bytes_per_token / ms.kv_shards(t)


def generate_memory(st: Setting, ms: ModelShape, t, slots, reps=1):
    """Bytes per device of generation: weights in the generation layout, KV pages, working set.
    `slots` per replica; with a replicated page pool (`st.kv_replicated`, the sampler today) every
    device of the group holds the pages of all `reps` replicas. The working set is the KV gathered
    to dense buffers x the fitted gen_memory_factor: one layer's pages (gather attention), or on a
    CPU every layer's pages of every slot (the "chunk" attention, sampling/chunk_attention.gather_chunk),
    split over `tensor` like the pool (since d163566; before it the decode programs at tensor 2
    held them whole on each device)."""
    t, slots = np.asarray(t, np.float64), np.asarray(slots, np.float64)
    held = slots * (np.asarray(reps, np.float64) if st.kv_replicated else 1.0)
    kv = held * kv_bytes_per_seq(st, ms, t)
    if st.hw.kind == "cpu":
        gathered = slots * kv_bytes_per_seq(st, ms, t)
    else:
        gathered = slots * kv_bytes_per_seq(st, ms, t) / ms.L
    logits = slots * ms.V * 4.0 * 2.0
    return ms.weight_bytes() / t + kv + st.hw.efficiency.gen_memory_factor * gathered + logits


def max_slots(st: Setting, ms: ModelShape, t, free_bytes, reps=1):
    """Concurrent sequences per replica that fit in `free_bytes` per device (after weights)."""
    t = np.asarray(t, np.float64)
    held = np.asarray(reps, np.float64) if st.kv_replicated else 1.0
    work = kv_bytes_per_seq(st, ms, t) / (1.0 if st.hw.kind == "cpu" else ms.L)
    per = kv_bytes_per_seq(st, ms, t) * held + st.hw.efficiency.gen_memory_factor * work + ms.V * 8.0
    return np.floor(np.maximum(free_bytes - ms.weight_bytes() / t, 0.0) / per)


def kv_read_factor(st: Setting) -> float:
    """KV bytes a decode step moves per cached byte (Setting.kv_read)."""
    if st.kv_read == "once":
        return 1.0
    if st.kv_read == "chunk":  # the buffers read every step; the pages read and the buffers written per chunk
        return 1.0 + 2.0 / max(st.chunk_steps, 1)
    return st.hw.efficiency.kv_read_factor


def decode_step_time(st: Setting, ms: ModelShape, t, busy, batch, ctx):
    """Seconds of one decode step per replica with `batch` active sequences of context `ctx`."""
    hw = st.hw
    t = np.asarray(t, np.float64)
    rate, bw, ovh = rates(hw, ms.dtype, busy)
    flops = ms.decode_flops(batch, ctx) / t
    kv = batch * ctx * ms.kv_bytes_per_token / ms.kv_shards(t) * kv_read_factor(st)
    nbytes = ms.decode_weight_bytes(batch) / t + kv + batch * ms.V * 4.0  # a mixture: the experts touched
    if hw.shared_host:  # a CPU's decode kernels (small GEMMs, page gathers, softmax) run one after
        # another on the same cores: streaming the weights and KV does not hide behind the compute
        core = flops / (rate * mm_eff(hw, ms.mm_size(batch, t)))
        if hw.efficiency.kv_attend_bw:  # the attention's KV at its measured rate (the host's share
            # of it, as `rates` shares the memory bandwidth), the rest streamed
            kv_bw = hw.efficiency.kv_attend_bw * bw / hw.device.memory_bw
            core = core + mem_time(hw, nbytes - kv, bw, busy) + kv / kv_bw
        else:
            core = core + mem_time(hw, nbytes, bw, busy)
    else:
        core = roofline(hw, flops, nbytes, ms.mm_size(batch, t), rate, bw, busy)
    tp = sampler_tp_time(hw, ms, batch, t) * ovh
    return core + tp + hw.efficiency.decode_step_s * ovh + ms.L * hw.efficiency.decode_layer * ovh


def sampler_tp_time(hw: HardwareProfile, ms: ModelShape, rows, t):
    """Tensor-parallel collectives of one sampler pass over `rows` tokens: 2 all-reduces of the
    hidden state per layer (Megatron), × the fitted decode_tp_factor. The CPU sampler's fused
    q/k/v and gate/up products (sampling/forward.py) split their outputs off shard boundaries, so
    XLA also permutes them every layer (decode HLO of model T at 192 slots, tensor 2: 9 all-reduces
    plus 20 collective-permutes per step, ~3x the bytes), and the decode program's CPU time doubled
    from tensor 1 to 2 (155 -> 322 ms) where 2 all-reduces per layer priced +20%."""
    if hw.shared_host:  # in-process copies and reductions: per byte, no message-size efficiency
        t = np.asarray(t, np.float64)
        nbytes = rows * ms.D * ms.act_bytes_per
        ar = np.where(
            t > 1,
            2.0 * (t - 1.0) / t * nbytes / hw.node.link_bw + 2.0 * np.log2(np.maximum(t, 2.0)) * hw.node.latency_s,
            0.0,
        )
    else:
        ar = collective_time(hw, "all_reduce", rows * ms.D * ms.act_bytes_per, t, 1)
    return hw.efficiency.decode_tp_factor * 2.0 * ms.L * ar


SLOT_FACTORS = (1.0, 1.5, 2.0, 3.0)  # continuous admission: slots tried, x one batch per replica


def generate_stage(st: Setting, ms: ModelShape, *, n_gen: int, t, slots, async_ks=(), recompute: bool = False):
    """Generation on `n_gen` devices as n_gen/t replicas with `slots` sequences each.

    Returns (seconds, parts, finished_at, continuous_seconds):
      seconds: one synchronous batch (rollout.admission=step); the slowest replica's
        Σ_bins steps · t_step plus prefill, plus the sampler's host cost per sequence (B · gen_seq_s;
        fitted, 0 on the accelerator presets).
      finished_at(q): per candidate, when a fraction q of the batch has finished (streamed pieces).
      continuous_seconds[k]: steady-state seconds per step with rollout.admission=continuous under
        staleness k ≥ 1 (`continuous_step`), at the best slot count up to `slots`; its slot count
        per replica is parts[f"slots_k{k}"]. `recompute`: the KV in flight is rebuilt at every weight
        update (rollout.on_weight_update=recompute; also st.recompute_kv)."""
    t = np.atleast_1d(np.asarray(t, np.int64))
    slots = np.atleast_1d(np.asarray(slots, np.int64))
    t, slots = np.broadcast_arrays(t, slots)
    reps = np.maximum(n_gen // t, 1)
    total, decode, prefill = np.zeros(t.shape), np.zeros(t.shape), np.zeros(t.shape)
    curves: list = [None] * len(t)
    for ti, ri, si in set(zip(t.tolist(), reps.tolist(), slots.tolist())):
        idx = np.nonzero((t == ti) & (reps == ri) & (slots == si))[0]
        ni = -(-st.B // ri)
        sched = gen_schedule(st.dist, st.B, int(ri), int(max(si, 1)), st.P)
        rows = [float(min(si, ni)) if st.static_rows else p.batch for p in sched.critical]
        per_bin = [p.steps * decode_step_time(st, ms, ti, n_gen, b, p.ctx) for p, b in zip(sched.critical, rows)]
        w = int(np.argmax([b.sum() for b in per_bin]))
        pf = _prefill_time(st, ms, ti, n_gen, -(-ni // st.G), st.P)
        decode[idx], prefill[idx] = per_bin[w].sum(), pf
        total[idx] = pf + per_bin[w].sum()
        cum = np.concatenate([[0.0], np.cumsum(per_bin[w])]) + pf
        for i in idx:
            curves[i] = (sched.finish_step, sched.critical[w].bin_edges, cum)
    host = st.B * st.hw.efficiency.gen_seq_s  # the sampler's host work per sequence (admission, pages, results)
    total = total + st.hw.efficiency.dispatch_s + host
    asy, best = continuous_stage(st, ms, n_gen=n_gen, t=t, slots=slots, ks=async_ks, recompute=recompute)

    def finished_at(q: float) -> np.ndarray:
        out = np.empty(len(t))
        for i, (fin, edges, cum) in enumerate(curves):
            step = fin[min(len(fin) - 1, max(0, int(np.ceil(q * len(fin))) - 1))]
            out[i] = np.interp(step, edges, cum)
        return out

    parts = {"prefill": prefill, "decode": decode, **{f"slots_k{k}": v for k, v in best.items()}}
    return total, parts, finished_at, asy


def continuous_stage(
    st: Setting, ms: ModelShape, *, n_gen: int, t, slots, ks, recompute: bool = False, exact: bool = False
):
    """({k: seconds per step}, {k: slots per replica}) of generation under continuous admission at
    staleness k, per candidate: the best slot count up to `slots` (continuous_slots; `exact`: `slots`
    itself, a run's rollout.max_slots) of continuous_step, plus the sampler's host cost per
    sequence (B · gen_seq_s)."""
    t, slots = np.broadcast_arrays(np.atleast_1d(np.asarray(t, np.int64)), np.atleast_1d(np.asarray(slots, np.int64)))
    reps = np.maximum(n_gen // t, 1)
    secs = {k: np.zeros(t.shape) for k in ks}
    best = {k: np.zeros(t.shape, np.int64) for k in ks}
    host = st.B * st.hw.efficiency.gen_seq_s
    for ti, ri, si in set(zip(t.tolist(), reps.tolist(), slots.tolist())):
        idx = np.nonzero((t == ti) & (reps == ri) & (slots == si))[0]
        opts = [int(si)] if exact else continuous_slots(-(-st.B // ri), int(si))
        for k in ks:
            got = [continuous_step(st, ms, n_gen, ti, ri, c, k, recompute)[0] for c in opts]
            j = int(np.argmin(got))
            secs[k][idx], best[k][idx] = got[j] + host, opts[j]
    return secs, best


def continuous_slots(per_replica: int, cap: int) -> list[int]:
    """Slot counts per replica tried under continuous admission: one batch's share x SLOT_FACTORS,
    at most `cap` (what memory allows); `cap` itself when even one batch does not fit."""
    opts = sorted({min(int(np.ceil(per_replica * f)), cap) for f in SLOT_FACTORS})
    return [c for c in opts if c >= 1] or [max(cap, 1)]


def continuous_admission(st: Setting, reps: int, slots: int, k: int, lag: int = 0) -> Admission:
    """The engine's steady state under continuous admission for `reps` replicas of `slots` slots:
    simulated as one pool of reps x slots slots (a group is admitted into one replica's shard, so
    its unit is at most one replica's slots: the sampler splits a larger group)."""
    unit = int(min(st.G, slots))
    return admission(
        st.dist,
        int(reps * slots),
        -(-st.B // unit),
        unit,
        int(k),
        "continuous",
        int(st.chunk_steps),
        int(st.min_chunk_steps),
        # the sampler's width buckets (its smallest, shapes/buckets.MIN_TABLE_WIDTH, is the runtime's:
        # SamplerConfig's default, which the run config does not change): with a tail in flight a
        # continuous engine's chunks read every slot's table to the bucket above the longest sequence
        table=(int(st.page_size), int(st.P), MIN_TABLE_WIDTH, float(st.table_growth)),
        lag=int(lag),  # 1: decoding ahead (rollout.decode_ahead), every token one version older
    )


def continuous_step(st: Setting, ms: ModelShape, n_gen: int, t: int, reps: int, slots: int, k: int, recompute=False):
    """(seconds, Admission) of one RL step's generation under continuous admission, before the
    host cost per sequence: the simulated decode steps (lengths.admission), each priced as a step of
    all `slots` rows with st.static_rows (the decode program runs every slot, busy or not: occupancy
    changes the number of steps, not their price), else of its busy rows, at the busy slots' mean
    context, plus one prefill per admitted group and its host work (admission_group_s)
    (its prompt once), plus with `recompute` re-prefilling the sequences in flight at every update."""
    a = continuous_admission(st, reps, slots, k)
    # Static rows (the CPU): every slot's page table is read to the chunk's width, which the
    # longest running sequence sets (with a long tail in flight, well above the busy mean).
    # Otherwise the busy rows at their mean context (as DecodeProfile.ctx: prompt + the token fed +
    # those generated).
    ctx = st.P + 1.0 + (a.ctx_width if st.static_rows else a.ctx)
    rows = slots if st.static_rows else slots * a.occupancy
    steps = a.decode_steps * decode_step_time(st, ms, t, n_gen, rows, ctx)
    sec = steps + _prefill_time(st, ms, t, n_gen, max(a.admitted / reps, 1.0), st.P)
    sec = sec + a.admitted * st.hw.efficiency.admission_group_s  # the engine's host work per group
    if recompute or st.recompute_kv:
        sec = sec + _prefill_time(st, ms, t, n_gen, max(slots * a.occupancy, 1.0), ctx)
    return float(sec), a


def _prefill_time(st: Setting, ms: ModelShape, t, busy, seqs, seq_len):
    """Prefill of `seqs` sequences of `seq_len` tokens on one replica (a GRPO group's prompt is
    prefilled once and its pages shared, so callers pass prompts, not sequences)."""
    hw = st.hw
    tokens = seqs * seq_len
    rate, bw, ovh = rates(hw, ms.dtype, busy)
    flops = ms.forward_flops(tokens, seqs, seqs * seq_len**2, st.causal_skip) / t
    nbytes = ms.weight_bytes() / t + tokens * ms.kv_bytes_per_token / ms.kv_shards(t)
    core = roofline(hw, flops, nbytes, ms.mm_size(tokens, t), rate, bw, busy)
    tp = sampler_tp_time(hw, ms, tokens, t) * ovh
    return float(core + tp + ms.L * hw.efficiency.layer_s * ovh)


def weight_sync_time(hw: HardwareProfile, nbytes, transport_s):
    """Seconds of one weight sync (train -> rollout) moving `nbytes` of rollout weights (the whole
    model in the rollout dtype), whose data movement alone takes `transport_s` (a reshard on the
    same devices, or a transfer between groups, priced by comm.py):

        t_sync = sync_fixed_s + ceil(nbytes / sync_bucket_bytes) · sync_bucket_s + transport_s
                 + dispatch_s

    Real syncs stream the weights in buckets (verl's bucketed sync, slime's 512 MB buckets,
    NeMo-RL's refit) and each bucket pays host work beyond its bytes; the fixed part is the
    engine's pause/resume and the controller's round trips. Unset constants (the CPU profile)
    cost nothing."""
    eff = hw.efficiency
    fixed = eff.sync_fixed_s or 0.0
    per = eff.sync_bucket_s or 0.0
    buckets = np.ceil(np.asarray(nbytes, np.float64) / eff.sync_bucket_bytes) if eff.sync_bucket_bytes else 0.0
    return fixed + buckets * per + transport_s + eff.dispatch_s


def weight_sync_stage(st: Setting, ms: ModelShape, *, colocated: bool, shards_train, t_g, n_train: int, n_gen: int):
    """Weight sync of the actor `ms` into the generation layout (tensor `t_g`): colocated, a reshard
    of the training shards (fsdp x tensor = `shards_train`) on the same devices plus the cast of
    the parameters to the rollout dtype; split, a transfer from the training group's `n_train`
    devices to the generation group's `n_gen` (comm.transfer_time). See weight_sync_time."""
    hw = st.hw
    w = ms.weight_bytes()  # the rollout's copy, in the compute dtype
    if ms.adapters and not colocated:
        # model.lora on disjoint devices (runtime/setup.AdapterSync): the generation group keeps the
        # base (moved once, not per step); a sync moves the adapters and merges them there
        a = float(ms.adapters * ms.param_bytes_per)
        return weight_sync_time(hw, a, transfer_time(hw, a, n_train, n_gen, t_g) + lora_merge_time(hw, ms, t_g))
    if colocated:
        cast = ms.num_params * (ms.param_bytes_per + ms.act_bytes_per) / shards_train / hw.device.memory_bw
        move = reshard_time(hw, w, shards_train, t_g, n_train) + cast
    else:
        move = transfer_time(hw, w, n_train, n_gen, t_g)
    return weight_sync_time(hw, w, move + lora_merge_time(hw, ms, shards_train))


def lora_merge_time(hw: HardwareProfile, ms: ModelShape, shards_train):
    """model.lora: the sync first merges the adapters into a new copy of the base in the training
    layout (runtime/setup.merge_adapters: W + s A B, the plain model's parameters): every parameter
    read and written once in the parameter dtype, per device over its `shards_train` shards, plus
    the rank-r products 2·r·in·out of the targeted projections (memory-bound: r/4 FLOPs per byte
    at float32). Then the merged model moves as a full one would (weight_sync_stage); on disjoint
    devices the same merge runs on the generation group's shards instead. 0 without LoRA."""
    if not ms.adapters:
        return 0.0
    shards = np.asarray(shards_train, np.float64)
    nbytes = 2.0 * ms.num_params * ms.param_bytes_per / shards
    flops = 2.0 * ms.lora_rank * ms.merged / shards
    return np.maximum(nbytes / hw.device.memory_bw, flops / hw.peak(ms.dtype))


def elementwise_stage(st: Setting, busy, arrays: int = 6):
    """Advantages/returns: a few [B, R] float32 arrays read and written once."""
    rate, bw, _ = rates(st.hw, "float32", busy)
    nbytes = arrays * st.B * st.R_train * 4.0 / np.maximum(np.asarray(busy, np.float64), 1.0)
    return nbytes / (bw * interp_eff(st.hw.efficiency.memory, nbytes)) + st.hw.efficiency.dispatch_s


def reward_stage(st: Setting, per_seq_s: float = 2e-6):
    """Host-side verifiers: a fixed cost per sequence (string parsing), not device work."""
    return st.B * per_seq_s
