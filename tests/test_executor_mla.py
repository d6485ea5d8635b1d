"""Multi-head latent attention in the executor (executor/models.py ``LatentAttention``; DeepSeek-V2,
arXiv:2405.04434, Sec 2.1): the modules against the planner's layer graph (planner/layers.py ``_mla_ops``), the
attention against its formulas and against transformers' ``DeepseekV3Attention``, a tiny DeepSeek-style model
under expert, pipeline and context parallelism and a dense one under tensor parallelism on gloo against one
process (losses and the first step's gradients within 1e-4), and DeepSeek-V3 built at 256 and 1024 ranks on the
fake process group with the plans the planner makes for it.

The router stays Mixtral's softmax top-k (executor/moe.py), not DeepSeek-V3's sigmoid scores with group-limited
top-k and a bias: these tests check attention, placement and shapes, not routing.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from executor_support import assert_losses, load_rank_grads, reference_run
from moe_support import TINY_DEEPSEEK, built_as_planned, train_cases
from planner.errors import UserError

STEPS = 3
# DeepSeek-style (DeepSeek-V3's shape, shrunk): q through a rank-16 bottleneck, keys and values from a rank-8
# latent; each head's q.k is 8 no-RoPE + 4 RoPE channels, its v 6 (all different, so a mix-up shows); the
# first block dense, then 8 routed experts (top 2) beside one shared expert
TINY_MLA = replace(TINY_DEEPSEEK, name="tiny-mla", head_dim=12, qk_rope_head_dim=4, v_head_dim=6,
                   q_lora_rank=16, kv_lora_rank=8)
# DeepSeek-V2-Lite's choice: a full-rank q projection (q_lora_rank 0)
TINY_MLA_FULL_Q = replace(TINY_MLA, name="tiny-mla-full-q", q_lora_rank=0)
# dense (no experts): tensor parallelism splits its heads (the executor runs no MoE model with tp > 1)
TINY_MLA_DENSE = replace(TINY_MLA, name="tiny-mla-dense", num_experts=0, experts_per_token=0, moe_ffn_hidden=0,
                         shared_experts=0, dense_layers=0)
SPECS = {"mla": TINY_MLA, "mla-full-q": TINY_MLA_FULL_Q, "mla-dense": TINY_MLA_DENSE}


def _filled(module: torch.nn.Module, prefix: str, spec, scale: float = 1.0) -> torch.nn.Module:
    from executor.models import full_init
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(full_init(f"{prefix}{name}", p.shape, spec, 0) * scale)
            if name.endswith("norm.weight"):      # not all ones: the norms' weights matter too
                p.add_(torch.linspace(-0.5, 0.5, p.numel()))
    return module


# -- the modules, one process -----------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_mla_models_have_the_planner_module_paths_and_parameter_count(spec):
    from executor.models import LatentAttention
    model = built_as_planned(spec)
    assert all(isinstance(block.attn, LatentAttention) for block in model.layers.values())
    attn = model.layers["0"].attn
    names = {name for name, _ in attn.named_parameters()}
    q = {"q_down.weight", "q_norm.weight", "q_up.weight"} if spec.q_lora_rank else {"q_proj.weight"}
    assert names == q | {"kv_down.weight", "kv_norm.weight", "kv_up.weight", "o_proj.weight"}
    assert attn.kv_down.weight.shape == (spec.kv_lora_rank + spec.qk_rope_head_dim, spec.hidden)
    assert attn.kv_up.weight.shape == (spec.num_heads * (8 + 6), spec.kv_lora_rank)
    assert attn.o_proj.weight.shape == (spec.hidden, spec.num_heads * 6)


def _rotated(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE by its definition (Su et al. 2021, eq. 34): channel pairs (2i, 2i+1) as complex numbers times
    exp(i m theta_i), theta_i = 10000^(-2i/d). x: (S, d) at positions (S,)."""
    d = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64), positions[:, None] * theta)
    return torch.view_as_real(torch.view_as_complex(x.reshape(-1, d // 2, 2).contiguous()) * turn).reshape(x.shape)


def _mla_by_formulas(attn, spec, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's eqs. 9-19 for one sequence, head by head, in float64. x: (S, h) -> (S, h)."""
    w = {name: p.detach().double() for name, p in attn.named_parameters()}
    x = x.double()
    seq, heads, hd, dr, dv = x.shape[0], spec.num_heads, spec.head_dim, spec.qk_rope_head_dim, 6
    dn = hd - dr

    def rms(v, weight):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * weight    # LATENT_NORM_EPS

    q_all = rms(x @ w["q_down.weight"].T, w["q_norm.weight"]) @ w["q_up.weight"].T if spec.q_lora_rank \
        else x @ w["q_proj.weight"].T                                      # (S, nh hd)
    c_kv = x @ w["kv_down.weight"].T                                       # (S, r_kv + dr)
    latent, k_rope = rms(c_kv[:, :spec.kv_lora_rank], w["kv_norm.weight"]), c_kv[:, spec.kv_lora_rank:]
    kv_all = latent @ w["kv_up.weight"].T                                  # (S, nh (dn + dv))
    positions = torch.arange(seq, dtype=torch.float64)
    k_rope = _rotated(k_rope, positions)                                   # one RoPE key shared by every head
    outs = []
    for i in range(heads):
        q = q_all[:, i * hd:(i + 1) * hd]
        q = torch.cat([q[:, :dn], _rotated(q[:, dn:], positions)], dim=-1)
        kv = kv_all[:, i * (dn + dv):(i + 1) * (dn + dv)]
        k, v = torch.cat([kv[:, :dn], k_rope], dim=-1), kv[:, dn:]
        scores = (q @ k.T) / math.sqrt(hd)                                 # 1/sqrt(d_h + d_h^R)
        scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
        outs.append(scores.softmax(-1) @ v)                                # (S, dv)
    return torch.cat(outs, dim=-1) @ w["o_proj.weight"].T


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_latent_attention_is_its_formulas(spec):
    from executor.models import LatentAttention
    torch.manual_seed(0)
    attn = _filled(LatentAttention(spec), "layers.0.attn.", spec, scale=10.0)    # sharper softmax
    x = torch.randn(2, 7, spec.hidden)
    got = attn(x)
    for b in range(2):
        torch.testing.assert_close(got[b].double(), _mla_by_formulas(attn, spec, x[b]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_latent_attention_equals_transformers_deepseek_v3_attention(spec):
    """The same weights in transformers' DeepseekV3Attention (RoPE on interleaved pairs, as DeepSeek-V3's
    checkpoints: ``rope_interleave``; no rope scaling, so no YaRN mscale), causal mask given."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    from executor.models import LatentAttention
    config = DeepseekV3Config(hidden_size=spec.hidden, num_attention_heads=spec.num_heads,
                              num_key_value_heads=spec.num_heads, q_lora_rank=spec.q_lora_rank or None,
                              kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.head_dim - spec.qk_rope_head_dim,
                              qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rms_norm_eps=1e-5,
                              rope_interleave=True, attention_dropout=0.0, max_position_embeddings=spec.seq_len)
    config._attn_implementation = "eager"
    assert config.rope_parameters["rope_type"] == "default"
    ours = _filled(LatentAttention(spec), "layers.0.attn.", spec, scale=10.0)
    theirs = DeepseekV3Attention(config, layer_idx=0)
    names = {"q_down": "q_a_proj", "q_norm": "q_a_layernorm", "q_up": "q_b_proj", "q_proj": "q_proj",
             "kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "o_proj": "o_proj"}
    theirs.load_state_dict({f"{names[k.split('.')[0]]}.weight": v for k, v in ours.state_dict().items()})
    x = torch.randn(2, 9, spec.hidden)
    cos_sin = DeepseekV3RotaryEmbedding(config)(x, torch.arange(9)[None])
    causal = torch.zeros(9, 9).masked_fill(torch.ones(9, 9).triu(1).bool(), float("-inf"))[None, None]
    want, _ = theirs(x, cos_sin, causal)
    torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)


def test_what_the_executor_refuses_with_latent_attention():
    """Sequence parallelism (executor/support.py says why); tp > 1 with experts, as for every MoE model."""
    from executor.support import check_supported
    from planner.config import ParallelConfig
    for spec, knobs, field in ((TINY_MLA_DENSE, {"sequence_parallel": True}, "config.sequence_parallel"),
                               (TINY_MLA, {}, "config.tp")):
        with pytest.raises(UserError) as e:
            check_supported(ParallelConfig(dp=1, tp=2, pp=1, **knobs), spec, "cpu", "plan.json")
        assert e.value.field == field and e.value.exit_code == 2
    check_supported(ParallelConfig(dp=1, tp=2, pp=1), TINY_MLA_DENSE, "cpu", "plan.json")
    check_supported(ParallelConfig(dp=2, tp=1, pp=1, cp=2, ep=2), TINY_MLA, "cpu", "plan.json")


def test_a_dense_mla_plan_with_tp_splits_the_heads_and_replicates_the_down_projections():
    """The planner's TP plan (planner/layers.py _mla_ops: q_down/kv_down replicated, q_up/kv_up column, o_proj
    row) built at 8 ranks (tp 2 x dp 4, ZeRO-3) on the fake process group: the up-projections' rows and the
    output projection's columns split over tp, the down-projections and the latents' norms whole over tp,
    every parameter sharded over dp by ZeRO-3 (executor/dryrun.py)."""
    from executor.dryrun import dry_run
    from planner.plan import Plan
    from moe_support import moe_plan_doc
    plan = Plan.from_json(moe_plan_doc(TINY_MLA_DENSE, gpus=8, tp=2, dp=4, zero=3), "tiny-mla-dense.json")
    assert {k: v for k, v in plan.tp_plan.items() if k.startswith("layers.0.attn")} == {
        "layers.0.attn.q_up": "colwise", "layers.0.attn.kv_up": "colwise", "layers.0.attn.o_proj": "rowwise"}
    reports, _ = dry_run(plan)
    assert reports and all(r.problems == [] for r in reports), [r.problems[:3] for r in reports]


# -- expert, pipeline, context and tensor parallelism on gloo against one process -------------------------------------------------

# name -> (world size, plan knobs); dp is world / (pp cp) unless given
PLANS = {
    "ep2": (2, {"ep": 2}),
    "dp4-ep2-zero3": (4, {"ep": 2, "zero": 3}),
    "pp2-ep2-zero2": (4, {"ep": 2, "pp": 2, "zero": 2, "schedule": "1f1b", "micro_batch": 2}),
    "cp2-ep2-zero3": (4, {"ep": 2, "cp": 2, "dp": 2, "zero": 3}),     # keys and values gathered over cp
    "tp2": (2, {"tp": 2, "dp": 1}),                             # heads split, the RoPE key's gradient summed
}
CASES = [("mla", plan) for plan in PLANS if plan != "tp2"] + [("mla-full-q", "ep2"), ("mla-dense", "tp2")]


def _run_plans(jobs: list[tuple[str, str]], out_dir: str) -> None:
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    for name, plan_path in jobs:
        measured = run(load_plan(plan_path), RunOptions(steps=STEPS, grads_path=f"{out_dir}/{name}.grads"))
        if dist.get_rank() == 0:
            Path(f"{out_dir}/{name}.json").write_text(json.dumps(measured))


@pytest.mark.distributed
def test_mla_under_each_parallelism_equals_single_process(tmp_path):
    """Every case of ``CASES``: the losses of 3 steps, and the first step's gradients, within 1e-4 of one
    process. One test, not one per case: under pytest-xdist each worker would run its own copy of a
    module-scoped fixture's gloo jobs (about 35 s on 2 cores), and this keeps them to one worker."""
    train_cases(CASES, PLANS, SPECS, tmp_path, _run_plans)
    references = {model: reference_run(SPECS[model], steps=STEPS) for model in {model for model, _ in CASES}}
    for model, plan in CASES:
        measured = json.loads((tmp_path / f"{model}-{plan}.json").read_text())
        grads = load_rank_grads(str(tmp_path / f"{model}-{plan}.grads"), PLANS[plan][0], SPECS[model])
        ref_losses, ref_grads = references[model]
        assert len(set(round(x, 6) for x in ref_losses)) == STEPS, ref_losses      # the losses move
        assert_losses(measured["losses"], ref_losses, against=f"single process ({model}, {plan})")
        assert set(grads) == set(ref_grads), (model, plan)
        floor = 1e-5 * max(g.abs().max().item() for g in ref_grads.values())
        for name, want in ref_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=floor,
                                       msg=lambda m: f"{model} {plan} {name}: {m}")


# -- DeepSeek-V3 at 256 and 1024 ranks, the planner's plans built on the fake process group ---------

@pytest.mark.distributed
@pytest.mark.parametrize("gpus", [256, 1024])
def test_deepseek_v3_builds_as_planned(gpus):
    """The plan `meshplan plan --model deepseek-v3 --cluster h100-80g --gpus N` makes (runtime torch) passes
    the executor's check and its dry run builds every pipeline rank as the first and the last rank of its
    groups (the experts' efsdp and ep ones included) with every parameter placed and shaped as the plan says
    (executor/dryrun.py); the routed experts' local shard by hand: E/ep experts, then ZeRO-2/3 over
    efsdp = dp cp / ep, along the experts where they divide, else along each expert's rows."""
    from executor.dryrun import dry_run, expected_shards
    from executor.mesh import ParallelDims
    from planner import api
    from planner.plan import Plan
    searched = api.plan(api.load_job("deepseek-v3", "h100-80g", gpus=gpus))
    plan = Plan.from_json(searched.to_json(), f"deepseek-v3-{gpus}.json")      # as `meshplan run` reads it
    c, spec = plan.config, plan.spec
    assert spec.is_mla and c.ep > 1
    reports, seconds = dry_run(plan)
    assert seconds < 60, seconds
    assert {r.pp_rank for r in reports} == set(range(c.pp))
    assert {(r.coordinates["efsdp"], r.coordinates["ep"]) for r in reports} == \
        {(0, 0), (c.dp * c.cp // c.ep - 1, c.ep - 1)}
    for r in reports:
        assert r.problems == [], r.problems[:5]
    dims = ParallelDims.from_config(c, gpus)
    e, f, h = spec.num_experts, spec.expert_ffn, spec.hidden
    local, efsdp = e // c.ep, c.dp * c.cp // c.ep
    if c.zero < 2:
        shard = (local, f, h)
    elif local % efsdp == 0:
        shard = (local // efsdp, f, h)
    else:
        shard = (local, f // efsdp, h)
    moe_block = next(i for i in range(spec.num_layers) if spec.is_moe_block(i))
    coords = {"dp_cp": 0, "tp": 0, "efsdp": 0, "ep": 0}
    got = expected_shards(f"layers.{moe_block}.mlp.gate_proj.weight", torch.Size([e, f, h]), plan, dims, coords)
    assert got[1] == shard, (got, shard)
