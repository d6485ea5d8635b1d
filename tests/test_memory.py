"""Model-state memory per runtime and activation in-flight counts per schedule."""
import json

import pytest

from planner.cost.memory import state_bytes_per_param
from planner.schedules import SCHEDULES


def inflight_microbatches(schedule, *, rank, pp, vpp, num_microbatches):
    return SCHEDULES[schedule].inflight(rank=rank, pp=pp, vpp=vpp, m=num_microbatches)

# Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
# Models", Table 1: model-state memory per GPU in GB (1e9 bytes) for stages 1 (P_os),
# 2 (P_os+g) and 3 (P_os+g+p), as printed.
ZERO_TABLE1 = {
    # (params in billions, Nd): (stage 1, stage 2, stage 3)
    (7.5, 1): (120, 120, 120), (7.5, 4): (52.5, 41.3, 30), (7.5, 16): (35.6, 21.6, 7.5),
    (7.5, 64): (31.4, 16.6, 1.88), (7.5, 256): (30.4, 15.4, 0.47), (7.5, 1024): (30.1, 15.1, 0.12),
    (128, 1): (2048, 2048, 2048), (128, 4): (896, 704, 512), (128, 16): (608, 368, 128),
    (128, 64): (536, 284, 32), (128, 256): (518, 263, 8), (128, 1024): (513, 257, 2),
    (1000, 1): (16000, 16000, 16000), (1000, 4): (7000, 5500, 4000), (1000, 16): (4750, 2875, 1000),
    (1000, 64): (4187, 2218, 250), (1000, 256): (4046, 2054, 62.5), (1000, 1024): (4011, 2013, 15.6),
}


def close_to_printed(value: float, printed: float) -> bool:
    """Within 1%, or within the rounding of the printed value (0.12 stands for 0.115..0.125)."""
    text = repr(float(printed))
    decimals = len(text.split(".")[1].rstrip("0")) if "." in text else 0
    return abs(value - printed) <= max(0.01 * printed, 0.5 * 10 ** -decimals)


@pytest.mark.parametrize("key", ZERO_TABLE1)
def test_zero_paper_table1_with_deepspeed_layout(key):
    psi, nd = key
    for stage, published in zip((1, 2, 3), ZERO_TABLE1[key]):
        s = state_bytes_per_param(framework="deepspeed", precision="fp16", zero=stage, shard=nd, optimizer_offload=False)
        assert close_to_printed((s.params + s.grads + s.optimizer) * psi, published), (stage, published)


@pytest.mark.parametrize("nd", [4, 64, 1024])
def test_zero_table_through_the_cli(cli, nd):
    """`meshplan plan --framework deepspeed` reports the same bytes per parameter."""
    for stage in (1, 2, 3):
        out = cli("plan", "--model", "gpt-1.7b", "--cluster", "a100-80g", "--gpus", str(nd), "--framework",
                  "deepspeed", "--precision", "fp16", "--dp", str(nd), "--tp", "1", "--pp", "1", "--zero",
                  str(stage), "--micro-batch", "1", "--recompute", "full", "--global-batch", str(nd), "--json")
        assert out.returncode == 0, out.stderr
        mem = json.loads(out.stdout)["estimate"]["memory_per_gpu_bytes"]
        params = json.loads(out.stdout)["model"]["params"]
        per_param = (mem["params"] + mem["grads"] + mem["optimizer"]) / params
        for psi in (7.5, 128, 1000):
            assert close_to_printed(per_param * psi, ZERO_TABLE1[(psi, nd)][stage - 1])


def test_megatron_keeps_fp32_main_grads():
    s = state_bytes_per_param(framework="megatron", precision="bf16", zero=0, shard=8, optimizer_offload=False)
    assert s.params + s.grads + s.optimizer == 18          # Megatron-LM docs: 18 bytes/param
    d = state_bytes_per_param(framework="megatron", precision="bf16", zero=1, shard=8, optimizer_offload=False)
    assert d.params + d.grads + d.optimizer == 6 + 12 / 8  # distributed optimizer: 6 + 12/d


def test_megatron_fsdp_shards_the_gradients_then_the_parameters():
    """Megatron-FSDP's optim_grads (ZeRO-2) shards the fp32 main gradients beside the optimizer, optim_grads_params
    (ZeRO-3) the bf16 parameters too: 2 + (4 + 12)/d, then 18/d."""
    two = state_bytes_per_param(framework="megatron", precision="bf16", zero=2, shard=8, optimizer_offload=False)
    assert (two.params, two.grads, two.optimizer) == (2, 4 / 8, 12 / 8)
    three = state_bytes_per_param(framework="megatron", precision="bf16", zero=3, shard=8, optimizer_offload=False)
    assert (three.params, three.grads, three.optimizer) == (2 / 8, 4 / 8, 12 / 8)


def test_torch_layouts():
    ddp = state_bytes_per_param(framework="torch", precision="bf16", zero=0, shard=8, optimizer_offload=False)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (6, 4, 8)      # fp32 + autocast bf16 copy
    fsdp3 = state_bytes_per_param(framework="torch", precision="bf16", zero=3, shard=8, optimizer_offload=False)
    assert (fsdp3.params, fsdp3.grads, fsdp3.optimizer) == (0.5, 0.5, 1)
    fsdp2 = state_bytes_per_param(framework="torch", precision="bf16", zero=2, shard=8, optimizer_offload=False)
    assert fsdp2.params == 0.5 + 2                                     # + unsharded bf16 held fwd->bwd
    fp32 = state_bytes_per_param(framework="torch", precision="fp32", zero=0, shard=1, optimizer_offload=False)
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4, 4, 8)


def test_offload_moves_the_optimizer_to_the_host():
    s = state_bytes_per_param(framework="deepspeed", precision="fp16", zero=2, shard=4, optimizer_offload=True)
    assert s.optimizer == 0 and s.host_optimizer == 12 / 4


def test_deepspeeds_parameter_offload_moves_the_zero3_parameter_shard_to_the_host():
    """offload_param (ZeRO-Infinity) at ZeRO-3 with offload_optimizer, as the Hugging Face Trainer's stock config
    sets them: the 2-byte parameter shard (2 / 8) and the 12 bytes of optimizer states (12 / 8) in host memory,
    the 2-byte gradient shard (2 / 8) on the device."""
    s = state_bytes_per_param(framework="deepspeed", precision="bf16", zero=3, shard=8, optimizer_offload=True,
                              param_offload=True)
    assert (s.params, s.grads, s.optimizer) == (0, 0.25, 0)
    assert (s.host_params, s.host_grads, s.host_optimizer) == (0.25, 0, 1.5)
    alone = state_bytes_per_param(framework="deepspeed", precision="bf16", zero=3, shard=8, optimizer_offload=False,
                                  param_offload=True)
    assert (alone.params, alone.grads, alone.optimizer, alone.host) == (0, 0.25, 1.5, 0.25)


def test_deepspeeds_parameter_offload_copies_the_shard_up_for_every_micro_batch():
    """Per micro-batch, the 2-byte shard goes up before the forward's gather and again before the backward's
    (4 bytes per local parameter), and after the step the updated parameters stay on the host (the 2 bytes that
    ZeRO-Offload copies up once a step are not copied): for Llama 3 8B on 8 H100 at ZeRO-3 with 4 micro-batches,
    the optimizer step grows by (4 x 4 - 2) bytes per local parameter over the host link."""
    from planner import api
    from planner.config import ParallelConfig
    from planner.cost.step import CostCache, optimizer_time_s
    from planner.network import fabric
    job = api.load_job("llama3-8b", "h100-80g", gpus=8, global_batch=32, framework="deepspeed")
    cache = CostCache(job.graph, job.cluster, job.workload)
    base = ParallelConfig(dp=8, tp=1, pp=1, zero=3, micro_batch=1, num_microbatches=4, optimizer_offload=True)
    params = 8e9
    extra = (optimizer_time_s(cache, base.but(param_offload=True), params) - optimizer_time_s(cache, base, params))
    local = params / 8
    assert extra == pytest.approx(local * (4 * 4 - 2) / fabric(job.cluster).host_bytes_per_s, rel=1e-9)


def test_torch_offload_layouts():
    """meshplan's executor: ZeRO-1's sharded AdamW moves its 8 bytes of states alone (executor/zero1.py);
    FSDP2's CPUOffloadPolicy at ZeRO-2/3 moves the fp32 parameter and gradient shards too, and the
    device keeps only ZeRO-2's gathered copy (bf16 under mixed precision)."""
    z1 = state_bytes_per_param(framework="torch", precision="bf16", zero=1, shard=8, optimizer_offload=True)
    assert (z1.params, z1.grads, z1.optimizer) == (6, 4, 0) and (z1.host_params, z1.host_grads, z1.host) == (0, 0, 1)
    z2 = state_bytes_per_param(framework="torch", precision="bf16", zero=2, shard=8, optimizer_offload=True)
    assert (z2.params, z2.grads, z2.optimizer) == (2, 0, 0)
    assert (z2.host_params, z2.host_grads, z2.host_optimizer) == (0.5, 0.5, 1)
    z3 = state_bytes_per_param(framework="torch", precision="fp32", zero=3, shard=4, optimizer_offload=True)
    assert (z3.params, z3.grads, z3.optimizer) == (0, 0, 0) and z3.host == 1 + 1 + 2


def test_torch_pipelines_hold_zero2_and_zero3_gradients_unsharded():
    """torch.distributed.pipelining turns FSDP's gradient sync and reshard-after-backward off for every
    backward but the schedule's own final reduction (stage.py, torch 2.13): under a pipeline the
    gradients accumulate unsharded (fp32, 4 B) and ZeRO-3 keeps the gathered bf16 parameters (2 B)
    as ZeRO-2 does; without a pipeline, and for ZeRO-1 or Megatron, nothing changes."""
    kw = dict(framework="torch", precision="bf16", shard=8, optimizer_offload=False)
    z3 = state_bytes_per_param(zero=3, pp=2, **kw)
    assert (z3.params, z3.grads, z3.optimizer) == (4 / 8 + 2, 4.0, 8 / 8)
    z2 = state_bytes_per_param(zero=2, pp=4, **kw)
    assert (z2.params, z2.grads) == (4 / 8 + 2, 4.0)
    flat = state_bytes_per_param(zero=3, pp=1, **kw)
    assert (flat.params, flat.grads) == (4 / 8, 4 / 8)
    assert state_bytes_per_param(zero=1, pp=2, **kw) == state_bytes_per_param(zero=1, pp=1, **kw)
    mkw = {**kw, "framework": "megatron"}
    assert state_bytes_per_param(zero=1, pp=2, **mkw) == state_bytes_per_param(zero=1, pp=1, **mkw)
    # optimizer offload: the reduced shard goes to the host, the unsharded accumulator stays
    off = state_bytes_per_param(framework="torch", precision="bf16", shard=8, optimizer_offload=True, zero=3, pp=2)
    assert (off.params, off.grads, off.host_params, off.host_grads) == (2.0, 4.0, 4 / 8, 4 / 8)


def test_inflight_microbatches_per_schedule():
    assert inflight_microbatches("gpipe", rank=0, pp=4, vpp=1, num_microbatches=16) == 16
    assert [inflight_microbatches("1f1b", rank=r, pp=4, vpp=1, num_microbatches=16) for r in range(4)] == \
        [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", rank=0, pp=8, vpp=1, num_microbatches=3) == 3
    # interleaved, first rank: p (1 + (p - 1)/(p v)) micro-batches' worth (Korthikanti et al. Sec 4.2.3)
    p, v = 4, 3
    assert inflight_microbatches("interleaved-1f1b", rank=0, pp=p, vpp=v, num_microbatches=16) == \
        pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert inflight_microbatches("1f1b", rank=0, pp=1, vpp=1, num_microbatches=16) == 1
