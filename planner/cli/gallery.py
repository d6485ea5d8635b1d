"""`meshplan gallery`: regenerate the reports/ gallery, the strategy reports of the reference scenarios
(planner/report/gallery.py)."""
from __future__ import annotations

import sys
from pathlib import Path

from ..report.gallery import ROOT, SCENARIOS, regenerate
from .common import add_debug


def add_parser(sub) -> None:
    p = sub.add_parser("gallery", help="regenerate the reports/ gallery of reference scenarios",
                       description="Plan each reference scenario and write its report (plan.json, report.md, "
                                   "report.html, plots, exports, and the layout its publication used beside it) "
                                   "under --out, with an index README.md.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"only these scenarios (then no index): {', '.join(s.name for s in SCENARIOS)}")
    p.add_argument("--out", type=Path, default=ROOT / "reports", help="gallery folder (default: the checkout's reports/)")
    add_debug(p)


def run(args) -> int:
    from ..errors import UserError
    unknown = sorted(set(args.names) - {s.name for s in SCENARIOS})
    if unknown:
        raise UserError(f"unknown scenario(s) {', '.join(unknown)}; allowed: "
                        f"{', '.join(s.name for s in SCENARIOS)}", field="NAME")
    for path in regenerate(args.out, args.names or None, progress=lambda t: sys.stderr.write(f"gallery: {t} ...\n")):
        print(path)
    return 0
