"""Predicted vs published throughput for the public validation cases.

    python benchmarks/fidelity.py [--cases ../shared/validation/public_cases.json]

For every throughput case, planned as `meshplan plan` plans it (planner.api.plan; the case's
model written as a GPT-2 config.json, ``case_flags`` for the command): the published degrees (tp,
pp, dp), what the source states about its runtime and the micro-batch and virtual stages where a source
gives them are fixed; what none publishes (Table 2's PTD-P virtual stages; Megatron-Core's micro-batch,
virtual stages, recompute and sequence parallelism) is searched. It prints the error by model size, pipeline depth and
data-parallel size, each with a least-squares trend. The prediction is converted to
the source's own FLOP convention (see ../shared/validation/README.md):

- NAR21-T1 (Narayanan et al. SC'21, Table 1): F = 96 B s l h^2 (1 + s/6h + V/16lh)
  per step, full recompute counted; TFLOP/s = F / (t n). Runtime: Megatron-LM of
  2021: fp16, full recompute, materialised attention scores (no FlashAttention yet),
  the micro-batch, the virtual stages and the data-parallel implementation of the authors' script
  (``NAR21_T1_SCRIPT``: interleaved 1F1B where it sets virtual stages, else 1F1B; torch's DDP, its all-reduce
  beside the backward, without a pipeline, else the local one, after the backward). Table 2's PTD-P rows: the
  local one.
- NAR21-T2 (the same paper, Table 2: fixed global batch, 174.6B and 529.6B on 384 to 2240 GPUs), in
  Table 1's convention. ZeRO-3 rows: DeepSpeed of 2021 (``--framework deepspeed-2021``: v0.3.13-v0.4.2) with no
  model parallelism, ZeRO-3, the published micro-batch, full recompute, fp16, materialised attention,
  overlap_comm on (DeepSpeed's default at stage 3). PTD-P rows: as Table 1's runs (the TP x PP split of
  the published model-parallel size inferred as 8 x 12 and 8 x 35), Table 2's micro-batch (1). The
  published orderings are checked too: PTD-P faster than ZeRO-3 at every GPU count both ran, and ZeRO-3's
  per-GPU throughput falling as its GPUs double.
- MLM24-H100 (Megatron-Core r0.8 README table): model FLOPs without recompute,
  72 B s l h^2 (1 + s/6h + V/12lh) (Megatron's num_floating_point_operations),
  TFLOP/s per GPU. Runtime flags published: --overlap-grad-reduce,
  --overlap-param-gather, --tp-comm-overlap; distributed optimizer (ZeRO-1);
  bf16; FlashAttention (TransformerEngine).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import api  # noqa: E402
from planner.config import ParallelConfig  # noqa: E402
from planner.errors import NoFeasiblePlan, UserError  # noqa: E402
from planner.estimate import Estimate  # noqa: E402
from planner.model import ModelSpec  # noqa: E402
from planner.runtimes import RUNTIMES, priced_as  # noqa: E402
from planner.search import search  # noqa: E402

DEFAULT_CASES = Path(__file__).resolve().parents[2] / "shared" / "validation" / "public_cases.json"


def case_model(case: dict) -> ModelSpec:
    m = case["model"]
    h, heads = m["hidden"], m["heads"]
    nar = case["id"].startswith("NAR21")
    return ModelSpec(name=case["id"], num_layers=m["layers"], hidden=h, num_heads=heads, num_kv_heads=heads,
                     head_dim=h // heads, ffn_hidden=m.get("ffn_hidden") or 4 * h, vocab_size=m["vocab"],
                     seq_len=m["seq_len"], max_positions=m["seq_len"], mlp="gelu", norm="layernorm",
                     linear_bias=True, qkv_bias=False,
                     # NAR21: tied embeddings (the source says so); MLM24: the parameter labels
                     # (e.g. 1.7B for 24 x 2048 with V = 131072) need untied embeddings. Dropout: NAR21's 0.1; MLM24
                     # publishes none, so Megatron-LM's defaults (--attention-dropout and --hidden-dropout 0.1,
                     # megatron/training/arguments.py at 937571cfd4, the README's commit)
                     tied_embeddings=nar, dropout=True, source=case["source"].get("paper", case["source"].get("repo", "")))


def case_config_json(case: dict) -> dict:
    """The case's model as a Hugging Face GPT-2 config.json (what `meshplan plan --model` reads):
    the same architecture as ``case_model``."""
    spec = case_model(case)
    drop = 0.1 if spec.dropout else 0.0
    return {"model_type": "gpt2", "n_embd": spec.hidden, "n_head": spec.num_heads, "n_layer": spec.num_layers,
            "n_inner": spec.ffn_hidden, "vocab_size": spec.vocab_size, "n_positions": spec.seq_len,
            "tie_word_embeddings": spec.tied_embeddings, "resid_pdrop": drop, "attn_pdrop": drop,
            "embd_pdrop": drop}


# The runs of NAR21 Table 1 as the authors' reproduction script sets them (Megatron-LM examples/sc21/run_table_1.sh,
# commit 6985e58938, 2021-08-18: "some of the scripts that were used to produce the results" of the paper):
# (--micro-batch-size, --num-layers-per-virtual-pipeline-stage or None where the script sets none: the
# non-interleaved 1F1B schedule, --DDP-impl: torch's DDP, whose buckets all-reduce beside the backward, on the rows
# without a pipeline, the local one, one all-reduce after it, on the others: runtimes.py MEGATRON_2021_DDP). The
# paper says Table 1 used the interleaved schedule (Sec 5.1), which its 39.1B row on 2 stages could not
# (Megatron-LM of 2021 interleaves at pp > 2 only); the script is the more specific of the two and is followed for
# the 1T row too
NAR21_T1_SCRIPT = {"1.7B": (16, None, "torch"), "3.6B": (16, None, "torch"), "7.5B": (16, None, "torch"),
                   "18.4B": (8, None, "torch"), "39.1B": (4, None, "local"), "76.1B": (2, 5, "local"),
                   "145.6B": (2, 5, "local"), "310.1B": (1, 3, "local"), "529.6B": (1, 1, "local"),
                   "1008.0B": (1, None, "local")}


def interleaves_in_2021(pp: int) -> bool:
    """Whether Megatron-LM of 2021 could run the interleaved schedule on ``pp`` stages (pp > 2: runtimes.py)."""
    return pp >= RUNTIMES["megatron-2021"].on("cuda").virtual_stages_min_pp


def t1_script(case: dict) -> tuple[int, int | None, str] | None:
    """``NAR21_T1_SCRIPT``'s (micro-batch, layers per virtual stage, DDP implementation) of a Table 1 row; None
    for other cases."""
    return NAR21_T1_SCRIPT.get(case["id"].removeprefix("NAR21-T1-")) if case["id"].startswith("NAR21-T1") else None


def case_settings(case: dict) -> tuple[dict, dict]:
    """(the job's settings besides the model: planner.api.JobInputs fields, the fixed knobs: Knobs fields)
    of a case: the published degrees and what the source states about its runtime, fixed, with the micro-batch
    where the source gives it (Table 2's column, the script of Table 1: ``NAR21_T1_SCRIPT``, which gives Table 1's
    virtual stages too); what it does not publish (the virtual stages of Table 2's PTD-P rows; for Megatron-Core
    the micro-batch, virtual stages, recompute and sequence parallelism) searched."""
    cfg, m = case["config"], case["model"]
    job = {"gpus": case["hardware"]["num_gpus"], "global_batch": cfg["global_batch"], "seq_len": m["seq_len"],
           "framework": "megatron"}
    knobs = {"tp": cfg["tp"], "pp": cfg["pp"], "dp": cfg["dp"], "cp": 1}
    if case["id"].startswith("NAR21-T2-ZeRO3"):
        job.update(cluster="a100-80g", precision="fp16", attention="unfused", overlap_grad_reduce=True,
                   framework="deepspeed-2021")
        knobs.update(zero=3, recompute="full", micro_batch=cfg["micro_batch"])
    elif case["id"].startswith("NAR21"):
        job.update(cluster="a100-80g", precision="fp16", attention="unfused", overlap_grad_reduce=False,
                   framework="megatron-2021")
        knobs.update(zero=0, recompute="full", **({"sequence_parallel": False} if cfg["tp"] > 1 else {}))
        script = t1_script(case)
        if script is not None:
            micro_batch, layers_per_chunk, ddp = script
            knobs["micro_batch"] = micro_batch
            job["overlap_grad_reduce"] = ddp == "torch"
            if cfg["pp"] > 1:
                knobs.update(schedule="interleaved-1f1b", vpp=m["layers"] // cfg["pp"] // layers_per_chunk) \
                    if layers_per_chunk else knobs.update(schedule="1f1b", vpp=1)
        else:
            if cfg.get("micro_batch"):
                knobs["micro_batch"] = cfg["micro_batch"]
            # the interleaved schedule where Megatron-LM of 2021 ran it (pp > 2), else 1F1B
            if cfg["pp"] > 1:
                knobs["schedule"] = "interleaved-1f1b" if interleaves_in_2021(cfg["pp"]) else "1f1b"
    else:
        job.update(cluster="h100-80g", precision="bf16", attention="flash", tp_comm_overlap=True)
        knobs.update(zero=1)
    return job, knobs


def case_flags(case: dict) -> list[str]:
    """The `meshplan plan` flags of ``case_settings`` (the command each row records). The published runtimes
    split layers evenly across stages (Megatron-LM requires it): --uniform-stages."""
    job, knobs = case_settings(case)
    flags = []
    for key, value in {**job, **knobs}.items():
        if key == "overlap_grad_reduce":
            flags += [] if value else ["--no-overlap-grad-reduce"]
        elif key == "tp_comm_overlap":
            flags += ["--tp-comm-overlap"] if value else []
        else:
            flags += [f"--{key.replace('_', '-')}", ("on" if value else "off") if isinstance(value, bool) else str(value)]
    return flags + ["--uniform-stages", "--top-k", "1"]


def published_convention_tflops(case: dict, step_s: float) -> float:
    m, cfg = case["model"], case["config"]
    B, s, l, h, V = cfg["global_batch"], m["seq_len"], m["layers"], m["hidden"], m["vocab"]
    n = case["hardware"]["num_gpus"]
    if case["id"].startswith("NAR21"):
        flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    else:
        flops = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    return flops / (step_s * n) / 1e12


def run_case(case: dict, workdir: Path) -> dict:
    """The case planned as `meshplan plan ... --uniform-stages --top-k 1` plans it (planner.api.plan), its
    throughput in the source's own convention against the published one."""
    config = workdir / f"{case['id']}.json"
    config.write_text(json.dumps(case_config_json(case)))
    job, knobs = case_settings(case)
    t0 = time.perf_counter()
    plan = api.plan(api.load_job(str(config), **job), api.Knobs(**knobs), top_k=1, solver="uniform")
    seconds = time.perf_counter() - t0
    published = case["published"]["tflops_per_gpu"]
    step_s = plan.best.estimate.step_time_s
    predicted = published_convention_tflops(case, step_s)
    c = plan.best.config
    chosen = f"mb {c.micro_batch} vpp {c.vpp} rc {c.recompute} sp {'on' if c.sequence_parallel else 'off'}"
    return {"id": case["id"], "params": plan.model_params, "pp": case["config"]["pp"], "dp": case["config"]["dp"],
            "gpus": case["hardware"]["num_gpus"], "runtime": job["framework"], "published": published,
            "predicted": predicted, "error": predicted / published - 1, "config": chosen, "vpp": c.vpp,
            "seconds": seconds, "step_s": step_s, "mem_gib": plan.best.estimate.memory.total / 2**30,
            "command": "meshplan plan " + " ".join(["--model", f"{case['id']}.json", *case_flags(case)])}


def case_inputs(case: dict, profile_override: dict | None = None):
    """What `meshplan plan` searches a case with: (layer graph, cluster, workload, fixed knobs);
    ``profile_override`` replaces fields of the cluster's device."""
    with tempfile.TemporaryDirectory(prefix="meshplan-fidelity-") as tmp:
        config = Path(tmp) / f"{case['id']}.json"
        config.write_text(json.dumps(case_config_json(case)))
        job, knobs = case_settings(case)
        loaded = api.load_job(str(config), **job)
    cluster = loaded.cluster
    if profile_override:
        from dataclasses import replace
        cluster = replace(cluster, device=replace(cluster.device, **profile_override))
    return loaded.graph, cluster, loaded.workload, api.Knobs(**knobs)


def run_case_api(case: dict, profile_override: dict | None = None) -> dict:
    """``run_case`` on the search alone (the same search, no Plan), for scripts that
    change the device profile (benchmarks/calibrate.py)."""
    graph, cluster, workload, knobs = case_inputs(case, profile_override)
    t0 = time.perf_counter()
    # the published runtimes split layers evenly across stages (Megatron-LM requires it):
    # search balanced stages with one recompute policy, as they could run
    result = search(graph, cluster, workload, knobs, top_k=1, solver="uniform")
    seconds = time.perf_counter() - t0
    published = case["published"]["tflops_per_gpu"]
    if result.best is None:
        return {"id": case["id"], "published": published, "predicted": float("nan"), "error": float("nan"),
                "config": "no plan fits", "seconds": seconds}
    predicted = published_convention_tflops(case, result.best.estimate.step_time_s)
    c = result.best.config
    chosen = (f"mb {c.micro_batch} vpp {c.vpp} rc {c.recompute} sp {'on' if c.sequence_parallel else 'off'}")
    return {"id": case["id"], "published": published, "predicted": predicted,
            "error": predicted / published - 1, "config": chosen, "seconds": seconds,
            "step_s": result.best.estimate.step_time_s, "mem_gib": result.best.estimate.memory.total / 2**30}


THROUGHPUT_TYPES = ("throughput", "throughput+ranking")     # dense, bf16/fp16: what meshplan plans today
MOE_TYPES = ("throughput (MoE, BF16)",)     # the FP8 ones once FP8 is priced
# the Megatron-Bridge rows' models (model.name_in_source) as meshplan's zoo holds them; ``moe_case_model`` checks the
# dimensions the case gives against the zoo's
MOE_ZOO = {"GPT OSS 120B": "gpt-oss-120b", "Qwen3_30B_a3B": "qwen3-30b-a3b", "Qwen3_235B_a22B": "qwen3-235b-a22b",
           "DeepSeekV3 (w/ MTP)": "deepseek-v3"}
# the clusters meshplan has a profile of, by the case's system
MOE_CLUSTERS = {"DGX-H100": "h100-80g", "DGX-B200": "b200"}


def moe_case_model(case: dict) -> str:
    """The zoo name of a Megatron-Bridge MoE case's model, its dimensions checked against the case's."""
    from planner.model import ZOO
    m = case["model"]
    name = MOE_ZOO[m["name_in_source"]]
    spec = ZOO[name]
    for field, key in (("num_layers", "layers"), ("hidden", "hidden"), ("num_heads", "heads"), ("vocab_size", "vocab"),
                       ("num_experts", "num_experts"), ("experts_per_token", "experts_per_token")):
        assert getattr(spec, field) == m[key], (name, field, getattr(spec, field), m[key])
    return name


# The MoE runs whose performance script overlaps the expert all-to-alls (Megatron-Bridge @5776a6d90: moe_a2a_overlap=True
# in scripts/performance/configs/qwen/qwen3_workload_base_configs.py, which scripts/performance/utils/overrides.py
# turns into overlap_moe_expert_parallel_comm and delay_wgrad_compute): planned with --ep-comm-overlap
EP_COMM_OVERLAP = {
    "MBRIDGE2511-H100-QWEN3_30B_A3B-16gpu-FP8CS": "QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_BASE_CONFIG",
    "MBRIDGE2511-H100-QWEN3_235B_A22B-256gpu-FP8CS": "QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_BASE_CONFIG",
    "MBRIDGE2511-B200-QWEN3_235B_A22B-64gpu-FP8MX": "QWEN3_235B_A22B_PRETRAIN_CONFIG_B200_FP8_MX_BASE_CONFIG (the FP8_CS one)",
}


def moe_case_settings(case: dict) -> tuple[dict, dict]:
    """(job settings, fixed knobs) of a Megatron-Bridge MoE case: every published degree (tp, pp, cp, dp, ep, virtual
    stages) and the micro-batch fixed; the distributed optimizer (ZeRO-1, Megatron-Bridge's default) unless the summary's
    FSDP column says Megatron-FSDP (``config.fsdp``: ZeRO-3, its default strategy optim_grads_params);
    recompute and optimizer offload searched, as the source does not publish them. The published run ran, so it fit
    its GPU: no memory headroom beyond the device's (``--memory-headroom 0``; the default headroom is the gap measured
    for meshplan's own torch runtime, not Megatron-LM's)."""
    cfg, m, hw = case["config"], case["model"], case["hardware"]
    job = {"gpus": hw["num_gpus"], "global_batch": cfg["global_batch"], "seq_len": m["seq_len"], "framework": "megatron",
           "cluster": MOE_CLUSTERS[hw["system"]], "precision": "bf16", "attention": "flash", "memory_headroom": 0.0,
           # its performance scripts keep and reduce gradients in bf16 (scripts/performance/configs/*/
           # *_llm_pretrain.py @5776a6d9: ddp.grad_reduce_in_fp32 = False)
           "grad_reduce_in_bf16": True}
    if case["id"] in EP_COMM_OVERLAP:
        job["ep_comm_overlap"] = True
    knobs = {"tp": cfg["tp"], "pp": cfg["pp"], "cp": cfg["cp"], "dp": cfg["dp"], "ep": cfg["ep"],
             "micro_batch": cfg["micro_batch"], "zero": 3 if cfg.get("fsdp") else 1}
    if cfg["pp"] > 1:
        knobs["vpp"] = cfg["virtual_stages"]
    return job, knobs


# Where the summary's row and the performance script of its release disagree on a knob: the script's value and where
# it is set. The rows stay checked with the summary's degrees; these are printed beside them. The script: Megatron-Bridge
# tag v0.2.0 (2025-11-26, eight days before the 25.11 summary was committed; the same values through v0.2.2 and at
# 5776a6d90, the summary's commit), scripts/performance/configs/gpt_oss/workload_base_configs.py. B200: EP 64 (the
# GB200 and GB300 rows of the summary say 64 too) where the row says 8. H100: the base's micro_batch_size=1 with
# PP 4, where the row says MBS 4 and GA 2, which do not give GBS 512 at DP 16 (MBS 1 does, with GA 32). Both also set
# recompute_modules layernorm and moe_act: meshplan's "discard" on GPT-OSS (a MoE without MLA).
_GPT_OSS_SCRIPT = "Megatron-Bridge v0.2.0 scripts/performance/configs/gpt_oss/workload_base_configs.py: "
AS_CONFIGURED = {
    "MBRIDGE2511-B200-GPTOSS_120B-64gpu-BF16": (
        {"ep": 64, "recompute": "discard"},
        _GPT_OSS_SCRIPT + "GPT_OSS_120B_B200_BF16_BASE_CONFIG expert_model_parallel_size=64, recompute_modules "
                          "layernorm moe_act"),
    "MBRIDGE2511-H100-GPTOSS_120B-64gpu-BF16": (
        {"micro_batch": 1, "recompute": "discard"},
        _GPT_OSS_SCRIPT + "GPT_OSS_120B_H100_BF16_BASE_CONFIG micro_batch_size=1 (the base's), recompute_modules "
                          "layernorm moe_act"),
}


def run_moe_case(case: dict, override: dict | None = None) -> dict:
    """A Megatron-Bridge MoE case planned as `meshplan plan --model <zoo name> ...` plans it: tokens per second per GPU
    predicted against the published; ``override`` replaces fixed knobs (``AS_CONFIGURED``)."""
    model = moe_case_model(case)
    job, knobs = moe_case_settings(case)
    knobs = {**knobs, **(override or {})}
    t0 = time.perf_counter()
    plan = api.plan(api.load_job(model, **job), api.Knobs(**knobs), top_k=1, solver="uniform")
    seconds = time.perf_counter() - t0
    published = case["published"]["tokens_per_s_per_gpu"]
    predicted = plan.best.estimate.tokens_per_s / job["gpus"]
    c, t = plan.best.config, plan.best.estimate.time
    return {"id": case["id"], "published": published, "predicted": predicted, "error": predicted / published - 1,
            "config": f"rc {c.recompute} offload {'on' if c.optimizer_offload else 'off'}", "seconds": seconds,
            "step_s": plan.best.estimate.step_time_s, "mem_gib": plan.best.estimate.memory.total / 2**30,
            "ep_comm_s": t.ep_comm, "bubble_s": t.bubble,
            "command": plan_command(model, job, knobs)}


def plan_or_closest(model: str, job: dict, knobs: dict) -> tuple[Estimate, ParallelConfig, str]:
    """(estimate, config, note) of a published run planned with its fixed knobs on balanced stages (``plan_command``).
    The run ran, so it fit: where meshplan's memory says no plan of those knobs does, the plan closest to fitting is
    priced and ``note`` says by how much meshplan finds it too large (NoFeasiblePlan where there is none at all)."""
    try:
        plan = api.plan(api.load_job(model, **job), api.Knobs(**knobs), top_k=1, solver="uniform")
        return plan.best.estimate, plan.best.config, ""
    except NoFeasiblePlan as err:
        least = err.answer.get("least_memory")
        if not least:
            raise
        est = Estimate.from_json(least["estimate"])
        return est, ParallelConfig.from_json(least["config"]), (
            f"does not fit by meshplan's memory: {est.memory.total / 2**30:.1f} of {est.usable_bytes / 2**30:.1f} GiB")


def plan_command(model: str, job: dict, knobs: dict) -> str:
    """The `meshplan plan` line of a case planned with ``job`` settings and fixed ``knobs`` (a switch is its flag
    alone), on balanced stages as the published runtimes split them."""
    flags = []
    for key, value in {**job, **knobs}.items():
        if value is not False:
            flags += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return "meshplan plan " + " ".join(["--model", model, *flags, "--uniform-stages", "--top-k", "1"])


def throughput_cases(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text()) if c["case_type"] in THROUGHPUT_TYPES]


def orderings(rows: list[dict]) -> list[dict]:
    """The orderings NAR21 Table 2 publishes, each checked on the published and on the predicted TFLOP/s per
    GPU (the same FLOPs per step for both runtimes, so higher is faster): PTD-P against ZeRO-3 at each GPU
    count both ran, and ZeRO-3's per-GPU throughput falling as its GPUs double."""
    by_id = {r["id"]: r for r in rows}
    out = []
    zero3 = sorted((r for r in rows if r["id"].startswith("NAR21-T2-ZeRO3")), key=lambda r: (r["params"], r["gpus"]))
    for z in zero3:
        ptdp = by_id.get(z["id"].replace("ZeRO3", "PTDP"))
        if ptdp is not None:
            out.append({"claim": f"{ptdp['id']} faster than ZeRO-3", "published": ptdp["published"] > z["published"],
                        "predicted": ptdp["predicted"] > z["predicted"]})
    for a, b in zip(zero3, zero3[1:]):
        if a["params"] == b["params"]:
            out.append({"claim": f"ZeRO-3 per-GPU throughput falls from {a['gpus']} to {b['gpus']} GPUs "
                                 f"({a['id'].split('-')[3]})",
                        "published": b["published"] < a["published"], "predicted": b["predicted"] < a["predicted"]})
    return out


def trend(rows: list[dict], key) -> tuple[float, float]:
    """(slope of the signed error per decade of ``key``, Pearson correlation): least squares."""
    xs = [math.log10(key(r)) for r in rows]
    ys = [r["error"] for r in rows]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / sxx, sxy / math.sqrt(sxx * syy) if sxx and syy else 0.0


def paper_schedule(case: dict) -> tuple[int, float] | None:
    """(virtual stages, error) of a Table 1 row whose script runs the non-interleaved schedule where Megatron-LM of
    2021 could interleave (pp > 2), planned as the paper's Sec 5.1 says Table 1 ran (interleaved, the virtual
    stages searched); None for the other cases."""
    script = t1_script(case)
    if script is None or script[1] is not None or not interleaves_in_2021(case["config"]["pp"]):
        return None
    from dataclasses import replace
    graph, cluster, workload, knobs = case_inputs(case)
    result = search(graph, cluster, workload, replace(knobs, schedule="interleaved-1f1b", vpp=None), top_k=1,
                    solver="uniform")
    best = result.best
    predicted = published_convention_tflops(case, best.estimate.step_time_s)
    return best.config.vpp, predicted / case["published"]["tflops_per_gpu"] - 1


def vpp_sensitivity(case: dict) -> list[tuple[int, float]]:
    """(virtual stages, error) of ``case`` at every number of virtual stages its runtime allows with its published
    degrees, the rest searched as ``run_case_api`` searches it; none where the source fixes the schedule (pp 1, or
    the script of Table 1: ``NAR21_T1_SCRIPT``)."""
    from dataclasses import replace
    if case["config"]["pp"] <= 1 or t1_script(case) is not None:
        return []
    graph, cluster, workload, knobs = case_inputs(case)
    per_stage = case["model"]["layers"] // case["config"]["pp"]
    out = []
    for vpp in (v for v in range(1, per_stage + 1) if per_stage % v == 0):
        try:
            result = search(graph, cluster, workload, replace(knobs, vpp=vpp), top_k=1, solver="uniform")
        except UserError:          # a number of virtual stages the runtime refuses at these degrees
            continue
        if result.best is not None:
            predicted = published_convention_tflops(case, result.best.estimate.step_time_s)
            out.append((vpp, predicted / case["published"]["tflops_per_gpu"] - 1))
    return out


def print_vpp_sensitivity(cases: list[dict], rows: list[dict]) -> None:
    """The error of each pipelined case at every allowed number of virtual stages, the searched one in brackets:
    how much of a case's error the one knob its source leaves out can move."""
    searched = {r["id"]: r["vpp"] for r in rows}
    print("\nvirtual stages the sources do not publish: error at each number the runtime allows "
          "[the searched one]")
    for case in cases:
        points = vpp_sensitivity(case)
        if len(points) > 1:
            cells = "  ".join(f"[{v}] {100 * e:+.1f}%" if v == searched[case["id"]] else f"{v} {100 * e:+.1f}%"
                              for v, e in points)
            print(f"  {case['id']:<30} pp {case['config']['pp']:>2}  {cells}")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the rows and the summary to OUT "
                                                                  "(benchmarks/results/fidelity.json)")
    parser.add_argument("--unpublished-vpp", action="store_true",
                        help="also print, for each pipelined case whose source does not publish its virtual stages, "
                             "the error at every number of virtual stages its runtime allows (the search picks one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshplan-fidelity-") as tmp:
        rows = [run_case(case, Path(tmp)) for case in throughput_cases(args.cases)]
    if args.unpublished_vpp:
        print_vpp_sensitivity(throughput_cases(args.cases), rows)
    moe = [c for c in json.loads(args.cases.read_text()) if c["case_type"] in MOE_TYPES]
    moe_rows = []
    for case in (c for c in moe if c["hardware"]["system"] in MOE_CLUSTERS):
        row = run_moe_case(case)
        if case["id"] in AS_CONFIGURED:     # also as the run's own script set it
            override, where = AS_CONFIGURED[case["id"]]
            row["as_configured"] = {**run_moe_case(case, override), "where": where}
        moe_rows.append(row)
    unpriced = [c["id"] for c in moe if c["hardware"]["system"] not in MOE_CLUSTERS]
    print(f"{'case':<30} {'published':>9} {'predicted':>9} {'error':>7}  {'step s':>7} {'GiB':>5}  "
          f"knobs (published, or searched)")
    for r in rows:
        print(f"{r['id']:<30} {r['published']:>9.1f} {r['predicted']:>9.1f} {100 * r['error']:>+6.1f}%  "
              f"{r['step_s']:>7.2f} {r['mem_gib']:>5.1f}  {r['config']}")
    for case in throughput_cases(args.cases):
        alt = paper_schedule(case)
        if alt is not None:
            print(f"  {case['id']} as the paper says Table 1 ran (Sec 5.1: the interleaved schedule; the script sets "
                  f"no virtual stages): {100 * alt[1]:+.1f}% at {alt[0]} virtual stages (searched)")
    errors = [abs(r["error"]) for r in rows]
    print(f"\nmean absolute error {100 * statistics.mean(errors):.1f}%   max {100 * max(errors):.1f}%   "
          f"({len(rows)} cases through `meshplan plan`; TFLOP/s per GPU in each source's own convention)")
    by_source = {}
    for prefix in ("NAR21-T1", "NAR21-T2-PTDP", "NAR21-T2-ZeRO3", "MLM24"):
        sub = [abs(r["error"]) for r in rows if r["id"].startswith(prefix)]
        if sub:
            by_source[prefix] = {"cases": len(sub), "mean_abs": statistics.mean(sub), "max_abs": max(sub)}
            print(f"  {prefix}: mean {100 * statistics.mean(sub):.1f}%  max {100 * max(sub):.1f}%")
    print("\nerror (signed) by model size, pipeline depth and data-parallel size: a trend would show the model "
          "missing something that grows with scale")
    tables = {"parameters": ("params", [("< 10B", 0, 1e10), ("10B-100B", 1e10, 1e11), ("100B-1T", 1e11, 1e12),
                                        (">= 1T", 1e12, math.inf)]),
              "pipeline stages": ("pp", [("1", 1, 2), ("2-7", 2, 8), ("8-31", 8, 32), (">= 32", 32, math.inf)]),
              "data-parallel replicas": ("dp", [("1-15", 1, 16), ("16-63", 16, 64), ("64-511", 64, 512),
                                                (">= 512", 512, math.inf)])}
    for title, (key, buckets) in tables.items():
        print(f"  by {title}:")
        for label, lo, hi in buckets:
            for who, runtime in (("Megatron-LM", "megatron"), ("DeepSpeed", "deepspeed-2021")):
                sub = [r["error"] for r in rows if lo <= r[key] < hi and priced_as(r["runtime"]) == runtime]
                if sub:
                    print(f"    {label:<9} {who:<12} {len(sub):>2} cases  mean {100 * statistics.mean(sub):+6.1f}%  "
                          f"mean |error| {100 * statistics.mean(abs(e) for e in sub):5.1f}%")
    trends = {}
    for label, sub in (("all cases", rows),
                       ("the Megatron-LM cases", [r for r in rows if priced_as(r["runtime"]) == "megatron"])):
        piped, wide = [r for r in sub if r["pp"] > 1], [r for r in sub if r["dp"] > 1]
        t = trends[label] = {
            "size": trend(sub, lambda r: r["params"]),
            "pp": trend(piped, lambda r: r["pp"]) if len(piped) > 2 else (0.0, 0.0),
            "dp": trend(wide, lambda r: r["dp"]) if len(wide) > 2 else (0.0, 0.0)}
        print(f"  least squares over {label} ({len(sub)}), signed error per decade: of parameters "
              f"{100 * t['size'][0]:+.2f}% (r = {t['size'][1]:+.2f}); of pipeline stages (pp > 1) "
              f"{100 * t['pp'][0]:+.2f}% (r = {t['pp'][1]:+.2f}); of data-parallel replicas (dp > 1) "
              f"{100 * t['dp'][0]:+.2f}% (r = {t['dp'][1]:+.2f})")
    (size_slope, size_r), (pp_slope, pp_r), (dp_slope, dp_r) = (trends["all cases"][k] for k in ("size", "pp", "dp"))
    checks = orderings(rows)
    if checks:
        print("\npublished orderings (NAR21 Table 2): holds in the source / in the prediction")
        for c in checks:
            print(f"  {'yes' if c['published'] else 'NO ':<3} / {'yes' if c['predicted'] else 'NO ':<3}  {c['claim']}")
        print(f"  {sum(c['predicted'] for c in checks)} of {len(checks)} hold in the prediction")
    if moe_rows:
        print(f"\nmixtures of experts (Megatron-Bridge, tokens/s per GPU): {'published':>9} {'predicted':>9} {'error':>7}")
        for r in moe_rows:
            print(f"  {r['id']:<44} {r['published']:>9.0f} {r['predicted']:>9.0f} {100 * r['error']:>+6.1f}%  "
                  f"step {r['step_s']:.2f} s, {r['mem_gib']:.1f} GiB, all-to-all {r['ep_comm_s']:.2f} s, "
                  f"{r['config']}\n    {r['command']}")
            if "as_configured" in r:
                a = r["as_configured"]
                print(f"    as its performance script sets it ({a['where']}): predicted {a['predicted']:.0f} "
                      f"({100 * a['error']:+.1f}%), step {a['step_s']:.2f} s, all-to-all {a['ep_comm_s']:.2f} s, "
                      f"{a['config']}")
    if unpriced:
        print(f"  not priced (no profile of their GPU yet): {', '.join(unpriced)}")
    if args.json:
        summary = {"cases": len(rows), "mean_abs": statistics.mean(errors), "max_abs": max(errors),
                   "by_source": by_source, "size_slope_per_decade": size_slope, "size_r": size_r,
                   "pp_slope_per_decade": pp_slope, "pp_r": pp_r, "dp_slope_per_decade": dp_slope, "dp_r": dp_r,
                   "orderings": checks, "orderings_held": sum(c["predicted"] for c in checks),
                   "megatron_trends": {k: {"slope_per_decade": v[0], "r": v[1]}
                                       for k, v in trends["the Megatron-LM cases"].items()},
                   "moe": {"rows": moe_rows, "not_priced": unpriced}}
        args.json.write_text(json.dumps({"measured_by": "python benchmarks/fidelity.py --json "
                                         "benchmarks/results/fidelity.json", "cases_file": str(args.cases.name),
                                         "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
