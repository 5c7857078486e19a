"""Packing sequences into rows: the rule of a packed update (train.pack_sequences, rl/packing.py)
and of its price (costmodel/stages.packed_per_seq).

A micro-batch of b sequences is packed first-fit-decreasing into rows of S = P + R columns; every
micro-batch of an update is padded to the same (N rows, K response tokens), N a multiple of
`row_quantum` and K of `token_quantum`, so one compiled program serves every step.
"""

from __future__ import annotations

import numpy as np

ROW_BUCKETS = 16  # N is a multiple of ceil(b / ROW_BUCKETS) (rounded up to the devices)
TOKEN_BUCKETS = 8  # K is a multiple of ceil(b·R / TOKEN_BUCKETS)


def first_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity: items longest first (ties in index
    order), each into the first bin it fits. Items of length 0 are left out; longer than capacity
    is an error."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > capacity:
        raise ValueError(f"first_fit_decreasing: an item of length {lengths.max()} exceeds the row length {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        if n == 0:
            continue
        for j, f in enumerate(free):
            if n <= f:
                bins[j].append(i)
                free[j] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return bins


def row_quantum(b: int, devices: int = 1) -> int:
    """Packed rows are a multiple of this: ceil(b / ROW_BUCKETS) rounded up to the devices."""
    devices = max(int(devices), 1)
    q = -(-int(b) // ROW_BUCKETS)
    return -(-q // devices) * devices


def token_quantum(b: int, response_len: int) -> int:
    """Packed response tokens are a multiple of this: ceil(b·R / TOKEN_BUCKETS), at least 1."""
    return max(-(-int(b) * int(response_len) // TOKEN_BUCKETS), 1)


def round_to_quantum(n: int, q: int) -> int:
    """n rounded up to a multiple of q, at least q (an empty micro-batch still has one quantum)."""
    return max(q, -(-int(n) // q) * q)


def packed_shape(rows_needed: int, tokens_needed: int, b: int, response_len: int, devices: int = 1) -> tuple[int, int]:
    """(N, K) of every micro-batch of an update whose fullest micro-batch of b sequences needs
    `rows_needed` packed rows and `tokens_needed` response tokens."""
    return (
        round_to_quantum(rows_needed, row_quantum(b, devices)),
        round_to_quantum(tokens_needed, token_quantum(b, response_len)),
    )


def prompt_groups_fit(rows, group_size: int, pieces, devices):
    """Whether a pass over `rows` rollout rows in `pieces` micro-batches on `devices` devices can run
    each GRPO group's prompt once (models/prefix.py): groups of >= 2 consecutive rows, every piece
    whole groups, and groups per piece a multiple of the devices (each device's rows whole groups).
    Elementwise over arrays (the cost model asks for a table of layouts at once)."""
    rows, pieces, devices = (np.asarray(x, np.int64) for x in (rows, pieces, devices))
    per = max(int(group_size), 1) * pieces
    return (group_size >= 2) & (np.mod(rows, per) == 0) & (np.mod(rows // per, devices) == 0)
