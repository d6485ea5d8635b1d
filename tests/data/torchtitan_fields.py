"""Write torchtitan_fields.json: the fields of torchtitan's config dataclasses at one commit, read from its
source with ``ast`` (torchtitan is not installable here: its Python config form is newer than its last
PyPI release). The export test checks every key meshplan writes against them.

    python tests/data/torchtitan_fields.py /path/to/torchtitan [COMMIT]
"""
import ast
import json
import subprocess
import sys
from pathlib import Path

SOURCES = {"TrainingConfig": "torchtitan/config/configs.py", "ParallelismConfig": "torchtitan/config/configs.py",
           "Trainer.Config": "torchtitan/trainer.py"}
AC = "torchtitan/distributed/activation_checkpoint.py"


def fields(tree: ast.Module, dotted: str) -> list[str]:
    names = dotted.split(".")
    body = tree.body
    for name in names:
        node = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == name)
        body = node.body
    return [n.target.id for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def main(repo: str, commit: str = "HEAD") -> None:
    def show(path: str) -> ast.Module:
        text = subprocess.run(["git", "-C", repo, "show", f"{commit}:{path}"], check=True, capture_output=True,
                              text=True).stdout
        return ast.parse(text)

    sha = subprocess.run(["git", "-C", repo, "rev-parse", commit], check=True, capture_output=True,
                         text=True).stdout.strip()
    out = {"commit": sha, "repository": "https://github.com/pytorch/torchtitan", "sources": SOURCES,
           "classes": {name: fields(show(path), name) for name, path in SOURCES.items()}}
    ac = show(AC)
    out["activation_checkpoint_classes"] = sorted(n.name for n in ac.body if isinstance(n, ast.ClassDef)
                                                  and any(_name(b) == "ActivationCheckpointing" for b in n.bases))
    Path(__file__).with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")


def _name(node) -> str:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


if __name__ == "__main__":
    main(*sys.argv[1:])
