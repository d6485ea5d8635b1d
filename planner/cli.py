"""`meshplan`: plan, explain and run hybrid-parallel training.

Every bad input ends in one line on stderr and exit code 2 (3 when no plan
fits); --debug shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from . import schedules
from .argtypes import positive_int, recompute
from .recompute import DESCRIPTIONS, EVERY_K_DESCRIPTION
from .errors import UserError

DEFAULT_MODEL = "llama3-8b"
DEFAULT_CLUSTER = "h100-80g"

EPILOG_PLAN = """\
examples:
  meshplan plan                                   # Llama-3 8B on one DGX H100 node, everything searched
  meshplan plan --model gpt3-175b --cluster a100-80g --gpus 1024 --global-batch 1536
  meshplan plan --model llama3-70b --gpus 64 --tp 8 --pp 4      # fix some knobs, search the rest
  meshplan plan --model path/to/config.json --cluster my-cluster.toml --gpus 16 --json
  meshplan plan --model gpt-1.7b --cluster a100-80g --gpus 32 --dp 32 --tp 1 --pp 1 \\
                --micro-batch 4 --recompute full --zero 0      # fully fixed: just estimate it

Knobs you leave out are searched: dp, tp, pp, cp (data, tensor, pipeline, context
parallel degrees), --zero, --micro-batch, --vpp, --schedule, --recompute,
--sequence-parallel, --optimizer-offload. A fully fixed plan that does not fit is still
reported, with "fits": false. Exit codes: 0 ok, 2 bad input, 3 nothing fits.

recompute policies (--recompute; the search chooses one per block among those the runtime runs):
""" + "".join(f"  {name:<10} {text}\n" for name, text in DESCRIPTIONS.items()) + f"  {'every-K':<10} {EVERY_K_DESCRIPTION}\n" \
    + "\npipeline schedules (--schedule; the search chooses among those the runtime runs):\n" \
    + "".join(f"  {s.name:<18} {s.description} ({s.source})\n" for s in schedules.SCHEDULES.values())


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag on one line, exit code 2."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)




def _on_off(text: str) -> bool:
    if text.lower() in ("on", "true", "yes", "1"):
        return True
    if text.lower() in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"zoo name (see `meshplan models`), a Hugging Face config.json, or an nn.Module to trace: "
                        f"path/to/file.py:factory or package.module:factory (default {DEFAULT_MODEL})")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER,
                   help=f"built-in profile (see `meshplan clusters`) or a profile TOML (default {DEFAULT_CLUSTER})")
    p.add_argument("--gpus", type=positive_int, help="number of GPUs (default: one node of the cluster)")
    p.add_argument("--global-batch", type=positive_int,
                   help="sequences per optimizer step (default: about 1M tokens, a multiple of the GPUs)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the model's)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"),
                   help="compute dtype, mixed precision with fp32 master weights (default: bf16, or what the "
                        "device supports)")
    p.add_argument("--framework", choices=("torch", "megatron", "deepspeed"), default="torch",
                   help="whose memory layout is modelled: torch = meshplan's executor (FSDP2/DDP), megatron = fp32 "
                        "main grads (18 B/param), deepspeed = the ZeRO paper's 2+2+12 B/param (default torch)")
    p.add_argument("--attention", choices=("flash", "unfused"), default="flash",
                   help="attention kernels: fused (FlashAttention) or materialised scores (default flash)")
    p.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="model a runtime that reduces gradients after backward instead of overlapping")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="model TP collectives overlapped with GEMMs (TransformerEngine userbuffers)")


def _add_knob_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("knobs (each one given is fixed; the rest are searched)")
    g.add_argument("--dp", type=positive_int, help="data-parallel degree")
    g.add_argument("--tp", type=positive_int, help="tensor-parallel degree (divides the attention heads)")
    g.add_argument("--pp", type=positive_int, help="pipeline stages")
    g.add_argument("--cp", type=positive_int, help="context-parallel degree (splits the sequence)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage: 1 optimizer, 2 +grads, 3 +params")
    g.add_argument("--micro-batch", type=positive_int, help="sequences per micro-batch per replica")
    g.add_argument("--vpp", type=positive_int, help="virtual stages per pipeline rank (a schedule with virtual "
                                                    f"stages: {', '.join(schedules.virtual_names())})")
    g.add_argument("--schedule", choices=schedules.NAMES, help="pipeline schedule (one line on each below)")
    g.add_argument("--recompute", type=recompute, metavar="POLICY",
                   help="activation recompute policy of every block: none, selective, op, full, activation-offload, or every-K "
                        "(one line on each below); left out, the search picks one per block")
    g.add_argument("--sequence-parallel", type=_on_off, metavar="on|off", help="sequence parallelism (tp >= 2)")
    g.add_argument("--optimizer-offload", type=_on_off, metavar="on|off",
                   help="optimizer states (and fp32 master weights) in host memory: ZeRO-Offload, ZeRO >= 1")
    g.add_argument("--offload", choices=("none", "optimizer"), help=argparse.SUPPRESS)   # the earlier name


def build_parser(with_run: bool = False) -> argparse.ArgumentParser:
    parser = _Parser(prog="meshplan", description="Plan, explain and run hybrid-parallel PyTorch training.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("plan", help="find the fastest plan that fits (or estimate a fixed one)",
                       description="Find the fastest hybrid-parallel plan that fits in memory, or estimate a "
                                   "fixed one.", epilog=EPILOG_PLAN,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(p)
    _add_knob_args(p)
    p.add_argument("--top-k", type=positive_int, default=5, help="runners-up to keep (default 5)")
    p.add_argument("--solver", choices=("cbc", "highs"), default=None,
                   help="ILP solver for stage sizes, per-layer recompute, ZeRO and optimizer offload (default: highs where "
                        "highspy is installed, as it is with meshplan: it solves in-process; else cbc, which "
                        "ships with PuLP). Both find the same optimum")
    p.add_argument("--exhaustive", action="store_true",
                   help="enumerate every stage split and recompute assignment instead of the ILP (the "
                        "reference solver: exact and slow, for small models)")
    p.add_argument("--uniform-stages", action="store_true",
                   help="only balanced stages with one recompute policy for every layer (as Megatron-LM runs)")
    p.add_argument("--time-limit", type=float, default=20.0, metavar="SECONDS",
                   help="time limit of each stage ILP (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", metavar="PLAN.json", help="also write plan.json (the executor's input)")
    p.add_argument("--report", metavar="DIR", help="also write a strategy report into DIR: plan.json, report.md, "
                                                   "report.html, plots (PNG, SVG) and exports for other frameworks")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    from .trace import cli as trace_cli          # meshplan trace / profile (imports no torch)
    trace_cli.add_example_input_arg(p)
    trace_cli.add_parsers(sub)
    m = sub.add_parser("models", help="list the model zoo with parameter counts")
    m.add_argument("--json", action="store_true")
    m.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    from .whatif import add_whatif_parser
    add_whatif_parser(sub, _add_model_args, _add_knob_args, positive_int)
    from .compare_cli import add_compare_parser
    add_compare_parser(sub, positive_int, DEFAULT_CLUSTER)
    c = sub.add_parser("clusters", help="list the built-in cluster profiles")
    c.add_argument("--json", action="store_true")
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if with_run:    # `meshplan run` lives in executor/ (torch); imported only for that command
        from executor.cli import add_run_parser
        add_run_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(with_run=True)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "plan":
            from .commands import plan_command
            return plan_command(args)
        if args.command == "whatif":
            from .whatif import whatif_command
            return whatif_command(args)
        if args.command == "compare":
            from .compare_cli import compare_command
            return compare_command(args)
        if args.command == "models":
            from .commands import models_command
            return models_command(args)
        if args.command == "clusters":
            from .commands import clusters_command
            return clusters_command(args)
        if args.command in ("trace", "profile"):
            from .trace.cli import run
            return run(args)
        if args.command == "run":
            from executor.cli import run_command
            return run_command(args)
    except UserError as e:
        if args.debug:
            raise
        sys.stderr.write(f"meshplan {args.command}: error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("meshplan: interrupted\n")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
