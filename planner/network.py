"""The cost of a collective over a group of GPUs, read off the cluster graph.

Time = latency + bytes over the bottleneck bandwidth the group crosses, for each algorithm and
protocol NCCL runs (ring; tree for all-reduce across nodes; PAT for all-gather and reduce-scatter
with one rank per node; NVLS inside an NVSwitch node with NVLink SHARP), priced as NCCL prices them
(planner/nccl.py: its latencies and protocol factors); NCCL picks the cheapest, and so do we. The bandwidth factors
are the ones nccl-tests uses to define bus bandwidth (NVIDIA/nccl-tests,
doc/PERFORMANCE.md): all-reduce moves 2(n-1)/n of the buffer through each
rank's link, all-gather and reduce-scatter (n-1)/n, all-to-all (n-1)/n.

Ranks are laid out tp fastest, then cp, then dp, then pp (Megatron-LM's order),
so a group is described by its size and how many of its ranks share a node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import nccl
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

    intra_bytes_per_s: float      # GPU to GPU through the node switch, per direction, achievable (a mesh: over all
                                  # of a GPU's links together)
    net_bytes_per_s: float        # one GPU's share of its NIC, per direction, achievable
    intra_latency_s: float
    net_latency_s: float
    nvls_bytes_per_s: float       # NVLink SHARP all-reduce algorithm bandwidth inside a node (0: none)
    host_bytes_per_s: float       # GPU to host memory (offload)
    intra_peers: int = 0          # a full mesh: the peers a GPU has a link of its own to, which share intra_bytes_per_s
                                  # evenly; 0: a switch, through which any pair of GPUs reaches the full rate


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
                  host_bytes_per_s=host_bytes_per_s(cluster),
                  intra_peers=cluster.gpus_per_node - 1 if cluster.fabric == "mesh" else 0)


def host_bytes_per_s(cluster: Cluster) -> float:
    """What one GPU copies to or from host memory per second while every GPU of its node copies too (the
    plans are symmetric, so they do): its own PCIe link, or its share of the PCIe switch's one uplink to
    the CPU where GPUs share a switch ([host] gpus_per_uplink; the uplink is as wide as a GPU's link)."""
    return cluster.host.bytes_per_s / max(1, min(cluster.gpus_per_host_uplink, cluster.num_gpus))


def intra_bytes_per_s(f: Fabric, k: int) -> float:
    """What one GPU moves per second, per direction, among ``k`` GPUs of its node: through a switch the full rate;
    in a full mesh only its links to the other k - 1 (each of its ``intra_peers`` links carries an equal share: AMD's
    MI300X platform wires each of 8 GPUs to the 7 others by an Infinity Fabric link of its own), so two GPUs meet over
    one link, and a collective over the whole node uses every link (RCCL lays its rings over all of them)."""
    if not f.intra_peers:
        return f.intra_bytes_per_s
    return f.intra_bytes_per_s * min(max(k - 1, 1), f.intra_peers) / f.intra_peers


def _ring_bandwidth(f: Fabric, grp: Group) -> float:
    """Bus bandwidth of a ring: the slower of the NVLink hop and the node's share of NICs.

    With k ranks per node NCCL runs k channels, each leaving the node through
    a different NIC, so the network hop carries k times one GPU's NIC share.
    """
    bw = math.inf
    if grp.per_node > 1:
        bw = intra_bytes_per_s(f, grp.per_node)
    if grp.nodes > 1:
        bw = min(bw, grp.per_node * f.net_bytes_per_s)
    return bw


def _step_latency(f: Fabric, grp: Group) -> float:
    return f.net_latency_s if grp.nodes > 1 else f.intra_latency_s


def _runs_nccl(cluster: Cluster) -> bool:
    """GPUs run NCCL; a CPU cluster runs gloo, whose ring is priced at its profile's measured step latency."""
    return cluster.device_kind == "cuda"


def _gloo_ring_latency_s(f: Fabric, grp: Group) -> float:
    """One trip round a gloo ring: a step per rank at the profile's measured latency, the network's for a step
    that leaves the node."""
    inter = grp.nodes - 1 if grp.nodes > 1 else 0
    return (grp.size - 1 - inter) * f.intra_latency_s + inter * f.net_latency_s


def all_reduce_s(cluster: Cluster, nbytes: float, grp: Group) -> float:
    """All-reduce of a ``nbytes`` buffer on every rank, as NCCL runs it (planner/nccl.py): the cheapest of the
    ring and, across nodes, the double binary tree, each at its best protocol; inside an NVSwitch node with
    NVLink SHARP also NVLS, at the profile's measured bandwidth, and across such nodes NVLS-tree."""
    return _all_reduce(cluster, nbytes, grp)[1]


def all_reduce_choice(cluster: Cluster, nbytes: float, grp: Group) -> str:
    """The algorithm and protocol ``all_reduce_s`` prices (``ring/Simple``, ``tree/LL128``, ``nvls``...)."""
    return _all_reduce(cluster, nbytes, grp)[0]


def _all_reduce(cluster: Cluster, nbytes: float, grp: Group) -> tuple[str, float]:
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return "none", 0.0
    f = fabric(cluster)
    bw = _ring_bandwidth(f, grp)
    if not _runs_nccl(cluster):
        return "gloo ring", 2 * (n - 1) / n * nbytes / bw + 2 * _gloo_ring_latency_s(f, grp)
    ll_max = nccl.ll_max_bytes_per_s(cluster.nccl_arch, cluster.cpu_vendor, grp.nodes)
    options = {f"ring/{p}": nccl.ring_latency_s(n, grp.nodes, p, passes=2) + 2 * (n - 1) / n * nbytes /
               nccl.ring_bus_bw(bw, p, ll_max) for p in nccl.PROTOCOLS}
    if grp.nodes > 1:
        # NCCL's algorithm bandwidth of the tree is half its bus bandwidth (tuning.cc: ratio .5)
        options.update({f"tree/{p}": nccl.tree_latency_s(n, grp.nodes, p) + nbytes / (
            0.5 * nccl.tree_bus_bw(bw, p, ll_max)) for p in nccl.PROTOCOLS})
        if f.nvls_bytes_per_s and grp.per_node > 2:
            # NVLS-tree (tuning.cc NCCL_ALGO_NVLS_TREE): per channel the lesser of NVLS's bandwidth inside the node
            # (the measured all-reduce's, as a bus bandwidth: x 2 (k - 1) / k on its k GPUs) and the network's (on
            # two nodes twice it); NCCL's ring ratio turns the bus bandwidth into the algorithm's, n / 2 (n - 1)
            net_bus = grp.per_node * f.net_bytes_per_s * (2 if grp.nodes <= 2 else 1)
            options["nvls-tree"] = nccl.nvls_tree_latency_s(grp.nodes) + nbytes / _ring_algorithm_bw(
                min(_nvls_bus_bandwidth(f, grp.per_node), net_bus), n)
        if cluster.collnet and grp.per_node > 1:
            options.update(_collnet_all_reduce(cluster, f, nbytes, grp))
    elif f.nvls_bytes_per_s and grp.per_node > 2:
        options["nvls"] = nbytes / f.nvls_bytes_per_s + nccl.nvls_latency_s()
    return nccl.cheapest(options)


def _collnet_all_reduce(cluster: Cluster, f: Fabric, nbytes: float, grp: Group) -> dict[str, float]:
    """All-reduce across nodes whose switches reduce in the network (SHARP) through NCCL's CollNet (tuning.cc at
    5067397): the switch does the reduction between nodes, so NCCL prices CollNet from the node's inside (its
    graphs' ``bwIntra``: here the NVLink bus bandwidth) at half as the algorithm's bandwidth (ratio .5).
    Direct (NVSwitch nodes only): each GPU reaches the network through its own NIC, slower by the GPUs per NIC
    (``factor - (factor - 1) / 2``) and at 85% on compute capability 9.0 and later (taken here as the GPUs with
    FP8 tensor cores, NVSwitch systems being Hopper and later among those). Chain: the node's ranks in a chain.
    NVLS across nodes: NVLS's bus bandwidth inside the node against the NICs', NCCL's ring ratio n / 2 (n - 1)."""
    n, k = grp.size, grp.per_node
    out = {"collnet-chain": nccl.collnet_chain_latency_s(k) + nbytes / (0.5 * intra_bytes_per_s(f, k))}
    if cluster.fabric == "nvswitch":
        factor = k / max(1, min(k, cluster.nics_per_node))
        factor -= (factor - 1) / 2
        bus = f.intra_bytes_per_s / factor * (nccl.COLLNET_DIRECT_HOPPER_BW if cluster.device.fp8_peak_flops else 1.0)
        out["collnet-direct"] = nccl.collnet_direct_latency_s(k) + nbytes / (0.5 * bus)
    if f.nvls_bytes_per_s and k > 2:
        out["nvls"] = nccl.nvls_nodes_latency_s() + nbytes / _ring_algorithm_bw(
            min(_nvls_bus_bandwidth(f, k), k * f.net_bytes_per_s), n)
    return out


def _nvls_bus_bandwidth(f: Fabric, per_node: int) -> float:
    """NVLS's bus bandwidth inside a node of ``per_node`` GPUs: the profile's measured all-reduce algorithm
    bandwidth times 2 (k - 1) / k."""
    return f.nvls_bytes_per_s * 2 * (per_node - 1) / per_node


def _ring_algorithm_bw(bus: float, n: int) -> float:
    """An all-reduce's algorithm bandwidth from its bus bandwidth on ``n`` ranks (tuning.cc: nRanks / nsteps,
    n / 2 (n - 1))."""
    return bus * n / (2 * (n - 1))


def all_gather_s(cluster: Cluster, nbytes: float, grp: Group) -> float:
    """All-gather whose *output* is ``nbytes`` on every rank (each contributes nbytes / n), as NCCL runs it:
    the ring at its best protocol, across nodes with one rank each PAT, and where the profile's switches reduce
    (``[network] collnet``) CollNet Direct and NVLS across nodes (planner/nccl.py)."""
    return _gather_or_scatter(cluster, nbytes, grp, cluster.intra_all_gather_ratio)[1]


def gather_or_scatter_choice(cluster: Cluster, nbytes: float, grp: Group) -> str:
    """The algorithm and protocol ``all_gather_s`` and ``reduce_scatter_s`` price (``ring/Simple``, ``pat``,
    ``collnet-direct``...)."""
    return _gather_or_scatter(cluster, nbytes, grp, cluster.intra_all_gather_ratio)[0]


def all_gather_bandwidth_s(cluster: Cluster, nbytes: float, grp: Group, *, ratio: float | None = None) -> float:
    """The bandwidth term of a ring all-gather at NCCL's Simple protocol (no latency): linear in the bytes.
    Inside a node at the profile's all-gather bus bandwidth against all-reduce's ([intra_node]
    all_gather_busbw_ratio; or ``ratio``)."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    r = (cluster.intra_all_gather_ratio if ratio is None else ratio) if grp.nodes == 1 else 1.0
    return (n - 1) / n * nbytes / (_ring_bandwidth(fabric(cluster), grp) * r)


def reduce_scatter_s(cluster: Cluster, nbytes: float, grp: Group) -> float:
    """Reduce-scatter whose *input* is ``nbytes`` on every rank: the mirror of all-gather, inside a node
    at the profile's reduce-scatter bus bandwidth ([intra_node] reduce_scatter_busbw_ratio)."""
    return _gather_or_scatter(cluster, nbytes, grp, cluster.intra_reduce_scatter_ratio)[1]


def _gather_or_scatter(cluster: Cluster, nbytes: float, grp: Group, ratio: float) -> tuple[str, float]:
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return "none", 0.0
    simple = all_gather_bandwidth_s(cluster, nbytes, grp, ratio=ratio)
    if not _runs_nccl(cluster):
        return "gloo ring", simple + _gloo_ring_latency_s(fabric(cluster), grp)
    # the ring's links carry (n - 1) / n of the bytes at the bus bandwidth ``simple`` takes; each protocol delivers
    # its share of it
    moved = (n - 1) / n * nbytes
    bus = moved / simple
    ll_max = nccl.ll_max_bytes_per_s(cluster.nccl_arch, cluster.cpu_vendor, grp.nodes)
    options = {f"ring/{p}": nccl.ring_latency_s(n, grp.nodes, p) + moved / nccl.ring_bus_bw(bus, p, ll_max)
               for p in nccl.PROTOCOLS}
    if grp.nodes > 1 and grp.per_node == 1:
        options["pat"] = nccl.pat_latency_s(n, grp.nodes) + nbytes / (_ring_bandwidth(fabric(cluster), grp)
                                                                      * nccl.PAT_BW)
    if grp.nodes > 1 and cluster.collnet and 1 < grp.per_node <= cluster.nics_per_node:
        options.update(_collnet_gather_or_scatter(cluster, fabric(cluster), nbytes, grp))
    return nccl.cheapest(options)


def _collnet_gather_or_scatter(cluster: Cluster, f: Fabric, nbytes: float, grp: Group) -> dict[str, float]:
    """All-gather or reduce-scatter across nodes through NCCL's CollNet (tuning.cc at 5067397), where the profile
    says NCCL runs it (``[network] collnet``, with a CollNet plugin that has ``iallgather`` and ``ireducescatter``)
    and every rank of a node has a NIC of its own (NCCL turns both off where a node's ranks outnumber its CollNet
    heads). Neither is converted by the ring's ratio: the bandwidth is the algorithm's. CollNet Direct (NVSwitch
    nodes): ``ppn x min(bwIntra, 0.9 bwInter)``, each GPU's share of NVLink against 90% of its NIC, over the node's
    ranks: the node's NICs bring each byte in once and NVLink spreads it. NVLS across nodes: NVLS's bus bandwidth
    for all-gather, ``(ppn - 1) / ppn`` where all-reduce's is 2 (here from the profile's measured NVLS all-reduce,
    whose bus bandwidth ``_nvls_bus_bandwidth`` is 2 (k - 1) / k of it), against the node's NICs. Latencies as the
    all-reduce's (``nccl.collnet_direct_latency_s``, ``nccl.nvls_nodes_latency_s``)."""
    k = grp.per_node
    out = {}
    if cluster.fabric == "nvswitch":
        out["collnet-direct"] = nccl.collnet_direct_latency_s(k) + nbytes / min(
            f.intra_bytes_per_s, nccl.COLLNET_GATHER_NET_BW * k * f.net_bytes_per_s)
    if f.nvls_bytes_per_s and k > 2:
        nvls_bus = _nvls_bus_bandwidth(f, k) / 2 * (k - 1) / k
        out["nvls"] = nccl.nvls_nodes_latency_s() + nbytes / min(nvls_bus, k * f.net_bytes_per_s)
    return out


def all_to_all_s(cluster: Cluster, nbytes: float, grp: Group) -> float:
    """All-to-all where each rank sends ``nbytes`` in total, 1/n to each peer."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    f = fabric(cluster)
    k = grp.per_node
    t_intra = (k - 1) / n * nbytes / intra_bytes_per_s(f, k) if k > 1 else 0.0
    t_net = (n - k) / n * nbytes / f.net_bytes_per_s * cluster.oversubscription if grp.nodes > 1 else 0.0
    return max(t_intra, t_net) + (n - 1) * _step_latency(f, grp)


def _misses(pool: float, held: float, k: int) -> float:
    """The chance that ``k`` draws without replacement from ``pool`` experts miss all ``held`` of them:
    C(pool - held, k) / C(pool, k)."""
    out = 1.0
    for i in range(k):
        out *= max(0.0, (pool - held - i) / (pool - i))
    return out


def distinct_holders(experts: int, k: int, holders: int, groups: int = 0, groups_used: int = 0) -> float:
    """Of ``holders`` (ranks or nodes) that hold ``experts / holders`` consecutive experts each, how many hold at
    least one of a token's ``k`` experts, in expectation, with balanced routing (the published benchmarks force it:
    Megatron-Core's moe_router_force_load_balancing draws random logits before the top-k): the k drawn uniformly
    without replacement, holders x (1 - C(E - E / holders, k) / C(E, k)). Under group-limited routing (``groups``
    of consecutive experts, the top-k from the best ``groups_used`` of them: DeepSeek-V3's node-limited routing,
    Megatron's --moe-router-num-groups and --moe-router-group-topk) the groups are drawn first, uniformly, then the k
    from their experts: a holder of whole groups is reached through j of them (hypergeometric), a holder inside a
    group when its group is drawn. Groups that neither hold whole holders nor fit in one are not modelled: drawn as
    without groups."""
    if holders <= 1:
        return float(holders)
    per = experts / holders
    if groups and groups_used and groups_used < groups and experts % groups == 0:
        size, pool = experts // groups, groups_used * experts // groups
        if groups % holders == 0:                # each holder holds c whole groups
            c = groups // holders
            hit = sum(math.comb(c, j) * math.comb(groups - c, groups_used - j) / math.comb(groups, groups_used)
                      * (1.0 - _misses(pool, j * size, k)) for j in range(1, min(c, groups_used) + 1))
            return holders * hit
        if holders % groups == 0:                # each holder holds part of one group
            return holders * groups_used / groups * (1.0 - _misses(pool, per, k))
    return holders * (1.0 - _misses(experts, per, k))


def forwarded_exchange_s(cluster: Cluster, token_bytes: float, tokens: float, experts: int, k: int,
                         grp: Group, groups: tuple[int, int] = (0, 0)) -> float:
    """One dispatch (or combine) of DeepEP's normal kernels over an expert-parallel group of consecutive ranks:
    each token crosses the network once per remote node that holds any of its ``k`` experts, on the rail of its
    GPU, and NVLink forwards it to each GPU there (and of its own node) that holds any of them, once per GPU
    however many of its experts that GPU holds; the two domains run at once inside one kernel (DeepEP
    docs/legacy.md, "Normal kernels with NVLink and RDMA forwarding"; its tests/legacy/test_internode.py counts
    the network's tokens that way: ``rdma_idx`` made unique per token over the nodes; Megatron-Core's MoE README:
    the flex dispatcher "removes redundant tokens during cross-node communication"). ``tokens`` each of
    ``token_bytes``, sent by every rank; the busiest link sets the time, plus one step's latency per hop kind.
    ``groups``: the router's (groups, groups used), as ``distinct_holders`` takes them."""
    n, k_node = grp.size, grp.per_node
    if n <= 1 or tokens <= 0:
        return 0.0
    f = fabric(cluster)
    ranks = distinct_holders(experts, k, n, *groups)      # the GPUs a token reaches, its own among them
    nvl = tokens * token_bytes * ranks * (k_node - 1) / k_node if k_node > 1 else 0.0
    t = nvl / intra_bytes_per_s(f, k_node) + f.intra_latency_s if nvl else 0.0
    if grp.nodes > 1:
        nodes = distinct_holders(experts, k, grp.nodes, *groups)
        net = tokens * token_bytes * nodes * (grp.nodes - 1) / grp.nodes     # its own node's share stays on NVLink
        t = max(t, net / f.net_bytes_per_s * cluster.oversubscription + f.net_latency_s)
    return t


def p2p_s(cluster: Cluster, nbytes: float, *, same_node: bool) -> float:
    """One send/recv between two GPUs (all pairs of a pipeline boundary send at once)."""
    if nbytes <= 0:
        return 0.0
    f = fabric(cluster)
    if same_node or cluster.num_gpus <= cluster.gpus_per_node:
        return nbytes / intra_bytes_per_s(f, 2) + f.intra_latency_s
    return nbytes / f.net_bytes_per_s + f.net_latency_s


def host_transfer_s(cluster: Cluster, nbytes: float) -> float:
    """Copy between GPU and host memory over the GPU's PCIe link."""
    return nbytes / fabric(cluster).host_bytes_per_s if nbytes > 0 else 0.0
