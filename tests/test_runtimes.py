"""One table of what each runtime runs (planner/runtimes.py): the search space for runtime
``torch`` and the executor's pre-launch check (executor/support.py) agree, walked by
hypothesis over small models, world sizes, devices and fixed knobs.

- every configuration the search space emits passes the executor's check (and its stage list
  passes ``check_stages``);
- every configuration the executor refuses is outside the space;
- every configuration the executor accepts, and the planner's own checks accept, is inside the
  space (with ZeRO normalised to 0 where there is nothing to shard over): the space leaves
  nothing runnable out, but for one choice of the search's own: it offers the interleaved
  schedule with virtual stages per rank that divide the rank's blocks, or that make every
  stage a single layer (the embedding and the head alone at the ends).
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.support import check_stages, check_supported
from planner.config import ParallelConfig, Workload
from planner.placement import stage_modules
from planner.errors import UserError
from planner.layers import build_layer_graph
from planner.model import ModelSpec
from planner.runtimes import RUNTIMES, refusals
from planner.search.space import Knobs, Space, divisors

SEQ = 16


@st.composite
def problems(draw):
    """A small Llama-like model, a world size, a global batch and a device kind."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = draw(st.sampled_from(divisors(heads)))
    spec = ModelSpec(name="prop", num_layers=draw(st.integers(1, 6)), hidden=16 * heads, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=16, ffn_hidden=32 * heads, vocab_size=64, seq_len=SEQ,
                     max_positions=0, mlp="swiglu", norm="rmsnorm", linear_bias=False, qkv_bias=False,
                     tied_embeddings=draw(st.booleans()), dropout=False)
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    global_batch = gpus * draw(st.sampled_from([1, 2, 4]))
    return spec, gpus, global_batch, draw(st.sampled_from(["cuda", "cpu"]))


def _space(spec, gpus, global_batch, device_kind, knobs=Knobs()) -> Space:
    workload = Workload(global_batch=global_batch, seq_len=SEQ, precision="fp32", framework="torch")
    return Space(build_layer_graph(spec), gpus, workload, knobs, device_kind=device_kind)


def emitted(space: Space) -> set[ParallelConfig]:
    out = set()
    for layout in space.layouts():
        for schedule, vpp in space.schedules(layout):
            for sp in space.sequence_parallel(layout, schedule):
                for zero in space.zeros(layout, schedule):
                    out.update(space.configs(layout, schedule, vpp, sp, zero))
    return out


def executor_accepts(spec, space, config, device_kind) -> bool:
    """The executor's pre-launch checks of the plan.json the planner would write for ``config``."""
    stages = tuple(tuple(s) for s in stage_modules(space.graph, config))
    try:
        check_supported(config, spec, device_kind)
        check_stages(stages, spec, "plan.json")
    except UserError:
        return False
    return True


def planner_accepts(space: Space, config: ParallelConfig) -> bool:
    try:
        space.check(config)
    except UserError:
        return False
    return True


KNOB_VALUES = {"zero": [0, 1, 2, 3], "schedule": ["gpipe", "1f1b", "interleaved-1f1b"],
               "recompute": ["none", "selective", "full"], "sequence_parallel": [False, True],
               "optimizer_offload": [False, True]}


def any_configs(gpus: int, global_batch: int, num_layers: int):
    """Every combination of knob values for this world and batch, runnable or not."""
    for dp, tp, pp in itertools.product(divisors(gpus), repeat=3):
        if gpus % (dp * tp * pp):
            continue
        cp = gpus // (dp * tp * pp)
        for mb in divisors(global_batch // dp) if global_batch % dp == 0 else []:
            single = [(num_layers + 2) // pp] if (num_layers + 2) % pp == 0 and pp > 1 else []
            for vpp in divisors(max(1, num_layers // pp)) + single:    # the space's choice (module docstring)
                for values in itertools.product(*KNOB_VALUES.values()):
                    knobs = dict(zip(KNOB_VALUES, values))
                    yield ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=mb, vpp=vpp,
                                         num_microbatches=global_batch // (dp * mb), **knobs)


def normalised(config: ParallelConfig) -> ParallelConfig:
    """As the space emits equivalent configs: ZeRO-1/2/3 with nothing to shard over is ZeRO-0, and
    without a pipeline the schedule is 1F1B."""
    if config.dp * config.cp == 1:
        config = replace(config, zero=0)
    if config.pp == 1 and config.schedule == "gpipe":
        config = replace(config, schedule="1f1b")
    return config


SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(problems(), st.data())
def test_every_config_the_space_emits_passes_the_executor_check(problem, data):
    spec, gpus, global_batch, device_kind = problem
    fixed = data.draw(st.fixed_dictionaries({}, optional={
        "zero": st.sampled_from([0, 1, 2, 3]), "tp": st.sampled_from(divisors(gpus)),
        "pp": st.sampled_from(divisors(gpus)), "schedule": st.sampled_from(KNOB_VALUES["schedule"]),
        "sequence_parallel": st.booleans(), "cp": st.sampled_from(divisors(gpus))}))
    try:
        space = _space(spec, gpus, global_batch, device_kind, Knobs(**fixed))
    except UserError:
        return      # fixed knobs the runtime does not run are refused before the search
    for config in emitted(space):
        assert executor_accepts(spec, space, config, device_kind), config


@SETTINGS
@given(problems())
def test_the_executor_refuses_only_what_is_outside_the_space_and_accepts_all_inside(problem):
    spec, gpus, global_batch, device_kind = problem
    space = _space(spec, gpus, global_batch, device_kind)
    inside = emitted(space)
    assert inside, "a small model on a few processes always has a plan"
    for config in {normalised(c) for c in any_configs(gpus, global_batch, spec.num_layers)}:
        if not planner_accepts(space, config):
            assert config not in inside, config
            continue
        accepted = executor_accepts(spec, space, config, device_kind)
        assert (config in inside) == accepted, (config, accepted)


def test_refusals_name_the_knob_and_what_is_allowed():
    assert refusals("megatron-2021", "cuda", zero=3) == [
        ("zero", "ZeRO-3 does not run on the megatron-2021 runtime on cuda; allowed: 0 or 1")]
    assert refusals("megatron", "cuda", zero=3, pp=2) == [
        ("zero", "ZeRO-3 with pipeline parallelism does not run on the megatron runtime on cuda; allowed with "
                 "pp > 1: 0 or 1")]
    assert refusals("megatron", "cuda", zero=3) == []           # Megatron-FSDP
    assert refusals("deepspeed", "cuda", zero=2, pp=2) == [
        ("zero", "ZeRO-2 with pipeline parallelism does not run on the deepspeed runtime on cuda; allowed with "
                 "pp > 1: 0 or 1")]
    assert refusals("deepspeed", "cuda", zero=2, pp=1, optimizer_offload=True) == []
    assert refusals("torch", "cpu", tp=4, num_kv_heads=2) == [
        ("tp", "tp 4 must divide the 2 key/value heads on the torch runtime on cpu (it does not replicate "
               "key/value heads)")]
    assert refusals("megatron", "cuda", tp=4, num_kv_heads=2) == []


def test_nothing_under_planner_names_executor_classes():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "planner"
    names = ("ZeroRedundancyOptimizer", "fully_shard", "FSDPModule", "ScheduleGPipe", "Schedule1F1B")
    found = [(str(path), name) for path in root.rglob("*.py") for name in names if name in path.read_text()]
    assert found == []


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_every_runtime_describes_both_device_kinds(runtime):
    rt = RUNTIMES[runtime]
    for kind in ("cuda", "cpu"):
        can = rt.on(kind)
        assert set(can.zero_stages_with_pp) <= set(can.zero_stages)
        assert set(can.zero_stages_with_tp) <= set(can.zero_stages)
        assert set(can.offload_zero_stages) <= set(can.zero_stages) - {0}


def _block_policies(graph, config) -> set[str]:
    from planner.placement import layer_policies
    return {policy for layer, policy in zip(graph.layers, layer_policies(graph, config)) if layer.kind == "block"}


@pytest.fixture(scope="module")
def llama70b_on_32():
    """Llama 3 70B on 32 H100 with a 128-sequence batch: tight enough that, where a runtime allowed a policy per
    layer, the search would mix them (for torch, Megatron-LM and torchtitan alike, were they allowed to)."""
    from planner import api
    return lambda framework: api.plan(api.load_job("llama3-70b", "h100-80g", gpus=32, global_batch=128,
                                                   framework=framework))


def test_the_torch_runtime_plans_per_layer_choices_on_this_job(llama70b_on_32):
    """The control for the test below: where the runtime allows them, the search does choose per-layer mixes."""
    plan = llama70b_on_32("torch")
    assert any(len(_block_policies(plan.graph, c.config)) > 1 for c in (plan.best, *plan.alternatives))


# What each framework's own files can say (not read from the runtime table): Megatron-LM one
# --recompute-granularity for every layer, or full recompute of the first N blocks of every stage
# (--recompute-method block), or with no pipeline the activations of its first N layers offloaded
# and no recompute (--cpu-offloading-num-layers N, N below the layers), any blocks per stage
# (--pipeline-model-parallel-layout); DeepSpeed
# activation checkpointing of every layer alike and PipelineModule's uniform partition; torchtitan one
# activation_checkpoint mode, any modules per stage (module_fqns_per_model_part)
ONE_POLICY_BALANCED = {"megatron": (True, False), "deepspeed": (True, True), "torchtitan": (True, False)}


@pytest.mark.parametrize("framework", list(ONE_POLICY_BALANCED))
def test_a_runtimes_plans_stay_inside_what_it_expresses(llama70b_on_32, framework):
    """Every plan the search offers for ``framework`` (the recommendation and its runners-up) passes the runtime
    table's refusals, recomputes every block alike where the framework takes one policy, and splits stages evenly
    where it cannot split them otherwise."""
    from planner.placement import balanced_stage_layers
    from planner.runtimes import config_refusals
    one_policy, balanced = ONE_POLICY_BALANCED[framework]
    can = RUNTIMES[framework].on("cuda")
    assert (can.recompute_per_layer, can.unequal_stages) == (not one_policy, not balanced)
    plan = llama70b_on_32(framework)
    for cand in (plan.best, *plan.alternatives):
        c = cand.config
        assert config_refusals(c, framework, "cuda", plan.graph.num_kv_heads, num_blocks=plan.graph.num_blocks) == [], c
        policies = _block_policies(plan.graph, c)
        if framework == "megatron" and policies == {"none", "activation-offload"}:
            blocks = [p for p, layer in zip(c.recompute_layers, plan.graph.layers) if layer.kind == "block"]
            n = blocks.count("activation-offload")
            assert c.pp == 1 and blocks == ["activation-offload"] * n + ["none"] * (len(blocks) - n), c
        elif framework == "megatron" and policies == {"none", "full"}:     # the first n of every stage
            stages, start, counts = c.stage_layers or balanced_stage_layers(plan.graph, c.pp * c.vpp), 0, set()
            for count in stages:
                blocks = [p for p, layer in zip(c.recompute_layers[start:start + count],
                                                plan.graph.layers[start:start + count]) if layer.kind == "block"]
                counts.add(blocks.count("full"))
                assert blocks == sorted(blocks, key=lambda p: p != "full"), c
                start += count
            assert len(counts) == 1, c
        elif one_policy:
            assert len(policies) == 1, c
        if balanced and c.stage_layers is not None:
            assert tuple(c.stage_layers) == balanced_stage_layers(plan.graph, c.pp * c.vpp), c


def test_torchtitan_expresses_neither_zero1_nor_replication_beside_context_parallelism():
    """torchtitan's data parallelism is FSDP2 (ZeRO-2/3) or replication (torchtitan/distributed/fsdp.py), and FSDP
    always shards over the context-parallel ranks (parallel_dims.py's dp_shard_cp mesh)."""
    assert [k for k, _ in refusals("torchtitan", "cuda", zero=1)] == ["zero"]
    assert [k for k, _ in refusals("torchtitan", "cuda", zero=0, cp=2)] == ["zero"]
    assert refusals("torchtitan", "cuda", zero=2, cp=2) == refusals("torchtitan", "cuda", zero=0, cp=1) == []
    assert [k for k, _ in refusals("torchtitan", "cuda", recompute="activation-offload")] == ["recompute"]
    assert [k for k, _ in refusals("torchtitan", "cuda", tp=4, num_kv_heads=2)] == ["tp"]


@pytest.mark.parametrize("cluster,gpus,model", [("h100-80g", 64, "mixtral-8x7b"), ("h100-80g", 32, "mixtral-8x7b"),
                                                ("cpu-gloo", 8, None)])
def test_every_moe_plan_for_meshplans_runtime_is_one_its_executor_runs(write_json, cluster, gpus, model):
    """The recommendation and every runner-up the search offers a mixture of experts for runtime torch pass the
    executor's own pre-launch check (executor/support.py check_supported: its mixtures of experts run tensor
    parallelism only with ep > 1 and sequence parallelism, ep over the data, context and tensor-parallel ranks, no
    'op' recompute with ep)."""
    from executor.support import check_supported
    from planner import api
    if model is None:       # a tiny Mixtral-style config.json the CPU can train
        model = write_json(dict(model_type="mixtral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=4, intermediate_size=96, num_local_experts=8,
                                num_experts_per_tok=2, vocab_size=128, max_position_embeddings=256))
    plan = api.plan(api.load_job(model, cluster, gpus=gpus, global_batch=gpus * 2, seq_len=256), top_k=8)
    device = "cpu" if cluster == "cpu-gloo" else "cuda"
    seen = set()
    for cand in (plan.best, *plan.alternatives):
        check_supported(cand.config, plan.spec, device)
        seen.add(cand.config.ep)
    assert max(seen) > 1


def test_no_plan_for_meshplans_runtime_puts_sequence_parallelism_on_latent_attention():
    """meshplan's executor splits latent attention's heads over the tp ranks with its down-projections on the whole
    sequence (executor/models.py LatentAttention), so the table refuses sequence parallelism with it: the search
    never offers it, a fixed --sequence-parallel on is refused naming the flag, and Megatron-LM keeps it."""
    from dataclasses import replace as with_fields

    from planner.cluster import load_cluster
    from planner.config import Workload
    from planner.errors import UserError
    from planner.layers import build_layer_graph
    from planner.model import ZOO
    from planner.search import Knobs, search
    spec = with_fields(ZOO["deepseek-v3"], name="dense-mla", num_layers=4, num_experts=0, experts_per_token=0,
                       moe_ffn_hidden=0, shared_experts=0, dense_layers=0)
    graph = build_layer_graph(spec)
    cluster = load_cluster("h100-80g", 8)
    work = Workload(global_batch=16, seq_len=4096, framework="torch")
    result = search(graph, cluster, work, Knobs(tp=2), top_k=5, simulate=False)
    assert result.best is not None
    assert not any(c.config.sequence_parallel for c in (result.best, *result.alternatives))
    with pytest.raises(UserError) as e:
        search(graph, cluster, work, Knobs(tp=2, sequence_parallel=True), top_k=1)
    assert e.value.field == "--sequence-parallel"
    megatron = search(graph, cluster, replace(work, framework="megatron"), Knobs(tp=2, sequence_parallel=True),
                      top_k=1, simulate=False)
    assert megatron.best.config.sequence_parallel


def test_megatron_2021_interleaves_only_past_two_stages():
    """Megatron-LM's arguments.py asserted pp > 2 with the interleaved schedule from March 2021 (commit 182841f7df)
    until May 2024 (3ee489d9ea, with overlap_p2p_comm): the 2021 runtime refuses it at pp 2, today's does not, and
    neither refuses 1F1B there."""
    assert [k for k, _ in refusals("megatron-2021", "cuda", pp=2, schedule="interleaved-1f1b")] == ["schedule"]
    assert refusals("megatron-2021", "cuda", pp=3, schedule="interleaved-1f1b") == []
    assert refusals("megatron-2021", "cuda", pp=2, schedule="1f1b") == []
    assert refusals("megatron", "cuda", pp=2, schedule="interleaved-1f1b") == []


def test_megatron_2021_search_offers_no_virtual_stages_at_pp_2():
    from planner import api
    job = api.load_job("gpt-1.7b", "a100-80g", gpus=16, global_batch=64, framework="megatron-2021",
                       precision="fp16")
    plan = api.plan(job, api.Knobs(tp=8, pp=2, dp=1), top_k=3)
    assert {c.config.vpp for c in (plan.best, *plan.alternatives)} == {1}
    plan3 = api.plan(job, api.Knobs(tp=4, pp=4, dp=1), top_k=3)
    assert any(c.config.vpp > 1 for c in (plan3.best, *plan3.alternatives))
