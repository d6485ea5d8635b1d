"""Summarise every validation of the cost model into profiles/validation/accuracy.toml: the evidence
behind the error band each plan prints (planner/accuracy.py).

    python benchmarks/accuracy.py            # print what the evidence says
    python benchmarks/accuracy.py --write    # and write profiles/validation/accuracy.toml

It reads only committed results, so the file can be checked against them anywhere
(tests/test_accuracy.py):

- benchmarks/results/fidelity.json: published Megatron-LM runs through `meshplan plan`
  (python benchmarks/fidelity.py --json benchmarks/results/fidelity.json);
- benchmarks/results/gpu_validate.json and gpu_holdout_validate.json: meshplan's executor
  on one H100, step time and peak memory (python benchmarks/gpu_validate.py [--set holdout]);
  gpu_round2_validate_host_insample.json and gpu_holdout2_validate.json: on one H200 (round 2);
  gpu_round3_validate.json: round 2's holdout plans again on one H100 (round 3);
- benchmarks/results/closed_loop.json, when it exists: meshplan's executor on this kind of
  CPU machine (python benchmarks/closed_loop.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "profiles" / "validation" / "accuracy.toml"
sys.path.insert(0, str(ROOT))
from planner.accuracy import written_by  # noqa: E402
from planner.cluster import load_cluster  # noqa: E402
from planner.runtimes import priced_as  # noqa: E402


def _band(errors: list[float]) -> dict:
    values = [abs(e) for e in errors]
    return {"cases": len(values), "median_abs": round(statistics.median(values), 4),
            "mean_abs": round(statistics.mean(values), 4), "max_abs": round(max(values), 4)}


def _profiled(cluster: str) -> bool:
    """Whether the profile a validation predicted from was written by `meshplan profile`."""
    path = ROOT / cluster
    return path.is_file() and written_by(load_cluster(str(path), 1), "meshplan profile")


def evidence(results: Path = RESULTS) -> list[dict]:
    """One entry per body of validation found under ``results``, most specific first."""
    out = []
    closed = results / "closed_loop.json"
    if closed.exists():
        doc = json.loads(closed.read_text())
        rows = doc["rows"]
        out.append({"name": "closed-loop", "device_kind": "cpu", "frameworks": ["torch"],
                    "what": f"{len(rows)} plans run by meshplan's executor on cpu-gloo, {doc['processes']} "
                            "processes, against this machine's measured profile",
                    "command": doc["measured_by"],
                    # what the band assumes of a plan: the machine profiled by `meshplan profile`, as many processes
                    "profiled_by": "meshplan profile", "processes": doc["processes"],
                    "step_time": _band([r["step_error"] for r in rows]),
                    "memory": _band([r["peak_error"] for r in rows])})
    gpu_rows, gpus, profiles = [], set(), set()
    # round 1 (H100) and round 2 (H200: offload, op and every-K recompute, FSDP with micro-batches, MoE), round 2
    # compared with the cost model as it now is (host bound included: in-sample) and its holdout (out of sample),
    # round 3 (H100: round 2's host-bound holdout plans)
    for name in ("gpu_validate.json", "gpu_holdout_validate.json", "gpu_round2_validate_host_insample.json",
                 "gpu_holdout2_validate.json", "gpu_round3_validate.json"):
        path = results / name
        if path.exists():
            doc = json.loads(path.read_text())
            gpu_rows += doc["rows"]
            gpus.add(next(g for g in ("H200", "H100", "A100", "L40S", "V100") if g in doc["device"]))
            profiles.add(doc.get("cluster", ""))
    if gpu_rows:
        out.append({"name": "one-gpu", "device_kind": "cuda", "frameworks": ["torch"],
                    "what": f"{len(gpu_rows)} single-GPU plans run by meshplan's executor on an H100 SXM "
                            "(12 calibration runs, 6 predicted before they ran, and 6 host-bound plans of round 3) "
                            "and an H200 (13 with offload, op and every-K recompute, FSDP micro-batches and experts, "
                            "and 9 predicted before they ran)",
                    "command": "python benchmarks/gpu_validate.py; python benchmarks/gpu_validate.py --set holdout; "
                               "python benchmarks/gpu_validate.py --raw benchmarks/results/gpu_round2_runs.json "
                               "--cluster profiles/measured/h200.toml; same with gpu_holdout2_runs.json; "
                               "python benchmarks/gpu_validate.py --set holdout2 --raw "
                               "benchmarks/results/gpu_round3_h100_runs.json",
                    "step_time": _band([r["step_error"] for r in gpu_rows]),
                    "memory": _band([r["peak_error"] for r in gpu_rows]),
                    "single_device": True, "gpu": "/".join(sorted(gpus)),
                    # predicted from a `meshplan profile` of that GPU (profiles/measured/), not a datasheet profile
                    **({"profiled_by": "meshplan profile"} if all(_profiled(p) for p in profiles) else {})})
    fidelity = results / "fidelity.json"
    if fidelity.exists():
        # the Megatron-LM runs, and apart from them the DeepSpeed ZeRO-3 runs of Narayanan et al. 2021 Table 2,
        # which DeepSpeed of 2021 ran (runtime deepspeed-2021)
        all_rows = json.loads(fidelity.read_text())["rows"]
        rows = [r for r in all_rows if priced_as(r.get("runtime", "megatron")) == "megatron"]   # megatron-2021 too
        zero3 = [r for r in all_rows if r.get("runtime") == "deepspeed-2021"]
        out.append({"name": "published", "device_kind": "cuda", "frameworks": ["megatron", "deepspeed", "torch"],
                    "what": f"{len(rows)} published Megatron-LM runs (Narayanan et al. 2021 Tables 1 and 2, "
                            "Megatron-Core r0.8 on H100), throughput",
                    "command": "python benchmarks/fidelity.py",
                    # throughput error e = predicted / published - 1; the step time's is 1 / (1 + e) - 1
                    "step_time": _band([1 / (1 + r["error"]) - 1 for r in rows])})
        # the Megatron-Bridge MoE runs, BF16 (fidelity.py) and FP8 (fidelity_fp8.py): said beside the band of a plan
        # that routes experts (planner/accuracy.py), not its band
        moe = [r for r in json.loads(fidelity.read_text())["summary"].get("moe", {}).get("rows", [])]
        fp8 = results / "fidelity_fp8.json"
        if fp8.exists():
            moe += [r for r in json.loads(fp8.read_text())["rows"] if r.get("moe") and r.get("error") is not None]
        if moe:
            out.append({"name": "published-moe", "device_kind": "cuda", "frameworks": ["megatron"], "moe": True,
                        "what": f"{len(moe)} published Megatron-Bridge runs of mixtures of experts (H100 and B200, "
                                "BF16 and FP8), throughput",
                        "command": "python benchmarks/fidelity.py; python benchmarks/fidelity_fp8.py",
                        "step_time": _band([1 / (1 + r["error"]) - 1 for r in moe])})
        if zero3:
            out.append({"name": "published-zero3", "device_kind": "cuda", "frameworks": ["deepspeed-2021"],
                        "what": f"{len(zero3)} published DeepSpeed ZeRO-3 runs (Narayanan et al. 2021 Table 2, "
                                "GPT-3 175B and 530B on 384 to 2240 A100), throughput",
                        "command": "python benchmarks/fidelity.py",
                        "step_time": _band([1 / (1 + r["error"]) - 1 for r in zero3])})
    return out


def to_toml(entries: list[dict]) -> str:
    lines = ["# The validation behind the error band each plan prints (planner/accuracy.py): the",
             "# relative error of the cost model against runs, per body of evidence. Written by",
             "# `python benchmarks/accuracy.py --write` from benchmarks/results/ (do not edit).",
             'source = "measured: the committed results in benchmarks/results/, each entry\'s command"', ""]
    for e in entries:
        lines.append("[[evidence]]")
        for key in ("name", "device_kind", "what", "command"):
            lines.append(f"{key} = {json.dumps(e[key])}")
        lines.append(f"frameworks = {json.dumps(e['frameworks'])}")
        if e.get("single_device"):
            lines.append("single_device = true")
        if e.get("moe"):
            lines.append("moe = true")
        if e.get("gpu"):
            lines.append(f"gpu = {json.dumps(e['gpu'])}")
        if e.get("profiled_by"):
            lines.append(f"profiled_by = {json.dumps(e['profiled_by'])}")
        if e.get("processes"):
            lines.append(f"processes = {e['processes']}")
        for part in ("step_time", "memory"):
            if part in e:
                b = e[part]
                lines.append(f"{part} = {{ cases = {b['cases']}, median_abs = {b['median_abs']}, "
                             f"mean_abs = {b['mean_abs']}, max_abs = {b['max_abs']} }}")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    args = parser.parse_args()
    text = to_toml(evidence())
    print(text)
    if args.write:
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
