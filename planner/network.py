"""The cost of a collective over a group of GPUs, read off the cluster graph.

Time = latency terms + bytes over the bottleneck bandwidth the group crosses,
for ring, tree, hierarchical and (on NVSwitch with SHARP) NVLS algorithms; the
runtime (NCCL) picks the fastest, so we take the minimum. The bandwidth factors
are the ones nccl-tests uses to define bus bandwidth (NVIDIA/nccl-tests,
doc/PERFORMANCE.md): all-reduce moves 2(n-1)/n of the buffer through each
rank's link, all-gather and reduce-scatter (n-1)/n, all-to-all (n-1)/n.

Ranks are laid out tp fastest, then cp, then dp, then pp (Megatron-LM's order),
so a group is described by its size and how many of its ranks share a node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .cluster import Cluster


@dataclass(frozen=True)
class Group:
    """A communicator: ``size`` ranks, ``per_node`` of them on each node it spans."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, self.size // self.per_node)


def group(cluster: Cluster, size: int, stride: int) -> Group:
    """The group of ``size`` ranks spaced ``stride`` apart in rank order."""
    if size <= 1:
        return Group(1, 1)
    if cluster.num_gpus <= cluster.gpus_per_node:
        return Group(size, size)              # a single node holds every rank
    per_node = 1 if stride >= cluster.gpus_per_node else min(size, cluster.gpus_per_node // stride)
    return Group(size, max(1, per_node))


@dataclass(frozen=True)
class Fabric:
    """Per-GPU bandwidths and per-step latencies, derived from the topology graph."""

    intra_bytes_per_s: float      # GPU to GPU through the node switch, per direction, achievable
    net_bytes_per_s: float        # one GPU's share of its NIC, per direction, achievable
    intra_latency_s: float
    net_latency_s: float
    nvls_bytes_per_s: float       # NVLink SHARP all-reduce algorithm bandwidth inside a node (0: none)
    host_bytes_per_s: float       # GPU to host memory (offload)


def fabric(cluster: Cluster) -> Fabric:
    """Bottleneck bandwidths from the edges of a two-node slice of the cluster graph
    (computed once per cluster value and kept on it: it depends on nothing else)."""
    cached = cluster.__dict__.get("_fabric")
    if cached is None:
        cached = _fabric(cluster)
        object.__setattr__(cluster, "_fabric", cached)
    return cached


def _fabric(cluster: Cluster) -> Fabric:
    import networkx as nx

    sample = cluster.with_gpus(min(cluster.num_gpus, 2 * cluster.gpus_per_node))
    g = sample.graph()

    def achievable(u, v):
        edge = g.edges[u, v]
        return edge["bytes_per_s"] * edge["efficiency"]

    intra = math.inf
    if sample.num_gpus > 1:
        path = nx.shortest_path(g, "gpu0", "gpu1")
        intra = min(achievable(u, v) for u, v in zip(path, path[1:]))
    net = 0.0
    nics = [n for n in g.neighbors("gpu0") if g.nodes[n]["kind"] == "nic"]
    if nics:
        nic = nics[0]
        sharing = sum(1 for n in g.neighbors(nic) if g.nodes[n]["kind"] == "gpu")
        uplink = next(n for n in g.neighbors(nic) if g.nodes[n]["kind"] == "leaf-switch")
        net = min(achievable("gpu0", nic), achievable(nic, uplink) / sharing)
    return Fabric(intra_bytes_per_s=intra, net_bytes_per_s=net, intra_latency_s=cluster.intra.latency_s,
                  net_latency_s=cluster.nic.latency_s, nvls_bytes_per_s=cluster.nvls_allreduce_bytes_per_s,
                  host_bytes_per_s=host_bytes_per_s(cluster))


def host_bytes_per_s(cluster: Cluster) -> float:
    """What one GPU copies to or from host memory per second while every GPU of its node copies too (the
    plans are symmetric, so they do): its own PCIe link, or its share of the PCIe switch's one uplink to
    the CPU where GPUs share a switch ([host] gpus_per_uplink; the uplink is as wide as a GPU's link)."""
    return cluster.host.bytes_per_s / max(1, min(cluster.gpus_per_host_uplink, cluster.num_gpus))


def _ring_bandwidth(f: Fabric, grp: Group) -> float:
    """Bus bandwidth of a ring: the slower of the NVLink hop and the node's share of NICs.

    With k ranks per node NCCL runs k channels, each leaving the node through
    a different NIC, so the network hop carries k times one GPU's NIC share.
    """
    bw = math.inf
    if grp.per_node > 1:
        bw = f.intra_bytes_per_s
    if grp.nodes > 1:
        bw = min(bw, grp.per_node * f.net_bytes_per_s)
    return bw


def _step_latency(f: Fabric, grp: Group) -> float:
    return f.net_latency_s if grp.nodes > 1 else f.intra_latency_s


def ring_latency_s(f: Fabric, grp: Group, passes: int = 1) -> float:
    """The latency of a ring's ``passes`` trips round the group (all-gather and reduce-scatter 1, all-reduce 2):
    of its ``passes x (n - 1)`` steps, ``passes x (nodes - 1)`` cross the network at its per-step latency and the
    rest move between GPUs of a node at NVLink's (NCCL src/graph/tuning.cc, ncclTopoTuneModel: latency +=
    (nsteps - nInterSteps) x intraLat + nInterSteps x interLat, nInterSteps = nNodes - 1, 2 (nNodes - 1) for
    all-reduce)."""
    n, nodes = grp.size, grp.nodes
    inter = passes * (nodes - 1) if nodes > 1 else 0
    return (passes * (n - 1) - inter) * f.intra_latency_s + inter * f.net_latency_s


def all_reduce_s(cluster: Cluster, nbytes: float, grp: Group) -> float:
    """All-reduce of a ``nbytes`` buffer on every rank: min over ring, tree, hierarchical, NVLS."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    f = fabric(cluster)
    bw = _ring_bandwidth(f, grp)
    ring = 2 * (n - 1) / n * nbytes / bw + ring_latency_s(f, grp, passes=2)
    best = ring
    if grp.nodes > 1:
        # double binary tree between nodes, chain inside: same bus bandwidth, log latency
        tree_latency = 2 * (math.ceil(math.log2(grp.nodes)) * f.net_latency_s + (grp.per_node - 1) * f.intra_latency_s)
        best = min(best, 2 * (n - 1) / n * nbytes / bw + tree_latency)
        if grp.per_node > 1:
            # reduce-scatter in the node, all-reduce of 1/k across nodes on each GPU's NIC, all-gather
            k, nodes = grp.per_node, grp.nodes
            hier = (2 * (k - 1) / k * nbytes / f.intra_bytes_per_s + 4 * (k - 1) * f.intra_latency_s
                    + 2 * (nodes - 1) / nodes * (nbytes / k) / f.net_bytes_per_s + 2 * (nodes - 1) * f.net_latency_s)
            best = min(best, hier)
    elif f.nvls_bytes_per_s and grp.per_node > 2:
        best = min(best, nbytes / f.nvls_bytes_per_s + 2 * f.intra_latency_s)
    return best


def all_gather_s(cluster: Cluster, nbytes: float, grp: Group) -> float:
    """All-gather whose *output* is ``nbytes`` on every rank (each contributes nbytes / n)."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return all_gather_bandwidth_s(cluster, nbytes, grp) + ring_latency_s(fabric(cluster), grp)


def all_gather_bandwidth_s(cluster: Cluster, nbytes: float, grp: Group, *, ratio: float | None = None) -> float:
    """The bandwidth term of ``all_gather_s`` (no per-step latency): linear in the bytes. Inside a node
    at the profile's all-gather bus bandwidth against all-reduce's ([intra_node]
    all_gather_busbw_ratio; or ``ratio``)."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    r = (cluster.intra_all_gather_ratio if ratio is None else ratio) if grp.nodes == 1 else 1.0
    return (n - 1) / n * nbytes / (_ring_bandwidth(fabric(cluster), grp) * r)


def reduce_scatter_s(cluster: Cluster, nbytes: float, grp: Group) -> float:
    """Reduce-scatter whose *input* is ``nbytes`` on every rank: the mirror of all-gather, inside a node
    at the profile's reduce-scatter bus bandwidth ([intra_node] reduce_scatter_busbw_ratio)."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (all_gather_bandwidth_s(cluster, nbytes, grp, ratio=cluster.intra_reduce_scatter_ratio)
            + ring_latency_s(fabric(cluster), grp))


def all_to_all_s(cluster: Cluster, nbytes: float, grp: Group) -> float:
    """All-to-all where each rank sends ``nbytes`` in total, 1/n to each peer."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    f = fabric(cluster)
    k = grp.per_node
    t_intra = (k - 1) / n * nbytes / f.intra_bytes_per_s if k > 1 else 0.0
    t_net = (n - k) / n * nbytes / f.net_bytes_per_s * cluster.oversubscription if grp.nodes > 1 else 0.0
    return max(t_intra, t_net) + (n - 1) * _step_latency(f, grp)


def p2p_s(cluster: Cluster, nbytes: float, *, same_node: bool) -> float:
    """One send/recv between two GPUs (all pairs of a pipeline boundary send at once)."""
    if nbytes <= 0:
        return 0.0
    f = fabric(cluster)
    if same_node or cluster.num_gpus <= cluster.gpus_per_node:
        return nbytes / f.intra_bytes_per_s + f.intra_latency_s
    return nbytes / f.net_bytes_per_s + f.net_latency_s


def host_transfer_s(cluster: Cluster, nbytes: float) -> float:
    """Copy between GPU and host memory over the GPU's PCIe link."""
    return nbytes / fabric(cluster).host_bytes_per_s if nbytes > 0 else 0.0
