"""`meshplan compare`: the baseline estimated exactly as `meshplan plan` estimates the same
fixed plan, the recommended plan exactly `meshplan plan`'s, both side by side; the
round trip of every export back into the plan's own configuration; the report section."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from test_baseline import GPT3_SCRIPT, HF_ZERO3
from gallery_plans import INTERLEAVED_UNEQUAL, fixed_plan
from planner.baseline import Context, read_baseline
from planner.config import ParallelConfig
from planner.placement import balanced_stage_layers, layer_policies
from planner.exports import deepspeed, megatron, torchtitan

SMALL = ["--model", "gpt-1.7b", "--cluster", "a100-80g", "--gpus", "8"]
# a Megatron-LM job on 8 A100: tp 2, pp 2, micro-batch 2, selective recompute, the distributed optimizer
SMALL_ARGS = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2\n"
              "--global-batch-size 64 --recompute-granularity selective --sequence-parallel\n"
              "--use-distributed-optimizer --overlap-grad-reduce --bf16 --seq-length 2048 --lr 1e-4\n")
# the same job as `meshplan plan` flags: Megatron-LM's runtime, every knob fixed
SMALL_FIXED = ["--global-batch", "64", "--framework", "megatron", "--precision", "bf16", "--tp", "2", "--pp", "2",
               "--micro-batch", "2", "--zero", "1", "--recompute", "selective", "--sequence-parallel", "on",
               "--schedule", "1f1b"]


def run_json(cli, *args) -> dict:
    out = cli(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    (folder / "megatron_args.txt").write_text(SMALL_ARGS)
    return folder / "megatron_args.txt"


def test_baseline_is_estimated_as_plan_estimates_it_and_recommended_is_plans_best(cli, small):
    doc = run_json(cli, "compare", *SMALL, "--baseline", str(small))
    fixed = run_json(cli, "plan", *SMALL, *SMALL_FIXED)
    searched = run_json(cli, "plan", *SMALL, "--global-batch", "64", "--framework", "megatron", "--precision", "bf16")
    assert doc["baseline"]["config"] == fixed["config"] and doc["baseline"]["estimate"] == fixed["estimate"]
    assert doc["recommended"]["config"] == searched["config"]
    assert doc["recommended"]["estimate"] == searched["estimate"]
    assert doc["speedup"] == pytest.approx(fixed["estimate"]["step_time_s"] / searched["estimate"]["step_time_s"])
    assert doc["verdict"] == "faster" and doc["speedup"] > 1
    changed = {c["knob"] for c in doc["changes"]}
    assert changed == {k for k in ("dp", "tp", "pp", "cp", "zero", "micro_batch", "num_microbatches", "sequence_parallel",
                                   "optimizer_offload") if fixed["config"][k] != searched["config"][k]} | {"schedule", "recompute"}
    assert doc["baseline"]["ignored"] == ["--lr"]


def test_gain_prices_the_token_budget(cli, small):
    doc = run_json(cli, "compare", *SMALL, "--baseline", str(small), "--tokens", "300B")
    g = doc["gain"]
    for name in ("baseline", "recommended"):   # 300e9 tokens at the estimated tokens/s, in days
        assert g["days"][name] == pytest.approx(300e9 / doc[name]["estimate"]["tokens_per_s"] / 86400)
    assert g["usd"] is None       # the a100-80g profile has no [pricing]


def test_cost_with_a_priced_cluster_and_a_plan_that_does_not_fit(cli, tmp_path):
    # Llama-3 8B on one DGX H100, pure data parallel, 8 sequences of 8192 tokens per micro-batch, nothing
    # recomputed or sharded: the activations alone exceed 80 GiB
    (tmp_path / "args.txt").write_text("--micro-batch-size 8 --global-batch-size 64 --bf16 --seq-length 8192\n")
    out = cli("compare", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--baseline",
              str(tmp_path / "args.txt"), "--tokens", "1T")
    assert out.returncode == 0, out.stderr
    assert "your plan does not fit: stage 0 needs" in out.stdout and "more than the 79" in out.stdout
    assert "per GPU-hour" in out.stdout
    doc = run_json(cli, "compare", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--baseline",
                   str(tmp_path / "args.txt"), "--tokens", "1T")
    assert doc["verdict"] == "does_not_fit" and doc["baseline"]["estimate"]["fits"] is False
    g = doc["gain"]
    # $4.916 per GPU-hour (the h100-80g profile's [pricing]) x 8 GPUs x 24 h x days
    assert g["usd"]["recommended"] == pytest.approx(g["days"]["recommended"] * 24 * 8 * 4.916)


def test_the_searchs_own_plan_is_already_the_best(cli, tmp_path):
    out = cli("plan", *SMALL, "--global-batch", "64", "--out", str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    doc = run_json(cli, "compare", *SMALL, "--baseline", str(tmp_path / "plan.json"))
    assert doc["verdict"] == "already_best" and doc["speedup"] == 1.0 and doc["changes"] == []
    assert doc["recommended"] == {k: doc["baseline"][k] for k in ("config", "estimate")}
    text = cli("compare", *SMALL, "--baseline", str(tmp_path / "plan.json")).stdout
    assert "your plan is already the best meshplan finds" in text


def test_table_names_every_part(cli, small):
    out = cli("compare", *SMALL, "--baseline", str(small))
    assert out.returncode == 0, out.stderr
    for text in ("your plan", "recommended", "step time (s)", "pipeline bubble", "exposed TP communication",
                 "tokens/s", "MFU", "memory per GPU (GiB)", "verdict", "changes", "tp 2 -> ", "gain", "switch",
                 "checkpoint reshard", "in your Megatron-LM arguments:", "- --tensor-model-parallel-size 2",
                 "ignored   not modelled: --lr", "compared in"):
        assert text in out.stdout, text


def test_comparing_a_config_model_does_not_import_torch(small):
    code = ("import sys; from planner.cli import main; "
            f"rc = main(['compare', '--model', 'gpt-1.7b', '--cluster', 'a100-80g', '--gpus', '8', '--baseline', "
            f"{str(small)!r}, '--json']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert out.returncode == 0, out.stderr


def test_report_sets_your_plan_against_the_recommended_one(cli, small, tmp_path):
    out = cli("compare", *SMALL, "--baseline", str(small), "--report", str(tmp_path / "report"), timeout=600)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    section = md[md.index("## Your plan against the recommended one"):md.index("## Where the time goes")]
    for text in ("megatron_args.txt (Megatron-LM arguments)", "| layout (dp x tp x pp x cp) | 2 x 2 x 2 x 1 |",
                 "Gain:", "Switch:", "In your file: remove `--tensor-model-parallel-size 2`", "--lr",
                 "plots/comparison.png", "plots/baseline_pipeline_timeline.png", "plots/pipeline_timeline.png",
                 "plots/baseline_memory_per_stage.png", "plots/memory_per_stage.png"):
        assert text in section, text
    for stem in ("comparison", "baseline_pipeline_timeline", "baseline_memory_per_stage"):
        assert (tmp_path / "report" / "plots" / f"{stem}.svg").stat().st_size > 1000
    html = (tmp_path / "report" / "report.html").read_text()
    assert "Your plan against the recommended one" in html and "One step of your plan" in html


def test_help_teaches(cli):
    out = cli("compare", "--help")
    assert out.returncode == 0
    for text in ("examples:", "--baseline", "torchtitan", "DeepSpeed", "Megatron-LM", "plan.json", "--tp", "ignored",
                 "Exit codes"):
        assert text in out.stdout, text


# -- the round trip: each export of a plan reads back as the plan's own configuration ---------------

def effective(plan, config: ParallelConfig) -> dict:
    """Every knob as it runs: the stage split and each layer's recompute spelled out."""
    c = config
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "zero": c.zero, "micro_batch": c.micro_batch,
            "num_microbatches": c.num_microbatches, "vpp": c.vpp, "schedule": c.schedule if c.pp > 1 else None,
            "sequence_parallel": c.sequence_parallel, "optimizer_offload": c.optimizer_offload,
            "stage_layers": tuple(c.stage_layers or balanced_stage_layers(plan.graph, c.pp * c.vpp)),
            "recompute": layer_policies(plan.graph, c)}


def plan_zero3_no_pipeline():
    # FSDP over 8 GPUs, every block recomputed (meshplan's own runtime)
    return fixed_plan("llama3-8b", "h100-80g", 8, ParallelConfig(dp=8, tp=1, pp=1, zero=3, micro_batch=1,
                                                                  num_microbatches=2, recompute="full"),
                      framework="torch")


def plan_tp_pp_distributed_optimizer():
    # GPT-3 175B, tp 8 x pp 4 with sequence parallelism and Megatron's distributed optimizer
    return fixed_plan("gpt3-175b", "a100-80g", 64, ParallelConfig(
        dp=2, tp=8, pp=4, zero=1, micro_batch=1, num_microbatches=8, recompute="full", sequence_parallel=True))


def plan_interleaved_unequal():
    # 2 ranks x 2 virtual stages of 9, 7, 8 and 8 blocks, selective recompute
    return fixed_plan("llama3-8b", "h100-80g", 4, INTERLEAVED_UNEQUAL)


def plan_context_parallel_zero3():
    return fixed_plan("llama3-8b", "h100-80g", 8, ParallelConfig(dp=4, tp=1, pp=1, cp=2, zero=3, micro_batch=1,
                                                                  num_microbatches=4, recompute="op"),
                      framework="torch")


def plan_pipeline_offload():
    # DeepSpeed's pipeline with ZeRO-1 and the optimizer in host memory
    return fixed_plan("llama3-8b", "h100-80g", 8, ParallelConfig(dp=2, tp=1, pp=4, zero=1, micro_batch=1,
                                                                  num_microbatches=8, optimizer_offload=True),
                      framework="deepspeed")


def plan_block_recompute():
    # the first 3 blocks of each of 2 stages recomputed: what Megatron's block method says
    c = ParallelConfig(dp=4, tp=1, pp=2, zero=1, micro_batch=1, num_microbatches=4, recompute="full",
                       recompute_layers=("none",) + (("full",) * 3 + ("none",) * 13) * 2 + ("none", "none"))
    return fixed_plan("llama3-8b", "h100-80g", 8, c)


def plan_stages_that_cannot_be_equal():
    # 30 blocks on 4 stages: meshplan's balanced split is 7, 8, 8, 7, which Megatron-LM only
    # runs when told (it asserts that the stages divide the layers otherwise)
    return fixed_plan("gpt-3.6b", "a100-80g", 8, ParallelConfig(dp=2, tp=1, pp=4, zero=1, micro_batch=1,
                                                                 num_microbatches=8))


def plan_experts_folded():
    # Mixtral 8x7B, its 8 experts over ep 8 folded onto tp 2 x dp 4 (Megatron's MoE parallel folding, SP on)
    return fixed_plan("mixtral-8x7b", "h100-80g", 32, ParallelConfig(
        dp=4, tp=2, pp=4, ep=8, zero=1, micro_batch=1, num_microbatches=16, recompute="full", sequence_parallel=True),
        framework="megatron")


def plan_experts_discard():
    # DeepSeek-V3 (MoE and MLA) under Megatron's output-discarding recompute: --recompute-modules layernorm moe_act
    # mla_up_proj
    return fixed_plan("deepseek-v3", "h100-80g", 256, ParallelConfig(
        dp=8, tp=1, pp=32, ep=8, zero=1, micro_batch=1, num_microbatches=32, recompute="discard"),
        framework="megatron")


def plan_experts_fsdp():
    # Qwen3-30B-A3B under FSDP, 128 experts over ep 8 of the 16 data-parallel ranks (torchtitan's way)
    return fixed_plan("qwen3-30b-a3b", "h100-80g", 16, ParallelConfig(
        dp=16, tp=1, pp=1, ep=8, zero=3, micro_batch=1, num_microbatches=2, recompute="full"),
        framework="torchtitan")


def plan_experts_deepspeed():
    # DeepSpeed-MoE: ep 4 dividing dp 8, ZeRO-2
    return fixed_plan("mixtral-8x7b", "h100-80g", 8, ParallelConfig(
        dp=8, tp=1, pp=1, ep=4, zero=2, micro_batch=1, num_microbatches=2, recompute="full"),
        framework="deepspeed")


def plan_zbv_unequal():
    # ZB-V: 2 ranks x 2 stages in a V (rank 0 holds the first and the last), 9, 7, 7 and 9 blocks (the embedding
    # first, the norm and the head last)
    return fixed_plan("llama3-8b", "h100-80g", 4, ParallelConfig(
        dp=2, tp=1, pp=2, zero=0, micro_batch=1, num_microbatches=8, vpp=2, schedule="zbv", recompute="full",
        stage_layers=(10, 7, 7, 11)), framework="torchtitan")


def plan_interleaved_zb():
    return fixed_plan("llama3-8b", "h100-80g", 8, ParallelConfig(
        dp=2, tp=1, pp=4, zero=2, micro_batch=1, num_microbatches=8, vpp=2, schedule="interleaved-zb",
        recompute="full"), framework="torchtitan")


def plan_dualpipev():
    return fixed_plan("llama3-8b", "h100-80g", 8, ParallelConfig(
        dp=2, tp=1, pp=4, zero=3, micro_batch=1, num_microbatches=8, vpp=2, schedule="dualpipev",
        recompute="full"), framework="torchtitan")


PLANS = {f.__name__[5:]: f for f in (plan_zbv_unequal, plan_interleaved_zb, plan_dualpipev, plan_zero3_no_pipeline, plan_tp_pp_distributed_optimizer,
                                     plan_interleaved_unequal, plan_context_parallel_zero3, plan_pipeline_offload,
                                     plan_block_recompute, plan_stages_that_cannot_be_equal, plan_experts_folded,
                                     plan_experts_fsdp, plan_experts_deepspeed, plan_experts_discard)}
# (plan, format, knobs the format cannot hold: the export's notes say so)
ROUND_TRIP = [
    *[(name, "plan.json", ()) for name in PLANS],
    # Megatron-LM has no per-op recompute: full stands in for the op plan's (a note says so); nor a split-backward
    # schedule: interleaved 1F1B stands in (the record's ``nearest``; a note says so)
    *[(name, "megatron", ("recompute",) if name == "context_parallel_zero3" else
       ("schedule",) if name in ("zbv_unequal", "interleaved_zb", "dualpipev") else ()) for name in PLANS],
    ("zero3_no_pipeline", "deepspeed", ()),
    ("tp_pp_distributed_optimizer", "deepspeed", ("sequence_parallel",)),   # no key for Megatron-style SP
    ("pipeline_offload", "deepspeed", ()),
    ("stages_that_cannot_be_equal", "torchtitan", ("zero",)),
    ("block_recompute", "deepspeed", ("recompute",)),          # activation checkpointing is all or nothing
    ("zero3_no_pipeline", "torchtitan", ()),
    ("tp_pp_distributed_optimizer", "torchtitan", ("zero",)),  # torchtitan has no ZeRO-1
    # nor attention-core recompute: its per-op policy ("op") stands in for "selective"
    ("interleaved_unequal", "torchtitan", ("zero", "recompute")),
    ("context_parallel_zero3", "torchtitan", ()),
    ("pipeline_offload", "torchtitan", ("zero", "optimizer_offload")),   # nor optimizer offload
    ("experts_fsdp", "torchtitan", ()),
    ("experts_deepspeed", "deepspeed", ()),     # ep_size is a code argument: given as --ep, as tp and pp are
    # torch.distributed.pipelining's split-backward schedules by their class names (pipeline_parallel_schedule)
    ("zbv_unequal", "torchtitan", ()),
    ("interleaved_zb", "torchtitan", ()),
    ("dualpipev", "torchtitan", ()),
]
EXPORTS = {"megatron": megatron, "deepspeed": deepspeed, "torchtitan": torchtitan}


@pytest.mark.parametrize("name,fmt,cannot", ROUND_TRIP, ids=[f"{n}-{f}" for n, f, _ in ROUND_TRIP])
def test_every_export_reads_back_as_the_plans_own_configuration(tmp_path, name, fmt, cannot):
    plan = PLANS[name]()
    c = plan.best.config
    if fmt == "plan.json":
        path = tmp_path / "plan.json"
        plan.write(path)
    else:
        export = EXPORTS[fmt](plan)
        path = tmp_path / export.filename
        path.write_text(export.text)
    # Megatron-DeepSpeed gives tp and pp on its command line (the JSON holds neither)
    degrees = {"tp": c.tp, "pp": c.pp, "ep": c.ep} if fmt == "deepspeed" else {}
    baseline, _, _ = read_baseline(str(path), Context(gpus=c.world_size, **degrees), plan.model_source)
    want, got = effective(plan, c), effective(plan, baseline.config)
    for knob in want:
        if knob not in cannot:
            assert got[knob] == want[knob], (knob, got[knob], want[knob])
    assert baseline.global_batch == plan.workload.global_batch and baseline.seq_len == plan.workload.seq_len
    assert baseline.precision == plan.workload.precision


@pytest.mark.parametrize("fmt", ["plan.json", "megatron", "deepspeed", "torchtitan"])
def test_compare_reads_each_export_of_a_report_back(cli, tmp_path, fmt):
    # a plan every format holds whole: no sequence parallelism (torchtitan turns it on with tp), no cp (DeepSpeed)
    out = cli("plan", *SMALL, "--global-batch", "64", "--tp", "1", "--pp", "2", "--zero", "0", "--micro-batch", "1",
              "--recompute", "full", "--schedule", "1f1b", "--report", str(tmp_path / "report"), timeout=600)
    assert out.returncode == 0, out.stderr
    planned = json.loads((tmp_path / "report" / "plan.json").read_text())["config"]
    files = {"plan.json": "plan.json", "megatron": "exports/megatron_args.txt",
             "deepspeed": "exports/deepspeed_config.json", "torchtitan": "exports/torchtitan.toml"}
    extra = ["--tp", "1", "--pp", "2"] if fmt == "deepspeed" else []
    doc = run_json(cli, "compare", *SMALL, "--baseline", str(tmp_path / "report" / files[fmt]), *extra)
    assert doc["baseline"]["config"] == planned


# Where each knob a recommendation can change lives in a DeepSpeed job: its config keys, or the launch
# line of Megatron-DeepSpeed (tp, pp). dp follows from the world size and tp x pp, so it changes only with them;
# the schedule is DeepSpeed's one (1F1B), which a pipeline brings.
DEEPSPEED_HOME = {"tp": ("tensor_parallel.autotp_size", "--tensor-model-parallel-size"),
                  "pp": ("--pipeline-model-parallel-size",), "zero": ("zero_optimization.stage",),
                  "num_microbatches": ("gradient_accumulation_steps",),
                  "micro_batch": ("train_micro_batch_size_per_gpu",),
                  "optimizer_offload": ("zero_optimization.offload_optimizer",),
                  "param_offload": ("zero_optimization.offload_param",),
                  "recompute": ("activation_checkpointing",)}


@pytest.mark.parametrize("gpus,stage,offload", [(512, 3, False), (64, 1, False), (512, 3, True)])
def test_compare_on_a_deepspeed_config_changes_only_what_deepspeed_expresses(cli, tmp_path, gpus, stage, offload):
    """A DeepSpeed ZeRO config for GPT-3 175B (one with ZeRO-Infinity's parameter and optimizer offload): the
    recommendation stays inside what DeepSpeed's config and engine express (no Megatron sequence parallelism, no
    context parallelism, no interleaved schedule, balanced stages), and every knob it changes is in the edits it
    prints."""
    path = tmp_path / "ds_config.json"
    zero = {"stage": stage, "overlap_comm": True}
    if offload:
        zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    path.write_text(json.dumps({"train_batch_size": 1536, "train_micro_batch_size_per_gpu": 1,
                                "gradient_accumulation_steps": 1536 // gpus, "bf16": {"enabled": True},
                                "zero_optimization": zero}))
    doc = run_json(cli, "compare", "--model", "gpt3-175b", "--cluster", "a100-80g", "--gpus", str(gpus),
                   "--baseline", str(path))
    rec = doc["recommended"]["config"]
    assert rec["sequence_parallel"] is False and rec["cp"] == 1 and rec["vpp"] == 1
    assert rec["schedule"] == "1f1b"
    assert rec.get("stage_layers") is None and rec.get("recompute_layers") is None
    edits = doc["edits"]
    printed = " ".join(edits["add"] + edits["remove"] + edits["launch"])
    changed = {c["knob"] for c in doc["changes"]}
    for knob in changed - {"dp", "schedule"}:
        assert knob in DEEPSPEED_HOME, (knob, doc["changes"])
        assert any(home in printed for home in DEEPSPEED_HOME[knob]), (knob, printed)
    if "dp" in changed:
        assert changed & {"tp", "pp"}, doc["changes"]
    if "schedule" in changed:       # a pipeline where there was none runs DeepSpeed's one schedule
        assert "pp" in changed, doc["changes"]


def test_the_hugging_face_trainers_stock_zero3_config_says_how_each_auto_was_read(cli, tmp_path):
    """The shape of the Trainer's documented ZeRO-3 config: "auto" batch keys, optimizer and parameter offload
    to the CPU, fp16 and bf16 "auto". Every "auto" batch key is resolved in a note that names what the Trainer
    fills it from; without a global batch the file gives none, and the error says so."""
    path = tmp_path / "ds_zero3.json"
    zero = {**HF_ZERO3["zero_optimization"], "offload_param": {"device": "cpu", "pin_memory": True}}
    path.write_text(json.dumps({**HF_ZERO3, "zero_optimization": zero, "gradient_accumulation_steps": "auto",
                                "train_micro_batch_size_per_gpu": "auto"}))
    args = ("compare", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--baseline", str(path))
    out = cli(*args)
    assert out.returncode == 2 and "train_batch_size: the file gives no global batch" in out.stderr
    doc = run_json(cli, *args, "--global-batch", "64")
    notes = doc["baseline"]["notes"]
    base = doc["baseline"]["config"]
    assert (base["zero"], base["optimizer_offload"], base["micro_batch"], base["num_microbatches"]) == (3, True, 8, 1)
    said = " ".join(notes)
    assert 'train_micro_batch_size_per_gpu "auto"' in said and "--per_device_train_batch_size" in said
    assert "read as 8" in said and 'gradient_accumulation_steps "auto"' in said and 'train_batch_size "auto"' in said
    # offload_param read as DeepSpeed reads it at stage 3: the parameter shards in host memory
    assert base["param_offload"] is True and "offload_param" not in said


# The shape of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh as it is (test_baseline.GPT3_SCRIPT):
# no --tokenizer-type, and --vocab-file and --merge-file from its positional parameters, which pretrain_gpt.py
# reads as GPT-2's BPE files.
MEGATRON_175B_SHAPE = GPT3_SCRIPT.replace("VOCAB_FILE=$3", "MERGE_FILE=$4\nVOCAB_FILE=$3").replace(
    "--vocab-file gpt2-vocab.json\n    --merge-file gpt2-merges.txt", "--vocab-file $VOCAB_FILE\n    --merge-file $MERGE_FILE")


def test_megatrons_175b_example_script_plans_with_gpt2s_padded_vocabulary(cli, tmp_path):
    path = tmp_path / "train_gpt3_175b_distributed.sh"
    path.write_text(MEGATRON_175B_SHAPE)
    doc = run_json(cli, "compare", "--cluster", "a100-80g", "--gpus", "1024", "--baseline", str(path))
    base = doc["baseline"]
    assert (base["config"]["tp"], base["config"]["pp"], base["config"]["dp"]) == (8, 16, 8)
    assert doc["workload"]["framework"] == "megatron" and doc["workload"]["precision"] == "fp16"
    # GPT-2's 50257 BPE entries padded to a multiple of 128 x tp 8 = 1024 (megatron/training/vocab_utils.py)
    assert doc["model"]["spec"]["vocab_size"] == 51200
    assert any("GPT-2's BPE tokenizer (50257 tokens" in n and "--merge-file" in n for n in base["notes"])


@pytest.mark.parametrize("name,model,flavor", [("qwen3-8b", "qwen3", "8B"), ("qwen3-32b", "qwen3", "32B"),
                                                ("qwen3-30b-a3b", "qwen3", "30B-A3B"),
                                                ("gpt-oss-20b", "gpt_oss", "20b"), ("deepseek-v3", "deepseek_v3", "671B")])
def test_a_torchtitan_export_of_a_zoo_plan_names_the_model_and_reads_back_without_it(tmp_path, name, model, flavor):
    # torchtitan registers these as models "qwen3", "gpt_oss" and "deepseek_v3" with these flavors
    # (torchtitan/models/*/__init__.py, v0.2.2)
    experts = name != "qwen3-8b" and name != "qwen3-32b"
    plan = fixed_plan(name, "h100-80g", 16, ParallelConfig(
        dp=16, tp=1, pp=1, ep=8 if experts else 1, zero=3, micro_batch=1, num_microbatches=1, recompute="full"),
        framework="torchtitan")
    export = torchtitan(plan)
    assert f'name = "{model}"\nflavor = "{flavor}"' in export.text
    assert not any("registered models" in note for note in export.notes)
    path = tmp_path / export.filename
    path.write_text(export.text)
    baseline, spec, _ = read_baseline(str(path), Context(gpus=16))
    assert spec.name == name and baseline.config.ep == plan.best.config.ep
