"""`meshplan`: plan, explain and run hybrid-parallel training from the command line.

One module per command, each with ``add_parser(subparsers)`` and ``run(args) -> exit code``; each turns
its flags into values and calls the library (``planner.api``; for `meshplan run` and `meshplan profile`,
the executor). This package is the only place that handles parsed command lines. Every bad input ends
in one line on stderr and exit code 2 (3 when no plan fits); --debug shows the traceback.
"""
from __future__ import annotations

import argparse
import sys

from ..errors import UserError
from . import catalog, compare, gallery, plan, profile, run, trace, whatif
from .common import Parser

# command -> the module that parses and runs it, in the order `meshplan --help` lists them
COMMANDS = {"plan": plan, "whatif": whatif, "compare": compare, "run": run, "trace": trace, "profile": profile,
            "models": catalog, "clusters": catalog, "gallery": gallery}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="meshplan", description="Plan, explain and run hybrid-parallel PyTorch training.",
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in dict.fromkeys(COMMANDS.values()):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command].run(args)
    except UserError as e:
        if args.debug:
            raise
        sys.stderr.write(f"meshplan {args.command}: error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("meshplan: interrupted\n")
        return 130
