"""`meshplan profile`: measure this machine and write a cluster profile TOML. The flags become a call of
the profiler's values API (executor/profile: ``profile_machine``, ``rederive``), imported when the command
runs: importing this file does not import torch."""
from __future__ import annotations

import argparse
import json
import sys

from .common import add_debug, add_example_input_arg

EPILOG_PROFILE = """\
examples:
  meshplan profile --nproc 2                            # this machine: compute, memory, gloo/NCCL collectives
  meshplan profile --nproc 2 --out profiles/measured/myhost.toml --ops model.py:build
  meshplan plan --model model.py:build --cluster profiles/measured/myhost.toml --gpus 2

Writes a cluster profile TOML that --cluster accepts; every number in it is
measured by this command. With --ops MODEL it also times each traced operator
here and writes NAME.ops.json beside the TOML; `meshplan plan --cluster NAME.toml`
then uses those times for the ops it finds there (see planner/trace/measured.py).
"""




def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine and write a cluster profile TOML",
                       description="Measure this machine (GEMM, attention, memory bandwidth, collectives over "
                                   "torch.distributed) and write a cluster profile TOML.",
                       epilog=EPILOG_PROFILE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes for the collectives (default: the GPUs, or 2 on a CPU)")
    p.add_argument("--out", metavar="PATH.toml", help="where to write the profile (default ./<hostname>.toml)")
    p.add_argument("--name", help="profile name (default: measured-<hostname>)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="what to measure (default: cuda when present)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per process, as torchrun runs them (default 1)")
    p.add_argument("--ops", metavar="MODEL", help="also time each traced operator of MODEL here")
    add_example_input_arg(p)
    p.add_argument("--quick", action="store_true", help="fewer shapes and message sizes (seconds, not minutes)")
    p.add_argument("--json", action="store_true", help="also print the measurements as JSON")
    p.add_argument("--from", dest="from_json", metavar="NAME.kernels.json",
                   help="measure nothing: derive the profile again from the raw measurements an earlier "
                        "`meshplan profile` wrote (after meshplan's derivations improved)")
    add_debug(p)


def run(args) -> int:
    from executor.profile import profile_machine, rederive
    if args.from_json:
        out = rederive(args.from_json, out=args.out, name=args.name)
        sys.stdout.write(f"wrote {out} (derived from {args.from_json})\n")
        return 0
    result = profile_machine(device=args.device, nproc=args.nproc, threads=args.threads, quick=args.quick,
                             out=args.out, name=args.name, ops_model=args.ops, example_input=args.example_input,
                             progress=lambda line: sys.stdout.write(line + "\n"))
    if args.json:
        json.dump({"device": result.device, "collectives": result.collectives}, sys.stdout)
        sys.stdout.write("\n")
    return 0
