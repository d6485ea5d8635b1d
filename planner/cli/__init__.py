"""`meshplan`: plan, explain and run hybrid-parallel training from the command line.

One module per command, each with ``add_parser(subparsers)`` and ``run(args) -> exit code``; each turns
its flags into values and calls the library (``planner.api``; for `meshplan run` and `meshplan profile`,
the executor). This package is the only place that handles parsed command lines. Every bad input ends
in one line on stderr and exit code 2 (3 when no plan fits); --debug shows the traceback.
"""
from __future__ import annotations

import argparse
import sys

import json

from ..errors import UserError
from . import catalog, compare, gallery, plan, profile, run, trace, whatif
from .common import BadFlags, Parser

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
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except BadFlags as e:
        sys.stderr.write(f"{e.prog}: error: {e}\n")
        if "--json" in argv:
            json_error(str(e), 2)
        return 2
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command].run(args)
    except UserError as e:
        if args.debug:
            raise
        sys.stderr.write(f"meshplan {args.command}: error: {e}\n")
        if e.trailer:
            sys.stderr.write(e.trailer)
        if getattr(args, "json", False):
            json_error(e.detail, e.exit_code, source=e.source, field=e.field, **(
                {"no_fit": e.answer} if getattr(e, "answer", None) else {}))
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("meshplan: interrupted\n")
        return 130


def json_error(message: str, exit_code: int, **fields) -> None:
    """What --json prints on stdout when a command ends in an error: one JSON object, whatever the exit."""
    json.dump({"error": message, "exit_code": exit_code, **fields}, sys.stdout)
    sys.stdout.write("\n")
