"""A torchtitan config in its current Python form: a module whose function returns ``Trainer.Config(...)``.

torchtitan replaced its TOML job config with Python dataclass configs in February 2026 (pytorch/torchtitan
PR 2386) and counted batches in tokens from August 2026 (PR 4121): ``TrainingConfig``'s
``num_tokens_per_microbatch_per_dp_rank`` (one forward's tokens per data-parallel rank),
``num_tokens_per_train_step`` (default: that x ``num_pp_microbatches`` x the data-parallel degree) and
``max_context_length``; ``ParallelismConfig`` keeps the TOML's degree and pipeline names, with
``num_pp_microbatches`` for the pipeline's micro-batches (torchtitan/config/configs.py). Activation
checkpointing is a class: ``FullAC`` (every block in full), ``SelectiveAC`` (per operator; the default),
``MemoryBudgetAC``, or ``None``.

The file is read, never run (it imports torchtitan): its syntax tree is evaluated for literals, arithmetic,
the ``*.Config(...)`` calls, ``model_registry("FLAVOR")``, local names, calls of the module's other config
functions and assignments to their fields (``config.parallelism.tensor_parallel_degree = 4``). The result is
the TOML reader's document (torchtitan.py), so both forms read alike.
"""
from __future__ import annotations

import ast
import operator
from pathlib import Path

from ..errors import UserError, one_of
from . import torchtitan
from .values import FileModel

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.truediv}
AC_CLASSES = {"FullAC": {"mode": "full"}, "SelectiveAC": {"mode": "selective", "selective_ac_option": "op"},
              "MemoryBudgetAC": {"mode": "memory_budget"}}


class _Config(dict):
    """A ``X.Config(...)`` call's fields (and the class it names)."""

    def __init__(self, cls: str, fields: dict):
        super().__init__(fields)
        self.cls = cls


class _Registry(str):
    """``model_registry("FLAVOR")``: the flavor."""


class _Opaque:
    """A value the reader does not evaluate (a function call, an attribute of an import)."""

    def __init__(self, text: str):
        self.text = text


def _name(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


class _Evaluator:
    def __init__(self, tree: ast.Module, source: str):
        self.source = source
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def value(self, node, scope: dict):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.value(x, scope) for x in node.elts]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            v = self.value(node.operand, scope)
            return -v if isinstance(v, (int, float)) else _Opaque(ast.unparse(node))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = self.value(node.left, scope), self.value(node.right, scope)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
                out = _OPS[type(node.op)](a, b)
                return int(out) if isinstance(out, float) and out.is_integer() else out
            return _Opaque(ast.unparse(node))
        if isinstance(node, ast.Name):
            return scope.get(node.id, _Opaque(node.id))
        if isinstance(node, ast.Call):
            name = _name(node.func)
            if name.endswith("model_registry") and node.args:
                flavor = self.value(node.args[0], scope)
                return _Registry(flavor) if isinstance(flavor, str) else _Opaque(ast.unparse(node))
            if name.endswith("Config"):
                return _Config(name, {k.arg: self.value(k.value, scope) for k in node.keywords if k.arg})
            if name in self.functions and not node.args and not node.keywords:
                return self.run(name)
        return _Opaque(ast.unparse(node))

    def run(self, name: str, depth: int = 0) -> _Config:
        """The Trainer.Config that function ``name`` returns."""
        if depth > 8:
            raise UserError(f"{name}: config functions call each other too deeply", source=self.source)
        scope: dict = {}
        for stmt in self.functions[name].body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target, value = stmt.targets[0], self.value(stmt.value, scope)
                if isinstance(target, ast.Name):
                    scope[target.id] = value
                elif isinstance(target, ast.Attribute):
                    self._assign(target, value, scope)
            elif isinstance(stmt, ast.Return) and stmt.value is not None:
                out = self.value(stmt.value, scope)
                if isinstance(out, _Config):
                    return out
                break
        raise UserError(f"{name}() does not return a Trainer.Config(...) this reader can follow", source=self.source,
                        field=name)

    def _assign(self, target: ast.Attribute, value, scope: dict) -> None:
        path = []
        node = target
        while isinstance(node, ast.Attribute):
            path.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or not isinstance(scope.get(node.id), _Config):
            return
        obj = scope[node.id]
        for part in reversed(path[1:]):
            obj = obj.setdefault(part, _Config(part, {}))
            if not isinstance(obj, dict):
                return
        obj[path[0]] = value


def config_functions(tree: ast.Module) -> list[str]:
    """Functions that return a ``*.Config(...)`` (directly, or the result of another such function)."""
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            annotation = _name(node.returns) if node.returns is not None else ""
            if annotation.endswith("Config") or any(isinstance(n, ast.Return) and isinstance(n.value, ast.Call)
                                                    and _name(n.value.func).endswith("Config")
                                                    for n in ast.walk(node)):
                out.append(node.name)
    return out


def _model_module(tree: ast.Module, path: str) -> str | None:
    """The torchtitan model whose ``model_registry`` the file imports: ``from torchtitan.models.X import
    model_registry``, or ``from . import model_registry`` inside torchtitan/models/X/."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "model_registry" for a in node.names):
            if node.module and node.module.startswith("torchtitan.models."):
                return node.module.split(".")[2]
            if node.level:
                parent = Path(path).resolve().parents[max(0, node.level - 1)]
                return parent.name
    return None


def is_python_config(text: str) -> bool:
    return "torchtitan" in text or "Trainer.Config" in text


def parse(text: str, source: str) -> dict:
    """The TOML reader's document from a Python config; ``source`` is ``file.py`` or ``file.py:function``."""
    path, _, function = source.partition(".py:")
    path = path + ".py" if function else source
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise UserError(f"not valid Python at line {e.lineno}: {e.msg}", source=path) from None
    names = config_functions(tree)
    if function:
        if function not in names:
            raise UserError(f"{function!r} is not a config function of the file; allowed: {one_of(names)}",
                            source=path, field="function")
    elif len(names) == 1:
        function = names[0]
    else:
        raise UserError(f"the file defines {len(names)} config functions; name one as {path}:FUNCTION; allowed: "
                        f"{one_of(names) or 'none found'}", source=path, field="function")
    config = _Evaluator(tree, path).run(function)
    return to_document(config, _model_module(tree, path), path, function)


def to_document(config: _Config, model: str | None, source: str, function: str) -> dict:
    """Trainer.Config fields -> the TOML form's sections, the token counts turned into sequences."""
    notes = [f"read {function}() of the torchtitan Python config"]
    training = dict(config.get("training") or {})
    parallelism = {k: v for k, v in (config.get("parallelism") or {}).items()}
    for section, body in (("training", training), ("parallelism", parallelism)):
        for key, value in body.items():
            if isinstance(value, _Opaque):
                raise UserError(f"{value.text!r} is not a value this reader evaluates; allowed: numbers, strings, "
                                "lists and arithmetic", source=source, field=f"{section}.{key}")
    doc = {"training": training, "parallelism": parallelism}
    registry = config.get("model_spec")
    if isinstance(registry, _Registry):
        doc["model"] = {"name": model, "flavor": str(registry)}
    ac = config.get("activation_checkpoint", "default")
    if ac == "default":
        doc["activation_checkpoint"] = dict(AC_CLASSES["SelectiveAC"])
        notes.append("no activation_checkpoint: Trainer.Config's default, SelectiveAC (per operator)")
    elif ac is None:
        doc["activation_checkpoint"] = {"mode": "none"}
    elif isinstance(ac, _Config) and ac.cls.split(".")[0] in AC_CLASSES:
        doc["activation_checkpoint"] = dict(AC_CLASSES[ac.cls.split(".")[0]])
    else:
        raise UserError(f"{getattr(ac, 'cls', ac)!r}; allowed: FullAC.Config(), SelectiveAC.Config(), "
                        "MemoryBudgetAC.Config() or None", source=source, field="activation_checkpoint")
    for section in config:
        if section not in ("training", "parallelism", "model_spec", "activation_checkpoint"):
            doc.setdefault(section, {})          # listed as not modelled
    torchtitan.tokens_to_sequences(doc, source)
    doc["_notes"] = notes
    return doc


def model_of(doc: dict, source: str) -> FileModel:
    return torchtitan.model_of(doc, source)


def read(doc: dict, source: str, ctx, graph):
    from dataclasses import replace
    baseline = torchtitan.read(doc, source, ctx, graph)
    return replace(baseline, format="torchtitan-python", notes=tuple(doc.get("_notes", ())) + baseline.notes)


def settings(text: str, source: str = "torchtitan_config.py") -> list[str]:
    """One line per field a Python config's (only) config function sets, in its own words
    (``parallelism.tensor_parallel_degree = 2``, ``activation_checkpoint = FullAC.Config()``)."""
    tree = ast.parse(text)
    names = config_functions(tree)
    config = _Evaluator(tree, source).run(names[0])
    out = []
    for key, value in config.items():
        if isinstance(value, _Config) and key in ("training", "parallelism"):
            out += [f"{key}.{k} = {v!r}" for k, v in value.items()]
        elif isinstance(value, _Config):
            out.append(f"{key} = {value.cls}()")
        elif isinstance(value, _Registry):
            out.append(f"{key} = model_registry({str(value)!r})")
        else:
            out.append(f"{key} = {value!r}")
    return out
