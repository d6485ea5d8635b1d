"""``auto_parallelize`` with expert parallelism on tiny Hugging Face ``transformers`` mixtures of experts (Mixtral,
Qwen3-MoE, GPT-OSS with its biased experts, DeepSeek-V3 with its shared expert and dense first layer), in 2- and
4-process torchrun jobs on gloo: each rank holds E / ep of every layer's experts (a quarter or half of their
parameters, less under ZeRO-2/3 over the expert-data-parallel ranks), and the gradients of one step, the losses of
three and the parameters after them are those of one process on the whole batch. And the trace says which modules'
experts the executor can split, so that the search offers ep > 1 for those only."""
from __future__ import annotations

import pytest
import torch

from executor_support import assert_losses
from test_auto_hf import HARNESS, SCRIPT_END, scope_of, torchrun

STEPS = 3

MODELS = HARNESS + '''
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, GptOssConfig, GptOssForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def decoder(family):
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                                                num_experts_per_tok=2, **COMMON))
    if family == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
                                                  num_experts=8, num_experts_per_tok=2, head_dim=8, **COMMON))
    if family == "gpt_oss":
        return GptOssForCausalLM(GptOssConfig(intermediate_size=24, num_hidden_layers=2, num_local_experts=4,
                                              num_experts_per_tok=2, head_dim=8, sliding_window=8,
                                              layer_types=["sliding_attention", "full_attention"], **COMMON))
    # multi-head latent attention (every head its own keys), one dense layer first, a shared expert, grouped routing
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, **{**COMMON, "num_key_value_heads": 4}))


def whole(t):
    """A parameter or gradient as one process holds it (a DTensor gathered)."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t
'''

SCRIPT = '''
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from executor import auto_parallelize
from executor.train import exit_now
from planner.api import Knobs

out, ep, zero, pp, families = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
results = {}
for family in families:
    torch.manual_seed(0 if rank == 0 else 1000 + rank)   # every rank its own init: rank 0's must win
    dp = world // pp
    train = auto_parallelize(Logits(decoder(family)), EXAMPLE, global_batch=8, loss_fn=loss_fn,
                             knobs=Knobs(ep=ep, zero=zero, pp=pp, tp=1, micro_batch=8 // dp // pp))
    got = {"ep": train.plan.ep, "dp": train.plan.dp, "pp": train.plan.pp, "zero": train.plan.zero, "held": {}}
    for part in train.parts:
        for name, p in part.named_parameters():
            if ".experts." in name:         # the share of each expert stack this rank holds
                local = p.to_local() if isinstance(p, DTensor) else p
                got["held"][name] = local.numel() / p.numel()
    grads = {}
    if pp == 1 and zero != 1:               # gradients reduced by the backward (ZeRO-1's optimizer reduces them)
        x, y = batch(0)
        train.loss_fn(train.module(train.shard(x)), train.shard(y)).backward()
        grads = {name: whole(p.grad) for name, p in train.module.named_parameters()}
        for optimizer in train.optimizers:
            optimizer.zero_grad(set_to_none=True)
    losses = []
    for step in range(3):
        x, y = batch(step)
        losses.append(train.step(train.shard(x), train.shard(y)))
    params = {name: whole(p.detach()) for part in train.parts for name, p in part.named_parameters()}
    torch.save({"grads": grads, "params": params}, f"{out}.{family}.{rank}.pt")
    results[family] = {**got, "losses": losses}
''' + SCRIPT_END


def _reference(family: str) -> tuple[list[float], dict, dict]:
    """One process, the whole batch, AdamW lr 1e-3 (auto_parallelize's optimizer): (losses, the first step's
    gradients, the parameters after the steps)."""
    scope = scope_of(MODELS)
    torch.manual_seed(0)
    net = scope["Logits"](scope["decoder"](family))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = scope["batch"](step)
        loss = scope["loss_fn"](net(x), y)
        loss.backward()
        if step == 0:
            grads = {name: p.grad.clone() for name, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {name: p.detach().clone() for name, p in net.named_parameters()}


def _assert_close(got: dict, want: dict, what: str, atol: float) -> None:
    for name, tensor in got.items():
        ref = want[name.removeprefix("module.")]
        assert torch.allclose(tensor, ref, rtol=1e-4, atol=atol), \
            f"{what} {name}: off by {(tensor - ref).abs().max().item():.3g}"


@pytest.mark.distributed                  # auto_parallelize inside torchrun jobs
@pytest.mark.parametrize("world, ep, zero, pp, families", [
    (2, 2, 3, 1, ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")),     # ep 2, FSDP over one expert replica
    (4, 2, 2, 1, ("mixtral", "deepseek_v3")),      # ep 2 x FSDP over 2 expert-data-parallel ranks
    (4, 4, 1, 1, ("qwen3_moe",)),                  # ep 4, ZeRO-1's optimizer reducing the experts over efsdp 1
    (2, 2, 0, 1, ("gpt_oss",)),                    # ep 2, replicated
    (4, 2, 3, 2, ("mixtral",)),                    # ep 2 in each of 2 pipeline stages
], ids=["ep2-zero3", "ep2-efsdp2-zero2", "ep4-zero1", "ep2-zero0", "pp2-ep2"])
def test_auto_parallelize_splits_transformers_experts(tmp_path, world, ep, zero, pp, families):
    results = torchrun(tmp_path, MODELS + SCRIPT, world, str(ep), str(zero), str(pp), *families)
    dp = world // pp
    for family in families:
        got = results[family]
        assert (got["ep"], got["dp"], got["pp"], got["zero"]) == (ep, dp, pp, zero), got
        # every expert stack split over ep, and over the dp / ep expert-data-parallel ranks where ZeRO-2/3 shards
        share = 1 / ep / (dp // ep if zero >= 2 else 1)
        assert got["held"] and all(abs(held - share) < 1e-9 for held in got["held"].values()), (share, got["held"])
        losses, grads, params = _reference(family)
        assert_losses(got["losses"], losses, against=f"single process ({family}, {world} processes)")
        for rank in range(world):
            saved = torch.load(tmp_path / f"out.json.{family}.{rank}.pt", weights_only=True)
            _assert_close(saved["grads"], grads, f"{family} rank {rank} gradient of", atol=1e-6)
            _assert_close(saved["params"], params, f"{family} rank {rank} parameter", atol=1e-5)


def test_the_trace_says_whose_experts_the_executor_splits():
    """A transformers mixture of experts: its experts split (the search offers ep > 1 for meshplan's runtime); a
    module of the user's own holding its experts as one stacked weight (a grouped GEMM over a fixed share of the
    rows each) but called its own way: not split, the reason given, a fixed ep refused naming it; and only the
    experts' own work counted as routed, not the block's norm beside them."""
    from planner.api import Knobs, plan_graph
    from planner.config import Workload
    from planner.errors import UserError
    from planner.trace import trace
    from trace_models import stacked_experts

    scope = scope_of(MODELS)
    graph = trace(scope["Logits"](scope["decoder"]("mixtral")), scope["EXAMPLE"], runnable=True)
    assert (graph.num_experts, graph.splits_experts, graph.experts_why) == (4, True, "")
    plan = plan_graph(graph, "cpu-gloo", Workload(global_batch=8, seq_len=graph.seq_len, precision="fp32"), gpus=2,
                      knobs=Knobs(ep=2))
    assert plan.best.config.ep == 2

    graph = trace(*stacked_experts(), runnable=True)
    assert graph.num_experts == 4 and not graph.splits_experts, (graph.num_experts, graph.splits_experts)
    assert "'0.experts' are not in a transformers grouped-experts module" in graph.experts_why
    routed = {op.name for layer in graph.layers for op in layer.ops if op.expert}
    assert routed == {"0.experts", "1.experts"}, routed
    with pytest.raises(UserError, match="grouped-experts module"):
        plan_graph(graph, "cpu-gloo", Workload(global_batch=8, seq_len=graph.seq_len, precision="fp32"), gpus=2,
                   knobs=Knobs(ep=2))
