"""Sequence packing for the training update (train.pack_sequences; verl's use_remove_padding).

The rollout layout (runtime/rollout/layout.py) pads every sequence to S = P + R columns (prompt
left-padded to P, response right-padded to R, under continuous admission R = the response cap),
so an update over it pays for padding. Packed, a (micro-)batch of b sequences runs as N rows of
the same length S, each holding several sequences' real tokens back to back:

    packed row:  [seq_3 (prompt+response) | seq_0 | seq_7 | pad ...]   segment ids 1, 2, 3, 0 ...

Positions are the rollout layout's own (each sequence restarts at 0), segment ids number the
sequences of a row (attention is causal within a segment: models/attention.DenseAttention), so
every real token sees exactly the keys it sees in the padded pass. Only the hidden states that
predict a response token go through the LM head / value head: K of them, gathered out of the
packed rows. The outputs (logp, entropy, values) are put back into the padded [b, R] response
window, so the loss, its aggregation (every rl.loss_agg, GSPO's sequence ratio), the metrics
and the NaN guard see exactly the arrays of the unpacked update; response cells with no real
target token get 0 (they are padding: every loss term selects by the mask).

The plan (`piece_plan`) is numpy, computed on the host before the update's program runs, from
the batch's segment ids: first-fit-decreasing of the sequences' real lengths (prompt + response)
into rows of S columns; sequences of equal length keep their batch order, so it is deterministic.
Static shapes, few compiled programs: N is rounded up to a multiple of `row_quantum` (b/16
rows, at least the stage's device count), K to a multiple of b·R/8; one update compiles once per
distinct (N, K), i.e. at most 16 x 8 shapes per batch shape and in practice a handful.

The update's shuffles and splits stay those of the unpacked update: `update_plan` draws the
per-epoch orders with the same key and function (rl/update.epoch_order), splits them the same way
(rl/layout.split_tree, whole groups when the unpacked update would share prompts) and packs each
micro-batch on its own, so every optimizer step sees the same sequences. The arrays get leading
axes [epochs, minibatches, micro_batches] and ride through make_update's loops (`pack=`).

Plan arrays of one micro-batch of b rows (flat indices, int32):
    src_NxT   the micro-batch's flat [b·S] column each packed slot copies, -1 for an empty slot
    seg_NxT   segment id of each packed slot (1..n within a row, 0 empty)
    pred_K    flat [N·S] slot of the hidden state predicting response token k (0 for filler)
    out_BxR   for each response cell of the padded window, its k, or -1 (no real target)

The scoring forwards (ref / old / critic) pack too (`forward_plan`): the batch in its own order,
split into rl.forward_micro_batches strided pieces as the padded scoring pass splits it.

Called by: runtime/kernels.py (the update and scoring stages' host step and forward,
runtime/packed_forward.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from rpeg_jax.rl.update import PLAN_KEY  # noqa: E402,F401 (the micro-batch entry carrying a plan)
from rpeg_jax.shapes.packing import (  # noqa: F401 (the floor's rule, re-exported for the learner's callers)
    ROW_BUCKETS,
    TOKEN_BUCKETS,
    first_fit_decreasing,
    packed_shape,
    round_to_quantum,
    row_quantum,
    token_quantum,
)


def sequence_spans(segment_ids_BxS: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first real column [B], real length [B]) of each row: its nonzero segment ids, which must
    be one contiguous run of one segment (the rollout layout); ValueError otherwise."""
    seg = np.asarray(segment_ids_BxS)
    real = seg != 0
    length = real.sum(1)
    start = np.where(length > 0, real.argmax(1), 0)
    cols = np.arange(seg.shape[1])[None]
    inside = (cols >= start[:, None]) & (cols < (start + length)[:, None])
    first = seg[np.arange(seg.shape[0]), start][:, None]
    bad = np.any(inside != real, axis=1) | np.any(real & (seg != first), axis=1)
    if bad.any():
        raise ValueError(
            f"train.pack_sequences: rows {np.flatnonzero(bad)[:8].tolist()} are not one contiguous segment "
            "of real tokens (the rollout layout); cannot pack them"
        )
    return start.astype(np.int64), length.astype(np.int64)


def piece_plan(start_b, length_b, prompt_len: int, response_len: int, *, rows: int, tokens: int) -> dict:
    """The plan arrays (module docstring) of one micro-batch packed into `rows` rows of S = P + R
    columns with `tokens` response slots; `start_b`, `length_b` from `sequence_spans`."""
    b = len(start_b)
    P, R = prompt_len, response_len
    S = P + R
    bins = first_fit_decreasing(length_b, S)
    if len(bins) > rows:
        raise ValueError(f"piece_plan: {len(bins)} packed rows needed, {rows} given")
    src = np.full((rows, S), -1, np.int32)
    seg = np.zeros((rows, S), np.int32)
    pred = np.zeros((tokens,), np.int32)
    out = np.full((b, R), -1, np.int32)
    k = 0
    for r, items in enumerate(bins):
        o = 0
        for j, i in enumerate(items):
            a, n = int(start_b[i]), int(length_b[i])
            src[r, o : o + n] = i * S + a + np.arange(n)
            seg[r, o : o + n] = j + 1
            # response token t (column P + t) is predicted from column P - 1 + t: both must be real
            t = np.arange(R)
            ok = (P - 1 + t >= a) & (P + t < a + n)
            t = t[ok]
            if k + len(t) > tokens:
                raise ValueError(f"piece_plan: more than {tokens} response tokens")
            pred[k : k + len(t)] = r * S + o + (P - 1 + t - a)
            out[i, t] = k + np.arange(len(t))
            k += len(t)
            o += n
    return {"src_NxT": src, "seg_NxT": seg, "pred_K": pred, "out_BxR": out}


def piece_sizes(start_b, length_b, prompt_len: int, response_len: int) -> tuple[int, int]:
    """(packed rows, response tokens) one micro-batch needs."""
    P, R = prompt_len, response_len
    rows = len(first_fit_decreasing(length_b, P + R))
    lo = np.maximum(start_b, P - 1) - (P - 1)  # first response index whose predictor is real
    hi = np.minimum(start_b + length_b - P, R)  # response indices whose target is real
    return rows, int(np.maximum(hi - lo, 0).sum())


def host_array(x) -> np.ndarray:
    """A (possibly multi-process) global array's values on this host."""
    if isinstance(x, np.ndarray):
        return x
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def epoch_orders(rng, b: int, epochs: int, group_size: int) -> np.ndarray:
    """[epochs, b] row orders of make_update's epochs (identity when rng is None), drawn as it does."""
    from rpeg_jax.rl.update import epoch_order  # noqa: PLC0415

    if rng is None:
        return np.broadcast_to(np.arange(b, dtype=np.int32), (epochs, b)).copy()
    keys = jax.random.split(rng, epochs)
    return np.stack([np.asarray(epoch_order(keys[e], b, group_size)) for e in range(epochs)]).astype(np.int32)


def update_plan(
    segment_ids_BxS,
    response_len: int,
    *,
    epochs: int,
    minibatches: int,
    micro_batches: int,
    group_size: int = 1,
    rng=None,
    devices: int = 1,
) -> dict:
    """The plan of a whole update call (make_update(..., pack=)): {"order_ExB": [E, B], and each
    piece_plan array with leading [E, M, U]}, every micro-batch padded to the same (N, K)."""
    from rpeg_jax.rl.layout import split_tree  # noqa: PLC0415

    seg = host_array(segment_ids_BxS)
    B, S = seg.shape
    R = response_len
    P = S - R
    start, length = sequence_spans(seg)
    orders = epoch_orders(rng, B, epochs, group_size)
    pieces = []  # [E][M][U] -> row indices into the batch
    for e in range(epochs):
        mbs = np.asarray(split_tree(jnp.asarray(orders[e]), minibatches, group_size))
        pieces.append([np.asarray(split_tree(jnp.asarray(mb), micro_batches, group_size)) for mb in mbs])
    flat = [u for e in pieces for m in e for u in m]
    b = len(flat[0])
    sizes = [piece_sizes(start[u], length[u], P, R) for u in flat]
    rows, tokens = packed_shape(max(s[0] for s in sizes), max(s[1] for s in sizes), b, R, devices)
    plans = [piece_plan(start[u], length[u], P, R, rows=rows, tokens=tokens) for u in flat]
    lead = (epochs, minibatches, micro_batches)
    out = {k: np.stack([p[k] for p in plans]).reshape(*lead, *v.shape) for k, v in plans[0].items()}
    out["order_ExB"] = orders
    return out


# ---- device side (inside the update's program) -------------------------------------------------
def pack_rows(plan: dict, *arrays_BxS):
    """Each [b, S] array gathered into the packed [N, S] rows (0 in empty slots)."""
    src = plan["src_NxT"]
    idx = jnp.maximum(src, 0)
    return tuple(jnp.where(src >= 0, jnp.reshape(x, (-1,))[idx], jnp.zeros((), x.dtype)) for x in arrays_BxS)


def predicting(plan: dict, h_NxTxD):
    """[K, D]: the packed hidden states that predict the response tokens, and their targets are
    the packed tokens one slot later (the same sequence's next token)."""
    n, t = h_NxTxD.shape[:2]
    return jnp.reshape(h_NxTxD, (n * t, *h_NxTxD.shape[2:]))[plan["pred_K"]]


def next_tokens(plan: dict, tokens_NxT):
    """[K] target token of each response slot."""
    return jnp.reshape(tokens_NxT, (-1,))[plan["pred_K"] + 1]


def unpack_response(plan: dict, x_K):
    """[K] per-response-token values -> the padded response window [b, R] (0 where no target)."""
    out = plan["out_BxR"]
    return jnp.where(out >= 0, x_K[jnp.maximum(out, 0)], jnp.zeros((), x_K.dtype))


def stage_plan(completions: dict, rl_cfg, group_size: int, rng, devices: int = 1) -> dict:
    """update_plan for an update stage over the rollout batch `completions` (the runtime's host
    step before the update's program, runtime/kernels.py); `group_size`: the group size the update
    shuffles and splits by (the unpacked update's, so the optimizer steps see the same rows)."""
    return update_plan(
        completions["segment_ids_BxS"],
        completions["response_mask_BxR"].shape[1],
        epochs=rl_cfg.ppo_epochs,
        minibatches=rl_cfg.minibatches,
        micro_batches=rl_cfg.micro_batches,
        group_size=group_size,
        rng=rng,
        devices=devices,
    )


def forward_plan(completions: dict, micro_batches: int, devices: int = 1) -> dict:
    """The plan of a scoring forward (ref / old / critic) over the rollout batch `completions`:
    update_plan of one epoch in batch order (no shuffle), one minibatch, split into the
    rl.forward_micro_batches strided pieces that runtime/kernels.scoring_fn runs (row splits:
    packed passes share no prompts), each piece packed as an update's micro-batch is. The
    piece_plan arrays with a leading [micro_batches] axis (no order: the batch's own)."""
    plan = update_plan(
        completions["segment_ids_BxS"],
        completions["response_mask_BxR"].shape[1],
        epochs=1,
        minibatches=1,
        micro_batches=micro_batches,
        devices=devices,
    )
    return {k: v[0, 0] for k, v in plan.items() if k != "order_ExB"}


def plan_metrics(plan: dict | None, prefix: str) -> dict:
    """perf/<prefix>_pack_fill: the fraction of the packed rows' slots holding real tokens, and
    perf/<prefix>_pack_rows: packed rows per micro-batch over its sequences (1 = no packing gain);
    {} without a plan. Computed in the update's program from the plan's arrays."""
    if plan is None:
        return {}
    seg, out = plan["seg_NxT"], plan["out_BxR"]
    return {
        f"perf/{prefix}_pack_fill": jnp.mean((seg > 0).astype(jnp.float32)),
        f"perf/{prefix}_pack_rows": jnp.float32(seg.shape[-2] / out.shape[-2]),
    }
