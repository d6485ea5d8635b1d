"""Layers from module structure: repeated blocks, what comes before and after them.

A *block container* is a module with two or more consecutive children of the
same structure (class and parameter shapes, recursively), each made of
submodules and together holding at least a tenth of the parameters, such as
``model.layers`` of a Llama or ``transformer.h`` of a GPT-2; the containers
holding the most parameters are chosen first, and none nested inside another.
Each child of a container is one ``block`` layer. The modules around them
(embedding, final norm, head, and whatever a model runs between) are layers of
their own, in the order they first ran: before the first block ``embedding``,
after the last one ``norm`` (a normalisation) or ``head``, in between ``block``.
A model without repeated blocks (an MLP, a small CNN) has one ``block`` layer
per top-level module, so it can still be pipelined and recomputed.

Every op belongs to the layer whose module path contains its module; an op that
ran directly in a parent module (a residual add in ``GPT2Model``, the loss)
joins the layer that ran just before it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .classify import is_norm_class
from .records import Capture


@dataclass(frozen=True, kw_only=True)
class LayerSpan:
    path: str
    kind: str                 # embedding | block | norm | head


def parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def is_within(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


class _Tree:
    def __init__(self, cap: Capture):
        self.cap = cap
        self.executed = set(cap.modules)
        self.children: dict[str, list[str]] = {}
        for path in cap.classes:           # definition order
            if path:
                self.children.setdefault(parent(path), []).append(path)
        self.params_under: dict[str, int] = {}
        for name, shape in cap.params.items():
            n = math.prod(shape)
            owner = parent(name)
            while True:
                self.params_under[owner] = self.params_under.get(owner, 0) + n
                if owner == "":
                    break
                owner = parent(owner)
        self._keys: dict[str, tuple] = {}
        self._order: dict[str, int | None] = {}

    def key(self, path: str) -> tuple:
        """Structure of a module: class, own parameter shapes, children's structure, recursively."""
        if path not in self._keys:
            own = tuple((name[len(path) + 1:] if path else name, shape) for name, shape in self.cap.params.items()
                        if parent(name) == path)
            aliases = tuple(name[len(path) + 1:] for name in self.cap.param_aliases if parent(name) == path)
            self._keys[path] = (self.cap.classes.get(path, ""), own, aliases,
                                tuple(self.key(c) for c in self.children.get(path, ())))
        return self._keys[path]

    def first_order(self, path: str) -> int | None:
        """When a module or anything inside it first ran (None: never; a ModuleList itself never runs)."""
        if path not in self._order:
            own = self.cap.modules[path].order if path in self.executed else None
            inner = [o for c in self.children.get(path, ()) if (o := self.first_order(c)) is not None]
            self._order[path] = min([o for o in [own, *inner] if o is not None], default=None)
        return self._order[path]

    def ran(self, path: str) -> list[str]:
        kids = [c for c in self.children.get(path, ()) if self.first_order(c) is not None]
        return sorted(kids, key=self.first_order)


def find_blocks(tree: _Tree) -> list[str]:
    """Paths of the repeated blocks (children of the chosen containers)."""
    candidates = []
    for container, kids in tree.children.items():
        kids = [k for k in kids if k in tree.executed]
        start = 0
        while start < len(kids):
            end = start + 1
            while end < len(kids) and tree.key(kids[end]) == tree.key(kids[start]):
                end += 1
            run = kids[start:end]
            weight = sum(tree.params_under.get(k, 0) for k in run)
            composite = all(tree.children.get(k) for k in run)      # blocks hold modules, not one Linear
            if len(run) >= 2 and composite and weight >= 0.1 * tree.params_under.get("", 0) and weight > 0:
                candidates.append((weight, len(run), run))
            start = end
    chosen: list[str] = []
    for _, _, run in sorted(candidates, key=lambda c: (-c[0], -c[1])):
        if any(is_within(k, b) or is_within(b, k) for k in run for b in chosen):
            continue
        chosen += run
    return chosen


def layer_spans(cap: Capture) -> list[LayerSpan]:
    """The layers in the order they first ran, with their kinds."""
    tree = _Tree(cap)
    blocks = set(find_blocks(tree))

    def visit(path: str) -> list[tuple[str, bool]]:
        if path in blocks:
            return [(path, True)]
        if not any(is_within(b, path) for b in blocks):
            return [(path, False)]
        out = []
        for child in tree.ran(path):
            out += visit(child)
        return out

    if blocks:
        found = visit("")
    else:
        top = ""
        while len(tree.ran(top)) == 1 and not _runs_own_ops(cap, top):
            top = tree.ran(top)[0]
        found = [(c, True) for c in tree.ran(top)] or [(top, True)]
    return _kinds(cap, found)


def _runs_own_ops(cap: Capture, path: str) -> bool:
    return any(r.module == path and r.phase == "fwd" and not r.view and not r.in_loss for r in cap.records)


def _kinds(cap: Capture, found: list[tuple[str, bool]]) -> list[LayerSpan]:
    first = next(i for i, (_, b) in enumerate(found) if b)
    last = max(i for i, (_, b) in enumerate(found) if b)
    spans = []
    for i, (path, is_block) in enumerate(found):
        if i < first:
            kind = "embedding"
        elif i > last:
            kind = "norm" if is_norm_class(cap.classes.get(path, "")) else "head"
        else:
            kind = "block"
        spans.append(LayerSpan(path=path, kind=kind))
    return spans


def assign_ops(cap: Capture, spans: list[LayerSpan]) -> dict[int, int]:
    """Forward op index -> layer index (see the module docstring)."""
    paths = [s.path for s in spans]
    out = {}
    current = None
    pending = []
    for rec in cap.records:
        if rec.phase != "fwd":
            continue
        layer = _containing(rec.module, paths)
        if layer is None:
            if current is None:
                pending.append(rec.index)
                continue
            layer = current
        current = layer
        for i in pending:
            out[i] = layer
        pending.clear()
        out[rec.index] = layer
    for i in pending:
        out[i] = 0
    return out


def _containing(module: str, paths: list[str]) -> int | None:
    best, best_len = None, -1
    for i, p in enumerate(paths):
        if is_within(module, p) and len(p) > best_len and (p or module == ""):
            best, best_len = i, len(p)
    return best


def layer_of_module(path: str, spans: list[LayerSpan]) -> int | None:
    return _containing(path, [s.path for s in spans])
