"""The published FP8 runs through `meshplan plan`: Megatron-Bridge's performance summary (``MBRIDGE2511-*`` in
../shared/validation/public_cases.json: Llama 3 and MoE models on DGX H100 and DGX B200 in FP8 current scaling
and MXFP8), each with its published degrees, tokens per second per GPU predicted against the published.

FP8-CS is TransformerEngine's per-tensor current scaling (``--precision fp8-tensorwise``), FP8-MX its MXFP8
(``--precision mxfp8``), both under ``--framework megatron`` with ``--fp8-param-gather`` as Megatron-Bridge's FP8
presets set it. Every published degree, virtual stages and the
micro-batch are fixed, the distributed optimizer (ZeRO-1) assumed as for the BF16 rows (benchmarks/fidelity.py
``moe_case_settings``), recompute and offload searched as the source does not publish them. The MoE rows are also
checked against the same runs with token drop, from the summary's 25.09 table (``TOKEN_DROP_2509``): static shapes,
no host read per layer, so that comparison isolates the device side's error.

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


HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("fidelity", HERE / "fidelity.py")
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)

# the published precision (config.precision opens with it) as a --precision recipe
RECIPE = {"FP8 current scaling": "fp8-tensorwise", "MXFP8": "mxfp8"}
DENSE_ZOO = {"LLAMA3_8B": "llama3-8b", "LLAMA3_70B": "llama3-70b", "LLAMA3.1_405B": "llama3-405b"}


def recipe_of(case: dict) -> str:
    """The --precision recipe of a case's published precision."""
    return next(r for p, r in RECIPE.items() if case["config"]["precision"].startswith(p))


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


# The same MoE runs as the summary's 25.09 table ran them (docs/performance-summary.md @5776a6d90, '25.09 NeMo
# Container', DGX-B200 and DGX-H100 rows 'Qwen3_30B_a3B (tokendrop)' and 'Qwen3_235B_a22B (tokendrop)'): the same GPUs,
# batch, micro-batch and degrees as the 25.11 rows, FP8 current scaling outside the parentheses and MXFP8 inside (the
# table's footnote), but with token drop: Megatron-Bridge 25.09's performance script applies moe_expert_capacity_factor
# 1.0 with moe_pad_expert_input_to_capacity (scripts/performance/run_script.py, src/megatron/bridge/training/utils/
# moe_token_drop.py @fa0315ae2), so every expert runs a fixed number of rows, which is the balanced routing meshplan
# prices, and the shapes never change: no host read of the token counts (Megatron-LM's token_dispatcher.py skips
# _maybe_dtoh_and_synchronize when drop_and_pad is set), where the dropless 25.11 runs stop the host once per MoE
# layer's forward before the dispatch all-to-all (token_dispatcher.py, Megatron-LM 92c8482e, the 25.11 pin). Against
# these the prediction's error is the device side's; the dropless rows' further gap is the host's, not priced. The
# 25.09 script overlaps no Qwen3 all-to-all (scripts/performance/run_script.py @fa0315ae2 sets
# overlap_moe_expert_parallel_comm for DeepSeek-V3 only), so these are planned without --ep-comm-overlap.
TOKEN_DROP_2509 = {     # 25.11 case: (25.09 tokens/s per GPU, the recipe that figure ran)
    "MBRIDGE2511-B200-QWEN3_30B_A3B-8gpu-FP8MX": (18066, "fp8-tensorwise"),     # no MXFP8 figure in that row
    "MBRIDGE2511-B200-QWEN3_235B_A22B-64gpu-FP8MX": (4275, "mxfp8"),
    "MBRIDGE2511-H100-QWEN3_30B_A3B-16gpu-FP8CS": (10494, "fp8-tensorwise"),
    "MBRIDGE2511-H100-QWEN3_235B_A22B-256gpu-FP8CS": (1204, "fp8-tensorwise"),
}


# Where the summary's row and the performance script of its release disagree on a knob (as fidelity.AS_CONFIGURED):
# Megatron-Bridge tag v0.2.0 (2025-11-26; the same values through v0.2.2 and at 5776a6d90),
# scripts/performance/configs/qwen3/workload_base_configs.py. Printed beside the rows, which stay checked with the
# summary's knobs.
_QWEN3_SCRIPT = "Megatron-Bridge v0.2.0 scripts/performance/configs/qwen3/workload_base_configs.py: "
AS_CONFIGURED = {
    # pp 2, vpp 12 and the base's micro_batch_size 1 where the row says VP 24 and MBS 2 (its GA 32 is MBS 2's)
    "MBRIDGE2511-H100-QWEN3_30B_A3B-16gpu-FP8CS": (
        {"micro_batch": 1, "vpp": 12}, _QWEN3_SCRIPT + "QWEN3_30B_A3B_H100_FP8_CS_BASE_CONFIG virtual_pipeline_model_"
                                       "parallel_size=12, micro_batch_size=1 (the base's)"),
    # vpp 4 where the row says VP 2 (FP8_MX is FP8_CS's preset)
    "MBRIDGE2511-B200-QWEN3_235B_A22B-64gpu-FP8MX": (
        {"vpp": 4}, _QWEN3_SCRIPT + "QWEN3_235B_A22B_B200_FP8_CS_BASE_CONFIG virtual_pipeline_model_parallel_size=4"),
}


def run(case: dict, recipe: str | None = None, ep_comm_overlap: bool | None = None,
        override: dict | None = None) -> dict:
    """The case planned as its run was configured; ``recipe``, ``ep_comm_overlap``: instead of its own; ``override``
    replaces fixed knobs (``AS_CONFIGURED``)."""
    model = case_model(case)
    job, knobs = fidelity.moe_case_settings(case)
    knobs = {**knobs, **(override or {})}
    if ep_comm_overlap is not None:
        job["ep_comm_overlap"] = ep_comm_overlap
    recipe = recipe or recipe_of(case)
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
    published = case["published"]["tokens_per_s_per_gpu"]
    command = fidelity.plan_command(model, job, knobs)
    out = {"id": case["id"], "published": published, "moe": case["config"]["ep"] > 1 or "MoE" in case["case_type"],
           "command": command}
    est, c, note = fidelity.plan_or_closest(model, job, knobs)
    fits = f", {note}" if note else ""
    predicted = est.tokens_per_s / job["gpus"]
    return {**out, "predicted": predicted, "error": predicted / published - 1, "seconds": time.perf_counter() - t0,
            "step_s": est.step_time_s, "mem_gib": est.memory.total / 2**30,
            "config": f"rc {c.recompute} offload {'on' if c.optimizer_offload else 'off'}{fits}"}


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
    scripted = []
    for case in fp8_cases(args.cases):
        if case["id"] in AS_CONFIGURED:
            override, where = AS_CONFIGURED[case["id"]]
            r = run(case, override=override)
            scripted.append({**r, "where": where})
    if scripted:
        print("\nas the performance script of the summary's release sets them (the rows above keep the summary's knobs)")
        for r in scripted:
            print(f"  {r['id']:<46} {r['published']:>6} {r['predicted']:>7.0f} {100 * r['error']:>+6.1f}%  "
                  f"step {r['step_s']:.2f} s, {r['config']}\n    {r['where']}\n    {r['command']}")
    dropped = []
    for case in fp8_cases(args.cases):
        if case["id"] in TOKEN_DROP_2509:
            published, recipe = TOKEN_DROP_2509[case["id"]]
            r = run(case, recipe, ep_comm_overlap=False)
            dropped.append({"id": case["id"], "recipe": recipe, "published_token_drop": published,
                            "predicted": r["predicted"], "error": r["predicted"] / published - 1,
                            "dropless_over_token_drop": case["published"]["tokens_per_s_per_gpu"] / published
                            if recipe == recipe_of(case) else None})
    if dropped:
        print("\nthe same MoE runs with token drop (Megatron-Bridge's 25.09 summary: capacity 1.0, padded; static shapes,"
              "\nno host read per layer): the device side's error; the 25.11 dropless row over it where the recipe is the same")
        for d in dropped:
            ratio = (f"  dropless / token drop {d['dropless_over_token_drop']:.2f}"
                     if d["dropless_over_token_drop"] is not None else "")
            print(f"  {d['id']:<46} {d['recipe']:<15} {d['published_token_drop']:>6} {d['predicted']:>7.0f} "
                  f"{100 * d['error']:>+6.1f}%{ratio}")
    if args.json:
        args.json.write_text(json.dumps({"measured_by": "python benchmarks/fidelity_fp8.py --json "
                                         "benchmarks/results/fidelity_fp8.json", "summary": summary, "rows": rows,
                                         "token_drop_2509": dropped, "as_configured": scripted}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
