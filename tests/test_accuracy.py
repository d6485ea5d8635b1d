"""The error band each plan prints: which validation covers it, and that the band is the one
that validation measured (recomputed here from the committed results)."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from planner.accuracy import accuracy
from planner.cluster import load_cluster
from planner.config import Workload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def abs_errors(rows, key):
    return [abs(r[key]) for r in rows]


def test_profile_is_what_the_committed_results_say():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from accuracy import evidence, to_toml
    finally:
        sys.path.pop(0)
    assert (ROOT / "profiles" / "validation" / "accuracy.toml").read_text() == to_toml(evidence()), \
        "profiles/validation/accuracy.toml is stale: python benchmarks/accuracy.py --write"


def test_megatron_plans_carry_the_published_runs_band():
    rows = [r for r in json.loads((RESULTS / "fidelity.json").read_text())["rows"]
            if r["runtime"] in ("megatron", "megatron-2021")]
    # throughput error e -> step-time error 1 / (1 + e) - 1
    step = [abs(1 / (1 + r["error"]) - 1) for r in rows]
    acc = accuracy(load_cluster("h100-80g", 64), Workload(global_batch=512, seq_len=4096, framework="megatron"))
    assert acc.basis == "published" and acc.memory is None and not acc.caveats
    assert acc.step_time.cases == len(rows) == 25      # NAR21 Table 1 and Table 2's PTD-P rows, MLM24
    assert acc.step_time.max_abs == pytest.approx(max(step), abs=1e-4)
    assert acc.step_time.mean_abs == pytest.approx(statistics.mean(step), abs=1e-4)
    assert "memory not checked" in acc.line() and "benchmarks/fidelity.py" in acc.line()


def test_torch_plans_carry_the_single_gpu_band_and_say_what_it_misses():
    rows = []
    for name in ("gpu_validate.json", "gpu_holdout_validate.json", "gpu_round2_validate_host_insample.json",
                 "gpu_holdout2_validate.json", "gpu_round3_validate.json"):
        rows += json.loads((RESULTS / name).read_text())["rows"]
    assert len(rows) == 46          # H100: 12 + 6; H200 round 2: 13 + 9 measured of 11 held out; H100 round 3: 6
    work = Workload(global_batch=512, seq_len=4096, framework="torch")
    # the profile the runs were predicted from, and the datasheet one
    one = accuracy(load_cluster(str(ROOT / "profiles" / "measured" / "h100-sxm5.toml"), 1), work)
    assert one.basis == "one-gpu" and one.caveats == ()
    stock = accuracy(load_cluster("h100-80g", 1), work)
    assert stock.basis == "one-gpu" and len(stock.caveats) == 1
    assert "(h100-80g) was not written by `meshplan profile`" in stock.caveats[0]
    assert one.memory.max_abs == pytest.approx(max(abs_errors(rows, "peak_error")), abs=1e-4)
    assert one.step_time.median_abs == pytest.approx(statistics.median(abs_errors(rows, "step_error")), abs=1e-4)
    many = accuracy(load_cluster("a100-80g", 64), work)
    assert many.basis == "one-gpu"
    assert any("A100" in c for c in many.caveats) and any("communication" in c for c in many.caveats)


def test_deepspeed_borrows_the_megatron_runs_and_says_so():
    acc = accuracy(load_cluster("a100-80g", 64), Workload(global_batch=512, seq_len=2048, framework="deepspeed"))
    assert acc.basis == "published" and any("not the deepspeed runtime" in c for c in acc.caveats)


def test_cpu_plans_without_closed_loop_results_say_they_are_not_validated():
    evidence = tuple(e for e in _all() if e["device_kind"] != "cpu")
    acc = accuracy(load_cluster("cpu-gloo", 2), Workload(global_batch=8, seq_len=256), evidence)
    assert acc.basis is None and acc.step_time is None and acc.line().startswith("not validated")


def _profiled_here(tmp_path) -> Path:
    """cpu-gloo.toml as `meshplan profile` would have written it: its top-level source names the command."""
    text = (ROOT / "profiles" / "cpu-gloo.toml").read_text()
    head, sep, rest = text.partition("\nsource = ")
    rest = rest.partition("\n")[2]
    path = tmp_path / "here.toml"
    path.write_text(head + sep + '"measured: `meshplan profile --device cpu --nproc 2 --out here.toml` on vm '
                    '(2026-11-24)"\n' + rest)
    return path


def test_cpu_plans_carry_the_closed_loop_band_and_say_when_their_profile_is_not_this_machines(tmp_path):
    work = Workload(global_batch=8, seq_len=256)
    rows = json.loads((RESULTS / "closed_loop.json").read_text())["rows"]
    stock = accuracy(load_cluster("cpu-gloo", 2), work)
    assert stock.basis == "closed-loop"
    assert stock.step_time.max_abs == pytest.approx(max(abs_errors(rows, "step_error")), abs=1e-4)
    assert [c for c in stock.caveats if "meshplan profile" in c and "(cpu-gloo)" in c]
    assert not [c for c in stock.caveats if "processes" in c]
    here = accuracy(load_cluster(str(_profiled_here(tmp_path)), 2), work)
    assert here.basis == "closed-loop" and here.caveats == ()
    four = accuracy(load_cluster(str(_profiled_here(tmp_path)), 4), work)
    assert four.caveats == ("it ran 2 processes, this plan 4",)


def _all():
    from planner.accuracy import _evidence
    return _evidence()


def test_plan_json_and_table_print_the_band(cli):
    args = ["plan", "--model", "gpt-7.5b", "--cluster", "h100-80g", "--gpus", "8", "--framework", "megatron"]
    doc = json.loads(cli(*args, "--json").stdout)
    assert doc["accuracy"]["basis"] == "published" and doc["accuracy"]["step_time"]["cases"] == 25
    assert "checked   against 25 published Megatron-LM runs" in cli(*args).stdout


def test_a_plan_that_routes_experts_says_what_the_published_moe_runs_measured():
    """A megatron plan of a mixture of experts keeps the published dense runs' band (it ranks the plans) and says
    beside it how far the published Megatron-Bridge MoE runs were (recomputed here from the committed results);
    a dense plan, or one on meshplan's own runtime, does not."""
    moe = json.loads((RESULTS / "fidelity.json").read_text())["summary"]["moe"]["rows"]
    moe += [r for r in json.loads((RESULTS / "fidelity_fp8.json").read_text())["rows"]
            if r.get("moe") and r.get("error") is not None]
    step = [abs(1 / (1 + r["error"]) - 1) for r in moe]
    work = Workload(global_batch=512, seq_len=4096, framework="megatron")
    acc = accuracy(load_cluster("h100-80g", 64), work, moe=True)
    assert acc.basis == "published" and len(acc.caveats) == 1
    assert f"off by {100 * statistics.median(step):.0f}% median, {100 * max(step):.0f}% worst" in acc.caveats[0]
    assert f"against {len(moe)} published Megatron-Bridge runs" in acc.caveats[0]
    assert accuracy(load_cluster("h100-80g", 64), work).caveats == ()
    torch = accuracy(load_cluster("h100-80g", 64), Workload(global_batch=512, seq_len=4096, framework="torch"),
                     moe=True)
    assert not any("routes experts" in c for c in torch.caveats)
