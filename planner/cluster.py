"""What it runs on: devices, nodes and the network, read from a profile TOML.

A ``Cluster`` is a plain value. ``Cluster.graph()`` builds the topology as a
networkx graph (GPUs, NVSwitch or PCIe switches, NICs, leaf and spine switches,
edges carrying bandwidth and latency). The collective cost functions in
``planner.network`` read their bandwidths off that graph's edges.
"""
from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from .errors import UserError, one_of

GiB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# the torch executor's regimes whose host time `meshplan profile` measures (executor/profile/host.py PROBES;
# priced by planner/cost/host.py): ZeRO-0 eager, with operator-level and full recompute, FSDP2 ZeRO-3, MoE
HOST_REGIMES = ("eager", "op", "full", "fsdp", "moe")


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or one CPU process for cpu-gloo)."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    peak_flops: tuple[tuple[str, float], ...]   # dense FLOP/s per dtype, e.g. (("bf16", 312e12),)
    fp8_peak_flops: float = 0.0           # dense FP8 (e4m3) tensor-core FLOP/s, 0 where the GPU has none; not a
                                          # training precision of its own (FP8 recipes keep bf16 around the GEMMs)
    mxfp8_peak_flops: float = 0.0         # dense block-scaled FP8 (MXFP8: an e8m0 scale per 32 values) in the
                                          # tensor cores, 0 where the GPU has none (before Blackwell)
    sm_count: int
    gemm_tiles: tuple[tuple[int, int], ...]   # output tile shapes (rows, cols) the GEMM library picks from
    gemm_efficiency: float                # achieved fraction of peak on large training GEMMs
    hbm_efficiency: float                 # achieved fraction of HBM bandwidth, streaming kernels
    attention_efficiency: float           # fused attention kernels, fraction of peak
    reserved_bytes: float                 # runtime memory not available to tensors
    fused_kernels: tuple[str, ...] = ("rmsnorm", "layernorm")   # normalisation kernels the runtime fuses
    gemm_latency_s: float = 0.0           # fixed time of one GEMM kernel (launch gap, prologue, epilogue)
    gemm_wave_latency_s: float = 0.0      # fixed time of each wave of output tiles
    gemm_unaligned_efficiency: float = 1.0  # rate of a GEMM with a dimension not a multiple of 8 elements,
                                          # against an aligned one (the library falls back to align-1 kernels)
    attention_latency_s: float = 0.0      # fixed time of one attention kernel call (forward + backward)
    sfu_ops_per_s: float = 0.0            # special-function results (exp2) per second: softmax's exponentials
    fused_attention_efficiency: float = 0.0   # cuDNN's fused flash kernels (TransformerEngine's FusedAttention, torch's
                                          # cuDNN SDPA): their matmuls' rate, a fraction of the dense peak; 0: not
                                          # characterised
    fused_attention_row_tiles: float = 0.0    # their fixed work a row of 128 query tiles, in key tiles
    fused_attention_dropout_s: tuple[float, float] = (0.0, 0.0)   # (forward, backward) seconds attention dropout
                                          # adds a score element in them
    eager_bytes_per_s: tuple[tuple[str, float], ...] = ()   # achieved bandwidth of eager elementwise
                                          # kernels by class (planner.eager_bytes.CLASSES); absent: HBM rate
    kernel_gap_s: float = 0.0             # GPU time between two queued kernels (issue gap)
    strided_reduce_bytes_per_s: float = 0.0   # bytes per second a compiled kernel reads while it reduces along a
                                          # tensor's strided dimension (the column-wise amax of FP8 rowwise
                                          # scaling); 0: the ``reduce`` class rate
    optimizer_bytes_per_s: float = 0.0    # AdamW as the executor steps it here, at 28 B per parameter (0: HBM)
    tp_block_overhead_s: tuple[float, float] = (0.0, 0.0)   # (forward, backward) host time tensor parallelism
                                          # adds to a block beyond its collectives in torch eager (a CPU profile)
    host_us: tuple[tuple[str, float, float, float, float], ...] = ()   # the torch executor's host time by
                                          # regime (HOST_REGIMES): microseconds per block per
                                          # micro-batch and per step, of the rest per micro-batch and per step
    gemm_shapes: tuple[tuple[int, int, int, float], ...] = ()   # measured (m, n, k, efficiency): a GEMM's
                                          # rate is the peak times the efficiency of the nearest shape (a CPU)

    def shape_efficiency(self, m: float, n: float, k: float) -> float:
        """The measured efficiency of the ``gemm_shapes`` entry nearest to (m, n, k), by the sum of the
        dimensions' log ratios (1.0 where none is measured)."""
        if not self.gemm_shapes:
            return 1.0
        lm, ln, lk = math.log(m), math.log(n), math.log(k)
        return min(self._log_shapes, key=lambda e: abs(e[0] - lm) + abs(e[1] - ln) + abs(e[2] - lk))[3]

    @functools.cached_property
    def _log_shapes(self) -> tuple[tuple[float, float, float, float], ...]:
        return tuple((math.log(m), math.log(n), math.log(k), eff) for m, n, k, eff in self.gemm_shapes)

    def eager_bandwidth(self, kind: str) -> float:
        """Bytes per second an eager elementwise kernel of class ``kind`` streams."""
        return dict(self.eager_bytes_per_s).get(kind) or self.hbm_bytes_per_s * self.hbm_efficiency

    def strided_reduce_bandwidth(self) -> float:
        """Bytes per second read by a reduction along a tensor's strided dimension (``strided_reduce_bytes_per_s``),
        or, where the profile has not measured one, the ``reduce`` class rate."""
        return self.strided_reduce_bytes_per_s or self.eager_bandwidth("reduce")

    def peak(self, precision: str) -> float:
        return self._peaks[precision]

    def gemm_peak(self, dtype: str) -> float:
        """The tensor-core rate of a GEMM whose operands are ``dtype``: a compute dtype, or "fp8" / "mxfp8"
        (the operands of an FP8 recipe's GEMMs, planner/precision.py)."""
        if dtype == "fp8":
            return self.fp8_peak_flops
        if dtype == "mxfp8":
            return self.mxfp8_peak_flops
        return self._peaks[dtype]

    @functools.cached_property
    def _peaks(self) -> dict[str, float]:
        return dict(self.peak_flops)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.peak_flops)


@dataclass(frozen=True, kw_only=True)
class Link:
    """A kind of link: bandwidth per direction, achievable fraction, latency per hop."""

    bytes_per_s: float
    efficiency: float
    latency_s: float

    @property
    def effective_bytes_per_s(self) -> float:
        return self.bytes_per_s * self.efficiency


@dataclass(frozen=True, kw_only=True)
class Power:
    """Electrical power of one node's parts, each with its source (the profile's [power] table)."""

    gpu_tdp_w: float                      # one GPU's board power limit: its draw with every SM busy
    gpu_idle_w: float                     # one GPU's draw with nothing running
    host_w: float                         # per node, besides the GPUs: CPUs, memory, NVSwitches, NICs, fans
    network_w: float                      # per node: its share of the switch fabric (0: not in the profile)
    source: str                           # where each number comes from


@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str
    description: str
    num_gpus: int
    gpus_per_node: int
    device: Device
    fabric: Literal["nvswitch", "mesh", "pcie", "loopback"]   # mesh: every GPU of a node wired to every other
    intra: Link                           # GPU to GPU inside a node (per GPU, per direction)
    nvls_allreduce_bytes_per_s: float     # NVLink SHARP all-reduce algorithm bandwidth (0: none)
    nics_per_node: int
    nic: Link                             # one NIC
    host: Link                            # GPU to host memory (offload): one GPU's PCIe link
    gpus_per_host_uplink: int = 1         # GPUs behind one PCIe switch that share its one link to the CPU
    host_memory_bytes: float              # per node
    host_dram: Link                       # host DRAM bandwidth per node (CPU optimizer step)
    gpus_per_host: int = 0                # GPUs of one host (its CPUs, memory and drives) where a node holds several
                                          # (a GB200 NVL72 rack: 18 trays of 4); 0: the node is one host
    nvme_bytes: float = 0.0               # local NVMe capacity per node (ZeRO-Infinity's offload; 0: none described)
    nvme_read_bytes_per_s: float = 0.0    # its sequential read and write rates per node, all drives together
    nvme_write_bytes_per_s: float = 0.0
    oversubscription: float               # leaf-to-spine oversubscription of the fat tree
    collnet: bool = False                 # the switches reduce in the network (SHARP) and NCCL runs CollNet on them
                                          # (NCCL_COLLNET_ENABLE=1 with the SHARP plugin; NCCL's default is off)
    nccl_arch: str = ""                   # the GPU generation NCCL's tuning tables index (volta, ampere, hopper,
                                          # blackwell); "": not NCCL's (no LL cap priced)
    cpu_vendor: str = ""                  # the hosts' CPUs (intel, amd, arm): NCCL's LL cap across nodes
    max_nodes: int = 0                    # 0: unlimited
    comm_sm_fraction: float = 0.0         # share of the device's SMs a running collective occupies
    intra_all_gather_ratio: float = 1.0       # all-gather's bus bandwidth in a node against all-reduce's (gloo: < 1)
    intra_reduce_scatter_ratio: float = 1.0   # reduce-scatter's likewise
    sync_wait_coefficient: float = 0.0    # a blocking collective after t seconds of work waits c sqrt(t) for the
                                          # slowest rank (CPU profiles: executor/profile/collectives.py _sync_wait)
    copy_launch_s: float = 0.0            # host time to enqueue one device-to-device copy (torch's copy_ of a
                                          # contiguous tensor: one cudaMemcpyAsync); 0: not in the profile
    source: str = ""
    measured_by: str = ""                 # the profile's own top-level `source` (what `meshplan profile` ran)
    gpu_hour_usd: float = 0.0             # price of one GPU for one hour (0: the profile has no [pricing])
    price_source: str = ""                # the public price list and its date
    power: Power | None = None            # the optional [power] table (None: energy is not estimated)
    cores_per_node: int = 0               # CPU cores a node's processes share (CPU profiles; 0: none shared)
    threads_per_process: int = 1          # compute threads each process runs (CPU profiles)
    time_share: float = 1.0               # the share of its threads' cores each process gets (``with_gpus``)
    profile_node: "Cluster | None" = field(default=None, compare=False, repr=False)
                                          # where the job uses only part of each node (``with_gpus``: a GB200 NVL72
                                          # rack's trays), the profile's whole node; None: the job's nodes are whole

    @property
    def num_nodes(self) -> int:
        return max(1, math.ceil(self.num_gpus / self.gpus_per_node))

    @property
    def gpus_on_a_node(self) -> int:
        """The job's GPUs that share one node's host (its memory, links and drives): a node's, or all of them
        where the job is smaller than a node."""
        return min(self.gpus_per_node, self.num_gpus)

    @property
    def host_share(self) -> float:
        """The share of a node's hosts the job's GPUs on that node use: 1 where the node is one host or the job
        fills it; where a node holds several hosts ([host] gpus_per_host: a GB200 NVL72 rack is one NVLink domain of
        18 compute trays, each with its own Grace CPUs, memory and drives), the hosts of the job's GPUs over the
        node's. The profile's [host] memory, DRAM bandwidth and drives and [power] host_W are the node's: a job on
        8 GPUs of a rack has 2 trays' worth of them, not the rack's."""
        if not self.gpus_per_host or self.gpus_per_host >= self.gpus_per_node:
            return 1.0
        used = math.ceil(self.gpus_on_a_node / self.gpus_per_host)
        return used / (self.gpus_per_node // self.gpus_per_host)

    @property
    def job_host_memory_bytes(self) -> float:
        """Host memory for the job's GPUs of one node (``host_memory_bytes`` times ``host_share``)."""
        return self.host_memory_bytes * self.host_share

    @property
    def job_host_dram_bytes_per_s(self) -> float:
        """Achievable host DRAM bandwidth for the job's GPUs of one node (the node's times ``host_share``)."""
        return self.host_dram.effective_bytes_per_s * self.host_share

    @property
    def job_nvme(self) -> tuple[float, float, float]:
        """(capacity, read, write bytes per second) of the NVMe drives of the hosts of the job's GPUs on one node."""
        k = self.host_share
        return self.nvme_bytes * k, self.nvme_read_bytes_per_s * k, self.nvme_write_bytes_per_s * k

    def peak_flops(self, precision: str) -> float:
        return self.device.peak(precision)

    @property
    def device_kind(self) -> str:
        """"cpu" for processes on one host over TCP loopback (cpu-gloo, and what `meshplan profile`
        writes on a machine without a GPU: executor/profile/toml.py), else "cuda"."""
        return "cpu" if self.fabric == "loopback" else "cuda"

    def graph(self):
        """The topology as a networkx graph (built on first use, then shared)."""
        return _build_graph(self)

    @property
    def launch(self) -> tuple[int, int]:
        """(hosts, processes on each) that start the job: a node's GPUs on one host, or where a node holds several
        hosts ([host] gpus_per_host: a GB200 NVL72 rack's trays of 4), the hosts, each with its GPUs, as torchrun and
        Slurm count them (one agent a host, the same processes on each: a job of 6 GPUs on trays of 4 is 2 x 3)."""
        n, host = self.num_gpus, self.gpus_per_host
        if not host or host >= self.gpus_per_node:
            return self.num_nodes, min(n, self.gpus_per_node)
        per = next(d for d in range(min(n, host), 0, -1) if n % d == 0)
        return n // per, per

    @property
    def partial_nodes(self) -> str:
        """How the job sits on nodes it uses in part (``with_gpus``), for the plan's header: "4 NVLink domains of
        64 of their 72 GPUs, 16 of 18 hosts each"; "" where its nodes are whole (or it is within one)."""
        full = self.profile_node
        if full is None:
            return ""
        return (f"{self.num_nodes} NVLink domains of {self.gpus_per_node} of their {full.gpus_per_node} GPUs, "
                f"{self.gpus_per_node // full.gpus_per_host} of {full.gpus_per_node // full.gpus_per_host} hosts each")

    def with_gpus(self, num_gpus: int) -> "Cluster":
        from dataclasses import replace
        whole = self.profile_node or self
        out = replace(whole, num_gpus=num_gpus)
        used = gpus_used_per_node(whole, num_gpus)
        if used and used != whole.gpus_per_node:
            out = _part_of_each_node(out, used)
        if not self.cores_per_node:
            return out
        # processes beyond the cores time-share them (the OS scheduler gives each an equal share):
        # every rate of a process (its GEMMs, memory streams, kernel issue, gloo) runs at
        # cores / (processes x threads) of what it does alone, its fixed latencies that much longer
        # (measured: 4 processes on this 2-core machine, issue #11; `meshplan profile` records cores)
        processes = min(num_gpus, self.gpus_per_node)
        share = min(1.0, self.cores_per_node / (processes * self.threads_per_process))
        k = share / self.time_share
        if k == 1.0:
            return out
        return replace(out, time_share=share, device=_time_shared(self.device, k),
                       intra=Link(bytes_per_s=self.intra.bytes_per_s * k, efficiency=self.intra.efficiency,
                                  latency_s=self.intra.latency_s / k))


def gpus_used_per_node(cluster: Cluster, num_gpus: int) -> int:
    """The GPUs a job of ``num_gpus`` uses on each node: all of them (or the job, within one node); where a node holds
    several hosts ([host] gpus_per_host: a GB200 NVL72 rack is one NVLink domain of 18 trays of 4 GPUs) and the job
    fills no whole number of nodes, the same number of whole hosts on each, the most that divides the job, as a
    scheduler keeps each part of the job inside one NVLink domain (256 GPUs: 4 racks x 64, 16 of 18 trays each);
    0 where none does with at least half of each node (the job would be spread over many small domains: refused)."""
    per_node, host = cluster.gpus_per_node, cluster.gpus_per_host
    if num_gpus <= per_node or num_gpus % per_node == 0:
        return per_node
    if not host or host >= per_node or num_gpus % host:
        return 0
    return next((d for d in range(per_node - host, 0, -host) if num_gpus % d == 0 and 2 * d >= per_node), 0)


def _part_of_each_node(cluster: Cluster, used: int) -> Cluster:
    """``cluster`` (a profile's, at the job's GPU count) as a job sees it that uses ``used`` GPUs (whole hosts) of
    each node: its node is those GPUs, with their hosts' share of the node's NICs, host memory, DRAM bandwidth,
    drives and host power (the profile gives them per node: a rack's, summed over its trays)."""
    from dataclasses import replace
    share = used / cluster.gpus_per_node
    power = cluster.power and replace(cluster.power, host_w=cluster.power.host_w * share,
                                      network_w=cluster.power.network_w * share)
    return replace(cluster, gpus_per_node=used, nics_per_node=cluster.nics_per_node * used // cluster.gpus_per_node,
                   host_memory_bytes=cluster.host_memory_bytes * share,
                   host_dram=replace(cluster.host_dram, bytes_per_s=cluster.host_dram.bytes_per_s * share),
                   nvme_bytes=cluster.nvme_bytes * share, nvme_read_bytes_per_s=cluster.nvme_read_bytes_per_s * share,
                   nvme_write_bytes_per_s=cluster.nvme_write_bytes_per_s * share, power=power,
                   profile_node=replace(cluster, num_gpus=cluster.gpus_per_node))


def _time_shared(device: Device, k: float) -> Device:
    """``device`` with its rates scaled by ``k`` and its fixed times by 1 / k."""
    from dataclasses import replace
    return replace(device, hbm_bytes_per_s=device.hbm_bytes_per_s * k,
                   peak_flops=tuple((d, f * k) for d, f in device.peak_flops), fp8_peak_flops=device.fp8_peak_flops * k,
                   mxfp8_peak_flops=device.mxfp8_peak_flops * k,
                   eager_bytes_per_s=tuple((c, b * k) for c, b in device.eager_bytes_per_s),
                   gemm_latency_s=device.gemm_latency_s / k, gemm_wave_latency_s=device.gemm_wave_latency_s / k,
                   attention_latency_s=device.attention_latency_s / k, kernel_gap_s=device.kernel_gap_s / k,
                   sfu_ops_per_s=device.sfu_ops_per_s * k,
                   fused_attention_dropout_s=tuple(t / k for t in device.fused_attention_dropout_s),
                   optimizer_bytes_per_s=device.optimizer_bytes_per_s * k,
                   strided_reduce_bytes_per_s=device.strided_reduce_bytes_per_s * k,
                   tp_block_overhead_s=tuple(t / k for t in device.tp_block_overhead_s))


# -- the topology graph -------------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _build_graph(cluster: Cluster):
    """GPUs, their node switch (NVSwitch or PCIe), NICs, leaf and spine switches.

    Edge attributes: ``bytes_per_s`` (per direction), ``efficiency``, ``latency_s``,
    ``kind`` (nvlink, mesh, pcie, network; a mesh node is drawn as a star whose GPU edges carry all of a GPU's
    links, planner/network.py ``intra_bytes_per_s`` splits them). Rail-optimised: GPU i of every node shares
    NIC i * nics / gpus_per_node with its neighbours, and NICs of the same rail
    meet on one leaf switch (the DGX SuperPOD layout).
    """
    import networkx as nx

    g = nx.Graph(name=cluster.name)
    per_node = cluster.gpus_per_node
    nics = cluster.nics_per_node
    intra_kind = "nvlink" if cluster.fabric == "nvswitch" else cluster.fabric
    for node in range(cluster.num_nodes):
        switch = f"node{node}/switch"
        g.add_node(switch, kind=f"{cluster.fabric}-switch", node=node)
        first = node * per_node
        for local in range(min(per_node, cluster.num_gpus - first)):
            gpu = f"gpu{first + local}"
            g.add_node(gpu, kind="gpu", node=node, local=local)
            g.add_edge(gpu, switch, kind=intra_kind, bytes_per_s=cluster.intra.bytes_per_s,
                       efficiency=cluster.intra.efficiency, latency_s=cluster.intra.latency_s)
            if nics:
                nic = f"node{node}/nic{local * nics // per_node}"
                if nic not in g:
                    g.add_node(nic, kind="nic", node=node)
                g.add_edge(gpu, nic, kind="pcie", bytes_per_s=cluster.host.bytes_per_s,
                           efficiency=cluster.host.efficiency, latency_s=cluster.host.latency_s)
        for rail in range(nics):
            nic, leaf = f"node{node}/nic{rail}", f"leaf{rail}"
            if nic in g:
                g.add_node(leaf, kind="leaf-switch")
                g.add_edge(nic, leaf, kind="network", bytes_per_s=cluster.nic.bytes_per_s,
                           efficiency=cluster.nic.efficiency, latency_s=cluster.nic.latency_s)
    if nics and cluster.num_nodes > 1:   # spine: full bisection divided by the oversubscription
        g.add_node("spine", kind="spine-switch")
        uplink = cluster.nic.bytes_per_s * cluster.num_nodes / cluster.oversubscription
        for rail in range(nics):
            g.add_edge(f"leaf{rail}", "spine", kind="network", bytes_per_s=uplink,
                       efficiency=cluster.nic.efficiency, latency_s=cluster.nic.latency_s)
    return g


# -- loading profiles ---------------------------------------------------------------------------

def builtin_profiles() -> dict[str, Path]:
    folder = resources.files("profiles")
    return {p.name[:-5]: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".toml")}


def profile_source(cluster: Cluster) -> str:
    """What ``load_cluster`` reads ``cluster``'s profile from again: its built-in name, or its TOML's absolute path
    (so a job re-planned from another working directory finds it: executor/elastic.py)."""
    builtin = builtin_profiles().get(cluster.name)
    if builtin is not None and cluster.source and Path(cluster.source).resolve() == builtin.resolve():
        return cluster.name
    return str(Path(cluster.source).resolve()) if cluster.source else cluster.name


def load_cluster(source: str, num_gpus: int | None = None) -> Cluster:
    """A built-in profile name or a path to a profile TOML; ``num_gpus`` defaults to one node."""
    profiles = builtin_profiles()
    if source in profiles:
        path = profiles[source]
    else:
        path = Path(source)
        if not path.exists():
            if source.endswith(".toml") or "/" in source:
                raise UserError("no such file", source=source)
            raise UserError(f"unknown cluster {source!r}; known: {one_of(sorted(profiles))}, "
                            "or a path to a profile TOML", field="--cluster")
    cluster = parse_cluster(_profile_data(path, ()), str(path))
    gpus = cluster.gpus_per_node if num_gpus is None else num_gpus
    return _check_gpus(cluster.with_gpus(gpus), gpus)


def _profile_data(path: Path, seen: tuple[str, ...]) -> dict:
    """A profile's TOML, merged over the profile its ``base`` names (a built-in profile or a TOML path relative to
    it): a variant card or cluster says only what differs (tables merge key by key; a value replaces the base's;
    ``drop`` lists the base's tables it does not take, such as a price that is not its own)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise UserError(f"cannot read: {e.strerror}", source=str(path)) from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"not valid TOML: {e}", source=str(path)) from None
    base, drop = data.pop("base", None), data.pop("drop", [])
    if base is None:
        return data
    if not isinstance(drop, list) or not all(isinstance(t, str) for t in drop):
        raise UserError(f"must be a list of the base's table names, got {drop!r}", source=str(path), field="drop")
    profiles = builtin_profiles()
    if not isinstance(base, str) or not (base in profiles or (path.parent / base).exists()):
        raise UserError(f"names no profile: {base!r}; allowed: {one_of(sorted(profiles))}, or a TOML path relative "
                        "to this file", source=str(path), field="base")
    base_path = profiles[base] if base in profiles else path.parent / base
    if str(base_path) in seen:
        raise UserError(f"profiles name each other as base: {' -> '.join((*seen, str(base_path)))}",
                        source=str(path), field="base")
    inherited = _profile_data(base_path, (*seen, str(path)))
    unknown = [t for t in drop if t not in inherited]
    if unknown:
        raise UserError(f"the base has no table {unknown[0]!r}; allowed: {one_of(sorted(inherited))}",
                        source=str(path), field="drop")
    return _merged({k: v for k, v in inherited.items() if k not in drop}, data)


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _check_gpus(cluster: Cluster, gpus) -> Cluster:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus <= 0:
        raise UserError(f"must be a positive integer, got {gpus!r}", field="--gpus")
    whole = cluster.profile_node or cluster         # the profile's node, whatever part of it the job uses
    per_node, host = whole.gpus_per_node, whole.gpus_per_host
    if not gpus_used_per_node(whole, gpus):
        if host and host < per_node:
            near = _near_counts(whole, gpus)
            raise UserError(f"{gpus} GPUs on {cluster.name}: use at most {per_node}, a multiple of {per_node}, or a "
                            f"multiple of {host} (whole hosts) that splits into equal parts of {per_node // 2} to "
                            f"{per_node} GPUs, one a node; near it: {', '.join(map(str, near))}", field="--gpus")
        raise UserError(f"{gpus} GPUs do not fill whole nodes of {per_node} on {cluster.name}; "
                        f"use a multiple of {per_node} (or at most {per_node})", field="--gpus")
    if cluster.max_nodes and cluster.num_nodes > cluster.max_nodes:
        raise UserError(f"{cluster.name} is {cluster.max_nodes} host(s) of {per_node} processes: "
                        f"at most {cluster.max_nodes * per_node}, got {gpus}", field="--gpus")
    return cluster


def _near_counts(cluster: Cluster, gpus: int) -> list[int]:
    """The GPU counts nearest ``gpus`` below and above that ``gpus_used_per_node`` accepts."""
    host = cluster.gpus_per_host
    start = gpus - gpus % host
    below = next((n for n in range(start, 0, -host) if n < gpus and gpus_used_per_node(cluster, n)), None)
    above = next(n for n in range(start + host, gpus + 2 * cluster.gpus_per_node, host)
                 if gpus_used_per_node(cluster, n))
    return [n for n in (below, above) if n]


class _Table:
    """Typed access to a TOML table with errors that name the file and the dotted field."""

    def __init__(self, data, source: str, prefix: str = ""):
        if not isinstance(data, dict):
            raise UserError(f"must be a table, got {type(data).__name__}", source=source, field=prefix or "<root>")
        self.data, self.source, self.prefix = data, source, prefix

    def _name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def table(self, key: str) -> "_Table":
        if key not in self.data:
            raise UserError("missing table (required)", source=self.source, field=self._name(key))
        return _Table(self.data[key], self.source, self._name(key))

    def number(self, key: str, *, minimum: float = 0.0, allow_zero: bool = False, default=None) -> float:
        if key not in self.data:
            if default is not None:
                return default
            raise UserError("missing (required)", source=self.source, field=self._name(key))
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"must be a number, got {value!r}", source=self.source, field=self._name(key))
        if value < minimum or (value == 0 and not allow_zero):
            allowed = f">= {minimum}" if allow_zero else "> 0"
            raise UserError(f"must be {allowed}, got {value!r}", source=self.source, field=self._name(key))
        return float(value)

    def integer(self, key: str, *, allow_zero: bool = False, default=None) -> int:
        value = self.number(key, allow_zero=allow_zero, default=default)
        if value != int(value) or isinstance(self.data.get(key), float):
            raise UserError(f"must be an integer, got {self.data[key]!r}", source=self.source, field=self._name(key))
        return int(value)

    def boolean(self, key: str, *, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise UserError(f"must be true or false, got {value!r}", source=self.source, field=self._name(key))
        return value

    def fraction(self, key: str) -> float:
        value = self.number(key)
        if value > 1:
            raise UserError(f"must be a fraction in (0, 1], got {value!r}", source=self.source, field=self._name(key))
        return value

    def string(self, key: str, *, choices=None, default=None) -> str:
        value = self.data.get(key, default)
        if value is None:
            raise UserError("missing (required)", source=self.source, field=self._name(key))
        if not isinstance(value, str):
            raise UserError(f"must be a string, got {value!r}", source=self.source, field=self._name(key))
        if choices and value not in choices:
            raise UserError(f"{value!r} is not allowed; allowed: {one_of(choices)}", source=self.source,
                            field=self._name(key))
        return value


def _fused_attention(gpu: "_Table", kernels: "_Table", source) -> dict:
    """The Device fields of cuDNN's fused flash kernels: ``[gpu] sfu_Tops`` and ``[gpu.kernels]
    fused_attention_efficiency``, ``fused_attention_row_tiles`` and ``fused_attention_dropout_ps`` ([forward,
    backward] picoseconds a score element), all or none of the last three (a profile without them prices every
    flash kernel at ``attention_efficiency``)."""
    keys = ("fused_attention_efficiency", "fused_attention_row_tiles", "fused_attention_dropout_ps")
    given = [k for k in keys if k in kernels.data]
    if not given:
        return {}
    if len(given) < len(keys):
        missing = next(k for k in keys if k not in kernels.data)
        raise UserError(f"missing (required with {given[0]})", source=source, field=f"gpu.kernels.{missing}")
    if "sfu_Tops" not in gpu.data:
        raise UserError(f"missing (required with gpu.kernels.{given[0]})", source=source, field="gpu.sfu_Tops")
    dropout = kernels.data["fused_attention_dropout_ps"]
    if not (isinstance(dropout, list) and len(dropout) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in dropout)):
        raise UserError(f"must be [forward, backward] picoseconds (two numbers >= 0), got {dropout!r}", source=source,
                        field="gpu.kernels.fused_attention_dropout_ps")
    return {"sfu_ops_per_s": gpu.number("sfu_Tops") * 1e12,
            "fused_attention_efficiency": kernels.fraction("fused_attention_efficiency"),
            "fused_attention_row_tiles": kernels.number("fused_attention_row_tiles", allow_zero=True),
            "fused_attention_dropout_s": (dropout[0] * 1e-12, dropout[1] * 1e-12)}


FUSED_KERNELS = ("rmsnorm", "layernorm")


def _fused_kernels(runtime: "_Table", source: str) -> tuple[str, ...]:
    value = runtime.data.get("fused_kernels", list(FUSED_KERNELS))
    if not isinstance(value, list) or not all(v in FUSED_KERNELS for v in value):
        raise UserError(f"must be a list drawn from {one_of(FUSED_KERNELS)}, got {value!r}", source=source,
                        field="runtime.fused_kernels")
    return tuple(value)


def _gemm_shapes(kernels: "_Table", source: str) -> tuple[tuple[int, int, int, float], ...]:
    """[gpu.kernels] gemm_shapes = [[m, n, k, efficiency], ...]: measured GEMM efficiency by shape."""
    rows = kernels.data.get("gemm_shapes", [])
    if not isinstance(rows, list) or not all(
            isinstance(r, list) and len(r) == 4 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                        for x in r[:3])
            and isinstance(r[3], (int, float)) and not isinstance(r[3], bool) and 0 < r[3] <= 10 for r in rows):
        raise UserError("must be a list of [m, n, k, efficiency] with positive integer dimensions and an "
                        f"efficiency in (0, 10], got {rows!r}", source=source, field="gpu.kernels.gemm_shapes")
    return tuple((r[0], r[1], r[2], float(r[3])) for r in rows)


def _tp_block_overhead(kernels: "_Table", source: str) -> tuple[float, float]:
    """[gpu.kernels] tp_block_overhead_us = [forward, backward]."""
    value = kernels.data.get("tp_block_overhead_us", [0.0, 0.0])
    if not (isinstance(value, list) and len(value) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in value)):
        raise UserError(f"must be [forward, backward] in microseconds, each >= 0, got {value!r}", source=source,
                        field="gpu.kernels.tp_block_overhead_us")
    return float(value[0]) * 1e-6, float(value[1]) * 1e-6


def _host_us(kernels: "_Table", source: str) -> tuple[tuple[str, float, float, float, float], ...]:
    """[gpu.kernels] host_us = { eager = [block per micro-batch, block per step, rest per micro-batch, rest per
    step], ... } in microseconds, by regime (HOST_REGIMES); a solved value may be slightly
    negative where it is below the timing noise."""
    if "host_us" not in kernels.data:
        return ()
    table = kernels.table("host_us")
    out = []
    for key, value in table.data.items():
        if key not in HOST_REGIMES:
            raise UserError(f"unknown regime {key!r}; allowed: {one_of(HOST_REGIMES)}", source=source,
                            field=f"gpu.kernels.host_us.{key}")
        if not (isinstance(value, list) and len(value) == 4 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)):
            raise UserError("must be [block per micro-batch, block per step, rest per micro-batch, rest per step] "
                            f"in microseconds, got {value!r}", source=source, field=f"gpu.kernels.host_us.{key}")
        out.append((key, *(float(x) for x in value)))
    if out and "eager" not in table.data:
        raise UserError("needs the eager regime, which the others are priced against", source=source,
                        field="gpu.kernels.host_us")
    return tuple(out)


def _eager_bandwidths(kernels: "_Table", source: str) -> tuple[tuple[str, float], ...]:
    """[gpu.kernels] eager_GBps = { stream = ..., cast_up = ..., ... } (planner.eager_bytes.CLASSES)."""
    from .eager_bytes import CLASSES
    if "eager_GBps" not in kernels.data:
        return ()
    table = kernels.table("eager_GBps")
    for key in table.data:
        if key not in CLASSES:
            raise UserError(f"unknown kernel class {key!r}; allowed: {one_of(CLASSES)}", source=source,
                            field=f"gpu.kernels.eager_GBps.{key}")
    return tuple((key, table.number(key) * 1e9) for key in CLASSES if key in table.data)


def parse_cluster(data: dict, source: str) -> Cluster:
    """Validate a profile document (see profiles/*.toml for the schema) into a Cluster."""
    root = _Table(data, source)
    schema = root.integer("schema", default=1)
    if schema != 1:
        raise UserError(f"unsupported schema {schema}; this meshplan reads schema 1", source=source, field="schema")
    gpu, kernels = root.table("gpu"), root.table("gpu").table("kernels")
    peaks = gpu.table("peak_tflops")
    peak_flops = {}
    for dtype, value in peaks.data.items():
        if dtype in ("fp8", "mxfp8"):
            continue
        if dtype not in DTYPE_BYTES:
            raise UserError(f"unknown dtype {dtype!r}; allowed: {one_of([*DTYPE_BYTES, 'fp8', 'mxfp8'])}", source=source,
                            field=f"gpu.peak_tflops.{dtype}")
        peak_flops[dtype] = peaks.number(dtype) * 1e12
    if not peak_flops:
        raise UserError("needs at least one dtype", source=source, field="gpu.peak_tflops")
    tiles = kernels.data.get("gemm_tiles", [kernels.data.get("gemm_tile", [128, 128])])
    field = "gpu.kernels.gemm_tiles" if "gemm_tiles" in kernels.data else "gpu.kernels.gemm_tile"
    if not isinstance(tiles, list) or not tiles or not all(
            isinstance(t, list) and len(t) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                        for x in t) for t in tiles):
        raise UserError(f"must be a list of [rows, cols] pairs of positive integers, got {tiles!r}", source=source,
                        field=field)
    device = Device(
        name=gpu.string("name"), memory_bytes=gpu.number("memory_GiB") * GiB,
        hbm_bytes_per_s=gpu.number("hbm_GBps") * 1e9, peak_flops=tuple(peak_flops.items()),
        fp8_peak_flops=peaks.number("fp8") * 1e12 if "fp8" in peaks.data else 0.0,
        mxfp8_peak_flops=peaks.number("mxfp8") * 1e12 if "mxfp8" in peaks.data else 0.0,
        sm_count=gpu.integer("sm_count"), gemm_tiles=tuple((t[0], t[1]) for t in tiles),
        gemm_efficiency=kernels.fraction("gemm_efficiency"),
        hbm_efficiency=kernels.fraction("hbm_efficiency"),
        attention_efficiency=kernels.fraction("attention_efficiency"),
        reserved_bytes=root.table("runtime").number("reserved_GiB", allow_zero=True) * GiB,
        fused_kernels=_fused_kernels(root.table("runtime"), source),
        gemm_latency_s=kernels.number("gemm_latency_us", allow_zero=True, default=0.0) * 1e-6,
        gemm_wave_latency_s=kernels.number("gemm_wave_latency_us", allow_zero=True, default=0.0) * 1e-6,
        gemm_unaligned_efficiency=kernels.fraction("gemm_unaligned_efficiency")
        if "gemm_unaligned_efficiency" in kernels.data else 1.0,
        attention_latency_s=kernels.number("attention_latency_us", allow_zero=True, default=0.0) * 1e-6,
        **_fused_attention(gpu, kernels, source),
        eager_bytes_per_s=_eager_bandwidths(kernels, source),
        kernel_gap_s=kernels.number("kernel_gap_us", allow_zero=True, default=0.0) * 1e-6,
        optimizer_bytes_per_s=kernels.number("optimizer_GBps", allow_zero=True, default=0.0) * 1e9,
        strided_reduce_bytes_per_s=kernels.number("strided_reduce_GBps", allow_zero=True, default=0.0) * 1e9,
        gemm_shapes=_gemm_shapes(kernels, source), tp_block_overhead_s=_tp_block_overhead(kernels, source),
        host_us=_host_us(kernels, source))
    intra, host, net = root.table("intra_node"), root.table("host"), root.table("network")
    nics = net.integer("nics_per_node", allow_zero=True)
    return Cluster(
        name=root.string("name"), description=root.string("description", default=""),
        num_gpus=root.integer("gpus_per_node"), gpus_per_node=root.integer("gpus_per_node"), device=device,
        fabric=intra.string("fabric", choices=("nvswitch", "mesh", "pcie", "loopback")),
        intra=Link(bytes_per_s=intra.number("link_GBps") * 1e9, efficiency=intra.fraction("efficiency"),
                   latency_s=intra.number("latency_us", allow_zero=True) * 1e-6),
        nvls_allreduce_bytes_per_s=intra.number("nvls_allreduce_algbw_GBps", allow_zero=True, default=0.0) * 1e9,
        intra_all_gather_ratio=intra.number("all_gather_busbw_ratio", default=1.0),
        intra_reduce_scatter_ratio=intra.number("reduce_scatter_busbw_ratio", default=1.0),
        nics_per_node=nics,
        nic=Link(bytes_per_s=net.number("nic_Gbps", allow_zero=not nics) / 8 * 1e9,
                 efficiency=net.fraction("efficiency"),
                 latency_s=net.number("latency_us", allow_zero=True) * 1e-6),
        host=Link(bytes_per_s=host.number("pcie_GBps") * 1e9, efficiency=1.0, latency_s=10e-6),
        gpus_per_host_uplink=host.integer("gpus_per_uplink", default=1),
        host_memory_bytes=host.number("memory_GiB") * GiB,
        host_dram=Link(bytes_per_s=host.number("memory_GBps") * 1e9, efficiency=host.fraction("memory_efficiency"),
                       latency_s=0.0),
        gpus_per_host=_gpus_per_host(host, root.integer("gpus_per_node")),
        **_nvme(host),
        oversubscription=net.number("oversubscription", default=1.0),
        collnet=net.boolean("collnet", default=False),
        nccl_arch=gpu.string("nccl_arch", choices=("", "volta", "ampere", "hopper", "blackwell"), default=""),
        cpu_vendor=host.string("cpu_vendor", choices=("", "intel", "amd", "arm"), default=""),
        max_nodes=root.integer("max_nodes", allow_zero=True, default=0),
        comm_sm_fraction=min(1.0, root.table("runtime").number("comm_sms", allow_zero=True, default=0.0)
                             / gpu.integer("sm_count")),
        sync_wait_coefficient=root.table("runtime").number("sync_wait_coefficient", allow_zero=True, default=0.0),
        copy_launch_s=root.table("runtime").number("copy_launch_us", allow_zero=True, default=0.0) * 1e-6,
        cores_per_node=host.integer("cores", default=0, allow_zero=True),
        threads_per_process=gpu.integer("threads", default=1),
        source=source, measured_by=root.string("source", default=""), **_pricing(root), **_power(root))


def _gpus_per_host(host: _Table, per_node: int) -> int:
    """[host] gpus_per_host: the GPUs of one host where a node (an NVLink domain) holds several, dividing
    gpus_per_node; absent: the node is one host (0)."""
    if "gpus_per_host" not in host.data:
        return 0
    k = host.integer("gpus_per_host")
    if per_node % k:
        raise UserError(f"{k} does not divide gpus_per_node {per_node}; allowed: a divisor of gpus_per_node (the "
                        "GPUs of one host where a node holds several)", source=host.source,
                        field=host._name("gpus_per_host"))
    return k


def _nvme(host: _Table) -> dict:
    """[host] nvme_GiB, nvme_read_GBps and nvme_write_GBps: the node's local NVMe drives together (RAID-0), all three
    or none (nvme_GiB 0: none)."""
    if "nvme_GiB" not in host.data:
        for key in ("nvme_read_GBps", "nvme_write_GBps"):
            if key in host.data:
                raise UserError(f"given without nvme_GiB; allowed: nvme_GiB, nvme_read_GBps and nvme_write_GBps "
                                "together, or none of them", source=host.source, field=host._name(key))
        return {}
    if not host.number("nvme_GiB", allow_zero=True):     # 0: a variant of a base with drives that it does not have
        return {}
    return {"nvme_bytes": host.number("nvme_GiB") * GiB, "nvme_read_bytes_per_s": host.number("nvme_read_GBps") * 1e9,
            "nvme_write_bytes_per_s": host.number("nvme_write_GBps") * 1e9}


def _power(root: _Table) -> dict:
    """The optional [power] table: watts per GPU (TDP and idle), per node besides the GPUs, per node of
    the network fabric (optional), and their sources."""
    if "power" not in root.data:
        return {}
    power = root.table("power")
    tdp = power.number("gpu_tdp_W")
    idle = power.number("gpu_idle_W", allow_zero=True)
    if idle > tdp:
        raise UserError(f"{idle} W is more than gpu_tdp_W {tdp} W; allowed: at most the TDP", source=root.source,
                        field="power.gpu_idle_W")
    return {"power": Power(gpu_tdp_w=tdp, gpu_idle_w=idle, host_w=power.number("host_W", allow_zero=True),
                           network_w=power.number("network_W", allow_zero=True, default=0.0),
                           source=power.string("source"))}


def _pricing(root: _Table) -> dict:
    """The optional [pricing] table: gpu_hour_usd and the price list it comes from."""
    if "pricing" not in root.data:
        return {}
    pricing = root.table("pricing")
    return {"gpu_hour_usd": pricing.number("gpu_hour_usd"), "price_source": pricing.string("source")}
