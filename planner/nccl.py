"""NCCL's own model of its collectives: the algorithm and protocol it picks and the latency each costs.

NCCL prices every (algorithm, protocol) pair of a collective as latency + bytes / bandwidth and runs the
cheapest (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel and ncclTopoGetAlgoTime; constants below read at
commit 5067397, June 2026). The latencies are software constants of NCCL's, the same on every machine: a base
per algorithm and protocol, and one per step by the link the step crosses (NVLink inside a node, the network
between nodes). The bandwidths are the machine's (planner/network.py reads them off the cluster graph), scaled
by what each protocol delivers of them:

- LL (8-byte lines with flags): half of the link (ring: ``busBw * .5``); lowest latency;
- LL128 (128-byte lines): 92% (``busBw * 0.92``, 120 of 128 bytes);
- Simple: all of it, at the highest per-step latency.

Algorithms: the ring for every collective; for all-reduce across nodes also the double binary tree (latency
logarithmic in the nodes, 92% of the ring's bandwidth); for all-gather and reduce-scatter across nodes with one
rank per node also PAT (latency logarithmic in the nodes plus 2.8 us per rank, 75% of the bandwidth). NVLS
(NVLink SHARP inside a node) is the profile's measured all-reduce bandwidth (planner/network.py); across nodes of
such a switch NVLS-tree reduces inside each node with NVLS and between the nodes with a tree, at the lesser of
the node's NVLS bus bandwidth and its NICs' (twice the NICs' on two nodes, where the tree's two directions
each carry half), latency logarithmic in the nodes. Where the profile's network reduces in its switches and
NCCL runs CollNet there (``[network] collnet``; NCCL's default is off: NCCL_COLLNET_ENABLE=0), all-reduce across
nodes may also take CollNet Direct (NVSwitch nodes: each GPU to its own NIC, the switch reducing), CollNet Chain
and NVLS across nodes, at tuning.cc's bandwidths (CollNet's from the node's inside, as NCCL's model takes it:
the network reduces, so it is not the bound) and latencies, which are one network hop whatever the nodes; and
all-gather and reduce-scatter across such nodes CollNet Direct and NVLS across nodes, where each GPU has a NIC of
its own (NCCL's condition: no more local ranks than CollNet heads) and the plugin gathers and scatters
(``iallgather``, ``ireducescatter``), at the node's NICs' rate (tuning.cc: ``ppn * min(bwIntra, bwInter * 0.9)``).
LL's own cap is priced (``llMaxBws``: absolute, by GPU generation on one node and by CPU vendor across nodes,
``ll_max_bytes_per_s``): across nodes it holds LL to 19-39 GB/s, so LL runs only the smallest messages there. Left
out: NCCL's per-channel caps (``perChMaxRingLL128Bw``, ``perChMaxTreeBw``, ``perChMaxNVLSTreeBw``: they need the
channel count of NCCL's topology search, and bind on small messages only) and its tree correction factors by size.
"""
from __future__ import annotations

import math

PROTOCOLS = ("LL", "LL128", "Simple")

# baseLatencies (us): Tree, Ring, PAT by protocol (LL, LL128, Simple)
BASE_US = {"tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4},
           "ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},
           "pat": {"Simple": 8.0}}
# hwLatencies (us) per step: NVLink (inside a node) and NET (between nodes), by algorithm and protocol
HOP_US = {"nvlink": {"tree": {"LL": 0.6, "LL128": 1.25, "Simple": 4.0},
                     "ring": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
                     "pat": {"Simple": 4.0}, "nvls": {"Simple": 25.0}, "nvls_tree": {"Simple": 25.0},
                     "collnet_direct": {"Simple": 3.7}, "collnet_chain": {"Simple": 2.8}},
          "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 14.0},
                  "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0},
                  "pat": {"Simple": 14.0}, "nvls_tree": {"Simple": 20.9}, "nvls": {"Simple": 18.0},
                  "collnet_direct": {"Simple": 31.0}, "collnet_chain": {"Simple": 30.0}}}
# CollNet Direct's all-reduce on compute capability 9.0 and later runs at 85% of its bus bandwidth
COLLNET_DIRECT_HOPPER_BW = 0.85
# and each intra-node rank beyond the first adds 0.4 us of arity serialisation
COLLNET_ARITY_US = 0.4
# CollNet Direct's all-gather and reduce-scatter: each GPU at the lesser of its NVLink share and 90% of its NIC
# (tuning.cc: busBw = ppn * min(bwIntra, bwInter * 0.9f))
COLLNET_GATHER_NET_BW = 0.9
# the share of the links' bus bandwidth each protocol delivers ("Various model refinements")
RING_BW = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
TREE_BW = {"LL": 0.92 / 3.8, "LL128": 0.92 * 120 / 128, "Simple": 0.92}     # all-reduce, more than one node
PAT_BW = 0.75
# llMaxBws (GB/s): the most LL delivers whatever the links, absolute rather than per channel; on one node by the GPU's
# generation, across nodes by the host CPU's vendor (AMD's row for AMD, Intel's for every other), two nodes or more
LL_MAX_GBPS = {"one node": {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 282.0},
               "intel": (39.0, 20.4), "amd": (22.5, 19.0)}
# getNetOverhead: the host's cost of posting a network operation (x86: 1.0 us), three times for Simple; an
# intra-node step of a ring that spans nodes costs at least that
NET_OVERHEAD_US = 1.0


def ll_max_bytes_per_s(arch: str, cpu_vendor: str, nodes: int) -> float:
    """NCCL's cap on the LL protocol's bus bandwidth (tuning.cc llMaxBws): on one node the GPU generation's
    (``arch``: volta, ampere, hopper, blackwell, by compute capability 7, 8, 9, 10 and up), across two nodes or
    more the host CPU vendor's; none where the profile names no NCCL generation (RCCL, gloo)."""
    if not arch:
        return math.inf
    if nodes <= 1:
        return LL_MAX_GBPS["one node"][arch] * 1e9
    two, more = LL_MAX_GBPS["amd" if cpu_vendor == "amd" else "intel"]
    return (two if nodes == 2 else more) * 1e9


def ring_bus_bw(bus: float, protocol: str, ll_max: float) -> float:
    """The ring's bus bandwidth at ``protocol`` from the links' ``bus`` (tuning.cc: LL min(llMaxBw, busBw * .5),
    LL128 busBw * 0.92, Simple busBw)."""
    out = bus * RING_BW[protocol]
    return min(out, ll_max) if protocol == "LL" else out


def tree_bus_bw(bus: float, protocol: str, ll_max: float) -> float:
    """The all-reduce tree's bus bandwidth at ``protocol`` (tuning.cc: busBw * .92, then LL min(busBw / 3.8,
    llMaxBw), LL128 busBw * 120 / 128)."""
    out = bus * TREE_BW[protocol]
    return min(out, ll_max) if protocol == "LL" else out


def _log2i(x: int) -> int:
    return max(0, int(math.floor(math.log2(x)))) if x >= 1 else 0


def ring_latency_s(n: int, nodes: int, protocol: str, passes: int = 1) -> float:
    """Latency of a ring going ``passes`` times round ``n`` ranks on ``nodes`` nodes (all-gather and
    reduce-scatter 1, all-reduce 2): the base, then ``passes x (nodes - 1)`` steps across the network and the
    other ``passes x (n - 1)`` minus those over NVLink (each at least the network post overhead where the ring
    leaves the node). With one rank per node every step is the network's, at the tree's per-hop latency
    ("with ppn=1 latencies are fully exposed")."""
    if n <= 1:
        return 0.0
    steps = passes * (n - 1)
    inter_steps = passes * (nodes - 1) if nodes > 1 else 0
    intra = HOP_US["nvlink"]["ring"][protocol]
    if nodes > 1:
        intra = max(intra, NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
    inter = HOP_US["net"]["tree" if n == nodes else "ring"][protocol]
    return (BASE_US["ring"][protocol] + (steps - inter_steps) * intra + inter_steps * inter) * 1e-6


def tree_latency_s(n: int, nodes: int, protocol: str) -> float:
    """Latency of the double binary tree all-reduce: up and down a chain of the node's ranks and
    log2(nodes) network hops."""
    per_node = max(1, n // max(1, nodes))
    intra = HOP_US["nvlink"]["tree"][protocol]
    inter = HOP_US["net"]["tree"][protocol]
    return (BASE_US["tree"][protocol] + 2 * ((per_node - 1) * intra + _log2i(nodes) * inter)) * 1e-6


def pat_latency_s(n: int, nodes: int) -> float:
    """Latency of PAT (all-gather and reduce-scatter, one rank per node, Simple only): logarithmic in the
    nodes, with a linear part of 2.8 us per rank."""
    return (BASE_US["pat"]["Simple"] + _log2i(nodes) * HOP_US["net"]["pat"]["Simple"] / 3.5 + n * 2.8) * 1e-6


def nvls_latency_s() -> float:
    """Latency of NVLS (NVLink SHARP) inside one node: NCCL prices it at NVLink's NVLS hop alone, 25 us
    (hwLatencies NVLINK NVLS Simple; no base latency)."""
    return HOP_US["nvlink"]["nvls"]["Simple"] * 1e-6


def nvls_tree_latency_s(nodes: int) -> float:
    """Latency of NVLS-tree (all-reduce across nodes: NVLS inside each node, a tree between them; Simple only):
    NVLink's NVLS-tree hop once and log2(nodes) network hops up and down (no base latency)."""
    return (HOP_US["nvlink"]["nvls_tree"]["Simple"] + 2 * _log2i(nodes) * HOP_US["net"]["nvls_tree"]["Simple"]) * 1e-6


def collnet_direct_latency_s(per_node: int) -> float:
    """Latency of CollNet Direct's all-reduce (SHARP in the network switches, every GPU of a node to its own NIC):
    twice an NVLink hop and the arity serialisation of the node's other ranks, and one network hop."""
    intra = HOP_US["nvlink"]["collnet_direct"]["Simple"]
    return (2 * (min(1, per_node - 1) * intra + (per_node - 1) * COLLNET_ARITY_US)
            + HOP_US["net"]["collnet_direct"]["Simple"]) * 1e-6


def collnet_chain_latency_s(per_node: int) -> float:
    """Latency of CollNet Chain's all-reduce: up and down a chain of the node's ranks, one network hop."""
    return (2 * (per_node - 1) * HOP_US["nvlink"]["collnet_chain"]["Simple"]
            + HOP_US["net"]["collnet_chain"]["Simple"]) * 1e-6


def nvls_nodes_latency_s() -> float:
    """Latency of NVLS across nodes (NVLink SHARP inside them, SHARP in the network between: needs CollNet):
    NVLink's NVLS hop and the network's."""
    return (HOP_US["nvlink"]["nvls"]["Simple"] + HOP_US["net"]["nvls"]["Simple"]) * 1e-6


def cheapest(options: dict[str, float]) -> tuple[str, float]:
    """(name, seconds) of the cheapest of ``options`` (algorithm/protocol -> seconds), as NCCL picks it."""
    name = min(options, key=options.get)
    return name, options[name]
