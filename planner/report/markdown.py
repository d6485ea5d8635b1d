"""A report Document as Markdown (report.md): figures as PNG links, files as code blocks."""
from __future__ import annotations

from .document import Document, Table


def _table(t: Table) -> list[str]:
    def row(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return [row(t.header), "| " + " | ".join("---" for _ in t.header) + " |", *(row(r) for r in t.rows), ""]


def render(doc: Document) -> str:
    lines = [f"# {doc.title}", ""]
    for s in doc.sections:
        lines += [f"## {s.title}", ""]
        for p in s.paragraphs:
            lines += [p, ""]
        if s.table:
            lines += _table(s.table)
        if s.bullets:
            lines += [f"- {b}" for b in s.bullets] + [""]
        for f in s.figures:
            lines += [f"![{f.caption}](plots/{f.name}.png)", "", f"*{f.caption}* ([SVG](plots/{f.name}.svg))", ""]
        for path, text in s.files:
            fence = "json" if path.endswith(".json") else "toml" if path.endswith(".toml") else \
                "python" if path.endswith(".py") else "bash" if path.endswith(".sh") else "text"
            lines += [f"`{path}`", "", f"```{fence}", text.rstrip("\n"), "```", ""]
    return "\n".join(lines)
