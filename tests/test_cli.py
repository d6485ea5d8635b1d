"""`meshplan` as a user runs it: outputs, and every bad input ending in one clear line."""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

SMALL = ["--model", "gpt-1.7b", "--cluster", "a100-80g", "--gpus", "8", "--global-batch", "64"]


def one_line_error(out, code=2):
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def test_plan_json_has_the_documented_shape(cli):
    out = cli("plan", *SMALL, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["model"] == {"name": "gpt-1.7b", "params": 1652230656, "source": "gpt-1.7b",
                            "spec": doc["model"]["spec"]}
    assert doc["cluster"]["name"] == "a100-80g" and doc["cluster"]["gpus"] == 8
    assert set(doc["config"]) >= {"dp", "tp", "pp", "cp", "zero", "micro_batch", "num_microbatches", "vpp",
                                  "schedule", "recompute", "sequence_parallel", "optimizer_offload"}
    est = doc["estimate"]
    assert set(est) >= {"step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "memory_per_gpu_bytes", "fits"}
    mem = est["memory_per_gpu_bytes"]
    assert set(mem) >= {"params", "grads", "optimizer", "activations", "other", "total"}
    if mem.get("grads_after_activations"):     # one micro-batch, no pipeline: the larger of the two
        assert mem["total"] == mem["params"] + mem["optimizer"] + mem["other"] + max(mem["grads"],
                                                                                     mem["activations"])
    else:
        assert mem["total"] == sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "other"))
    assert est["fits"] is True and mem["total"] <= 80 * 2**30
    c = doc["config"]
    assert c["dp"] * c["tp"] * c["pp"] * c["cp"] == 8
    assert c["num_microbatches"] * c["micro_batch"] * c["dp"] == 64
    assert set(doc["search"]) >= {"seconds", "candidates"} and doc["search"]["candidates"] > 100


def test_table_output_and_plan_file(cli, tmp_path):
    out = cli("plan", *SMALL, "--out", str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    assert "step" in out.stdout and "memory" in out.stdout and "runners-up" in out.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["schema_version"] == 2 and plan["stages"] and plan["recompute_per_layer"]


def test_fully_fixed_plan_that_does_not_fit_is_reported(cli):
    out = cli("plan", "--model", "gpt3-175b", "--cluster", "a100-80g", "--gpus", "8", "--dp", "8", "--tp", "1",
              "--pp", "1", "--zero", "0", "--micro-batch", "1", "--recompute", "none", "--global-batch", "8",
              "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["estimate"]["fits"] is False
    assert doc["estimate"]["memory_per_gpu_bytes"]["total"] > 80 * 2**30


def test_megatron_chunks_may_hold_the_embedding_or_the_loss_alone_and_more_chunks_name_vpp():
    """Llama 3.1 405B's 126 blocks on 16 stages of 8 virtual stages each, as Megatron-Bridge's GB200 MXFP8 recipe runs
    them (its --account-for-embedding/loss-in-pipeline-split: 128 layers): Megatron-LM on GPUs expresses the
    embedding and the loss as chunks of their own (--pipeline-model-parallel-layout 'E|t|...|t|L'), so it plans;
    more chunks than that are refused naming --vpp and the most it can be (it said only that no legal configuration
    exists); Megatron-LM of 2021 had no layouts."""
    from planner import api
    from planner.errors import UserError
    from planner.exports import megatron
    job = api.load_job("llama3-405b", "gb200-nvl72", gpus=256, global_batch=1536, seq_len=8192, framework="megatron")
    plan = api.plan(job, api.Knobs(tp=4, pp=16, vpp=8, micro_batch=1, zero=1, recompute="none"), top_k=1,
                    solver="uniform")
    assert plan.best.config.vpp == 8
    layout = megatron(plan).text.split("--pipeline-model-parallel-layout")[1].split()[0].strip("'")
    assert layout == "|".join(["E"] + ["t"] * 126 + ["L"])
    with pytest.raises(UserError) as e:
        api.plan(job, api.Knobs(tp=4, pp=16, vpp=9), top_k=1)
    assert e.value.field == "--vpp" and "144 model chunks" in str(e.value) and "vpp at most 8" in str(e.value)
    old = api.load_job("llama3-405b", "a100-80g", gpus=512, global_batch=1536, seq_len=8192, framework="megatron-2021")
    with pytest.raises(UserError) as e:
        api.plan(old, api.Knobs(tp=4, pp=16, vpp=8), top_k=1)
    assert e.value.field == "--vpp" and "at most 126" in str(e.value)
    # meshplan's executor: 32 blocks + the embedding and the head alone
    with pytest.raises(UserError) as e:
        api.plan(api.load_job("llama3-8b", "h100-80g", gpus=8), api.Knobs(pp=8, vpp=8), top_k=1)
    assert e.value.field == "--vpp" and "at most 34" in str(e.value)


def test_a_schedule_with_virtual_stages_fixed_without_vpp_searches_them(cli):
    """Every knob fixed but --vpp, the schedule an interleaved one: the virtual stages are searched (it refused
    "interleaved 1F1B needs --vpp >= 2", the fixed plan's default being 1); a V schedule has its own 2."""
    fixed = ["--model", "gpt3-175b", "--cluster", "a100-80g", "--gpus", "384", "--global-batch", "1536", "--tp", "8",
             "--pp", "12", "--dp", "4", "--zero", "0", "--micro-batch", "1", "--recompute", "full", "--top-k", "1",
             "--json"]
    out = cli("plan", *fixed, "--schedule", "interleaved-1f1b")
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)["config"]
    assert config["schedule"] == "interleaved-1f1b" and config["vpp"] >= 2 and 96 // 12 % config["vpp"] == 0
    out = cli("plan", *fixed, "--schedule", "zbv")
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)["config"]
    assert config["schedule"] == "zbv" and config["vpp"] == 2


def test_defaults_just_work(cli):
    out = cli("plan")
    assert out.returncode == 0, out.stderr
    assert "llama3-8b" in out.stdout and "h100-80g" in out.stdout


def test_sequence_parallelism_fixed_alone_searches_the_layouts_with_a_tp_group(cli):
    """--sequence-parallel on without --tp: the search keeps to tp >= 2 (it crashed on the tp 1 layouts)."""
    out = cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--sequence-parallel", "on",
              "--top-k", "1", "--json")
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)["config"]
    assert config["sequence_parallel"] is True and config["tp"] >= 2


def test_models_and_clusters_lists(cli):
    out = cli("models")
    assert out.returncode == 0
    for name in ("gpt-1.7b", "gpt-1t", "gpt3-175b", "llama2-70b", "llama3-405b", "mixtral-8x7b"):
        assert name in out.stdout
    assert "1.65B" in out.stdout
    out = cli("clusters")
    for name in ("a100-40g", "a100-80g", "b200", "h100-80g", "h200", "v100-32g", "l40s", "cpu-gloo"):
        assert name in out.stdout


def test_config_json_model(cli, write_json):
    path = write_json({"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 4,
                       "num_attention_heads": 8, "intermediate_size": 2816, "vocab_size": 32000,
                       "max_position_embeddings": 2048})
    out = cli("plan", "--model", path, "--cluster", "a100-40g", "--gpus", "8", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["params"] > 0


def test_planning_a_config_model_does_not_import_torch():
    code = ("import sys; from planner.cli import main; "
            "rc = main(['plan', '--model', 'gpt3-175b', '--cluster', 'a100-80g', '--gpus', '64', '--json']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert out.returncode == 0, out.stderr


# -- bad input: (arguments, what the one error line must say) -------------------------------------

BAD_FLAGS = [
    (["--model", "gpt-2b"], ["unknown model", "gpt-1.7b", "llama3-8b"]),
    (["--model", "nonexistent/config.json"], ["nonexistent/config.json", "no such file"]),
    (["--cluster", "tpu-v5"], ["unknown cluster", "a100-80g", "cpu-gloo"]),
    (["--cluster", "missing.toml"], ["missing.toml", "no such file"]),
    (["--gpus", "12"], ["--gpus", "multiple of 8"]),
    (["--gpus", "0"], ["--gpus", "positive integer"]),
    (["--tp", "abc"], ["--tp", "positive integer"]),
    (["--tp", "3"], ["--tp", "does not divide"]),
    (["--tp", "5", "--gpus", "40", "--model", "gpt-1.7b"], ["--tp"]),
    (["--dp", "2", "--tp", "2", "--pp", "1", "--cp", "1"], ["dp x tp x pp x cp", "8 GPUs"]),
    (["--micro-batch", "3"], ["micro-batch 3", "global batch"]),
    (["--pp", "64", "--gpus", "64"], ["--pp", "more stages than"]),
    (["--vpp", "2", "--schedule", "1f1b"], ["--vpp", "interleaved"]),
    (["--schedule", "interleaved-1f1b", "--pp", "1"], ["--schedule", "pp >= 2"]),
    (["--sequence-parallel", "on", "--tp", "1"], ["--sequence-parallel", "tp >= 2"]),
    (["--sequence-parallel", "maybe"], ["--sequence-parallel", "on or off"]),
    (["--optimizer-offload", "on", "--zero", "0"], ["--optimizer-offload", "ZeRO stage 1, 2 or 3"]),
    (["--offload", "optimizer", "--zero", "0"], ["--optimizer-offload", "ZeRO stage 1, 2 or 3"]),   # the earlier name
    (["--framework", "megatron-2021", "--zero", "3"], ["--zero", "ZeRO-3 does not run on the megatron-2021 runtime on cuda; allowed: 0 or 1"]),
    (["--framework", "megatron", "--zero", "3", "--pp", "2"], ["--zero", "ZeRO-3 with pipeline parallelism does not run on the megatron runtime", "allowed with pp > 1: 0 or 1"]),
    (["--framework", "deepspeed", "--zero", "3", "--pp", "2"], ["--zero", "pipeline"]),
    (["--param-offload", "on"], ["--param-offload", "not a knob of its own on the torch runtime", "allowed: off"]),
    (["--framework", "deepspeed", "--zero", "2", "--param-offload", "on"], ["--param-offload", "allowed with ZeRO 3"]),
    (["--framework", "torchtitan", "--zero", "1"], ["--zero", "ZeRO-1 does not run on the torchtitan runtime"]),
    (["--cluster", "v100-32g", "--gpus", "16", "--precision", "bf16"], ["--precision", "bf16", "fp16"]),
    (["--cp", "3"], ["--cp"]),
    (["--zero", "4"], ["--zero", "invalid choice"]),
    (["--schedule", "zigzag"], ["--schedule", "invalid choice"]),
]


@pytest.mark.parametrize("args,says", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags(cli, args, says):
    base = ["--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8"]
    line = one_line_error(cli("plan", *base, *args))
    for text in says:
        assert text in line, line


BAD_CONFIGS = [
    ("{oops", ["line 1"]),
    ('["a list"]', ["JSON object"]),
    ('{"model_type": "t5"}', ["model_type", "gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v3 or gpt_oss"]),
    ('{"model_type": "llama", "num_hidden_layers": "four"}', ["num_hidden_layers", "positive integer"]),
    ('{"model_type": "llama", "hidden_size": -1, "num_attention_heads": 8}', ["hidden_size", "positive integer"]),
    ('{"model_type": "gpt2", "n_embd": 100, "n_head": 3, "n_layer": 2, "vocab_size": 10}', ["n_embd", "multiple"]),
]


@pytest.mark.parametrize("text,says", BAD_CONFIGS)
def test_bad_model_configs(cli, write_json, text, says):
    path = write_json(text)
    line = one_line_error(cli("plan", "--model", path))
    assert path in line
    for s in says:
        assert s in line, line


def good_profile() -> str:
    return (ROOT / "profiles" / "a100-80g.toml").read_text()


BAD_PROFILES = [
    (lambda t: t + "\n[[[", ["not valid TOML"]),
    (lambda t: t.replace("[network]", "[networks]"), ["network", "missing table"]),
    (lambda t: t.replace("hbm_GBps = 2039", 'hbm_GBps = "fast"'), ["gpu.hbm_GBps", "must be a number"]),
    (lambda t: t.replace("hbm_GBps = 2039", "hbm_GBps = -5"), ["gpu.hbm_GBps", "> 0"]),
    (lambda t: t.replace("gemm_efficiency = 0.67", "gemm_efficiency = 1.7"), ["gpu.kernels.gemm_efficiency",
                                                                              "fraction"]),
    (lambda t: t.replace("gemm_efficiency = 0.67", "gemm_efficiency = 0.67\ngemm_shapes = [[1024, 512, 0.9]]"),
     ["gpu.kernels.gemm_shapes", "[m, n, k, efficiency]"]),
    (lambda t: t.replace("gemm_efficiency = 0.67", "gemm_efficiency = 0.67\ntp_block_overhead_us = [5.0, -1.0]"),
     ["gpu.kernels.tp_block_overhead_us", "[forward, backward]"]),
    (lambda t: t.replace("bf16 = 312.0", "bf17 = 312.0"), ["gpu.peak_tflops.bf17", "unknown dtype"]),
    (lambda t: t.replace('fabric = "nvswitch"', 'fabric = "ethernet"'), ["intra_node.fabric", "nvswitch"]),
    (lambda t: t.replace("gpus_per_node = 8", "gpus_per_node = 8.5"), ["gpus_per_node", "integer"]),
    (lambda t: t.replace("schema = 1", "schema = 7"), ["schema", "schema 1"]),
]


@pytest.mark.parametrize("edit,says", BAD_PROFILES)
def test_bad_cluster_profiles(cli, tmp_path, edit, says):
    path = tmp_path / "cluster.toml"
    path.write_text(edit(good_profile()))
    line = one_line_error(cli("plan", "--cluster", str(path)))
    assert str(path) in line
    for s in says:
        assert s in line, line


def test_custom_profile_works(cli, tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(good_profile().replace('name = "a100-80g"', 'name = "mine"'))
    out = cli("plan", "--cluster", str(path), "--gpus", "16", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cluster"]["name"] == "mine"


def test_nothing_fits_exits_3_with_what_would_help(cli):
    out = cli("plan", "--model", "llama3-405b", "--cluster", "a100-40g", "--gpus", "8")
    line = one_line_error(out, code=3)
    assert "no plan fits" in line and "(40.0 GiB less the 18% memory headroom)" in line
    # no candidate can need less than the model states fully sharded over the 8 GPUs:
    # 405.85e9 parameters x 16 bytes (fp32 weights, gradients, two Adam moments) / 8
    need = float(line.split("needs is ")[1].split(" GiB")[0])
    assert need >= 405.85e9 * 16 / 8 / 2**30
    # each change is re-searched and reported with its effect: more GPUs make it fit
    assert "--gpus 16 still needs" in line
    fitting = [int(n) for n in re.findall(r"--gpus (\d+) fits \(", line)]
    assert fitting and " s per step" in line
    # and only with enough memory in total for the model states: 16 bytes per parameter
    assert min(fitting) * 40 * 2**30 >= 405.85e9 * 16


def test_nothing_fits_says_when_offloaded_states_overflow_the_host(cli):
    """The torch runtime's ZeRO-3 offload keeps no model states on the GPU, so a plan can miss on host
    memory alone: 405.85e9 parameters x 16 bytes (fp32 weights, gradients, two Adam moments, all in
    host memory under FSDP2's CPU offload) on one node of 8 GPUs, against its 1 TiB."""
    out = cli("plan", "--model", "llama3-405b", "--cluster", "a100-40g", "--gpus", "8", "--zero", "3",
              "--optimizer-offload", "on")
    line = one_line_error(out, code=3)
    host = float(line.split("memory headroom) and ")[1].split(" GiB of host memory per node against ")[0])
    assert host >= 405.85e9 * 16 / 2**30 and "of host memory per node against 1024.0 GiB" in line, line
    assert "--gpus 16 still needs" in line and "GiB of host memory per node;" in line


def test_nothing_fits_with_fixed_knobs_tries_each_memory_knob_alone(cli):
    # (with offload, which the torch runtime runs, ZeRO-2 fits: fixed off here, it is one of the changes tried)
    out = cli("plan", "--model", "llama3-70b", "--cluster", "a100-80g", "--gpus", "16", "--tp", "8", "--pp", "1",
              "--zero", "2", "--recompute", "selective", "--optimizer-offload", "off")
    line = one_line_error(out, code=3)
    need = float(line.split("needs is ")[1].split(" GiB")[0])
    effects = dict(re.findall(r"; (--recompute full|--zero 3|--optimizer-offload on) "
                              r"(still needs [\d.]+ GiB|fits \([^)]*\))", line))
    assert set(effects) == {"--recompute full", "--zero 3", "--optimizer-offload on"}, line
    for change, effect in effects.items():
        if effect.startswith("still needs"):      # a more frugal knob never needs more memory
            assert float(effect.split()[2]) < need, (change, effect)
    assert "without --tp --pp --zero --recompute --optimizer-offload" in line


def test_debug_shows_a_traceback(cli):
    out = cli("--debug", "plan", "--model", "gpt-2b")
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_help_teaches(cli):
    out = cli("plan", "--help")
    assert out.returncode == 0
    for text in ("examples:", "--global-batch", "searched", "Exit codes"):
        assert text in out.stdout


# -- --json on every exit, user code that raises, what the plan line says ---------------------------

def test_json_on_every_exit_parses(cli):
    """A script reads one JSON document on stdout whatever the exit: the plan (0), the error with its
    field (2: a bad flag or a bad value), the no-fit answer (3: the least memory and what would fit)."""
    ok = cli("plan", "--model", "llama3-8b", "--gpus", "8", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["config"]["dp"] >= 1
    flag = cli("plan", "--gpus", "-3", "--json")
    assert flag.returncode == 2 and json.loads(flag.stdout) == {
        "error": "argument --gpus: expected a positive integer, got '-3' (see meshplan plan --help)", "exit_code": 2}
    value = cli("plan", "--tp", "3", "--json")
    doc = json.loads(value.stdout)
    assert value.returncode == 2 and doc["field"] == "--tp" and doc["exit_code"] == 2 and "tp 3" in doc["error"]
    nofit = cli("plan", "--model", "llama3-405b", "--cluster", "a100-40g", "--gpus", "8", "--json")
    doc = json.loads(nofit.stdout)
    assert nofit.returncode == 3 and doc["exit_code"] == 3 and doc["error"].startswith("no plan fits")
    answer = doc["no_fit"]
    assert answer["least_memory"]["estimate"]["memory_per_gpu_bytes"]["total"] > answer["capacity_bytes"]
    assert answer["what_would_fit"] and all(f["fits"] and f["config"] for f in answer["what_would_fit"])
    assert {f["change"] for f in answer["what_would_fit"]} <= {f["change"] for f in answer["tried"]}
    assert cli("plan", "--gpus", "-3").stdout == ""         # without --json, stdout stays empty


def test_a_factory_that_raises_is_one_line_and_the_users_traceback(cli, tmp_path):
    model = tmp_path / "mod.py"
    model.write_text("def helper():\n    raise ValueError('boom in the factory')\n\n\ndef build():\n    return helper()\n")
    out = cli("plan", "--model", f"{model}:build", "--cluster", "cpu-gloo", "--gpus", "2")
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert lines[0] == f"meshplan plan: error: {model}:build: the factory raised ValueError: boom in the factory"
    assert lines[1] == "Traceback of your code (most recent call last):"
    files = [line.split('"')[1] for line in lines if line.lstrip().startswith('File "')]
    assert files == [str(model), str(model)]              # build, then helper: meshplan's own frames left out


def test_the_plan_never_says_a_negative_saving():
    from planner.explain import gain_sentences
    stages = {"non_uniform_stages": {"saved_s": -0.928, "saved_pct": -9.1, "balanced_fits": False}}
    [sentence] = gain_sentences(stages)
    assert sentence == ("unequal stages take 0.928 s per step (9.1%) more than balanced ones, which would not fit: "
                        "memory decided")
    recompute = {"partial_recompute": {"recomputed_layers": 3, "blocks": 32, "saved_s": 5.93, "saved_pct": 30.5}}
    assert gain_sentences(recompute) == ["recomputing 3 of 32 blocks saves 5.93 s per step (30.5%) against "
                                         "recomputing every block"]
    assert not any("-" in s for s in gain_sentences({**stages, **recompute}))


def test_a_configs_context_length_as_the_sequence_is_said(cli, tmp_path):
    """A config.json gives the longest context the model takes (Llama 3.1: 131072), not its training sequence: left
    to it, the plan says so; with --seq-len, or a zoo model (its pretraining's length), nothing is said."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
                                  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
                                  "vocab_size": 1000, "max_position_embeddings": 131072}))
    out = cli("plan", "--model", str(config), "--cluster", "h100-80g", "--gpus", "8")
    assert out.returncode == 0, out.stderr
    assert "8 sequences x 131072 tokens" in out.stdout
    assert "--seq-len left out: 131072-token sequences" in out.stderr and "max_position_embeddings" in out.stderr
    out = cli("plan", "--model", str(config), "--cluster", "h100-80g", "--gpus", "8", "--seq-len", "4096")
    assert out.returncode == 0 and "--seq-len" not in out.stderr, out.stderr
    out = cli("plan", *SMALL)
    assert out.returncode == 0 and "--seq-len" not in out.stderr, out.stderr
