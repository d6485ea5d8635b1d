"""The host-bound step (planner/cost/host.py): no step of the torch executor is shorter than the host's
time to issue it, priced from the executor's measured host time per block (executor/profile/host.py,
``[gpu.kernels] host_us``). The expected host times are written out here from the probe's numbers."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner import api
from planner.cluster import load_cluster, parse_cluster
from planner.config import ParallelConfig, Workload
from planner.cost.host import probe_spec
from planner.errors import UserError
from planner.layers import build_layer_graph

US = 1e-6
# per block per micro-batch, per block per step, the rest per micro-batch, the rest per step (us)
EAGER = (1000.0, 200.0, 300.0, 400.0)
FSDP = (1500.0, 250.0, 500.0, 900.0)
OP = (1800.0, 200.0, 300.0, 400.0)


def _cluster(host_us=(("eager", *EAGER), ("fsdp", *FSDP), ("op", *OP))):
    base = load_cluster("profiles/measured/h200.toml", 1)
    return replace(base, device=replace(base.device, host_us=host_us))


def _estimate(cluster, *, blocks=4, m=1, zero=0, recompute="none", framework="torch", experts=0):
    spec = replace(probe_spec(blocks, experts), seq_len=64)
    job = api.Job(model_source=spec.name, spec=spec, graph=build_layer_graph(spec), cluster=cluster,
                  workload=Workload(global_batch=m, seq_len=64, precision="bf16", framework=framework))
    config = ParallelConfig(dp=1, tp=1, pp=1, zero=zero, micro_batch=1, num_microbatches=m, recompute=recompute, ep=1)
    return api.fixed_plan(job, config).best.estimate


@pytest.mark.parametrize("blocks,m", [(4, 1), (4, 3), (10, 2)])
def test_a_tiny_model_takes_the_hosts_time_written_out_from_the_probe(blocks, m):
    b_mb, b_step, r_mb, r_step = EAGER
    host = (m * (blocks * b_mb + r_mb) + blocks * b_step + r_step) * US
    est = _estimate(_cluster(), blocks=blocks, m=m)
    without = _estimate(_cluster(()), blocks=blocks, m=m)
    assert without.step_time_s < host                        # the GPU alone would be faster: host-bound
    assert est.step_time_s == pytest.approx(host, rel=1e-9)
    assert est.time.host_wait == pytest.approx(host - without.step_time_s, rel=1e-6)
    assert est.time.total == pytest.approx(est.step_time_s, rel=1e-6)
    assert est.tokens_per_s == pytest.approx(m * 64 / host, rel=1e-9)


def test_fsdp_prices_its_rest_and_adds_its_difference_per_block():
    blocks, m = 4, 2
    e_mb, e_step = EAGER[:2]
    f_mb, f_step, r_mb, r_step = FSDP
    block = m * e_mb + e_step + (m * f_mb + f_step - (m * e_mb + e_step))
    host = (blocks * block + m * r_mb + r_step) * US
    assert _estimate(_cluster(), blocks=blocks, m=m, zero=3).step_time_s == pytest.approx(host, rel=1e-9)


def test_fsdp_host_work_scales_with_a_blocks_parameter_tensors_not_its_kernels():
    """A LayerNorm block with biases (a GPT-2 block: 12 parameter tensors, fused q, k and v one weight and one
    bias) against the probe's (9): FSDP2's part of the host time grows by 12/9, the eager part by the kernels."""
    from planner.cost.host import block_host_s, launches, parameter_tensors, probe_launches, probe_tensors
    spec = replace(probe_spec(1), norm="layernorm", mlp="gelu", linear_bias=True, qkv_bias=True, fused_qkv=True)
    block = next(layer for layer in build_layer_graph(spec).layers if layer.is_block)
    assert (parameter_tensors(block), probe_tensors()) == (12, 9)
    table = {"eager": tuple(x * US for x in EAGER), "fsdp": tuple(x * US for x in FSDP)}
    m = 2
    eager = (m * EAGER[0] + EAGER[1]) * US
    fsdp = (m * FSDP[0] + FSDP[1]) * US - eager
    assert block_host_s(block, "none", m=m, fsdp=True, table=table) == pytest.approx(
        eager * launches(block) / probe_launches() + fsdp * 12 / 9, rel=1e-12)
    assert block_host_s(block, "none", m=m, fsdp=False, table=table) == pytest.approx(
        eager * launches(block) / probe_launches(), rel=1e-12)


def test_a_counted_blocks_host_work_scales_with_its_operators():
    """Where planner/eager_table.py counts both blocks, the eager part of a block's host time scales with the
    operators each dispatches per micro-batch (views and GEMMs included), not with its kernels: a GPT-2 block with
    dropout, 67 forward and 136 backward under autocast, against the Llama-style probe's 118 and 166."""
    from planner.cost.host import block_host_s, operators, probe_spec as spec_of
    from planner.model import ModelSpec
    gpt2 = ModelSpec(name="g", num_layers=1, hidden=768, num_heads=12, num_kv_heads=12, head_dim=64, ffn_hidden=3072,
                     vocab_size=50257, seq_len=1024, max_positions=1024, mlp="gelu", norm="layernorm",
                     linear_bias=True, qkv_bias=True, tied_embeddings=True, dropout=True)
    block = next(layer for layer in build_layer_graph(gpt2).layers if layer.is_block)
    probe = next(layer for layer in build_layer_graph(spec_of(1)).layers if layer.is_block)
    assert (operators(block), operators(probe)) == (67 + 136, 118 + 166)
    table = {"eager": tuple(x * US for x in EAGER)}
    m = 4
    eager = (m * EAGER[0] + EAGER[1]) * US
    assert block_host_s(block, "none", m=m, fsdp=False, table=table) == pytest.approx(eager * 203 / 284, rel=1e-12)


def test_operator_level_recompute_adds_its_probes_difference():
    blocks, m = 6, 1
    host = (m * (blocks * OP[0] + OP[2]) + blocks * OP[1] + OP[3]) * US
    assert _estimate(_cluster(), blocks=blocks, m=m, recompute="op").step_time_s == pytest.approx(host, rel=1e-9)


def test_no_host_measurement_or_another_runtime_means_no_host_bound():
    assert _estimate(_cluster(()), m=4).time.host_wait == 0.0
    assert _estimate(_cluster(), m=4, framework="megatron").time.host_wait == 0.0


def test_a_gpu_bound_step_is_left_as_it_is():
    """Host times far below the GPU's: the estimate is the one without them."""
    small = tuple((name, *(x * 1e-3 for x in values)) for name, *values in (("eager", *EAGER),))
    assert _estimate(_cluster(small), m=2).step_time_s == _estimate(_cluster(()), m=2).step_time_s


def test_a_mixture_of_experts_block_adds_the_moe_probes_routing_unscaled():
    moe = (5000.0, 300.0, 300.0, 400.0)
    blocks, m = 4, 1
    cluster = _cluster((("eager", *EAGER), ("moe", *moe)))
    routing = (m * moe[0] + moe[1]) - (m * EAGER[0] + EAGER[1])
    dense = _estimate(cluster, blocks=blocks, m=m).step_time_s
    assert _estimate(cluster, blocks=blocks, m=m, experts=8).step_time_s == pytest.approx(
        dense + blocks * routing * US, rel=1e-9)


def _profile(host_us: str) -> dict:
    import tomllib
    text = "\n".join(line for line in open("profiles/measured/h200.toml").read().splitlines()
                     if not line.startswith(("host_us", "host_source")))
    text = text.replace("[runtime]", f"{host_us}\n\n[runtime]", 1)
    return tomllib.loads(text)


def test_the_profile_reads_host_us_and_refuses_what_it_cannot_price():
    cluster = parse_cluster(_profile("host_us = { eager = [1000, 200, -30, 400], fsdp = [1, 2, 3, 4] }"), "p.toml")
    assert cluster.device.host_us == (("eager", 1000.0, 200.0, -30.0, 400.0), ("fsdp", 1.0, 2.0, 3.0, 4.0))
    for bad, field in (("host_us = { eager = [1, 2, 3, 4], turbo = [1, 2, 3, 4] }", "gpu.kernels.host_us.turbo"),
                       ("host_us = { eager = [1, 2, 3] }", "gpu.kernels.host_us.eager"),
                       ("host_us = { fsdp = [1, 2, 3, 4] }", "gpu.kernels.host_us")):
        with pytest.raises(UserError) as err:
            parse_cluster(_profile(bad), "p.toml")
        assert err.value.field == field


def test_the_probe_fits_the_four_host_times_to_its_runs_and_says_how_well():
    from executor.profile.host import DEPTHS, solve
    truth = {"block_microbatch_s": 2e-3, "block_step_s": 3e-4, "rest_microbatch_s": 5e-4, "rest_step_s": 4e-3}
    t = {(blocks, m): m * (blocks * truth["block_microbatch_s"] + truth["rest_microbatch_s"])
         + blocks * truth["block_step_s"] + truth["rest_step_s"] for blocks, m in DEPTHS}
    got = solve(t)
    assert {k: got[k] for k in truth} == pytest.approx(truth, rel=1e-9) and got["rms_residual_s"] < 1e-12
    # round 2's four runs (2 and 6 blocks, 1 and 2 micro-batches) determine it exactly
    four = {k: t[k] for k in ((2, 1), (6, 1), (2, 2), (6, 2))}
    assert {k: solve(four)[k] for k in truth} == pytest.approx(truth, rel=1e-9)
    # one run 1 ms off: the fit moves and its residual shows it
    noisy = solve({**t, (4, 1): t[(4, 1)] + 1e-3})
    assert noisy["rms_residual_s"] > 1e-4


def test_the_derived_profile_carries_the_probe_as_host_us():
    from executor.profile.toml import host_lines
    probe = {"command": "python -m executor.profile.host --out x.json", "regimes": {
        "eager": {"block_microbatch_s": 1e-3, "block_step_s": 2e-4, "rest_microbatch_s": 3e-4, "rest_step_s": 4e-4},
        "fsdp": {"error": "RuntimeError: no NCCL"}}}
    lines = host_lines(probe, "measured: `meshplan profile`")
    assert "python -m executor.profile.host --out x.json" in lines[1]
    cluster = parse_cluster(_profile(lines[0]), "p.toml")
    assert cluster.device.host_us == (("eager", 1000.0, 200.0, 300.0, 400.0),)
