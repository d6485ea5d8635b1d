"""Mixed precision in ``auto_parallelize`` (executor/auto.py), as meshplan's own models take it
(executor/parallelize.py): where the device has mixed precision, FSDP2's MixedPrecisionPolicy
(16-bit compute, fp32 reduction) where FSDP2 manages the parameters, autocast where it does not;
fp32 on a CPU, which the run notes.

This machine has no GPU: the GPU rule is run on the CPU by standing the device kind "cuda" in for
"cpu" in the two decisions (both CPU kernels and gloo take bf16), and the test checks the dtype the
linears compute in, the FSDP2 policy, and the losses against one process under bf16 autocast."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from executor_support import assert_losses, spawn
from test_executor_auto import MLP, STEPS, _reference


def test_the_precision_rule_by_device_and_data_parallelism():
    from executor.parallelize import autocast_for, mixed_precision
    fsdp = mixed_precision("bf16", "cuda")
    assert (fsdp.param_dtype, fsdp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision("fp16", "cuda").param_dtype == torch.float16
    assert mixed_precision("bf16", "cpu").param_dtype is None and mixed_precision("fp32", "cuda").param_dtype is None
    assert autocast_for("bf16", "cuda", fsdp_managed=False) == torch.bfloat16
    assert autocast_for("fp16", "cuda", fsdp_managed=False) == torch.float16
    assert autocast_for("bf16", "cuda", fsdp_managed=True) is None        # FSDP2's policy casts instead
    assert autocast_for("bf16", "cpu", fsdp_managed=False) is None
    assert autocast_for("fp32", "cuda", fsdp_managed=False) is None


def _train(out: str, knobs: dict, gpu_rule: bool) -> None:
    import executor.auto as auto
    import executor.parallelize as parallelize
    from planner.api import Knobs
    if gpu_rule:        # the decisions a GPU gets, on this CPU
        mixed_precision, autocast_for = parallelize.mixed_precision, parallelize.autocast_for
        parallelize.mixed_precision = lambda precision, device_type: mixed_precision(precision, "cuda")
        parallelize.autocast_for = lambda precision, device_type, fsdp_managed: autocast_for(
            precision, "cuda", fsdp_managed=fsdp_managed)
    scope: dict = {}
    exec(MLP, scope)
    torch.manual_seed(0)
    # planned for A100s (cpu-gloo has no bf16 peak, so the planner refuses bf16 for it), run here
    train = auto.auto_parallelize(scope["Net"](), scope["EXAMPLE"], global_batch=8, knobs=Knobs(**knobs),
                                  precision="bf16", cluster="a100-80g")
    computed = set()
    for m in train.module.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, output: computed.add(str(output.dtype)))
    losses = [train.step(*(train.shard(t) for t in scope["batch"](step))) for step in range(STEPS)]
    policy = getattr(train.module, "_get_fsdp_state", None)
    param_dtype = str(policy()._mp_policy.param_dtype) if policy else None
    if dist.get_rank() == 0:
        p = train.plan
        Path(out).write_text(json.dumps({"losses": losses, "computed": sorted(computed), "zero": p.zero,
                                         "precision": p.precision, "autocast": p.autocast, "notes": list(p.notes),
                                         "planned": p.doc["workload"]["precision"], "fsdp_param_dtype": param_dtype}))


def _run(tmp_path, knobs: dict, gpu_rule: bool) -> dict:
    out = tmp_path / "out.json"
    spawn(_train, 2, str(out), knobs, gpu_rule)
    return json.loads(out.read_text())


def _bf16_reference() -> list[float]:
    """One process, the whole batch, the forward under bf16 autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _reference(MLP)


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [1, 3])
def test_bf16_on_a_gpu_casts_by_fsdp_policy_or_autocast(tmp_path, zero):
    result = _run(tmp_path, {"dp": 2, "zero": zero}, gpu_rule=True)
    assert result["planned"] == result["precision"] == "bf16" and result["zero"] == zero
    assert result["computed"] == ["torch.bfloat16"]          # every linear computes in bf16
    if zero == 3:       # FSDP2 manages the parameters: its policy gathers them in bf16, no autocast
        assert result["fsdp_param_dtype"] == "torch.bfloat16" and result["autocast"] is None
    else:               # ZeRO-1: fp32 parameters, the forward autocasts
        assert result["fsdp_param_dtype"] is None and result["autocast"] == "bfloat16"
    # bf16 keeps 8 bits of mantissa: within 1% of one process under bf16 autocast, and not fp32's losses
    reference = _bf16_reference()
    for got, want in zip(result["losses"], reference):
        assert abs(got - want) <= 1e-2 * abs(want), (result["losses"], reference)
    assert result["losses"] != pytest.approx(_reference(MLP), rel=1e-6)


@pytest.mark.distributed
def test_bf16_on_a_cpu_runs_in_fp32_and_says_so(tmp_path):
    result = _run(tmp_path, {"dp": 2, "zero": 3}, gpu_rule=False)
    assert result["planned"] == "bf16" and result["computed"] == ["torch.float32"]
    assert result["notes"] == ["precision bf16 runs in fp32 on the CPU (mixed precision where the device has it, "
                               "as meshplan's own models)"]
    assert_losses(result["losses"], _reference(MLP), against="single process")


def test_an_unknown_precision_is_refused():
    from executor.auto import auto_parallelize
    from planner.errors import UserError
    with pytest.raises(UserError, match="precision: 'fp8' is not allowed; allowed: bf16, fp16 or fp32"):
        auto_parallelize(torch.nn.Linear(2, 2), (torch.randn(1, 2),), global_batch=2, precision="fp8")
