"""`meshplan compare`: your own configuration estimated, the same job searched, both side by side (a table,
or one JSON object), optionally a report.

    meshplan compare --model gpt3-175b --cluster a100-80g --gpus 1024 --baseline megatron_args.txt
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from ..finetune import describe as describe_mode
from .. import api
from ..api import DEFAULT_CLUSTER
from ..baseline import FORMAT_NAMES
from ..compare import (Comparison, changes, comparison_rows, counterpart, does_not_fit_by, file_edits, gain,
                       gain_line, switch_costs, verdict_line, word)
from ..errors import UserError
from .common import add_debug, positive_int, token_count

EPILOG = """\
examples:
  meshplan compare --model gpt3-175b --cluster a100-80g --gpus 1024 --baseline train_gpt3_175b.sh
  meshplan compare --cluster h100-80g --gpus 8 --global-batch 128 --baseline llama3_8b.toml
  meshplan compare --model llama3-8b --gpus 64 --baseline ds_config.json --tp 2 --pp 4   # Megatron-DeepSpeed
  meshplan compare --gpus 16 --baseline plan.json --json
  meshplan compare --gpus 256 --baseline llama3_70b.toml --report compare/ --tokens 15T

The baseline is told by its file: a .py is a torchtitan config module in its current Python
form (FILE.py:FUNCTION picks the function returning Trainer.Config where it has several; read,
never run: token-based batch keys as torchtitan counts them); a .toml is a torchtitan job config
of v0.2.2 and earlier ([parallelism], [training], [activation_checkpoint], [model] name/flavor);
a .json is meshplan's plan.json
or a DeepSpeed config (degrees from --tp/--pp); anything else is Megatron-LM arguments, a
file of flags or the launch script itself (--tensor-model-parallel-size ..., and the
architecture flags when no --model is given). The runtime, precision, sequence length and
global batch are the file's; the search uses the same. Flags meshplan does not model are
listed as ignored. Exit codes: 0 ok, 2 bad input (one line naming the file and the flag),
3 nothing fits.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="set your own Megatron-LM / DeepSpeed / torchtitan / plan.json configuration "
                                       "beside the best plan", epilog=EPILOG,
                       description="Estimate your configuration, search the best plan for the same job, and show "
                                   "both side by side: step time and its parts, throughput, memory, what changes, "
                                   "what it gains and what the switch costs.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, metavar="FILE",
                   help="your configuration: Megatron-LM arguments or launch script, a DeepSpeed JSON, a torchtitan "
                        "Python config (FILE.py or FILE.py:FUNCTION) or TOML, or a plan.json")
    p.add_argument("--model", help="zoo name or Hugging Face config.json (default: the model the file describes)")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER,
                   help=f"built-in profile or a profile TOML (default {DEFAULT_CLUSTER})")
    p.add_argument("--gpus", type=positive_int, help="number of GPUs: the world size (default: one node)")
    p.add_argument("--global-batch", type=positive_int,
                   help="sequences per step, when the file does not fix it (torchtitan: default local batch x dp)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence, when the file does not set it")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel degree of a Megatron-DeepSpeed job (DeepSpeed only)")
    p.add_argument("--pp", type=positive_int, help="pipeline stages of a Megatron-DeepSpeed job (DeepSpeed only)")
    p.add_argument("--ep", type=positive_int, help="expert-parallel degree of a DeepSpeed-MoE job: the ep_size its "
                                                   "MoE layers are built with (DeepSpeed only)")
    p.add_argument("--adapter-config", metavar="FILE",
                   help="a PEFT adapter_config.json the job trains with (LoRA: its r and target_modules); "
                        "default: the one beside a DeepSpeed or torchtitan baseline, if there is one")
    p.add_argument("--tokens", type=token_count, metavar="N",
                   help="token budget the gain in days and cost is priced for, e.g. 300B or 15T (default 20 per "
                        "parameter, Hoffmann et al. 2022)")
    p.add_argument("--top-k", type=positive_int, default=5, help="finalists the search ranks by simulation (default 5, "
                                                                 "as meshplan plan)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--report", metavar="DIR", help="also write the recommended plan's report into DIR, with a "
                                                   "section setting your plan against it")
    add_debug(p)


def run(args) -> int:
    t0 = time.perf_counter()
    cmp = api.compare(args.baseline, cluster=args.cluster, gpus=args.gpus, model=args.model,
                      global_batch=args.global_batch, seq_len=args.seq_len, tp=args.tp, pp=args.pp, ep=args.ep,
                      tokens=args.tokens, top_k=args.top_k, adapter=args.adapter_config)
    if args.report:
        from ..compare import plan_of
        from ..report import write_report
        try:
            write_report(plan_of(cmp), args.report, comparison=cmp)
        except OSError as e:
            raise UserError(f"cannot write the report: {e.strerror}", source=args.report) from None
    seconds = time.perf_counter() - t0
    if args.json:
        json.dump({**comparison_json(cmp), "seconds": seconds}, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_comparison(cmp) + f"\ncompared in {seconds:.2f} s\n")
    return 0


# -- JSON --------------------------------------------------------------------------------------------

def comparison_json(cmp: Comparison) -> dict:
    """{"baseline": {config, estimate, ...}, "recommended": {config, estimate}, "changes", "speedup", ...}:
    config and estimate as `meshplan plan --json` writes them."""
    b = cmp.baseline
    return {
        "baseline": {"config": cmp.mine.config.to_json(), "estimate": cmp.mine.estimate.to_json(),
                     "source": b.source, "format": b.format, "ignored": list(b.ignored), "notes": list(b.notes)},
        "recommended": {"config": cmp.recommended.config.to_json(), "estimate": cmp.recommended.estimate.to_json()},
        "changes": [asdict(c) for c in changes(cmp.graph, cmp.mine.config, cmp.recommended.config)],
        "speedup": cmp.speedup, "verdict": cmp.verdict,
        "does_not_fit": None if cmp.mine.estimate.fits else does_not_fit_by(cmp.mine.estimate),
        "gain": gain(cmp), "switch": switch_costs(cmp), "edits": file_edits(cmp),
        "model": {"name": cmp.spec.name, "params": int(cmp.graph.num_params), "spec": asdict(cmp.spec)},
        "cluster": {"name": cmp.cluster.name, "gpus": cmp.cluster.num_gpus}, "workload": asdict(cmp.workload),
    }


# -- the table ---------------------------------------------------------------------------------------

def format_comparison(cmp: Comparison) -> str:
    w, b = cmp.workload, cmp.baseline
    label, other = counterpart(cmp)
    table = comparison_rows(cmp.mine, other or cmp.mine)
    widths = [max(len(r[i]) for r in table + [("", "your plan", label, "")]) for i in range(3)]
    lines = [f"{cmp.spec.name} ({cmp.graph.num_params / 1e9:.2f}B params) on {cmp.cluster.name} x "
             f"{cmp.cluster.num_gpus} GPUs{f' ({cmp.cluster.partial_nodes})' if cmp.cluster.partial_nodes else ''}: "
             f"{w.global_batch} sequences x {w.seq_len} tokens per step, "
             f"{w.precision_name}, {w.framework} runtime"
        f"{describe_mode(w.finetune, w.lora_rank, w.lora_targets)}",
             f"baseline  {b.source} ({FORMAT_NAMES[b.format]})", "",
             f"{'':<{widths[0]}}  {'your plan':<{widths[1]}}  {label:<{widths[2]}}"]
    lines += [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in table]
    lines += ["", f"verdict   {verdict_line(cmp)}"]
    moved = changes(cmp.graph, cmp.mine.config, cmp.recommended.config)
    if moved:
        lines.append("changes   " + "; ".join(f"{c.knob} {word(c.baseline)} -> {word(c.recommended)}"
                                              for c in moved))
        lines.append(f"gain      {gain_line(cmp)}")
        lines += [f"switch    {s}" if i == 0 else f"          {s}" for i, s in enumerate(switch_costs(cmp))]
        edits = file_edits(cmp)
        if edits["remove"] or edits["add"]:
            lines.append(f"in your {FORMAT_NAMES[b.format]}:")
            lines += [f"  - {x}" for x in edits["remove"]] + [f"  + {x}" for x in edits["add"]]
        if edits["launch"]:
            lines.append(f"  on the launch line (Megatron-DeepSpeed): {', '.join(edits['launch'])}")
        lines += [f"  (cannot express: {n})" for n in edits["cannot_express"]]
    if b.ignored:
        lines.append(f"ignored   not modelled: {', '.join(b.ignored)}")
    lines += [f"note      {n}" for n in b.notes]
    return "\n".join(lines) + "\n"
