"""A report Document as one self-contained HTML page: the SVG plots inline, no scripts, no
external files, so it opens offline and prints as it shows."""
from __future__ import annotations

import html
import re
from pathlib import Path

from .document import Document, Table

STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .8em 0; font-size: .9em; }
td, th { border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
figure { margin: 1em 0; } figure svg { width: 100%; max-width: 1000px; height: auto; }
figcaption { font-size: .9em; color: #555; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .82em; }
"""


def inline_svg(path: Path) -> str:
    """An SVG file's <svg> element, without the XML prolog and doctype."""
    text = path.read_text()
    start = text.find("<svg")
    return re.sub(r"<!--.*?-->", "", text[start:], flags=re.S)


def _table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in t.rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render(doc: Document, plots: Path) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{html.escape(doc.title)}</title><style>{STYLE}</style></head><body>",
           f"<h1>{html.escape(doc.title)}</h1>"]
    shown: set[str] = set()       # a figure two sections show is inlined once, then linked to
    for s in doc.sections:
        out.append(f"<section><h2>{html.escape(s.title)}</h2>")
        out += [f"<p>{html.escape(p)}</p>" for p in s.paragraphs]
        if s.table:
            out.append(_table(s.table))
        if s.bullets:
            out.append("<ul>" + "".join(f"<li>{html.escape(b)}</li>" for b in s.bullets) + "</ul>")
        for f in s.figures:
            if f.name in shown:
                out.append(f'<p><a href="#figure-{f.name}">{html.escape(f.caption)}</a> (the figure above)</p>')
                continue
            shown.add(f.name)
            out.append(f'<figure id="figure-{f.name}">{inline_svg(plots / f"{f.name}.svg")}<figcaption>'
                       f"{html.escape(f.caption)}</figcaption></figure>")
        for path, text in s.files:
            out.append(f"<p><code>{html.escape(path)}</code></p><pre>{html.escape(text)}</pre>")
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
