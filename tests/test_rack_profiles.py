"""The 2025-2026 GPU profiles (profiles/gb200-nvl72.toml, mi300x.toml): a GB200 NVL72 rack is one NVLink
domain of 72 GPUs, so tensor parallelism over 16 of them stays on NVLink, where on DGX B200 nodes of 8 it
crosses InfiniBand; both plan and sweep."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from planner import api
from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.layers import build_layer_graph
from planner.model import load_model


def _tp_comm(cluster, tp: int) -> float:
    """Exposed TP communication of Llama 3 70B at ``tp`` under Megatron-LM (which replicates the 8 key/value
    heads over a TP group of 16), ZeRO-1, sequence parallel."""
    spec = load_model("llama3-70b")
    gpus = cluster.num_gpus
    job = api.Job(model_source="llama3-70b", spec=spec, graph=build_layer_graph(spec), cluster=cluster,
                  workload=Workload(global_batch=gpus // tp * 2, seq_len=8192, framework="megatron"))
    config = ParallelConfig(dp=gpus // tp, tp=tp, pp=1, zero=1, micro_batch=1, num_microbatches=2, recompute="full",
                            sequence_parallel=True)
    return api.fixed_plan(job, config).best.estimate.time.tp_comm


def test_tensor_parallelism_over_16_gpus_stays_on_nvlink_in_an_nvl72_rack():
    nvl72, dgx = load_cluster("gb200-nvl72", 144), load_cluster("b200", 144)
    # a TP group of 16 crosses InfiniBand between DGX B200 nodes of 8 and stays on NVLink in the rack
    assert _tp_comm(nvl72, 16) < 0.75 * _tp_comm(dgx, 16)
    # what decides it is the NVLink domain: DGX B200 nodes as large as the rack price it the same (both NVLink5 at
    # 900 GB/s per direction, the same efficiency and latency)
    rack_sized = replace(dgx, gpus_per_node=72, nics_per_node=72)
    assert _tp_comm(nvl72, 16) == pytest.approx(_tp_comm(rack_sized, 16), rel=1e-6)
    # inside 8 GPUs both are NVLink5 at the same rate
    assert _tp_comm(nvl72, 8) == pytest.approx(_tp_comm(dgx, 8), rel=1e-6)


@pytest.mark.parametrize("name,gpus_per_node,vendor", [("gb200-nvl72", 72, "NVIDIA"), ("mi300x", 8, "AMD")])
def test_the_new_profiles_load_with_their_domains(name, gpus_per_node, vendor):
    cluster = load_cluster(name)
    assert cluster.gpus_per_node == cluster.num_gpus == gpus_per_node and cluster.device.name.startswith(vendor)


def test_whatif_sweeps_the_gpus_of_2026(cli, tmp_path):
    out = cli("whatif", "--model", "llama3-8b", "--gpus", "72", "--sweep",
              "gpu=h100-80g,h200,b200,gb200-nvl72,mi300x", "--out", str(tmp_path))
    points = json.loads((tmp_path / "whatif.json").read_text())["points"]
    assert out.returncode == 0 and "gb200-nvl72" in out.stdout and (tmp_path / "whatif.png").is_file()
    assert len(points) == 5


@pytest.mark.parametrize("name,tflops", [("h100-80g", 1978.9), ("h200", 1978.9), ("b200", 4500), ("gb200-nvl72", 5000),
                                         ("mi300x", 2614.9), ("l40s", 733), ("a100-80g", 0), ("v100-32g", 0)])
def test_fp8_peaks_are_the_datasheets_dense_figures_and_no_precision_of_their_own(name, tflops):
    """Dense FP8 tensor-core peaks (H100/H200 SXM and L40S datasheets: half the sparse figure; B200 at 1,000 W and
    1,200 W; MI300X); Ampere and Volta have none. FP8 is not offered as a training precision by itself."""
    device = load_cluster(name).device
    assert device.fp8_peak_flops == pytest.approx(tflops * 1e12)
    assert "fp8" not in device.dtypes


def test_the_measured_h200_profile_carries_its_best_fp8_gemm(cli):
    raw = json.loads(open("profiles/measured/h200.kernels.json").read())["device"]["kernels"]["fp8_gemm"]
    best = max(r["tflops"] for r in raw if "tflops" in r)
    assert load_cluster("profiles/measured/h200.toml").device.fp8_peak_flops == pytest.approx(best * 1e12, rel=1e-3)
    listed = {c["name"]: c for c in json.loads(cli("clusters", "--json").stdout)}
    assert listed["b200"]["peak_tflops"]["fp8"] == 4500 and "fp8" not in listed["a100-80g"]["peak_tflops"]


def test_a_variant_profile_says_only_what_differs_from_its_base(tmp_path):
    from planner.errors import UserError
    capped, base = load_cluster("h100-96g-500w", 8), load_cluster("h100-80g", 8)
    # torchtitan's H100s: 96 GB HBM2e at 2.4 TB/s, 500 W; the GH100 peaks and the NVLink node of h100-80g
    assert capped.device.hbm_bytes_per_s == 2.4e12 and capped.device.memory_bytes > base.device.memory_bytes
    assert capped.device.peak("bf16") == base.device.peak("bf16") and capped.intra == base.intra
    assert capped.device.gemm_efficiency == pytest.approx(base.device.gemm_efficiency * (500 / 700) ** (1 / 3), abs=5e-4)
    assert capped.gpu_hour_usd == 0 and base.gpu_hour_usd > 0          # the base's price is dropped
    # a user's variant of a variant, relative to its own folder; a table merges key by key
    (tmp_path / "mine.toml").write_text('base = "h100-96g-500w"\nname = "mine"\n[gpu]\nmemory_GiB = 64\n')
    mine = load_cluster(str(tmp_path / "mine.toml"), 8)
    assert mine.device.memory_bytes == 64 * 2**30 and mine.device.hbm_bytes_per_s == 2.4e12
    (tmp_path / "a.toml").write_text('base = "b.toml"\n')
    (tmp_path / "b.toml").write_text('base = "a.toml"\n')
    with pytest.raises(UserError, match="as base"):
        load_cluster(str(tmp_path / "a.toml"))
    (tmp_path / "c.toml").write_text('base = "h100-90g"\n')
    with pytest.raises(UserError, match="h100-80g"):
        load_cluster(str(tmp_path / "c.toml"))
    (tmp_path / "d.toml").write_text('base = "h100-80g"\ndrop = ["prices"]\n')
    with pytest.raises(UserError, match="pricing"):
        load_cluster(str(tmp_path / "d.toml"))


def _offloaded_70b(cluster):
    """Llama 3 70B on ``cluster``'s GPUs under FSDP (ZeRO-3), its optimizer in host memory."""
    spec = load_model("llama3-70b")
    job = api.Job(model_source="llama3-70b", spec=spec, graph=build_layer_graph(spec), cluster=cluster,
                  workload=Workload(global_batch=cluster.num_gpus, seq_len=4096, framework="torch"))
    config = ParallelConfig(dp=cluster.num_gpus, tp=1, pp=1, zero=3, micro_batch=1, num_microbatches=1,
                            recompute="full", optimizer_offload=True)
    return api.fixed_plan(job, config).best


def test_a_job_on_part_of_an_nvl72_rack_has_its_trays_host_memory_bandwidth_and_power():
    """The rack is one node (its NVLink domain) of 18 compute trays, each a host of its own (two Grace CPUs with
    480 GB LPDDR5X at 512 GB/s each, 4 GPUs: [host] gpus_per_host = 4); the profile's [host] and [power] are the
    rack's. A job on 8 of its GPUs runs on 2 trays: 2/18 of the rack's host memory, DRAM bandwidth and host power,
    not all of it (before, 8 GPUs offloading DeepSeek-V3's 10.7 TB of states were given the rack's 15.8 TiB)."""
    rack = load_cluster("gb200-nvl72", 8)
    assert rack.host_share == pytest.approx(2 / 18)
    assert load_cluster("gb200-nvl72", 6).host_share == pytest.approx(2 / 18)      # 6 GPUs still take 2 trays
    assert load_cluster("gb200-nvl72", 72).host_share == load_cluster("gb200-nvl72", 144).host_share == 1.0
    assert load_cluster("h100-80g", 4).host_share == 1.0       # a DGX node is one host: a job on half of it has all
    best = _offloaded_70b(rack)
    assert best.estimate.host_capacity_bytes == pytest.approx(15827 * 2**30 * 2 / 18)
    # CPU Adam (28 bytes a parameter) of the 8 GPUs' shards over 2 trays' DRAM (4 x 512 GB/s at the profile's 0.5)
    # against the whole rack's (36 x 512 GB/s): the same plan's optimizer step differs by exactly that
    whole = _offloaded_70b(replace(rack, gpus_per_host=0))
    cpu_s = lambda dram_GBps: 8 * 70.55e9 / 8 * 28 / (dram_GBps * 1e9 * 0.5)    # noqa: E731
    assert best.estimate.time.optimizer - whole.estimate.time.optimizer == pytest.approx(
        cpu_s(4 * 512) - cpu_s(36 * 512), rel=2e-3)
    # the rack's 33.6 kW besides the GPUs, 2 trays' share of it
    from planner.energy import energy
    assert energy(best.estimate, rack, Workload(global_batch=8, seq_len=4096)).host_w == pytest.approx(33600 * 2 / 18)


def test_deepseek_v3_offloaded_on_8_gpus_of_a_rack_no_longer_fits_in_host_memory():
    """671B parameters' fp32 master weights, gradients and Adam moments (16 bytes each: 10.7 TB) do not fit in 2
    trays' 1.92 TB; the search says no plan fits at 8 GPUs of the rack, as it does on 8 GPUs of DGX B200."""
    from planner.errors import NoFeasiblePlan
    for name in ("gb200-nvl72", "b200"):
        job = api.load_job("deepseek-v3", name, gpus=8, global_batch=64, seq_len=4096)
        with pytest.raises(NoFeasiblePlan):
            api.plan(job, api.Knobs())


def test_gpus_per_host_must_divide_the_node(tmp_path):
    from planner.errors import UserError
    (tmp_path / "rack.toml").write_text('base = "gb200-nvl72"\nname = "rack"\n[host]\ngpus_per_host = 5\n')
    with pytest.raises(UserError, match="divide gpus_per_node 72") as err:
        load_cluster(str(tmp_path / "rack.toml"))
    assert "host.gpus_per_host" in str(err.value)


def test_a_job_of_256_gpus_uses_64_gpus_of_each_of_4_racks():
    """GB200 NVL72 jobs come in powers of two (Megatron-Bridge's runs: 256 GPUs), which fill no whole number of
    72-GPU racks. A scheduler keeps each part of the job in one NVLink domain: the same whole trays of each rack,
    the most that divide the job (256 = 4 x 64, 16 of 18 trays). The job's node is then those 64 GPUs, with their
    trays' share of the rack's NICs (one a GPU), host memory and host power; a group of 64 consecutive ranks
    (expert parallelism 64) stays inside one domain, one of 128 spans two."""
    from planner import network
    rack = load_cluster("gb200-nvl72", 72)
    job = load_cluster("gb200-nvl72", 256)
    assert (job.num_gpus, job.gpus_per_node, job.num_nodes, job.nics_per_node) == (256, 64, 4, 64)
    assert job.host_memory_bytes == pytest.approx(rack.host_memory_bytes * 16 / 18)
    assert job.host_dram.bytes_per_s == pytest.approx(rack.host_dram.bytes_per_s * 16 / 18)
    assert job.power.host_w == pytest.approx(33600 * 16 / 18) and job.host_share == 1.0
    assert job.partial_nodes == "4 NVLink domains of 64 of their 72 GPUs, 16 of 18 hosts each"
    assert network.group(job, 64, 1).nodes == 1 and network.group(job, 128, 1).nodes == 2
    # 200 GPUs: 5 racks x 40 (10 trays each); whole racks and jobs within one rack are as before
    assert load_cluster("gb200-nvl72", 200).gpus_per_node == 40
    assert load_cluster("gb200-nvl72", 144).partial_nodes == load_cluster("gb200-nvl72", 8).partial_nodes == ""
    # another count starts again from the rack: the same cluster as loading it at that count
    assert job.with_gpus(144) == load_cluster("gb200-nvl72", 144) and job.with_gpus(144).gpus_per_node == 72
    assert job.with_gpus(512).gpus_per_node == 64 and job.with_gpus(512).nics_per_node == 64


def test_a_gpu_count_that_splits_racks_unevenly_or_thinly_is_refused_with_the_counts_near_it():
    from planner.errors import UserError
    with pytest.raises(UserError) as e:       # 76 = 19 trays: only 4 or 76 GPUs a rack divide it
        load_cluster("gb200-nvl72", 76)
    assert e.value.field == "--gpus" and "near it: 72, 80" in str(e.value)
    with pytest.raises(UserError) as e:       # not whole trays
        load_cluster("gb200-nvl72", 74)
    assert "a multiple of 4 (whole hosts)" in str(e.value)
    with pytest.raises(UserError) as e:       # a DGX node is one host: whole nodes only, as before
        load_cluster("h100-80g", 12)
    assert "do not fill whole nodes of 8" in str(e.value)


def test_the_plan_header_says_how_the_job_sits_on_the_racks(cli):
    out = cli("plan", "--model", "llama3-8b", "--cluster", "gb200-nvl72", "--gpus", "128", "--global-batch", "128")
    assert out.returncode == 0, out.stderr
    assert "on gb200-nvl72 x 128 GPUs (2 NVLink domains of 64 of their 72 GPUs, 16 of 18 hosts each)" in out.stdout


def test_a_rack_job_is_launched_per_tray():
    """torchrun and Slurm start one agent per host, and a GB200 NVL72 host is a compute tray of 4 GPUs, not the rack:
    256 GPUs are 64 hosts of 4 (#SBATCH --nodes=64 --gpus-per-node=4, meshplan run --nnodes 64 --nproc 4); 6 GPUs
    of a rack take 2 trays, 3 processes on each (the same on every host); a DGX node is one host of 8."""
    from planner.exports import meshplan_run, slurm
    assert load_cluster("gb200-nvl72", 256).launch == (64, 4)
    assert load_cluster("gb200-nvl72", 144).launch == (36, 4)
    assert load_cluster("gb200-nvl72", 6).launch == (2, 3) and load_cluster("gb200-nvl72", 2).launch == (1, 2)
    assert load_cluster("h100-80g", 16).launch == (2, 8) and load_cluster("h100-80g", 4).launch == (1, 4)
    plan = api.plan(api.load_job("llama3-8b", "gb200-nvl72", gpus=256, global_batch=256), top_k=1)
    script = slurm(plan).text
    assert "#SBATCH --nodes=64" in script and "#SBATCH --gpus-per-node=4" in script
    assert "--nproc 4 --nnodes 64" in meshplan_run(plan).text
