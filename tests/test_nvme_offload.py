"""Offload to NVMe (ZeRO-Infinity, ``--nvme-offload on``, DeepSpeed ZeRO-3): what optimizer and parameter offload
move off the GPU lives on the node's NVMe; the drives' reads and writes join the step, the host keeps swap buffers.
Expected values are written out here from the profile's numbers and DeepSpeed's defaults."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from planner import api
from planner.cluster import GiB, load_cluster
from planner.config import ParallelConfig
from planner.errors import UserError

GB = 1e9
M = 4           # micro-batches
CONFIG = ParallelConfig(dp=8, tp=1, pp=1, zero=3, micro_batch=1, num_microbatches=M, recompute="full",
                        optimizer_offload=True, param_offload=True)


def _estimate(config: ParallelConfig):
    job = api.load_job("llama3-8b", "a100-80g", gpus=8, global_batch=8 * M, seq_len=4096, framework="deepspeed")
    return job, api.fixed_plan(job, config).best.estimate


def test_the_profiles_describe_the_nodes_drives():
    a100 = load_cluster("a100-80g", 8)
    # DGX A100 640GB: 8 x 3.84 TB; DeepNVMe's 10 and 5 GB/s over 4 Gen4 drives, per drive, times 8
    assert a100.nvme_bytes == pytest.approx(round(8 * 3.84e12 / GiB) * GiB)
    assert (a100.nvme_read_bytes_per_s, a100.nvme_write_bytes_per_s) == (20 * GB, 10 * GB)
    assert load_cluster("h800", 8).nvme_bytes == 0        # a variant whose drives are not its base's


def test_the_drives_reads_and_writes_join_the_step_and_the_host_keeps_buffers():
    job, cpu = _estimate(CONFIG)
    _, nvme = _estimate(CONFIG.but(nvme_offload=True))
    params = job.graph.num_params               # dp 8 on one node of 8: each rank a 1/8 shard, all on one node's drives
    # read: the parameters for every gather (2 bytes forward, 2 backward, each micro-batch) and the fp32 master
    # weights and both moments (12); written: the updated parameters (2) and those 12
    read, write = 4 * M + 12, 2 + 12
    assert nvme.step_time_s - cpu.step_time_s == pytest.approx(params * (read / (20 * GB) + write / (10 * GB)),
                                                               rel=1e-6)
    # host: offload_param's 5 buffers of 1e8 bf16 elements and one sub-group of 1e9 elements (12 + 4 bytes) a rank
    local = params / 8
    assert nvme.host_bytes_per_node == pytest.approx(8 * (5e8 * 2 + min(local, 1e9) * 16), rel=1e-9)
    assert nvme.nvme_bytes_per_node == pytest.approx(cpu.host_bytes_per_node, rel=1e-9)
    assert nvme.nvme_capacity_bytes == load_cluster("a100-80g", 8).nvme_bytes and nvme.fits


@pytest.mark.parametrize("args, says", [
    (["--framework", "megatron"], "does not run on the megatron runtime"),
    (["--framework", "deepspeed", "--zero", "2"], "with ZeRO-2 does not run"),
    (["--framework", "deepspeed", "--cluster", "b200"], "describes no local NVMe"),
])
def test_where_it_does_not_run_one_line_names_the_flag(args, says):
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--nvme-offload", "on"]
    proc = run_cli(*base, *(["--cluster", "a100-80g"] if "--cluster" not in args else []), *args)
    assert proc.returncode == 2 and "--nvme-offload" in proc.stderr and says in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_deepspeed_export_reads_back_as_the_same_plan(tmp_path):
    out = tmp_path / "report"
    proc = run_cli("plan", "--model", "llama3-8b", "--cluster", "a100-80g", "--gpus", "8", "--framework", "deepspeed",
                   "--zero", "3", "--optimizer-offload", "on", "--param-offload", "on", "--nvme-offload", "on",
                   "--top-k", "1", "--report", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["config"]["nvme_offload"] is True
    ds = json.loads((out / "exports" / "deepspeed_config.json").read_text())["zero_optimization"]
    assert ds["offload_optimizer"]["device"] == ds["offload_param"]["device"] == "nvme"
    proc = run_cli("compare", "--baseline", str(out / "exports" / "deepspeed_config.json"), "--model", "llama3-8b",
                   "--cluster", "a100-80g", "--gpus", "8", "--top-k", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["baseline"]["config"]["nvme_offload"] is True
    assert doc["baseline"]["estimate"]["step_time_s"] == pytest.approx(plan["estimate"]["step_time_s"], rel=1e-6)


def test_a_profile_with_rates_but_no_capacity_is_refused(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "b200"\nname = "mine"\n[host]\nnvme_read_GBps = 20\n')
    with pytest.raises(UserError) as err:
        load_cluster(str(path), 8)
    assert err.value.field == "host.nvme_read_GBps"


def test_fixed_on_alone_the_search_keeps_to_stages_and_offloads_that_run_it():
    """--nvme-offload on with everything else searched: ZeRO-3 plans (DeepSpeed's NVMe offload runs there only),
    on NVMe wherever something is offloaded."""
    job = api.load_job("llama3-70b", "a100-80g", gpus=8, global_batch=64, seq_len=4096, framework="deepspeed")
    plan = api.plan(job, api.Knobs(nvme_offload=True), top_k=3)
    for candidate in (plan.best, *plan.alternatives):
        c = candidate.config
        assert c.zero == 3 and c.nvme_offload == (c.optimizer_offload or c.param_offload)
    assert plan.best.config.nvme_offload and plan.best.estimate.nvme_bytes_per_node > 0


def test_fit_mins_answer_says_the_nvme_its_plan_needs():
    from planner.fitmin import FitMin
    job = api.load_job("llama3-8b", "a100-80g", gpus=8, global_batch=8 * M, seq_len=4096, framework="deepspeed")
    plan = api.fixed_plan(job, CONFIG.but(nvme_offload=True))
    doc = FitMin(gpus_per_node=8, plan=plan, tried=((8, "fits"),), limit=64).to_json()
    e = plan.best.estimate
    assert (doc["nvme_bytes_per_node"], doc["nvme_capacity_bytes"]) == (e.nvme_bytes_per_node, e.nvme_capacity_bytes)
    assert doc["nvme_bytes_per_node"] > 0 and doc["host_bytes_per_node"] > 0
