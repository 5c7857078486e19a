"""Collectives priced on the hierarchy level a mesh axis spans; resharding and transfers."""

import numpy as np
import pytest

from rpeg_jax.costmodel import comm
from rpeg_jax.costmodel.hardware import interp_eff, load_hardware

GH = load_hardware("gh200", calibrated=False)
H100 = load_hardware("h100", calibrated=False)


def test_axis_span_levels():
    # tensor innermost (stride 1): 4 stay in a GH200 node (NVLink), 8 span two nodes.
    k, m, mg = comm.axis_span(GH, 4, 1)
    assert (k, m, mg) == (4, 1, False)
    k, m, _ = comm.axis_span(GH, 8, 1)
    assert (k, m) == (4, 2)
    # An axis outside a 4-wide inner axis: one member per node.
    k, m, _ = comm.axis_span(GH, 16, 4)
    assert (k, m) == (1, 16)
    # 8 inside an H100 node; 128 devices with stride 4 leave the 448-GPU dragonfly group.
    assert comm.axis_span(H100, 8, 1)[1] == 1
    assert bool(comm.axis_span(GH, 128, 4)[2]) and not bool(comm.axis_span(GH, 64, 4)[2])


def test_allreduce_in_node_uses_nvlink_hand_formula():
    S = 256e6
    t = float(comm.collective_time(GH, "all_reduce", S, 4, 1))
    bw = 3 * 150e9 * interp_eff(GH.efficiency.intra_node, S)
    hand = 2 * 3 / 4 * S / bw + 2 * 3 * GH.node.latency_s
    assert t == pytest.approx(hand, rel=1e-9)


def test_allreduce_across_nodes_hand_formula():
    S = 256e6  # 2 nodes x 4 GPUs: RS + AG in the node, AR of S/4 per rail across 2 nodes
    t = float(comm.collective_time(GH, "all_reduce", S, 8, 1))
    intra = 2 * 3 / 4 * S / (450e9 * interp_eff(GH.efficiency.intra_node, S)) + 2 * 3 * GH.node.latency_s
    inter = 2 * 1 / 2 * (S / 4) / (25e9 * interp_eff(GH.efficiency.inter_node, S / 4)) + 2 * 1 * GH.network.latency_s
    assert t == pytest.approx(intra + inter, rel=1e-9)
    # Crossing nodes costs far more than staying on NVLink.
    assert t > 3 * float(comm.collective_time(GH, "all_reduce", S, 4, 1))


def test_allreduce_matches_alps_measurement_within_reason():
    # CSCS's nccl-tests on Alps (docs.cscs.ch), 2 nodes x 1 GPU, 128 MiB all-reduce: 5.87 ms.
    t = float(comm.collective_time(GH, "all_reduce", 128 * 2**20, 2, 4))
    assert t == pytest.approx(5.87e-3, rel=0.1)
    # 2 nodes x 4 GPUs, 128 MiB: 1.92 ms.
    t8 = float(comm.collective_time(GH, "all_reduce", 128 * 2**20, 8, 1))
    assert t8 == pytest.approx(1.92e-3, rel=0.15)


@pytest.mark.parametrize("op", comm.OPS)
@pytest.mark.parametrize("size, stride", [(4, 1), (8, 1), (64, 4)])
def test_time_monotone_in_message_size(op, size, stride):
    sizes = np.logspace(2, 10, 300)
    t = comm.collective_time(GH, op, sizes, size, stride)
    assert np.all(np.diff(t) >= 0)
    assert np.all(t > 0)


def test_single_device_is_free_and_bad_op():
    assert float(comm.collective_time(GH, "all_gather", 1e9, 1, 1)) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        comm.collective_time(GH, "allreduce", 1.0, 2)


def test_allgather_reduce_scatter_half_of_allreduce_bandwidth_term():
    S = 1e9
    ag = float(comm.collective_time(GH, "all_gather", S, 4, 1))
    ar = float(comm.collective_time(GH, "all_reduce", S, 4, 1))
    assert ag == pytest.approx(ar / 2, rel=1e-6)


def test_reshard_and_transfer():
    W = 15e9
    assert float(comm.reshard_time(GH, W, 4, 4, 256)) == 0.0
    assert float(comm.reshard_time(GH, W, 2, 8, 256)) == 0.0  # splitting further: slicing only
    gather = float(comm.reshard_time(GH, W, 32, 4, 256))  # fsdp 32 -> tensor 4: gather over 8
    assert gather == pytest.approx(float(comm.collective_time(GH, "all_gather", W / 4, 8, 1)))
    t1 = float(comm.transfer_time(GH, W, 64, 192, 4))
    t2 = float(comm.transfer_time(GH, 2 * W, 64, 192, 4))
    assert t2 == pytest.approx(2 * t1, rel=0.05)
    # Each receiver takes W/4 through one 25 GB/s NIC: at least W/4/25e9 seconds.
    assert t1 >= W / 4 / 25e9
