"""torchrun, ending in one line: ``python -m executor.torchrun [--debug] TORCHRUN-ARGS``.

Runs torch's own launcher (``torch.distributed.run``: its argument parser, its
elastic agent, its restarts) in this process. When the job fails after its
restarts, torchrun prints a traceback of its own; this prints one line naming
the first rank that failed and how, and exits with that rank's exit code (a
signal as 128 + its number), the ranks' own error lines already above it.
``--debug`` keeps torchrun's logging and traceback.
"""
from __future__ import annotations

import logging
import signal
import sys


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def main(argv: list[str]) -> int:
    debug = "--debug" in argv[:1]
    argv = argv[1:] if debug else argv
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    if not debug:       # the agent's progress and failure logs: the ranks' own lines and ours say it shorter
        for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        for name in list(logging.root.manager.loggerDict):
            if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        if debug:
            raise
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        sys.stderr.write(f"meshplan run: rank {rank} {_describe(code)}; the job stopped "
                         f"(after the restarts --max-restarts allowed)\n")
        return 128 - code if code < 0 else (code or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
