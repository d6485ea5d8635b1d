"""``--compile``: the executor compiles each block with torch.compile (inductor, on the CPU
too), as torchtitan does; the losses equal the eager single-process reference within 1e-4, under
FSDP2 ZeRO-3 over 2 gloo ranks with full recompute inside the compiled blocks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from executor_support import assert_losses, reference_run, spawn, write_plan
from planner.model import ModelSpec

SPEC = ModelSpec(name="tiny-compile", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden=64,
                 vocab_size=64, seq_len=16, max_positions=0, mlp="swiglu", norm="rmsnorm", linear_bias=False,
                 qkv_bias=False, tied_embeddings=False, dropout=False)
STEPS = 3


def _train(plan_path: str, out: str) -> None:
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    from torch._dynamo.utils import counters
    measured = run(load_plan(plan_path), RunOptions(steps=STEPS))
    if dist.get_rank() == 0:        # the graphs dynamo captured: compiled blocks, not eager ones
        Path(out).write_text(json.dumps({**measured, "graphs": counters["stats"]["unique_graphs"]}))


def test_the_plan_says_compile_and_other_runtimes_refuse_it(tmp_path, cli):
    plan = json.loads(Path(write_plan(tmp_path, SPEC, gpus=2, compile=True)).read_text())
    assert plan["workload"]["compile"] is True
    assert "compile" not in json.loads(Path(write_plan(tmp_path, SPEC, gpus=2, name="eager")).read_text())["workload"]
    proc = cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--framework", "megatron",
               "--compile")
    assert proc.returncode == 2 and "--compile" in proc.stderr and proc.stderr.count("\n") == 1


def test_compiled_blocks_with_tensor_parallelism_need_sp_and_no_checkpointing_inside(cli):
    """With tp 2 the executor's compiled blocks train only under sequence parallelism and without full or selective
    recompute on torch 2.13 (planner/runtimes.py compile_with_tp_needs_sp, compile_with_tp_recomputes): the search
    turns SP on, a fixed --sequence-parallel off or --recompute full is an error naming it, and a plan asking for
    either is refused before it launches, naming its field; torchtitan's runtime plans them."""
    from executor.support import check_supported
    from planner.config import ParallelConfig
    from planner.errors import UserError
    base = ("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--compile", "--tp", "2")
    proc = cli(*base, "--json")
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)["config"]
    assert config["tp"] == 2 and config["sequence_parallel"] is True and config["recompute"] in ("none", "op")
    for flag, value in (("--sequence-parallel", "off"), ("--recompute", "full")):
        proc = cli(*base, flag, value)
        assert proc.returncode == 2 and proc.stderr.startswith(f"meshplan plan: error: {flag}: "), proc.stderr
        assert cli(*base, flag, value, "--framework", "torchtitan").returncode == 0
    for device in ("cpu", "cuda"):
        for config, field in ((ParallelConfig(dp=1, tp=2, pp=1), "config.sequence_parallel"),
                              (ParallelConfig(dp=1, tp=2, pp=1, sequence_parallel=True, recompute="selective"),
                               "config.recompute")):
            with pytest.raises(UserError) as caught:
                check_supported(config, SPEC, device, compile=True)
            assert caught.value.field == field
            check_supported(config, SPEC, device)             # eager, the same plan runs
        check_supported(ParallelConfig(dp=1, tp=2, pp=1, sequence_parallel=True, recompute="op"), SPEC, device,
                        compile=True)


@pytest.mark.distributed
def test_compiled_blocks_train_as_eager_under_tensor_and_sequence_parallelism(tmp_path):
    plan = write_plan(tmp_path, SPEC, gpus=2, tp=2, sequence_parallel=True, recompute="op", compile=True)
    spawn(_train, 2, plan, str(tmp_path / "out.json"))
    measured = json.loads((tmp_path / "out.json").read_text())
    assert measured["graphs"] >= 1
    want, _ = reference_run(SPEC, steps=STEPS)
    assert_losses(measured["losses"], want, against="the eager single-process reference")


@pytest.mark.distributed
def test_compiled_blocks_train_as_eager_under_fsdp(tmp_path):
    plan = write_plan(tmp_path, SPEC, gpus=2, zero=3, recompute="full", compile=True)
    spawn(_train, 2, plan, str(tmp_path / "out.json"))
    measured = json.loads((tmp_path / "out.json").read_text())
    # the blocks ran compiled: dynamo captured their graph (one: identical blocks share its code and guards).
    # Compiling the module's call instead of a checkpointed block's own forward captured none (apply_compile)
    assert measured["graphs"] >= 1
    got = measured["losses"]
    want, _ = reference_run(SPEC, steps=STEPS)
    assert_losses(got, want, against="the eager single-process reference")
