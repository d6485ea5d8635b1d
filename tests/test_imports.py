"""The import graph of planner/ and executor/ has no circles: module-level
and function-level imports alike, read from the source with ast."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for package in ("planner", "executor"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(name: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The modules of ours an import statement loads (``from . import x``: the submodule x)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = base[:len(base) - node.level + 1] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
    return subs if subs and len(subs) == len(node.names) else [target, *subs]


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, path, node, modules):
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target and target != name:
                        deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan 1972)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_reports_and_exports_read_no_cli_layer():
    graph = import_graph()
    for name in graph:
        if name.startswith(("planner.report", "planner.exports")) and name != "planner.report.gallery":
            assert not graph[name] & {"planner.cli", "planner.commands"}, (name, graph[name])


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# the planner's command line: it hands `meshplan run` and `meshplan profile` to the executor's code
PLANNER_CLI = ("planner.cli", "planner.trace.cli")


def test_the_profiler_is_a_room_of_its_own():
    """executor/profile measures with torch.distributed and may use the executor's helpers and the
    planner's pure modules; nothing else in executor/ imports it, and the planner imports nothing of
    executor/ outside its command line."""
    graph = import_graph()
    assert "executor.profile.machine" in graph and "executor.profile.collectives" in graph
    for name, deps in graph.items():
        if _within(name, "executor") and not _within(name, "executor.profile"):
            assert not {d for d in deps if _within(d, "executor.profile")}, (name, deps)
        if _within(name, "planner") and not any(_within(name, cli) for cli in PLANNER_CLI):
            assert not {d for d in deps if _within(d, "executor")}, (name, deps)
