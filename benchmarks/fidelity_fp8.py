"""The published FP8 runs through `meshplan plan`: Megatron-Bridge's performance summary (``MBRIDGE2511-*`` in
../shared/validation/public_cases.json: Llama 3 and MoE models on DGX H100 and DGX B200 in FP8 current scaling
and MXFP8), each with its published degrees, tokens per second per GPU predicted against the published.

FP8-CS is TransformerEngine's per-tensor current scaling (``--precision fp8-tensorwise``), FP8-MX its MXFP8
(``--precision mxfp8``), both under ``--framework megatron`` with ``--fp8-param-gather`` as Megatron-Bridge's FP8
presets set it. Every published degree, virtual stages and the
micro-batch are fixed, the distributed optimizer (ZeRO-1) assumed as for the BF16 rows (benchmarks/fidelity.py
``moe_case_settings``), recompute and offload searched as the source does not publish them.

    python benchmarks/fidelity_fp8.py [--json benchmarks/results/fidelity_fp8.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

from planner import api

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("fidelity", HERE / "fidelity.py")
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)

# the published precision (config.precision opens with it) as a --precision recipe
RECIPE = {"FP8 current scaling": "fp8-tensorwise", "MXFP8": "mxfp8"}
DENSE_ZOO = {"LLAMA3_8B": "llama3-8b", "LLAMA3_70B": "llama3-70b", "LLAMA3.1_405B": "llama3-405b"}


def fp8_cases(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text()) if c["id"].startswith("MBRIDGE")
            and any(c["config"]["precision"].startswith(p) for p in RECIPE)]


def case_model(case: dict) -> str:
    name = case["model"]["name_in_source"]
    if name in DENSE_ZOO:
        from planner.model import ZOO
        spec, m = ZOO[DENSE_ZOO[name]], case["model"]
        for field, key in (("num_layers", "layers"), ("hidden", "hidden"), ("num_heads", "heads"),
                           ("ffn_hidden", "ffn_hidden"), ("vocab_size", "vocab")):
            assert getattr(spec, field) == m[key], (name, field, getattr(spec, field), m[key])
        return DENSE_ZOO[name]
    return fidelity.moe_case_model(case)


def run(case: dict) -> dict:
    model = case_model(case)
    job, knobs = fidelity.moe_case_settings(case)
    recipe = next(r for p, r in RECIPE.items() if case["config"]["precision"].startswith(p))
    # Megatron-Bridge's FP8 presets (src/megatron/bridge/training/mixed_precision.py @5776a6d9:
    # bf16_with_fp8_current_scaling_mixed, bf16_with_mxfp8_mixed) set fp8_param_gather = True
    # (the bf16 gradients of the performance scripts: fidelity.moe_case_settings)
    job = {**job, "precision": recipe, "fp8_param_gather": True}
    # the Llama recipes overlap TP communication with the GEMMs by TransformerEngine's userbuffers wherever tp > 1
    # (scripts/performance/configs/llama/llama3_llm_pretrain.py and llama31_llm_pretrain.py @5776a6d9: a
    # tp_comm_overlap_cfg of userbuffers per GPU and shape)
    if case["model"]["name_in_source"] in DENSE_ZOO and case["config"]["tp"] > 1:
        job["tp_comm_overlap"] = True
    if case["config"]["ep"] == 1:
        knobs.pop("ep")
    if case["config"]["pp"] > 1 and not case["config"].get("virtual_stages"):
        knobs.pop("vpp", None)
    t0 = time.perf_counter()
    plan = api.plan(api.load_job(model, **job), api.Knobs(**knobs), top_k=1, solver="uniform")
    seconds = time.perf_counter() - t0
    published = case["published"]["tokens_per_s_per_gpu"]
    predicted = plan.best.estimate.tokens_per_s / job["gpus"]
    c = plan.best.config
    return {"id": case["id"], "published": published, "predicted": predicted, "error": predicted / published - 1,
            "moe": case["config"]["ep"] > 1 or "MoE" in case["case_type"], "seconds": seconds,
            "step_s": plan.best.estimate.step_time_s, "mem_gib": plan.best.estimate.memory.total / 2**30,
            "config": f"rc {c.recompute} offload {'on' if c.optimizer_offload else 'off'}",
            "command": fidelity.plan_command(model, job, knobs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, default=fidelity.DEFAULT_CASES)
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the rows and the summary to OUT")
    args = parser.parse_args()
    rows = []
    for case in fp8_cases(args.cases):
        if case["hardware"]["system"] not in fidelity.MOE_CLUSTERS:
            continue
        try:
            rows.append(run(case))
        except Exception as err:        # a case meshplan cannot plan yet is a row that says why, not a crash
            rows.append({"id": case["id"], "error": None, "why": f"{type(err).__name__}: {err}"})
    print(f"{'case':<46} {'published':>9} {'predicted':>9} {'error':>7}  {'step s':>7} {'GiB':>6}")
    for r in rows:
        if r["error"] is None:
            print(f"{r['id']:<46} not planned: {r['why']}")
            continue
        print(f"{r['id']:<46} {r['published']:>9.0f} {r['predicted']:>9.0f} {100 * r['error']:>+6.1f}%  "
              f"{r['step_s']:>7.2f} {r['mem_gib']:>6.1f}  {r['config']}\n    {r['command']}")
    summary = {}
    for label, sub in (("dense", [r for r in rows if r["error"] is not None and not r["moe"]]),
                       ("moe", [r for r in rows if r["error"] is not None and r["moe"]])):
        if sub:
            errs = [abs(r["error"]) for r in sub]
            summary[label] = {"cases": len(sub), "mean_abs": statistics.mean(errs), "max_abs": max(errs)}
            print(f"{label}: {len(sub)} cases, mean |error| {100 * statistics.mean(errs):.1f}%, "
                  f"max {100 * max(errs):.1f}%")
    if args.json:
        args.json.write_text(json.dumps({"measured_by": "python benchmarks/fidelity_fp8.py --json "
                                         "benchmarks/results/fidelity_fp8.json", "summary": summary, "rows": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
