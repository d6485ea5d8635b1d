"""Collective costs on the topology graph against hand-computed values."""
import pytest

from planner.cluster import load_cluster
from planner.network import Group, all_gather_s, all_reduce_s, all_to_all_s, fabric, group, p2p_s

A100 = load_cluster("a100-80g", 64)      # 8 nodes of 8: NVLink 300 GB/s x 0.8, 8 NICs of 25 GB/s x 0.9
H100 = load_cluster("h100-80g", 16)
NVLINK = 300e9 * 0.8
NIC = 25e9 * 0.9


def test_fabric_is_read_off_the_graph():
    f = fabric(A100)
    assert f.intra_bytes_per_s == pytest.approx(NVLINK)
    assert f.net_bytes_per_s == pytest.approx(NIC)      # one rail NIC per GPU
    g = A100.graph()
    assert sum(1 for _, d in g.nodes(data=True) if d["kind"] == "gpu") == 64
    assert sum(1 for _, d in g.nodes(data=True) if d["kind"] == "nic") == 64


def test_v100_nics_are_shared_by_two_gpus():
    v100 = load_cluster("v100-32g", 32)                  # 16 GPUs and 8 NICs of 12.5 GB/s per node
    assert fabric(v100).net_bytes_per_s == pytest.approx(12.5e9 * 0.9 / 2)


def test_groups_follow_rank_order():
    assert group(A100, 8, 1) == Group(8, 8)              # a TP group fills a node
    assert group(A100, 8, 8) == Group(8, 1)              # its DP peers are one per node
    assert group(A100, 16, 2) == Group(16, 4)


def test_ring_all_reduce_inside_a_node():
    n, S = 8, 1e9
    expected = 2 * (n - 1) / n * S / NVLINK + 2 * (n - 1) * 1.9e-6
    assert all_reduce_s(A100, S, Group(8, 8)) == pytest.approx(expected)


def test_all_reduce_across_nodes_one_gpu_each():
    n, S = 8, 1e9
    bandwidth = 2 * (n - 1) / n * S / NIC
    tree_latency = 2 * 3 * 4e-6                           # log2(8) network hops, both ways
    assert all_reduce_s(A100, S, Group(8, 1)) == pytest.approx(bandwidth + tree_latency)


def test_all_reduce_spanning_nodes_uses_all_their_nics():
    n, S = 64, 1e9
    ring = 2 * (n - 1) / n * S / min(NVLINK, 8 * NIC)
    assert all_reduce_s(A100, S, Group(64, 8)) <= ring + 2 * (n - 1) * 4e-6
    assert all_reduce_s(A100, S, Group(64, 8)) < all_reduce_s(A100, S, Group(64, 1)) / 5


def test_nvlink_sharp_all_reduce_on_h100():
    S = 1e9
    assert all_reduce_s(H100, S, Group(8, 8)) == pytest.approx(S / 275e9 + 2 * 1.9e-6)


def test_all_gather_moves_half_of_an_all_reduce():
    S = 4e9
    assert all_gather_s(A100, S, Group(8, 8)) == pytest.approx(7 / 8 * S / NVLINK + 7 * 1.9e-6)


def test_a_ring_spanning_nodes_crosses_the_network_once_per_node():
    """NCCL's ring latency (tuning.cc): of an all-gather's 63 steps over 8 nodes of 8, 7 cross the network
    (4 us each) and 56 stay on NVLink (1.9 us each); an all-reduce goes round twice."""
    S = 4e9
    bandwidth = 63 / 64 * S / min(NVLINK, 8 * NIC)
    assert all_gather_s(A100, S, Group(64, 8)) == pytest.approx(bandwidth + 56 * 1.9e-6 + 7 * 4e-6)
    ring = 2 * 63 / 64 * S / min(NVLINK, 8 * NIC) + 2 * (56 * 1.9e-6 + 7 * 4e-6)
    assert all_reduce_s(A100, S, Group(64, 8)) <= ring


def test_all_to_all_bottleneck_is_the_network():
    S = 1e9
    expected = max(7 / 64 * S / NVLINK, 56 / 64 * S / NIC) + 63 * 4e-6
    assert all_to_all_s(A100, S, Group(64, 8)) == pytest.approx(expected)


def test_p2p():
    assert p2p_s(A100, 1e8, same_node=True) == pytest.approx(1e8 / NVLINK + 1.9e-6)
    assert p2p_s(A100, 1e8, same_node=False) == pytest.approx(1e8 / NIC + 4e-6)
