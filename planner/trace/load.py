"""``--model path/to/file.py:factory`` and ``--model package.module:factory``: a module to trace.

The factory takes no arguments and returns either ``(module, example_inputs)``
(a tensor, a tuple of tensors or a dict of keyword tensors for one micro-batch)
or the module alone, with ``--example-input 1x512:int64`` giving the shapes and
dtypes. ``--example-input`` wins over the factory's inputs when both are given.

Only what the user names runs: the file is executed as a module (nothing else
in its folder is imported unless it imports it), or ``package.module`` is
imported; then the factory is called. Importing this file does not import torch.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

from ..errors import UserError, one_of

DTYPES = {"int64": "int64", "long": "int64", "int32": "int32", "int": "int32", "bool": "bool",
          "float32": "float32", "float": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_SPEC = re.compile(r"^(\d+(?:x\d+)*):(\w+)$")


def is_traced_source(source: str) -> bool:
    """A ``--model`` that names a factory: contains ':' and is not an existing file or folder."""
    return ":" in source and not Path(source).exists()


def parse_example_input(text: str) -> list[tuple[tuple[int, ...], str]]:
    """'1x512:int64' or several separated by commas -> [(shape, dtype name)]."""
    out = []
    for part in text.split(","):
        match = _SPEC.match(part.strip())
        if not match:
            raise UserError(f"{part.strip()!r} is not SHAPE:DTYPE like 1x512:int64 or 2x3x224x224:float32",
                            field="--example-input")
        shape = tuple(int(s) for s in match.group(1).split("x"))
        if any(s <= 0 for s in shape):
            raise UserError(f"sizes must be positive, got {match.group(1)!r}", field="--example-input")
        dtype = DTYPES.get(match.group(2).lower())
        if dtype is None:
            raise UserError(f"unknown dtype {match.group(2)!r}; allowed: {one_of(sorted(set(DTYPES)))}",
                            field="--example-input")
        out.append((shape, dtype))
    return out


def example_tensors(text: str):
    """Meta tensors of the given shapes (the trace reads shapes and dtypes only)."""
    import torch
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for shape, dtype in
               parse_example_input(text)]
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _import_file(path: Path, source: str):
    name = "meshplan_model_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError("cannot be imported as a Python file", source=source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module        # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise user_code_error(e, "importing it", str(path), [str(path.resolve())]) from None
    return module


def user_code_error(error: BaseException, what: str, source: str, files: list[str]) -> UserError:
    """A UserError for an exception the user's own code raised: one line naming ``source`` (the factory or
    file) and the exception, and as its trailer the traceback of the frames in ``files`` only (meshplan's
    and torch's own frames left out)."""
    import traceback
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename in files]
    out = UserError(f"{what} raised {type(error).__name__}: {error}", source=source)
    if frames:
        out.trailer = "Traceback of your code (most recent call last):\n" + "".join(traceback.format_list(frames))
    return out


def _user_files(factory) -> list[str]:
    """The file that defines ``factory`` (its module's), where its traceback frames are the user's."""
    module = sys.modules.get(getattr(factory, "__module__", ""), None)
    path = getattr(module, "__file__", None)
    return [str(Path(path).resolve())] if path else []


def load_factory(source: str):
    """The factory callable a ``--model`` names."""
    where, _, attr = source.rpartition(":")
    if not where or not attr.isidentifier():
        raise UserError(f"{source!r} must be path/to/file.py:factory or package.module:factory", field="--model")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise UserError("no such file", source=where)
        module = _import_file(path, where)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise UserError(f"cannot import module {where!r}: {e}", field="--model") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise UserError(f"has no callable {attr!r}; callables defined there: {one_of(names) or 'none'}",
                        source=where)
    return factory


def build_module(source: str, example_input: str | None = None):
    """(module, example_inputs) from the factory, ``--example-input`` winning when given."""
    import torch
    factory = load_factory(source)
    try:
        result = factory()
    except Exception as e:
        raise user_code_error(e, "the factory", source, _user_files(factory)) from None
    inputs = None
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.nn.Module):
        module, inputs = result
    elif isinstance(result, torch.nn.Module):
        module = result
    else:
        raise UserError(f"the factory returned {type(result).__name__}; expected an nn.Module or "
                        "(module, example_inputs)", source=source)
    if example_input:
        inputs = example_tensors(example_input)
    if inputs is None:
        raise UserError("the factory returned a module without example inputs; give their shapes, e.g. "
                        "--example-input 1x512:int64", source=source)
    return module, inputs


def trace_source(source: str, example_input: str | None = None, **kwargs):
    """TraceResult of the module a ``--model file.py:factory`` names."""
    from .tracer import trace_module
    module, inputs = build_module(source, example_input)
    files = _user_files(type(module)) + _user_files(load_factory(source))
    try:
        return trace_module(module, inputs, name=type(module).__name__,
                            source=f"traced: {source}" + (f" --example-input {example_input}" if example_input else ""),
                            **kwargs)
    except UserError:
        raise
    except Exception as e:
        import traceback
        if not any(f.filename in files for f in traceback.extract_tb(e.__traceback__)):
            raise                   # not the user's code: meshplan's own error, with its traceback
        raise user_code_error(e, "the module's training step", source, files) from None


def load_traced_model(source: str, example_input: str | None = None):
    """The layer graph of a traced ``--model`` (what ``meshplan plan`` consumes)."""
    return trace_source(source, example_input).graph


def trace_any(source: str, example_input: str | None, *, seq_len: int | None = None, dtype=None,
              keep_replays: bool = False, device: str = "cpu"):
    """(TraceResult, ModelSpec or None): a factory, or a zoo/config model built with transformers.
    ``device``: the device type the fake tensors pretend to be on (its kernels are what is recorded)."""
    if dtype is not None:
        import torch
        dtype = getattr(torch, dtype)
    if is_traced_source(source):
        return trace_source(source, example_input, dtype=dtype, keep_replays=keep_replays, device=device), None
    from ..model import load_model
    from .tracer import trace_module
    from .zoo import build_hf_module
    spec = load_model(source, seq_len=seq_len)
    module, ids = build_hf_module(spec)
    if example_input:
        from .load import example_tensors
        ids = example_tensors(example_input)
    return trace_module(module, ids, name=spec.name, dtype=dtype, keep_replays=keep_replays, device=device,
                        source=f"traced: transformers {type(module).__name__} from {spec.source or spec.name}"), spec
