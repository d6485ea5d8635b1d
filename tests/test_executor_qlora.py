"""QLoRA in the executor (executor/qlora.py): the tiny Llama's block linears in NF4 (bitsandbytes' CPU
implementations of its 4-bit ops), rank-4 adapters on q and v, three AdamW steps. Under data parallelism (DDP
ZeRO-0, meshplan's ZeRO-1) and a pipeline (1F1B) the losses and the adapters' last gradients equal one process's
QLoRA run within 1e-4, and differ from the unquantized LoRA run's (the base really is the NF4 one); each rank's
parameter bytes, NF4 constants included, against the cost model's (planner/finetune.py: 4.127 bits a weight).
What the runtime table refuses (tensor parallelism, FSDP2) is refused by `meshplan plan`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from executor_support import GLOBAL_BATCH, SEQ, TINY_LLAMA, assert_losses, spawn, write_plan


STEPS, RANK, ALPHA, TARGETS = 3, 4, 8.0, ("q", "v")
LAYOUTS = {"dp2-zero0": {"dp": 2}, "dp2-zero1": {"dp": 2, "zero": 1},
           "pp2": {"pp": 2, "micro_batch": 2, "schedule": "1f1b"}}


def reference(*, quantize: bool):
    """One process: the base initialised as every plan is, LoRA adapters (executor/lora.py), the block linears in
    NF4 where ``quantize``; AdamW (lr 1e-3) over the adapters. (losses, the last step's adapter gradients)."""
    from executor.data import global_batch
    from executor.lora import apply_lora
    from executor.models import build_model, full_init
    from executor.qlora import quantize_base
    model = build_model(TINY_LLAMA, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_init(name, p.shape, TINY_LLAMA, 0))
    apply_lora(model, rank=RANK, alpha=ALPHA, targets=TARGETS)
    if quantize:
        assert len(quantize_base(model)) == 7 * TINY_LLAMA.num_layers
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-3, foreach=False)
    losses, grads = [], {}
    for step in range(STEPS):
        tokens = global_batch(step, seed=0, batch=GLOBAL_BATCH, seq_len=SEQ, vocab_size=TINY_LLAMA.vocab_size)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainable}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _train(jobs: list[tuple[str, str]], out_dir: str) -> None:
    import torch.distributed as dist

    from executor.measure import param_bytes
    from executor.plan_file import load_plan
    from executor.train import Job, RunOptions, train_step
    for name, path in jobs:
        job = Job(load_plan(path), RunOptions(steps=STEPS), torch.device("cpu"))
        assert job.lora is not None and job.lora.nf4_base
        losses = [train_step(job, s, dump_grads=f"{out_dir}/{name}.grads" if s == STEPS - 1 else None)
                  for s in range(STEPS)]
        packed = [p.dtype for m in job.trained for n, p in m.named_parameters() if n.endswith("proj.weight")]
        Path(f"{out_dir}/{name}.rank{dist.get_rank()}.json").write_text(json.dumps(
            {"losses": losses, "params_bytes": param_bytes(job.trained),
             "packed_dtypes": sorted({str(d) for d in packed})}))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora")
    jobs = [(name, write_plan(tmp, TINY_LLAMA, gpus=2, name=name, finetune="qlora", lora_rank=RANK,
                              lora_targets=",".join(TARGETS), **knobs)) for name, knobs in LAYOUTS.items()]
    spawn(_train, 2, jobs, str(tmp))
    out = {}
    for name, path in jobs:
        grads = {}
        for r in range(2):
            for key, g in torch.load(tmp / f"{name}.grads.rank{r}.pt", weights_only=True).items():
                grads.setdefault(key, g)
        out[name] = [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(2)], grads, path
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_qlora_equals_single_process(results, layout):
    ranks, grads, _ = results[layout]
    ref_losses, ref_grads = reference(quantize=True)
    lora_losses, _ = reference(quantize=False)
    assert max(abs(a - b) for a, b in zip(ref_losses, lora_losses)) > 1e-3     # NF4 moves the losses
    for record in ranks:
        assert_losses(record["losses"], ref_losses, against="single-process QLoRA")
        assert record["packed_dtypes"] == ["torch.uint8"]       # every block linear's weight is packed
    assert set(grads) == set(ref_grads)
    floor = 1e-5 * max(g.abs().max().item() for g in ref_grads.values())
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=floor, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["dp2-zero0", "pp2"])
def test_parameter_bytes_match_the_cost_model(results, layout):
    """The NF4 base (4 bits a weight packed, a uint8 absmax per 64 and an fp32 one per 256 of those, two code
    tables per tensor), the fp32 embedding, norms and head, the adapters: against the planner's parameters of the
    same plan, each rank (under the pipeline its stage) within 5%."""
    from executor.plan_file import load_plan
    from planner import api
    ranks, _, path = results[layout]
    plan = load_plan(path)
    stages = api.estimate(api.load_job(str(Path(path).parent / "tiny-llama.json"), cluster="cpu-gloo", gpus=2,
                                       global_batch=plan.workload.global_batch, seq_len=plan.workload.seq_len,
                                       precision="fp32", finetune="qlora", lora_rank=RANK, lora_targets=TARGETS),
                          plan.config).estimate.memory_per_stage
    for rank, record in enumerate(ranks):
        want = stages[rank if layout == "pp2" else 0].params
        print(f"{layout} rank {rank}: {record['params_bytes']} B of parameters, the cost model {want:.0f} B")
        assert record["params_bytes"] == pytest.approx(want, rel=0.05)


def test_the_nf4_base_is_refused_where_the_executor_cannot_quantize(tmp_path, capsys):
    """Tensor parallelism, FSDP2 (ZeRO-2/3) and ZeRO-0 with a pipeline over replicas (FSDP2's replicate) are
    refused by `meshplan plan` for QLoRA on the torch runtime, naming the flag."""
    from planner.cli import main
    config = tmp_path / "tiny.json"
    from planner.model import config_json
    config.write_text(json.dumps(config_json(TINY_LLAMA)))
    base = ["plan", "--model", str(config), "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "8",
            "--precision", "fp32", "--finetune", "qlora"]
    for extra, flag in ((["--tp", "2"], "--tp"), (["--zero", "3"], "--zero"),
                        (["--pp", "2", "--dp", "2", "--zero", "0"], "--zero")):
        assert main(base + extra) == 2, extra
        assert f"error: {flag}: --finetune qlora with" in capsys.readouterr().err
    assert main(base + ["--top-k", "1"]) == 0       # the search finds a plan it can run
