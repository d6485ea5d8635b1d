"""Collective costs on the topology graph against hand-computed values."""
from dataclasses import replace
from pathlib import Path

import pytest

from planner.cluster import load_cluster
from planner.network import (Group, all_gather_s, all_reduce_choice, all_reduce_s, all_to_all_s, fabric, group, p2p_s,
                             reduce_scatter_s)

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


# NCCL's latencies (src/graph/tuning.cc at 5067397), microseconds: base Ring Simple 8.4, LL 6.6, LL128 14;
# per step Ring Simple 3.4 over NVLink, 14 over the network (Tree NET Simple 14 with one rank per node);
# a ring leaving the node pays at least the network post overhead (1 us, x3 for Simple) per NVLink step.
US = 1e-6


def test_ring_all_reduce_inside_a_node():
    """8 ranks on one node, 1 GB: the ring at Simple (LL128 would lose 8% of the bandwidth for 15 us)."""
    n, S = 8, 1e9
    expected = 2 * (n - 1) / n * S / NVLINK + (8.4 + 2 * (n - 1) * 3.4) * US
    assert all_reduce_s(A100, S, Group(8, 8)) == pytest.approx(expected)
    assert all_reduce_choice(A100, S, Group(8, 8)) == "ring/Simple"


def test_small_all_reduce_takes_the_low_latency_protocol():
    """10 kB inside a node: LL, whose latency (6.6 + 14 x 0.6 us) beats its halved bandwidth, which NCCL caps at
    87.7 GB/s on one Ampere node (tuning.cc llMaxBws; half of the 240 GB/s links would be 120)."""
    expected = (6.6 + 14 * 0.6) * US + 2 * 7 / 8 * 1e4 / 87.7e9
    assert all_reduce_s(A100, 1e4, Group(8, 8)) == pytest.approx(expected)
    assert all_reduce_choice(A100, 1e4, Group(8, 8)) == "ring/LL"


def test_all_reduce_across_nodes_one_gpu_each():
    """8 nodes, one rank each, 1 GB: the ring (14 network steps at the tree's 14 us) beats the tree, whose
    algorithm bandwidth is half its bus bandwidth at 92% (NCCL's model)."""
    n, S = 8, 1e9
    ring = 2 * (n - 1) / n * S / NIC + (8.4 + 2 * (n - 1) * 14) * US
    tree = S / (0.5 * NIC * 0.92) + (8.4 + 2 * 3 * 14) * US
    assert ring < tree
    assert all_reduce_s(A100, S, Group(8, 1)) == pytest.approx(ring)


def test_all_reduce_spanning_nodes_uses_all_their_nics():
    """64 ranks on 8 nodes: 8 channels leave each node through its 8 NICs; of the ring's 126 steps, 14 cross
    the network."""
    n, S = 64, 1e9
    ring = 2 * (n - 1) / n * S / min(NVLINK, 8 * NIC) + (8.4 + (126 - 14) * 3.4 + 14 * 14) * US
    assert all_reduce_s(A100, S, Group(64, 8)) == pytest.approx(ring)
    assert all_reduce_s(A100, S, Group(64, 8)) < all_reduce_s(A100, S, Group(64, 1)) / 5


def test_nvlink_sharp_all_reduce_on_h100():
    S = 1e9
    assert all_reduce_s(H100, S, Group(8, 8)) == pytest.approx(S / 275e9 + 25 * US)
    assert all_reduce_choice(H100, S, Group(8, 8)) == "nvls"


def test_nvls_tree_all_reduce_across_h100_nodes():
    """NCCL's NVLS-tree (tuning.cc NCCL_ALGO_NVLS_TREE): NVLS inside each node, a tree between them. Its bus
    bandwidth is the lesser of NVLS's inside the node (the measured 275 GB/s all-reduce on 8 GPUs as a bus
    bandwidth: x 2 x 7/8 = 481.25 GB/s) and the node's 8 NICs (8 x 50 GB/s x 0.9 = 360 GB/s; twice that on two
    nodes), turned into the algorithm's by n / 2 (n - 1); latency 25 us + 2 x log2(nodes) x 20.9 us. On two
    nodes NVLS binds: 1 GB in 1e9 / (481.25e9 x 16 / 30) + 66.8 us = 3.963 ms, under the ring's 1e9 x 30 / 16 /
    360e9 = 5.21 ms. On three the NICs bind (360 GB/s x 24 / 46) and the log latency still beats the ring's."""
    S = 1e9
    two = all_reduce_s(H100, S, Group(16, 8))
    assert two == pytest.approx(S / (481.25e9 * 16 / 30) + (25 + 2 * 20.9) * US)
    assert all_reduce_choice(H100, S, Group(16, 8)) == "nvls-tree"
    three = load_cluster("h100-80g", 24)
    assert all_reduce_s(three, S, Group(24, 8)) == pytest.approx(S / (360e9 * 24 / 46) + (25 + 2 * 20.9) * US)
    assert all_reduce_choice(three, S, Group(24, 8)) == "nvls-tree"
    # small messages take the double binary tree, whose per-hop latencies are lower: at LL128, as LL is held to
    # 39 GB/s across two nodes of Intel hosts (tuning.cc llMaxBws): 1 MB in 14 + 2 (7 x 1.25 + 8.5) us + 1e6 /
    # (0.5 x 0.92 x 120/128 x 360e9) = 54.9 us, against LL's 25.2 us + 1e6 / (0.5 x 39e9) = 76.5 us
    assert all_reduce_choice(H100, 1e6, Group(16, 8)) == "tree/LL128"
    assert all_reduce_s(H100, 1e6, Group(16, 8)) == pytest.approx((14 + 2 * (7 * 1.25 + 8.5)) * US
                                                                  + 1e6 / (0.5 * 0.92 * 120 / 128 * 360e9))


def test_collnet_all_reduce_where_the_switches_reduce():
    """With ``[network] collnet`` (SHARP in the switches, NCCL_COLLNET_ENABLE=1) all-reduce across nodes may take
    CollNet (tuning.cc): priced from the node's inside, half the NVLink bus bandwidth as the algorithm's, one
    network hop whatever the nodes. On 8 DGX A100 nodes (no NVLS) a 1 MB all-reduce takes CollNet Direct,
    2 (3.7 + 7 x 0.4) + 31 = 44 us + 1e6 / (0.5 x 240e9): 52.3 us, against the tree's 95.4 us without it (at LL128,
    14 + 2 (7 x 1.25 + 3 x 8.5) us + 1e6 / (0.5 x 0.92 x 120/128 x 180e9): LL is held to 19 GB/s across nodes of AMD
    hosts, tuning.cc llMaxBws). On 8 DGX
    H100 nodes: NVLS across nodes for 1 MB, 25 + 18 us + 1e6 / (min(481.25, 8 x 45) GB/s x 64 / 126), and CollNet
    Chain for 1 GB, 2 x 7 x 2.8 + 30 us + 1e9 / (0.5 x 369e9). Off, as NCCL's default is, nothing changes."""
    a100 = replace(A100, collnet=True)
    assert all_reduce_choice(a100, 1e6, Group(64, 8)) == "collnet-direct"
    assert all_reduce_s(a100, 1e6, Group(64, 8)) == pytest.approx((2 * (3.7 + 7 * 0.4) + 31) * US + 1e6 / (0.5 * NVLINK))
    assert all_reduce_choice(A100, 1e6, Group(64, 8)) == "tree/LL128"
    assert all_reduce_s(A100, 1e6, Group(64, 8)) == pytest.approx((14 + 2 * (7 * 1.25 + 3 * 8.5)) * US
                                                                  + 1e6 / (0.5 * 0.92 * 120 / 128 * 180e9))
    h100 = replace(load_cluster("h100-80g", 64), collnet=True)
    assert all_reduce_choice(h100, 1e6, Group(64, 8)) == "nvls"
    assert all_reduce_s(h100, 1e6, Group(64, 8)) == pytest.approx(43 * US + 1e6 / (360e9 * 64 / 126))
    assert all_reduce_choice(h100, 1e9, Group(64, 8)) == "collnet-chain"
    assert all_reduce_s(h100, 1e9, Group(64, 8)) == pytest.approx((2 * 7 * 2.8 + 30) * US + 1e9 / (0.5 * 369e9))


def test_collnet_all_gather_and_reduce_scatter_take_the_nodes_nics_once():
    """With ``[network] collnet``, all-gather and reduce-scatter across nodes may also take CollNet Direct (tuning.cc:
    ``ppn x min(bwIntra, 0.9 bwInter)`` as the algorithm's bandwidth, not converted by the ring's ratio) and NVLS
    across nodes. On DGX H100 nodes (NVLink bus 369 GB/s, NICs 45 GB/s each after the profile's efficiency, NVLS
    all-reduce 275 GB/s): CollNet Direct moves min(369, 0.9 x 8 x 45 = 324) GB/s, NVLS 275 x (7/8)^2 = 210.5 GB/s.
    1 MB on 64 ranks: CollNet Direct, 2 (3.7 + 7 x 0.4) + 31 = 44 us + 1e6 / 324e9 (the ring's LL: 87 us). 1 GB on
    64 ranks stays on the ring, (63/64) 1e9 / 360e9 + 8.4 + 56 x 3.4 + 7 x 14 us = 3.03 ms, against CollNet's 3.13;
    on 1,024 ranks the ring's 1,023 steps cost more (5.24 ms at LL128) and CollNet Direct's 3.13 ms wins. Off, or
    with more ranks on a node than NICs, nothing changes."""
    from planner.network import gather_or_scatter_choice
    h100 = load_cluster("h100-80g", 1024)
    on = replace(h100, collnet=True)
    assert gather_or_scatter_choice(on, 1e6, Group(64, 8)) == "collnet-direct"
    assert all_gather_s(on, 1e6, Group(64, 8)) == pytest.approx(44 * US + 1e6 / 324e9)
    assert reduce_scatter_s(on, 1e6, Group(64, 8)) == pytest.approx(44 * US + 1e6 / 324e9)
    assert gather_or_scatter_choice(h100, 1e6, Group(64, 8)) == "ring/LL"
    assert gather_or_scatter_choice(on, 1e9, Group(64, 8)) == "ring/Simple"
    assert all_gather_s(on, 1e9, Group(64, 8)) == pytest.approx(63 / 64 * 1e9 / 360e9 + (8.4 + 56 * 3.4 + 7 * 14) * US)
    assert gather_or_scatter_choice(on, 1e9, Group(1024, 8)) == "collnet-direct"
    assert all_gather_s(on, 1e9, Group(1024, 8)) == pytest.approx(44 * US + 1e9 / 324e9)
    assert all_gather_s(h100, 1e9, Group(1024, 8)) > 5.2e-3
    # NVLS across nodes where the NICs would be slower than NVLS's 210.5 GB/s: one NIC per node at 45 GB/s
    # cannot hold 8 ranks (more ranks than CollNet heads), so NCCL turns both off
    few_nics = replace(on, nics_per_node=1)
    assert gather_or_scatter_choice(few_nics, 1e6, Group(64, 8)).startswith("ring")


def test_a_profile_says_whether_its_switches_reduce(tmp_path):
    """``[network] collnet`` is read as a boolean (the built-in profiles say false: NCCL's default), off where
    absent; anything else names the field."""
    assert load_cluster("v100-32g", 16).collnet is False           # no such line
    from planner.errors import UserError
    base = load_cluster("h100-80g", 16)
    assert base.collnet is False
    text = Path(__file__).resolve().parents[1].joinpath("profiles", "h100-80g.toml").read_text()
    on = tmp_path / "on.toml"
    on.write_text(text.replace("\ncollnet = false", "\ncollnet = true", 1))
    assert load_cluster(str(on), 16).collnet is True
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("\ncollnet = false", "\ncollnet = \"yes\"", 1))
    with pytest.raises(UserError, match="true or false") as err:
        load_cluster(str(bad), 16)
    assert "network.collnet" in str(err.value)


def test_all_gather_moves_half_of_an_all_reduce():
    S = 4e9
    assert all_gather_s(A100, S, Group(8, 8)) == pytest.approx(7 / 8 * S / NVLINK + (8.4 + 7 * 3.4) * US)


def test_a_ring_spanning_nodes_crosses_the_network_once_per_node():
    """An all-gather's 63 steps over 8 nodes of 8: 7 cross the network (14 us), 56 stay on NVLink (3.4 us)."""
    S = 4e9
    bandwidth = 63 / 64 * S / min(NVLINK, 8 * NIC)
    assert all_gather_s(A100, S, Group(64, 8)) == pytest.approx(bandwidth + (8.4 + 56 * 3.4 + 7 * 14) * US)


def test_pat_gathers_across_one_rank_per_node():
    """1 MB over 8 nodes of one rank: PAT (8 + log2(8) x 14 / 3.5 + 8 x 2.8 us, at 75% of the NIC) beats the
    ring's 7 network steps at every protocol."""
    S = 1e6
    pat = (8.0 + 3 * 14 / 3.5 + 8 * 2.8) * US + S / (NIC * 0.75)
    ring_ll128 = (14 + 7 * 8.5) * US + 7 / 8 * S / (NIC * 0.92)
    assert pat < ring_ll128
    assert all_gather_s(A100, S, Group(8, 1)) == pytest.approx(pat)


def test_all_to_all_bottleneck_is_the_network():
    S = 1e9
    expected = max(7 / 64 * S / NVLINK, 56 / 64 * S / NIC) + 63 * 4e-6
    assert all_to_all_s(A100, S, Group(64, 8)) == pytest.approx(expected)


def test_p2p():
    assert p2p_s(A100, 1e8, same_node=True) == pytest.approx(1e8 / NVLINK + 1.9e-6)
    assert p2p_s(A100, 1e8, same_node=False) == pytest.approx(1e8 / NIC + 4e-6)


def test_ll_is_capped_by_gpu_generation_on_a_node_and_by_cpu_vendor_across_nodes(tmp_path):
    """NCCL's llMaxBws (tuning.cc at 5067397): LL's bus bandwidth on one node is at most 39, 87.7, 141 or 282 GB/s
    (Volta, Ampere, Hopper, Blackwell); across nodes 39 GB/s on two and 20.4 on more with Intel hosts, 22.5 and 19.0
    with AMD's. The profiles say which ([gpu] nccl_arch, [host] cpu_vendor); a profile without them (RCCL, gloo)
    is not capped, and any other value names the field."""
    from math import inf
    from planner.nccl import ll_max_bytes_per_s
    assert [ll_max_bytes_per_s(a, "intel", 1) for a in ("volta", "ampere", "hopper", "blackwell")] == \
        [39e9, 87.7e9, 141e9, 282e9]
    assert (ll_max_bytes_per_s("hopper", "intel", 2), ll_max_bytes_per_s("hopper", "intel", 8)) == (39e9, 20.4e9)
    assert (ll_max_bytes_per_s("ampere", "amd", 2), ll_max_bytes_per_s("ampere", "amd", 8)) == (22.5e9, 19e9)
    assert ll_max_bytes_per_s("blackwell", "arm", 9) == 20.4e9          # every vendor but AMD takes Intel's row
    assert ll_max_bytes_per_s("", "amd", 8) == inf
    assert (A100.nccl_arch, A100.cpu_vendor) == ("ampere", "amd")
    h100 = load_cluster("h100-80g", 16)
    assert (h100.nccl_arch, h100.cpu_vendor) == ("hopper", "intel")
    assert load_cluster("mi300x", 8).nccl_arch == ""
    from planner.errors import UserError
    text = Path(__file__).resolve().parents[1].joinpath("profiles", "h100-80g.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('nccl_arch = "hopper"', 'nccl_arch = "ada"', 1))
    with pytest.raises(UserError, match="not allowed") as err:
        load_cluster(str(bad), 16)
    assert "gpu.nccl_arch" in str(err.value)


def test_a_full_mesh_node_gives_two_gpus_one_link_and_the_whole_node_all_of_them():
    """MI300X: each of 8 GPUs wired to the 7 others by a 64 GB/s link of its own (448 GB/s over all, x 0.70 achieved).
    A pair meets over one link (a pipeline send, a TP-2 ring: 44.8 GB/s); a ring over 4 GPUs uses the 3 links among
    them; over the node, all 7 (RCCL's rings over every link); an all-to-all sends each peer's share over its link.
    Through a switch (H100) any group gets the full rate."""
    mi = load_cluster("mi300x", 8)
    link = 448e9 * 0.70 / 7
    assert fabric(mi).intra_peers == 7 and fabric(H100).intra_peers == 0
    latency = mi.intra.latency_s
    assert p2p_s(mi, 1e9, same_node=True) == pytest.approx(1e9 / link + latency)
    # the ring at NCCL's Simple latencies (8.4 us, 3.4 a step, as in test_ring_all_reduce_inside_a_node)
    ring = lambda k: 2 * (k - 1) / k * 1e9 / ((k - 1) * link) + (8.4 + 2 * (k - 1) * 3.4) * US    # noqa: E731
    for k in (2, 4, 8):
        assert all_reduce_s(mi, 1e9, Group(k, k)) == pytest.approx(ring(k))
    # 1 GB sent by each of 8 ranks, 1/8 to each peer over its own link
    assert all_to_all_s(mi, 1e9, Group(8, 8)) == pytest.approx(1e9 / 8 / link + 7 * latency)
    h100_link = fabric(H100).intra_bytes_per_s
    assert p2p_s(H100, 1e9, same_node=True) == pytest.approx(1e9 / h100_link + H100.intra.latency_s)
