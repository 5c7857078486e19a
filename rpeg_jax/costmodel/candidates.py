"""Candidate plans of one placement family as a table (numpy columns, one row per candidate).

A row fixes the device groups (colocated: all N; split: n_gen + n_train), the generation
layout (tensor t_g, replicas n_gen/t_g, slots per replica), the training layout (data d ×
fsdp f × tensor t, gradient micro-batches, remat) and the forward layout (its own d' × f' × t',
micro-batches). Its columns are the base durations of every stage kind and the peak memory per
device; rows that do not fit the memory budget are dropped before anything is simulated.

Memory per device (the buffers each model holds, counted as in ZeRO), colocated (everything
shares the devices):
    resident = actor (+ critic) params + Adam moments / (f·t) + reference weights / (f'·t')
               + rollout weights / t_g
    (train.offload, costmodel/offload.py: the Adam moments, and the reference's weights, leave
    `resident`; the update and the reference forward hold them while they run, and pay the transfer)
    peak     = max(resident + KV pages + gen working set,
                   resident + update transients (grads, guarded new state, activations),
                   resident + forward weight copies + forward transients)
Split: the generation group holds rollout weights, KV pages and the generation working set (its
slots are sized on that alone); the training group the rest (training state, reference weights,
forward copies and transients). The row's peak is the larger of the two groups' peaks.

The table's columns: costmodel/table.py. Callers: costmodel/scoring.py, pricing.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rpeg_jax.costmodel import offload as OFF
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.comm import reshard_time
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.costmodel.table import Continuous, Layouts, Table, TrainSide

REMATS = ("none", "dots", "full")
MICROS = (1, 2, 4, 8, 16, 32, 64)  # gradient-accumulation micro-batches tried
PIECES = (2, 4, 8)  # streamed generation pieces tried (costmodel/space.py)
INF = float("inf")


@dataclass
class Roles:
    """The models of the workload: actor (or the shared backbone), critic, reference."""

    actor: ModelShape
    critic: ModelShape | None  # None: GRPO, or PPO with a shared backbone
    ref: ModelShape | None  # None when β = 0
    epochs: int = 1
    minibatches: int = 1
    offload: str = "none"  # train.offload: priced by costmodel/offload.py


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(n: int, B: int, ms: ModelShape, tensor_sizes) -> np.ndarray:
    """(d, f, t, e) rows with d·f·t = n, t dividing heads and mlp, d·f dividing the batch; e the
    expert degree (1, or for a mixture of experts f when it divides the experts:
    ModelShape.expert_degrees)."""
    rows = []
    for t in tensor_sizes:
        if n % t or ms.H % t or any(w % t for w in ms.mlp_widths):
            continue
        for f in divisors(n // t):
            d = n // (t * f)
            if B % (d * f) == 0:
                rows.extend((d, f, t, e) for e in ms.expert_degrees(f))
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def gen_layouts(n: int, B: int, ms: ModelShape, tensor_sizes) -> np.ndarray:
    """Tensor degrees t of generation on n devices: t divides heads and mlp, and the n/t replicas
    divide the batch (the sampler shards its slots over them)."""
    ok = [t for t in tensor_sizes if n % t == 0 and ms.H % t == 0 and B % (n // t) == 0]
    return np.array([t for t in ok if all(w % t == 0 for w in ms.mlp_widths)], np.int64)


def quantize_slots(slots: np.ndarray, n_rep: np.ndarray) -> np.ndarray:
    """Slots floored onto a grid of 4 steps per octave (bounds the distinct decode profiles),
    capped at `n_rep` (more slots than sequences in flight hold KV pages for nothing)."""
    s = np.maximum(slots, 0.0)
    q = np.where(s >= 1, 2.0 ** (np.floor(np.log2(np.maximum(s, 1.0)) * 4) / 4), 0.0)
    return np.where(s >= n_rep, n_rep, np.floor(q)).astype(np.int64)


def _best_train(st, roles: Roles, busy, lay: np.ndarray, trained: list[ModelShape], only=None):
    """Per training layout and (micro, remat) option: summed update time and transient bytes.
    `only`: that one (micro, remat) option (a given plan's settings), else every one."""
    d, f, t, e = (lay[:, i : i + 1].astype(np.float64) for i in range(4))
    opts = [only] if only is not None else [(m, r) for r in REMATS for m in MICROS]
    micro = np.array([o[0] for o in opts], np.float64)[None, :]
    time = np.zeros((len(lay), len(opts)))
    trans = np.zeros((len(lay), len(opts)))
    for ms in trained:
        for r in dict.fromkeys(o[1] for o in opts):
            cols = [j for j, o in enumerate(opts) if o[1] == r]
            tt, _ = S.train_stage(
                st,
                ms,
                busy=busy,
                d=d,
                f=f,
                t=t,
                micro=micro[:, cols],
                remat=r,
                epochs=roles.epochs,
                minibatches=roles.minibatches,
                **_ep(ms, e),
            )
            mem = S.train_memory(
                st, ms, d=d, f=f, t=t, micro=micro[:, cols], remat=r, minibatches=roles.minibatches, **_ep(ms, e)
            ) - ms.resident_state_bytes() / (f * t)
            mem = OFF.update_transient(roles.offload, ms, mem, f, t, micro[:, cols], roles.epochs * roles.minibatches)
            time[:, cols] += tt
            trans[:, cols] = np.maximum(trans[:, cols], mem)
    valid = (st.B / (d * f) / (roles.minibatches * micro)) >= 1
    valid &= np.isclose((st.B / (d * f)) % (roles.minibatches * micro), 0)
    time = np.where(valid, time, INF)
    return time, trans, opts


def _ep(ms: ModelShape, e) -> dict:
    """The expert degree argument of a stage price: only for a mixture of experts (a dense model's
    prices take none, so they stay what they were)."""
    return {"e": e} if ms.X else {}


def _best_forward(st, busy, lay: np.ndarray, models: list[ModelShape], only=None):
    d, f, t, e = (lay[:, i : i + 1].astype(np.float64) for i in range(4))
    # rl.forward_micro_batches tried (runtime/kernels.scoring_fn's loop); `only`: that one
    micros = [only] if only is not None else list(MICROS)
    micro = np.array(micros, np.float64)[None, :]
    per_device = st.B / (d * f)
    valid = (per_device >= micro) & np.isclose(per_device % micro, 0)  # equal pieces on every device
    times = []
    trans = np.zeros((len(lay), len(micros)))
    for ms in models:
        tt, _ = S.forward_stage(st, ms, busy=busy, d=d, f=f, t=t, micro=micro, **_ep(ms, e))
        times.append(np.where(valid, tt, INF))
        trans = np.maximum(trans, S.forward_memory(st, ms, d=d, f=f, t=t, micro=micro, **_ep(ms, e)))
    return times, trans, micros


def build(
    st: S.Setting,
    roles: Roles,
    *,
    allocs: list[tuple[int, int]],
    placement: str,
    tensor_sizes,
    max_staleness: int = 0,
    continuous: bool = False,
    gen_tensor_sizes=None,
    settings: tuple | None = None,
) -> Table | None:
    """All feasible rows of a placement family (see the module docstring) over the device-group
    options `allocs` [(n_gen, n_train)] (colocated: n_gen = n_train, the one group); None when no
    row fits. `continuous`: also price rollout.admission=continuous at every k in
    1..max_staleness (Table.continuous[k]: the engine's simulated steady state,
    stages.continuous_step, and the training stages on the shorter batches it hands over).
    `settings`: (micro_batches, remat, forward_micro_batches) fixed (pricing a given plan with its
    config's settings), else the best of each that fits."""
    parts = [
        _alloc_rows(
            st,
            roles,
            n_gen=ng,
            n_train=nt,
            placement=placement,
            tensor_sizes=tensor_sizes,
            max_k=max_staleness,
            continuous=continuous,
            gen_tensor_sizes=gen_tensor_sizes or tensor_sizes,
            settings=settings,
        )
        for ng, nt in allocs
    ]
    considered = sum(c for c, _ in parts)
    tables = [t for _, t in parts if t is not None and len(t)]
    if not tables:
        return None
    return dataclasses.replace(Table.concat(tables), considered=considered)


def _alloc_rows(
    st,
    roles: Roles,
    *,
    n_gen: int,
    n_train: int,
    placement: str,
    tensor_sizes,
    max_k: int,
    continuous: bool,
    gen_tensor_sizes,
    settings: tuple | None = None,
) -> tuple[int, Table | None]:
    """(combinations considered, the table of the rows that fit) for one device-group option."""
    hw, actor = st.hw, roles.actor
    coloc = placement == "colocated"
    lay = layouts(n_train, st.B, actor, tensor_sizes)
    gl = gen_layouts(n_gen, st.B, actor, gen_tensor_sizes)
    if not len(lay) or not len(gl):
        return 0, None
    trained, fwd_models = _models(roles)
    up_only, fw_only = (tuple(settings[:2]), settings[2]) if settings is not None else (None, None)
    up_t, up_m, up_opts = _best_train(st, roles, n_train, lay, trained, up_only)
    fw_times, fw_m, fw_micros = _best_forward(st, n_train, lay, [m for _, m in fwd_models], fw_only)
    ft = lay[:, 1] * lay[:, 2]  # parameter shards of a layout (fsdp × tensor)
    state = sum(OFF.resident_bytes(roles.offload, m) for m in trained) / ft  # [i]
    # the reference's weights in its forward layout; with LoRA the reference is the actor's frozen
    # base, already resident in the training state (runtime/setup.py: no second copy)
    ref_res = (roles.ref.weight_bytes() / ft) if roles.ref and not actor.adapters else np.zeros(len(lay))  # [j]
    ref_fetched = ref_res if OFF.offloads_reference(roles.offload) else np.zeros(len(lay))  # on device in its forward
    ref_res = ref_res - ref_fetched
    rollout = actor.weight_bytes() / gl  # [g]
    # Broadcast over (i train layout, j forward layout, g generation layout).
    I, J, G = np.meshgrid(np.arange(len(lay)), np.arange(len(lay)), np.arange(len(gl)), indexing="ij")
    I, J, G = I.ravel(), J.ravel(), G.ravel()
    same = I == J
    resident = state[I] + ref_res[J] + (rollout[G] if coloc else 0.0)
    # A given plan's settings are priced as they are, whatever memory they need (the prediction's
    # mem_peak says it); a search keeps what fits.
    budget = st.budget_bytes if settings is None else np.inf
    # Forward weight copies: actor and critic in the forward layout unless it is the training one.
    copies = np.where(same, 0.0, sum(m.weight_bytes() for m in trained) / ft[J]) + ref_fetched[J]
    fwd_ok = resident[:, None] + copies[:, None] + fw_m[J] <= budget
    fw_total = sum(fw_times)  # [j, micro]
    fw_masked = np.where(fwd_ok, fw_total[J], INF)
    fw_pick = np.argmin(fw_masked, axis=1)
    fw_best = fw_masked[np.arange(len(J)), fw_pick]
    up_ok = resident[:, None] + up_m[I] <= budget
    up_masked = np.where(up_ok, up_t[I], INF)
    up_pick = np.argmin(up_masked, axis=1)
    up_best = up_masked[np.arange(len(I)), up_pick]
    # Generation: slots from what is left next to the resident state (colocated) or alone (split:
    # the generation devices hold the rollout weights, KV pages and working set only; the training
    # state and reference weights live on the training group, whose memory is checked above).
    t_g = gl[G]
    reps = n_gen // t_g
    n_rep = -(-st.B // reps)
    free = budget - (resident - rollout[G]) if coloc else np.full(len(G), budget)
    gen_base = 0.0
    if actor.adapters and not coloc:  # LoRA on disjoint devices: the base beside the sampler's copy
        gen_base = actor.weight_bytes(actor.param_bytes_per) / t_g
        free = free - gen_base
    # A step-admission generate call holds one batch (n_rep sequences per replica); continuous
    # admission may keep more in flight (stages.continuous_slots picks how many, up to this).
    cap = np.ceil(n_rep * (max(S.SLOT_FACTORS) if continuous else 1.0))
    slots_max = quantize_slots(S.max_slots(st, actor, t_g, free, reps), cap)
    slots = np.minimum(slots_max, n_rep)
    ok = np.isfinite(fw_best) & np.isfinite(up_best) & (slots >= 1)
    considered = len(I) * len(up_opts) * len(fw_micros)
    if not ok.any():
        return considered, None
    I, J, G, t_g, slots, n_rep, reps = I[ok], J[ok], G[ok], t_g[ok], slots[ok], n_rep[ok], reps[ok]
    slots_max = slots_max[ok]
    gen_base = gen_base[ok] if np.ndim(gen_base) else gen_base
    resident, copies, same = resident[ok], copies[ok], same[ok]
    fw_pick, up_pick = fw_pick[ok], up_pick[ok]
    # (k = 0 too for a split placement: decoding ahead, the engine at k decides as at k - 1, scoring.engine_staleness)
    ks = tuple(range(0 if not coloc else 1, max_k + 1)) if continuous else ()
    gen_t, _, finished_at, _ = S.generate_stage(st, actor, n_gen=n_gen, t=t_g, slots=slots)
    gen_async, slots_c = S.continuous_stage(
        st, actor, n_gen=n_gen, t=t_g, slots=slots_max, ks=ks, recompute=st.recompute_kv
    )
    # The runtime's host work around the sampler: per step, per sequence, and per streamed piece
    # beyond the first.
    eff = hw.efficiency
    gen_t = gen_t + st.B * eff.host_seq_s + eff.host_step_s
    gen_async = {k: v + st.B * eff.host_seq_s + eff.host_step_s for k, v in gen_async.items()}
    gen_q = np.stack([finished_at(q / 8) for q in range(1, 8)], axis=1)
    # Streamed pieces as the runtime runs them: one generate call per piece of B/m sequences (each
    # call pays every decode step for its smaller batch); continuous admission has no pieces.
    pieces = {}
    if not coloc:
        for m in PIECES:
            if st.B % m == 0:
                stm = dataclasses.replace(st, B=st.B // m)
                pieces[m] = (
                    S.generate_stage(stm, actor, n_gen=n_gen, t=t_g, slots=np.minimum(slots, -(-stm.B // reps)))[0]
                    + eff.piece_s * (m - 1) / m
                    + stm.B * eff.host_seq_s
                    + eff.host_step_s / m
                )
    # colocated: the training state beside the sampler; split: LoRA's base on the generation devices (or 0)
    others = resident - rollout[G] if coloc else gen_base
    gen_mem = S.generate_memory(st, actor, t_g, slots, reps) + others
    gen_mem_sync = S.generate_memory(st, actor, t_g, np.minimum(slots, n_rep), reps) + others
    peak_up = resident + up_m[I, up_pick]
    peak_fw = resident + copies + fw_m[J, fw_pick]
    if actor.adapters:  # LoRA: the weight sync merges into a new copy of the base (training layout)
        peak_up = np.maximum(peak_up, resident + actor.weight_bytes(actor.param_bytes_per) / ft[I])
    peak = np.maximum(np.maximum(peak_up, peak_fw), gen_mem)
    peak_sync = np.maximum(np.maximum(peak_up, peak_fw), gen_mem_sync)
    lo = Layouts(
        n_gen=np.full(len(I), n_gen),
        n_train=np.full(len(I), n_train),
        t_g=t_g,
        d=lay[I, 0],
        f=lay[I, 1],
        t=lay[I, 2],
        fd=lay[J, 0],
        ff=lay[J, 1],
        ft=lay[J, 2],
        e=lay[I, 3],
        fe=lay[J, 3],
        micro=np.array([up_opts[k][0] for k in up_pick]),
        remat=np.array([REMATS.index(up_opts[k][1]) for k in up_pick]),
        fmicro=np.array([fw_micros[k] for k in fw_pick]),
    )
    # Per-role stage times at the chosen options.
    moves, fetch = _transfers(roles, hw, trained, lo)
    t_upd = {
        name: _train_rows(st, ms, n_train, lo, roles) + moves[name] for name, ms in zip(("actor", "critic"), trained)
    }
    t_fwd = {
        name: S.forward_stage(st, ms, busy=n_train, d=lo.fd, f=lo.ff, t=lo.ft, micro=lo.fmicro, **_ep(ms, lo.fe))[0]
        + fetch.get(name, 0.0)
        for name, ms in fwd_models
    }
    # Reallocation of actor/critic weights into the forward layout (ReaL's parameter realloc).
    shards_tr, shards_fw = lo.f * lo.t, lo.ff * lo.ft
    t_realloc = {}
    for ms, name in zip(trained, ["actor", "critic"]):
        rs = reshard_time(hw, ms.weight_bytes(), shards_tr, shards_fw, n_train)
        t_realloc[name] = np.where(same, 0.0, rs + ms.weight_bytes() / shards_fw / hw.device.memory_bw)
    cont = {}
    for k in ks:  # continuous admission: KV pages stay resident while the stages train (colocated)
        sk = slots_c[k]
        kv = S.generate_memory(st, actor, t_g, sk, reps) - S.generate_memory(st, actor, t_g, 0, reps)
        mem = np.maximum(S.generate_memory(st, actor, t_g, sk, reps) + others, peak_fw)
        mem = np.maximum(mem, peak_up + (kv if coloc else 0.0))
        cont[k] = Continuous(
            slots=sk,
            mem_peak=mem,
            t_gen=np.where(mem <= budget, gen_async[k], INF),
            # the training side on the batches continuous admission hands over
            train=consumed_side(st, roles, n_train, lo, k, sk),
        )
    return considered, Table(
        considered=considered,
        **dataclasses.asdict(lo),
        slots=slots,
        n_rep=n_rep,
        mem_peak=peak,
        mem_resident=resident,  # per device: training state, reference weights (+ rollout weights colocated)
        mem_peak_sync=peak_sync,
        mem_gen=gen_mem,
        mem_update=peak_up,
        mem_forward=peak_fw,
        t_gen=gen_t,
        gen_q=gen_q,
        # Weight sync into the generation layout (fixed + per-bucket costs + data movement).
        t_sync=S.weight_sync_stage(
            st, actor, colocated=coloc, shards_train=shards_tr, t_g=t_g, n_train=n_train, n_gen=n_gen
        ),
        t_reward=np.full(len(I), S.reward_stage(st)),
        t_realloc=t_realloc,
        train=TrainSide(t_upd=t_upd, t_fwd=t_fwd, t_adv=np.full(len(I), float(S.elementwise_stage(st, n_train)))),
        t_gen_pieces=pieces,
        continuous=cont,
    )


def consumed_setting(st: S.Setting, reps: int, slots: int, k: int) -> S.Setting:
    """The Setting the training stages are priced with under continuous admission at staleness k
    with `reps` engines of `slots` slots. The runtime lays such batches out at R =
    rollout.max_new_tokens (runtime/rollout/layout.lay_out: the batch's longest response changes every
    step, and each new width would compile the training stages again), so a padded update costs
    what it costs at k = 0. A packed update (Setting.packing: stages.packed_per_seq) computes on the
    consumed sequences' lengths: "the first groups to complete" under the per-token bound are biased
    short (a sequence that outlives k + 1 steps is re-queued), the simulated engine's
    Admission.consumed (R2 on the CPU, 2026-12-03: 15% fewer response tokens at k = 1 than at
    k = 0, 10% at k = 2, an 11% cheaper update measured; priced the same there, the packed rows
    rounding to the same count)."""
    if not st.packing:
        return st
    a = S.continuous_admission(st, int(reps), int(slots), int(k))
    if not a.consumed:
        return st
    return dataclasses.replace(
        st, dist=dataclasses.replace(st.dist, samples=a.consumed, min_len=min(st.dist.min_len, min(a.consumed)))
    )


def consumed_side(st: S.Setting, roles: Roles, n_train: int, lo, k: int, slots) -> TrainSide:
    """The training side (updates, scoring forwards, advantages) of the rows `lo` (a Table or
    Layouts) with the engine at `slots` slots per replica (per row): each row's training stages
    priced on its engine's consumed batches at staleness k (consumed_setting), rows grouped by
    (replicas, slots)."""
    hw = st.hw
    trained, fwd_models = _models(roles)
    n = len(lo.d)
    reps = np.maximum(np.asarray(lo.n_gen) // np.asarray(lo.t_g), 1)
    slots = np.broadcast_to(np.asarray(slots, np.int64), (n,))
    t_upd = {name: np.empty(n) for name in ("actor", "critic")[: len(trained)]}
    t_fwd = {name: np.empty(n) for name, _ in fwd_models}
    t_adv = np.empty(n)
    moves, fetch = _transfers(roles, hw, trained, lo)
    for r, c in set(zip(reps.tolist(), slots.tolist())):
        sel = np.nonzero((reps == r) & (slots == c))[0]
        sc = consumed_setting(st, r, max(int(c), 1), k)
        sub = Layouts(**{f.name: np.asarray(getattr(lo, f.name))[sel] for f in dataclasses.fields(Layouts)})
        for name, ms in zip(("actor", "critic"), trained):
            t_upd[name][sel] = _train_rows(sc, ms, n_train, sub, roles) + moves[name][sel]
        for name, ms in fwd_models:
            t_f = S.forward_stage(
                sc, ms, busy=n_train, d=sub.fd, f=sub.ff, t=sub.ft, micro=sub.fmicro, **_ep(ms, sub.fe)
            )[0]
            t_fwd[name][sel] = t_f + (fetch[name][sel] if name in fetch else 0.0)
        t_adv[sel] = float(S.elementwise_stage(sc, n_train))
    return TrainSide(t_upd=t_upd, t_fwd=t_fwd, t_adv=t_adv)


def _models(roles: Roles) -> tuple[list[ModelShape], list[tuple[str, ModelShape]]]:
    """(trained models: actor [, critic]; the forwards' (name, model): actor [, critic] [, ref])."""
    trained = [roles.actor] + ([roles.critic] if roles.critic is not None else [])
    fwd_models = (
        [("actor", roles.actor)]
        + ([("critic", roles.critic)] if roles.critic is not None else [])
        + ([("ref", roles.ref)] if roles.ref is not None else [])
    )
    return trained, fwd_models


def _transfers(roles: Roles, hw, trained, lo) -> tuple[dict, dict]:
    """Per row: seconds each update moves its offloaded optimizer state ({actor, critic}) and the
    reference forward fetches its offloaded weights ({"ref"}), costmodel/offload.py."""
    moves = {
        n: OFF.update_transfer_seconds(roles.offload, hw, ms, lo.f, lo.t) for n, ms in zip(("actor", "critic"), trained)
    }
    return moves, {"ref": OFF.reference_transfer_seconds(roles.offload, hw, roles.ref, lo.ff, lo.ft)}


def _train_rows(st, ms, busy, lo, roles: Roles) -> np.ndarray:
    out = np.empty(len(lo.d))
    for k, r in enumerate(REMATS):
        idx = lo.remat == k
        if idx.any():
            out[idx] = S.train_stage(
                st,
                ms,
                busy=busy,
                d=lo.d[idx],
                f=lo.f[idx],
                t=lo.t[idx],
                micro=lo.micro[idx],
                remat=r,
                epochs=roles.epochs,
                minibatches=roles.minibatches,
                **_ep(ms, lo.e[idx]),
            )[0]
    return out
