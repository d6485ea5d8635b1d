"""Energy per step and per run (planner/energy.py): the GPUs between idle and TDP by the share of the step
their kernels run, plus each node's host; shown by plan, compare and whatif, every number from the
profile's [power] table with its source."""
from __future__ import annotations

import json

import pytest

from planner import api
from planner.cluster import builtin_profiles, load_cluster
from planner.energy import energy


@pytest.mark.parametrize("name", ["a100-40g", "a100-80g", "b200", "h100-80g", "h200", "v100-32g", "l40s"])
def test_every_gpu_profile_has_power_with_its_sources(name):
    power = load_cluster(name).power
    assert power is not None and 0 < power.gpu_idle_w < power.gpu_tdp_w
    assert "datasheet" in power.source and "idle" in power.source and "network" in power.source
    assert load_cluster("cpu-gloo").power is None and "cpu-gloo" in builtin_profiles()


def test_energy_is_the_gpus_between_idle_and_tdp_plus_the_hosts():
    job = api.load_job("llama3-8b", "h100-80g", gpus=16, global_batch=64)
    plan = api.plan(job)
    e, t = plan.estimate, plan.estimate.time
    used = energy(e, job.cluster, job.workload)
    busy = (t.compute + t.recompute) / e.step_time_s
    # H100 SXM: 700 W TDP, 80.5 W idle (11.5% of it); DGX H100: 10.2 kW max less 8 x 700 W = 4.6 kW per node
    gpu_w = 80.5 + (700 - 80.5) * busy
    assert used.gpu_w == pytest.approx(gpu_w) and 80.5 < used.gpu_w < 700
    watts = 16 * gpu_w + 2 * 4600
    assert used.kwh_per_step == pytest.approx(watts * e.step_time_s / 3.6e6)
    assert used.kwh_per_million_tokens == pytest.approx(used.kwh_per_step / (64 * 8192) * 1e6)
    assert used.run_kwh(1e12) == pytest.approx(used.kwh_per_million_tokens * 1e6)
    assert plan.energy["kwh_per_step"] == pytest.approx(used.kwh_per_step)


def test_plan_compare_and_whatif_show_energy(cli, tmp_path):
    out = cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "16", "--tokens", "1T")
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("energy"))
    assert "kWh per step" in line and "for 1e+12 tokens" in line and "GPUs at" in line
    doc = json.loads(cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "16", "--tokens", "1T",
                         "--json").stdout)
    assert doc["energy"]["run_kwh"] == pytest.approx(doc["energy"]["kwh_per_million_tokens"] * 1e6)
    assert "DGX H100 datasheet" in doc["energy"]["source"]
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100,
                                "n_positions": 128}))
    cpu = cli("plan", "--model", str(tiny), "--cluster", "cpu-gloo", "--gpus", "2")
    assert "energy    not estimated: the cpu-gloo profile has no [power] table" in cpu.stdout, cpu.stdout
    baseline = tmp_path / "plan.json"
    assert cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "16", "--tp", "8", "--pp", "2",
               "--out", str(baseline)).returncode == 0
    cmp = json.loads(cli("compare", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "16", "--baseline",
                         str(baseline), "--tokens", "1T", "--json").stdout)
    g = cmp["gain"]
    assert g["kwh_saved"] == pytest.approx(g["kwh"]["baseline"] - g["kwh"]["recommended"])
    text = cli("compare", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "16", "--baseline",
               str(baseline), "--tokens", "1T").stdout
    assert "energy " in text and ("saved)" in text or "more)" in text)
    sweep = cli("whatif", "--model", "llama3-8b", "--cluster", "h100-80g", "--sweep", "gpus=8,16", "--out",
                str(tmp_path / "w"))
    assert sweep.returncode == 0, sweep.stderr
    assert "kWh/Mtok" in sweep.stdout
    rows = json.loads((tmp_path / "w" / "whatif.json").read_text())
    points = rows["points"] if isinstance(rows, dict) else rows
    assert all(p["kwh_per_million_tokens"] > 0 for p in points if p["fits"])
