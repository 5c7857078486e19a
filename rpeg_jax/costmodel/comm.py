"""Collectives priced on the level of the hierarchy a mesh axis spans, and resharding costs.

A mesh axis of `size` devices with `stride` (devices between neighbours; the mesh is laid out
row-major with `tensor` innermost) has k members inside each node and spans m = size / k nodes,
possibly several network groups. Collectives compose hierarchically (reduce-scatter in the
node, the cross-node part on each GPU's own NIC, all-gather in the node):

    all-reduce  m = 1: ring in the node     2(k-1)/k · S / B_node(k)
                m > 1: RS in node + AR across nodes on S/k per rail + AG in node
                       2(k-1)/k · S / B_node + 2(m-1)/m · (S/k) / B_nic
    all-gather / reduce-scatter (S = the full buffer):  (m-1)/m · (S/k) / B_nic + (k-1)/k · S / B_node
    all-to-all  (S = one device's buffer): max(in-node share / B_node, cross-node share / B_nic)
    p2p         S / B_level

Every bandwidth is the line rate times an efficiency looked up by message size in the profile's
busbw table (interpolated in log-log: NCCL switches protocol and channel count with the
size, so one α-β line fitted to the large messages of the Alps nccl-tests data is 16-68% off at
1-8 MB), and each step pays the level's latency α. All functions take numpy arrays (broadcasting).

Callers: costmodel/stages.py, costmodel/candidates.py, tests.
"""

from __future__ import annotations

import numpy as np

from rpeg_jax.costmodel.hardware import HardwareProfile, interp_eff

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def axis_span(hw: HardwareProfile, size, stride=1):
    """(k devices per node, m nodes, spans-several-groups flag) of a mesh axis; arrays broadcast."""
    size = np.asarray(size, np.float64)
    stride = np.asarray(stride, np.float64)
    node = float(hw.node.devices)
    k = np.where(stride >= node, 1.0, np.minimum(size, np.maximum(np.floor(node / stride), 1.0)))
    m = np.ceil(size / k)
    multi_group = (size * stride > hw.network.group_devices) & (m > 1)
    return k, m, multi_group


def _bw_node(hw: HardwareProfile, k, nbytes):
    return hw.node_bw(k) * interp_eff(hw.efficiency.intra_node, nbytes)


def _bw_net(hw: HardwareProfile, nbytes, multi_group):
    taper = np.where(multi_group, hw.network.global_taper, 1.0)
    return hw.network.nic_bw * interp_eff(hw.efficiency.inter_node, nbytes) / taper


def _steps(n):
    """Latency steps of a ring of n (bounded by a tree's 2·log2 n, as NCCL switches to trees)."""
    n = np.asarray(n, np.float64)
    return np.where(n > 1, np.minimum(n - 1.0, 2.0 * np.ceil(np.log2(np.maximum(n, 2.0)))), 0.0)


def collective_time(hw: HardwareProfile, op: str, nbytes, size, stride=1):
    """Seconds for one collective `op` over a mesh axis of `size` devices with `stride`.

    nbytes: all_reduce the buffer; all_gather the gathered output; reduce_scatter the input;
    all_to_all one device's buffer; p2p the message. size == 1 costs 0."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    S = np.asarray(nbytes, np.float64)
    k, m, mg = axis_span(hw, size, stride)
    p = k * m
    a_node, a_net = hw.node.latency_s, hw.network.latency_s
    if op == "all_reduce":
        intra = 2.0 * (k - 1) / k * S / _bw_node(hw, k, S) + 2.0 * _steps(k) * a_node
        inter = np.where(m > 1, 2.0 * (m - 1) / m * (S / k) / _bw_net(hw, S / k, mg) + 2.0 * _steps(m) * a_net, 0.0)
        t = intra + inter
    elif op in ("all_gather", "reduce_scatter"):
        intra = (k - 1) / k * S / _bw_node(hw, k, S) + _steps(k) * a_node
        inter = np.where(m > 1, (m - 1) / m * (S / k) / _bw_net(hw, S / k, mg) + _steps(m) * a_net, 0.0)
        t = intra + inter
    elif op == "all_to_all":
        in_node = S * (k - 1) / p
        cross = S * (p - k) / p
        t = np.maximum(in_node / _bw_node(hw, k, S / p), cross / _bw_net(hw, S / p, mg)) + np.where(
            m > 1, a_net, a_node
        ) * np.log2(np.maximum(p, 2.0))
    else:  # p2p between two members of the axis: the slowest level it crosses
        t = np.where(m > 1, S / _bw_net(hw, S, mg) + a_net, S / _bw_node(hw, 2.0, S) + a_node)
    return np.where(p > 1, t, 0.0)


def reshard_time(hw: HardwareProfile, param_bytes, src_shards, dst_shards, group):
    """Move a model's weights (`param_bytes` in the target dtype) from a layout splitting them
    `src_shards` ways to one splitting them `dst_shards` ways on the same `group` of devices.

    Each device must receive the part of its target shard it does not already hold
    (aligned layouts: it holds min(src, dst) of it). Priced as an all-gather over the
    src/dst ratio when gathering, as free slicing when splitting further."""
    src = np.asarray(src_shards, np.float64)
    dst = np.asarray(dst_shards, np.float64)
    target = np.asarray(param_bytes, np.float64) / dst
    ratio = np.maximum(src / dst, 1.0)
    # The gather runs among the `ratio` devices that jointly hold one target shard; they sit
    # inside the innermost axes of the group (stride 1) when ratio <= group.
    t = collective_time(hw, "all_gather", target, np.minimum(ratio, group), 1)
    return np.where(ratio > 1, t, 0.0)


def transfer_time(hw: HardwareProfile, param_bytes, n_src, n_dst, dst_shards):
    """Weights from a training group of `n_src` devices to a disjoint generation group of `n_dst`
    devices holding `dst_shards`-way shards (split placement): every receiver takes
    param_bytes/dst_shards over its own NIC, senders stripe the whole model over their NICs,
    and receivers relay to later replicas (a pipelined broadcast) so the time is the larger of
    the two plus a log-depth latency."""
    B = np.asarray(param_bytes, np.float64)
    shard = B / np.asarray(dst_shards, np.float64)
    recv = shard / _bw_net(hw, shard, False)
    send = B / (np.asarray(n_src, np.float64) * _bw_net(hw, B / np.asarray(n_src, np.float64), False))
    depth = np.ceil(np.log2(np.maximum(np.asarray(n_dst, np.float64) / np.asarray(dst_shards, np.float64), 1.0) + 1))
    return np.maximum(recv, send) + depth * hw.network.latency_s
