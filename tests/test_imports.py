"""The import graph of planner/, executor/ and benchmarks/, read from the source with ast (module-level and
function-level imports alike; importing a module also runs its packages' __init__): no circles, the
layers of ../shared/DESIGN.md, and the library's front door.

The layers, bottom up: the values the cost model reads (planner.config, schedules, recompute, runtimes,
model, layers, cluster, network, placement, estimate, the tracer...), the cost model (planner.cost), the
search and the simulation, then what reads plans (reports, exports, compare, what-if) and the front door
(planner.api). planner.cli, the command line, is the one place that reaches both the planner and the
executor (for `meshplan run` and `meshplan profile`). The executor reads plan.json's values and never the
search; the profiler (executor/profile) is its own room, which nothing else in executor/ imports."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(packages=("planner", "executor")) -> dict[str, Path]:
    out = {}
    for package in packages:
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


def _within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module importing ``start`` loads: its imports, theirs, and the packages they sit in."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        todo += graph[name]
        todo += [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]     # the packages' __init__
    return seen - {start}


# below the cost model: the values it reads (and the tracer, which makes layer graphs)
BELOW_THE_COST_MODEL = ("planner.errors", "planner.config", "planner.schedules", "planner.recompute",
                        "planner.runtimes", "planner.model", "planner.layers", "planner.cluster", "planner.network",
                        "planner.placement", "planner.estimate", "planner.eager_bytes", "planner.eager_table",
                        "planner.fingerprint", "planner.trace")


def test_nothing_below_the_cost_model_imports_it():
    graph = import_graph()
    below = [name for name in graph if _within(name, *BELOW_THE_COST_MODEL)]
    assert len(below) > 20
    for name in below:
        above = {m for m in reachable(graph, name) if _within(m, "planner.cost", "planner.search", "planner.simulate",
                                                               "planner.plan", "planner.api", "planner.cli")}
        assert not above, (name, sorted(above))


def test_the_planner_never_imports_the_executor():
    graph = import_graph()
    library = [name for name in graph if _within(name, "planner") and not _within(name, "planner.cli")]
    for name in library:
        executor = {m for m in reachable(graph, name) if _within(m, "executor")}
        assert not executor, (name, sorted(executor))


def test_the_executor_reads_plans_and_never_the_search():
    """The executor imports no search and no command line; auto_parallelize plans the live module through
    the library's front door (planner.api), the one executor module that calls it, and an elastic run
    plans its job again through planner.replan, which plans through the front door."""
    graph = import_graph()
    without_api = {name: deps - {"planner.api"} for name, deps in graph.items()}
    for name in (n for n in graph if _within(n, "executor")):
        searched = {m for m in reachable(without_api, name) if _within(m, "planner.search", "planner.api", "planner.cli")}
        assert not searched, (name, sorted(searched))
    assert {n for n in graph if _within(n, "executor") and "planner.api" in graph[n]} == {"executor.auto"}
    assert {n for n in graph if _within(n, "executor") and "planner.replan" in graph[n]} == {"executor.elastic"}
    assert "planner.api" in graph["planner.replan"]


def test_the_profiler_is_a_room_of_its_own():
    """executor/profile measures with torch.distributed and may use the executor's helpers and the
    planner's pure modules; nothing else in executor/ imports it, directly or through another module."""
    graph = import_graph()
    assert "executor.profile.machine" in graph and "executor.profile.collectives" in graph
    for name in (n for n in graph if _within(n, "executor") and not _within(n, "executor.profile")):
        profiler = {m for m in reachable(graph, name) if _within(m, "executor.profile")}
        assert not profiler, (name, sorted(profiler))


def test_the_layer_checks_see_a_violation():
    graph = {"planner.layers": {"planner.cluster"}, "planner.cluster": {"planner.cost.step"}, "planner.cost.step": set(),
             "planner.cost": set(), "planner": set()}
    assert "planner.cost.step" in reachable(graph, "planner.layers")
    assert "planner.cost" in reachable(graph, "planner.layers")         # the package the module sits in


def test_reports_and_exports_read_no_cli_layer():
    graph = import_graph()
    for name in graph:
        if _within(name, "planner.report", "planner.exports"):
            assert not {m for m in graph[name] if _within(m, "planner.cli")}, (name, graph[name])


# -- the front door: values cross module boundaries, not parsed command lines or private names -----

def _sources(packages=("planner", "executor", "benchmarks")) -> dict[str, Path]:
    out = _modules(tuple(p for p in packages if p != "benchmarks"))
    if "benchmarks" in packages:
        out.update({f"benchmarks.{p.stem}": p for p in (ROOT / "benchmarks").glob("*.py")})
    return out


def private_names_crossing(name: str, path: Path, ours=("planner", "executor")) -> list[str]:
    """``from ours.x import _name`` and ``ours_module._name`` in one file."""
    tree = ast.parse(path.read_text())
    modules, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in ours):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    out.append(f"{name}:{node.lineno} imports {alias.name}")
                else:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in ours)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            out.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    return out


def test_no_private_name_crosses_a_module():
    found = [line for name, path in _sources().items() for line in private_names_crossing(name, path)]
    assert found == []


def test_the_private_name_check_sees_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from planner.model import _fields\nfrom planner import cost\ncost._secret()\n")
    assert len(private_names_crossing("bad", bad)) == 2


def _names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out


def test_only_the_command_line_handles_parsed_flags():
    """Outside planner/cli, nothing calls the CLI's parser to reach the library, and no planner module
    imports argparse (which is what an argparse.Namespace would come from)."""
    for name, path in _sources().items():
        if _within(name, "planner.cli"):
            continue
        used = _names_used(path)
        assert not used & {"build_parser", "load_inputs", "_knobs", "job_inputs"}, (name, used & {"build_parser"})
        if _within(name, "planner"):
            assert "argparse" not in used, name
