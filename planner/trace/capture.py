"""Run a module once, forward and backward, on fake tensors and record every aten operator.

How (torch 2.13 APIs):

- ``FakeTensorMode`` (torch._subclasses.fake_tensor): parameters, buffers and
  inputs are fake tensors with shapes, dtypes and strides but no storage, so a
  70B model runs without its weights; ``torch.func.functional_call`` swaps them
  into the user's module without touching its own tensors.
- a ``TorchDispatchMode`` (torch.utils._python_dispatch) sits below autograd
  and sees every aten call of forward and backward, with FLOPs and bytes
  computed from shapes (flops.py).
- each module's ``forward`` is wrapped for the duration of the trace: the
  wrapper keeps the stack of module paths (what ModuleTracker does with hooks)
  and stamps the autograd nodes the module created with its path, so backward
  operators are attributed through ``torch._C._current_autograd_node()``. The
  wrapper is also where an untraceable module is caught and becomes an opaque
  leaf (opaque.py) instead of a crash.
- ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd keeps
  for backward: the saved-activation bytes of this runtime, kernel by kernel.

This is eager execution on fake tensors rather than ``torch.export``: Python
control flow that depends on shapes or config runs as written and nothing is
ever a graph break; only data-dependent control flow fails, and only in the
module where it happens.
"""
from __future__ import annotations

import collections
import logging
import re
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UserError
from .flops import METADATA_OPS, SDPA_FORWARD, addressed_bytes, is_view, matmul_flops, op_name, storage_nbytes
from .records import Capture, ModuleCall, OpaqueLeaf, OpRecord, SavedRecord, TensorMeta

STAMP_MODULE = "meshplan.module"      # autograd node metadata: path of the module that created it
STAMP_OP = "meshplan.op"              # autograd node metadata: index of the forward op that created it
# outputs of these ops are still "the parameter" (views and casts of a weight)
_PARAM_PRESERVING = {"_to_copy", "clone", "contiguous", "detach", "alias", "expand", "t", "transpose",
                     "permute", "view", "reshape", "_unsafe_view", "select", "slice", "unsqueeze", "squeeze",
                     "lift_fresh", "to", "as_strided"}
_COMPARISONS = {"le", "lt", "ge", "gt"}
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def node_op_name(node) -> str:
    """'addmm' for AddmmBackward0: the forward op an autograd node belongs to."""
    name = re.sub(r"Backward\d*$", "", node.name().split("::")[-1])
    return _CAMEL.sub("_", name).lower()


@dataclass
class _Mark:
    records: int
    saved: int
    modules: int
    depth: int


class TraceState:
    """The builder the recorder, the module wrappers and the saved-tensor hooks share."""

    def __init__(self, *, keep_replays: bool, real_budget_bytes: float, device: str):
        self.records: list[OpRecord] = []
        self.saved: list[SavedRecord] = []
        self.modules: dict[str, ModuleCall] = {}
        self.stack: list[str] = []
        self.keep: list[torch.Tensor] = []             # keeps ids and storages unique while tracing
        self.producer: dict[int, int] = {}
        self.param_of: dict[int, str] = {}
        self.buffer_ids: set[int] = set()
        self.input_ids: set[int] = set()
        self.arange_ids: set[int] = set()
        self.causal_ids: set[int] = set()
        self.storage_ids: dict[StorageWeakRef, int] = {}
        self.storage_producer: dict[int, int] = {}
        self.param_storages: set[int] = set()
        self.buffer_storages: set[int] = set()
        self.unmatched: dict[str, dict[str, collections.deque]] = collections.defaultdict(
            lambda: collections.defaultdict(collections.deque))
        self.pending: list[tuple[torch.Tensor, str]] = []
        self.last_out_ids: set[int] = set()
        self.last_in_module: dict[str, int] = {}
        self.suppress = 0                                # >0: our own helper ops, not the model's
        self.real_mode = 0                               # >0: an opaque module runs for real
        self.opaque_path = ""
        self.in_loss = False
        self.keep_replays = keep_replays
        self.replays: dict[int, object] = {}
        self.real_budget_bytes = real_budget_bytes
        self.device = device
        self.opaque: list[OpaqueLeaf] = []
        self.warnings: list[str] = []
        self.original_params: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        self.original_buffers: dict[str, torch.Tensor] = {}
        self.classes: dict[str, str] = {}
        self.linears: set[str] = set()
        self.windows: dict[str, int] = {}

    # -- tensors ----------------------------------------------------------------------------
    def storage_id(self, t: torch.Tensor) -> int:
        try:
            ref = StorageWeakRef(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return -1
        sid = self.storage_ids.get(ref)
        if sid is None:
            sid = self.storage_ids[ref] = len(self.storage_ids)
        return sid

    def meta(self, t: torch.Tensor, *, backward: bool = False) -> TensorMeta:
        storage = -1 if backward else self.storage_id(t)
        return TensorMeta(shape=tuple(int(s) for s in t.shape), dtype=str(t.dtype), itemsize=t.element_size(),
                          is_float=t.is_floating_point(), addressed_bytes=addressed_bytes(t), storage=storage,
                          storage_bytes=0 if backward else storage_nbytes(t),
                          producer=-1 if backward else self.producer.get(id(t), -1),
                          param=self.param_of.get(id(t), ""), buffer=id(t) in self.buffer_ids,
                          model_input=id(t) in self.input_ids)

    def canonical(self, path: str) -> str:
        """The first path of a shared parameter."""
        return self.aliases.get(path, path)

    def register_param(self, t: torch.Tensor, path: str, *, buffer: bool) -> None:
        self.keep.append(t)
        sid = self.storage_id(t)
        if buffer:
            self.buffer_ids.add(id(t))
            self.buffer_storages.add(sid)
        else:
            self.param_of[id(t)] = path
            self.param_storages.add(sid)

    # -- operators ----------------------------------------------------------------------------
    def record(self, func, args, kwargs, out) -> None:
        if self.suppress:
            return
        name = op_name(func)
        if getattr(func, "namespace", "aten") == "prim" or name in METADATA_OPS:
            return
        node = torch._C._current_autograd_node()
        flat_in, flat_out = _tensors((args, kwargs)), _tensors(out)
        index = len(self.records)
        if node is not None:
            self._record_backward(func, name, args, kwargs, out, flat_in, flat_out, node, index)
            return
        self._resolve_pending(index, flat_in)
        view = is_view(func)
        ins = tuple(self.meta(t) for t in flat_in)
        for t in flat_out:
            self.producer[id(t)] = index
            self.keep.append(t)
        outs = tuple(self.meta(t) for t in flat_out)
        for o in outs:
            self.storage_producer.setdefault(o.storage, index)
        self._propagate(name, view, flat_in, flat_out)
        module = self.stack[-1] if self.stack else ""
        rec = OpRecord(index=index, func=str(func), name=name, module=module, phase="fwd",
                       flops=self._flops(func, args, out), view=view,
                       bytes_read=0 if view else sum(m.addressed_bytes for m in ins),
                       bytes_written=0 if view else sum(m.addressed_bytes for m in outs),
                       inputs=ins, outputs=outs, attrs=self._attrs(func, name, args, kwargs, flat_in),
                       opaque=self.opaque_path if self.real_mode else "", in_loss=self.in_loss)
        self.records.append(rec)
        self.last_out_ids = {id(t) for t in flat_out}
        self.last_in_module[module] = index
        if torch.is_grad_enabled() and any(t.requires_grad for t in flat_in):
            self.unmatched[module][name.strip("_")].append(index)
        if self.keep_replays:
            self.replays[index] = _replay_spec(func, args, kwargs)

    def _record_backward(self, func, name, args, kwargs, out, flat_in, flat_out, node, index) -> None:
        md = node.metadata
        view = is_view(func)
        ins = tuple(self.meta(t, backward=True) for t in flat_in)
        outs = tuple(self.meta(t, backward=True) for t in flat_out)
        rec = OpRecord(index=index, func=str(func), name=name, module=md.get(STAMP_MODULE, ""), phase="bwd",
                       fwd_op=md.get(STAMP_OP, -1), flops=self._flops(func, args, out), view=view,
                       bytes_read=0 if view else sum(m.addressed_bytes for m in ins),
                       bytes_written=0 if view else sum(m.addressed_bytes for m in outs),
                       inputs=ins, outputs=outs, opaque=self.opaque_path if self.real_mode else "")
        self.records.append(rec)
        if self.keep_replays:
            self.replays[index] = _replay_spec(func, args, kwargs)

    @staticmethod
    def _flops(func, args, out) -> float:
        try:
            return matmul_flops(func, args, out)
        except Exception:      # a formula that does not fit an unusual call: count no FLOPs
            return 0.0

    def _attrs(self, func, name, args, kwargs, flat_in) -> tuple:
        attrs = []
        if any(id(t) in self.causal_ids for t in flat_in):
            attrs.append(("causal_input", True))
        if name in SDPA_FORWARD:
            names = [a.name for a in func._schema.arguments]
            bound = dict(zip(names, args))
            bound.update(kwargs)
            mask = bound.get("attn_mask", bound.get("attn_bias"))
            attrs += [("is_causal", bool(bound.get("is_causal", False))),
                      ("dropout_p", float(bound.get("dropout_p", 0.0) or 0.0)),
                      ("has_mask", isinstance(mask, torch.Tensor)),
                      ("mask_causal", isinstance(mask, torch.Tensor) and id(mask) in self.causal_ids)]
        return tuple(attrs)

    def _propagate(self, name, view, flat_in, flat_out) -> None:
        """Parameter identity through views and casts; causal-mask provenance (aranges compared)."""
        if flat_in and (view or name in _PARAM_PRESERVING):
            first = id(flat_in[0])
            if first in self.param_of:
                for t in flat_out:
                    self.param_of[id(t)] = self.param_of[first]
            elif first in self.buffer_ids:
                self.buffer_ids.update(id(t) for t in flat_out)
        ids = [id(t) for t in flat_in]
        if name == "arange":
            self.arange_ids.update(id(t) for t in flat_out)
        elif name in ("tril", "triu") or (name in _COMPARISONS and len(ids) == 2
                                           and all(i in self.arange_ids for i in ids)):
            self.causal_ids.update(id(t) for t in flat_out)
        elif any(i in self.causal_ids for i in ids):
            self.causal_ids.update(id(t) for t in flat_out)
        elif any(i in self.arange_ids for i in ids):
            self.arange_ids.update(id(t) for t in flat_out)

    # -- saved tensors ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        if not self.suppress:
            self.pending.append((t, self.stack[-1] if self.stack else ""))
        return t

    def _resolve_pending(self, index: int, flat_in) -> None:
        """Attribute what autograd saved since the last op: the inputs of the op about to run, the
        outputs of the op that just ran, or else the last op of the module that saved it."""
        if not self.pending:
            return
        in_ids = {id(t) for t in flat_in}
        module_now = self.stack[-1] if self.stack else ""
        for t, module in self.pending:
            if id(t) in in_ids and module == module_now:
                op = index
            elif id(t) in self.last_out_ids and index > 0:
                op = index - 1
            else:
                op = self.last_in_module.get(module, index)
            self._add_saved(t, module, op)
        self.pending.clear()

    def _add_saved(self, t: torch.Tensor, module: str, op: int) -> None:
        self.keep.append(t)
        sid = self.storage_id(t)
        state = ("parameter" if sid in self.param_storages or id(t) in self.param_of else
                 "buffer" if sid in self.buffer_storages or id(t) in self.buffer_ids else "activation")
        self.saved.append(SavedRecord(storage=sid, storage_bytes=storage_nbytes(t),
                                      shape=tuple(int(s) for s in t.shape), dtype=str(t.dtype),
                                      itemsize=t.element_size(), is_float=t.is_floating_point(), module=module,
                                      op=op, state=state, producer=self.storage_producer.get(sid, -1)))

    def flush(self) -> None:
        self._resolve_pending(len(self.records), [])

    # -- modules ---------------------------------------------------------------------------------
    def mark(self) -> _Mark:
        return _Mark(len(self.records), len(self.saved), len(self.modules), len(self.stack))

    def rollback(self, mark: _Mark) -> None:
        """Forget what a failed module recorded (its partial run)."""
        del self.records[mark.records:]
        del self.saved[mark.saved:]
        self.pending.clear()
        for path in [p for p, call in self.modules.items() if call.order >= mark.modules]:
            del self.modules[path]
        del self.stack[mark.depth:]
        for queues in self.unmatched.values():
            for name, queue in queues.items():
                queues[name] = collections.deque(i for i in queue if i < mark.records)
        self.replays = {i: r for i, r in self.replays.items() if i < mark.records}

    def enter(self, path: str, args, kwargs) -> None:
        self.stamp(_tensors((args, kwargs)), self.stack[-1] if self.stack else "")
        if path not in self.modules:
            self.modules[path] = ModuleCall(output=None, order=len(self.modules))
        self.stack.append(path)

    def exit(self, path: str, out) -> None:
        outs = _tensors(out)
        self.stamp(outs, path)
        call = self.modules.get(path)
        if call is not None and call.output is None:
            floats = [t for t in outs if t.is_floating_point()]
            biggest = max(floats, key=lambda t: t.numel()) if floats else None
            with self.suppressed():
                meta = self.meta(biggest) if biggest is not None else None
            self.modules[path] = ModuleCall(output=meta, order=call.order)
        if self.stack:
            self.stack.pop()

    def stamp(self, tensors, path: str) -> None:
        """Mark the autograd nodes behind ``tensors`` that no module has claimed yet as ``path``'s,
        and match each to the forward op that created it (by name, in creation order)."""
        new = []
        todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            md = node.metadata
            if STAMP_MODULE in md:
                continue
            md[STAMP_MODULE] = path
            new.append(node)
            todo.extend(fn for fn, _ in node.next_functions if fn is not None)
        new.sort(key=lambda n: n._sequence_nr())
        queues = self.unmatched.get(path)
        if not queues:
            return
        for node in new:
            queue = queues.get(node_op_name(node))
            if queue:
                node.metadata[STAMP_OP] = queue.popleft()

    def suppressed(self):
        state = self

        class _Suppress:
            def __enter__(self):
                state.suppress += 1

            def __exit__(self, *exc):
                state.suppress -= 1
        return _Suppress()


def _replay_spec(func, args, kwargs):
    """The call with each tensor replaced by its metadata: what `meshplan profile --ops` replays."""
    def meta(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(int(s) for s in x.shape), tuple(int(s) for s in x.stride()), x.dtype,
                    x.requires_grad)
        return x
    return func, pytree.tree_map(meta, (args, kwargs))


class Recorder(TorchDispatchMode):
    """Records every aten call into a TraceState (below autograd: forward and backward)."""

    def __init__(self, state: TraceState):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _call(func, args, kwargs)
        self.state.record(func, args, kwargs, out)
        return out


def _call(func, args, kwargs):
    """Run one op; work around fake kernels stricter than the real ones."""
    from torch._subclasses.fake_tensor import FakeTensor
    if op_name(func) == "_grouped_mm" and isinstance(args[0], FakeTensor) and args[0].dtype != torch.bfloat16:
        # the meta kernel of _grouped_mm accepts only bf16 while the CPU kernel runs fp32 too:
        # shapes do not depend on the dtype, so ask the meta kernel in bf16 and cast back
        cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        return func(*cast, **kwargs).to(args[0].dtype)
    return func(*args, **kwargs)


# -- the module wrappers -------------------------------------------------------------------------

def _sliding_window(module) -> int:
    """The span a module's attention is limited to, as Hugging Face attention modules declare it
    (``self.sliding_window``, else their config's ``sliding_window``); 0 for full attention. Masks
    are tensors without values on fake tensors, so the window is read from the declaration."""
    if "sliding_window" in vars(module) or hasattr(type(module), "sliding_window"):
        window = getattr(module, "sliding_window", None)
    else:
        config = vars(module).get("config")
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0


class _Wrappers:
    """Wrap every submodule's forward for the duration of a trace (restored on exit)."""

    def __init__(self, root: torch.nn.Module, state: TraceState):
        self.root, self.state, self.saved = root, state, []

    def __enter__(self):
        for path, module in self.root.named_modules():
            self.state.classes[path] = type(module).__name__
            if isinstance(module, torch.nn.Linear):
                self.state.linears.add(path)
            window = _sliding_window(module)
            if window:
                self.state.windows[path] = window
            had = "forward" in module.__dict__
            self.saved.append((module, had, module.__dict__.get("forward")))
            module.forward = self._wrap(path, module, module.forward)
        return self

    def __exit__(self, *exc):
        for module, had, previous in self.saved:
            if had:
                module.forward = previous
            else:
                del module.forward
        return False

    def _wrap(self, path: str, module: torch.nn.Module, forward):
        state = self.state

        def wrapped(*args, **kwargs):
            mark = state.mark()
            state.enter(path, args, kwargs)
            try:
                out = forward(*args, **kwargs)
            except UserError:
                raise
            except Exception as error:
                if state.real_mode:
                    raise
                state.rollback(mark)
                from .opaque import run_opaque
                state.enter(path, args, kwargs)
                out = run_opaque(state, path, module, args, kwargs, error)
            state.exit(path, out)
            return out
        return wrapped


# -- the trace ---------------------------------------------------------------------------------

def _fake_like(x: torch.Tensor, device: str, dtype) -> torch.Tensor:
    """An empty tensor of ``x``'s shape on ``device``, floating point cast to ``dtype`` when given (call it
    under the fake mode)."""
    cast = dtype if (dtype is not None and x.is_floating_point()) else x.dtype
    return torch.empty(x.shape, dtype=cast, device=device)


def _fake_inputs(example_inputs, fake_mode, device: str, dtype):
    """(args, kwargs) of fake tensors: a tensor, a tuple/list of them, or a dict of keyword inputs."""
    def fake(x):
        if not isinstance(x, torch.Tensor):
            return x
        with fake_mode:
            t = _fake_like(x, device, dtype)
        return t.requires_grad_(x.requires_grad) if x.is_floating_point() else t
    if isinstance(example_inputs, dict):
        return (), {k: fake(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, torch.Tensor):
        return (fake(example_inputs),), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(fake(x) for x in example_inputs), {}
    raise UserError(f"expected a tensor, a tuple of tensors or a dict of them, got {type(example_inputs).__name__}",
                    field="example_inputs")


def _fake_state(module, state: TraceState, fake_mode, device: str, dtype) -> dict:
    """Fake parameters and buffers under their paths (each shared tensor once)."""
    out = {}
    with fake_mode:
        for name, p in module.named_parameters():
            t = _fake_like(p, device, dtype)
            if p.is_floating_point():
                t.requires_grad_(p.requires_grad)
            state.original_params[name] = p
            state.register_param(t, name, buffer=False)
            out[name] = t
        for name, b in module.named_buffers():
            t = _fake_like(b, device, dtype)
            state.original_buffers[name] = b
            state.register_param(t, name, buffer=True)
            out[name] = t
    return out


def _param_aliases(module) -> dict[str, str]:
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def capture(module: torch.nn.Module, example_inputs, *, loss_fn=None, device: str = "cpu", dtype=None,
            keep_replays: bool = False, real_budget_bytes: float = 2**30) -> Capture:
    """Trace one training step (forward, loss, backward) of ``module`` on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    from .loss import training_loss

    state = TraceState(keep_replays=keep_replays, real_budget_bytes=real_budget_bytes, device=device)
    fake_mode = FakeTensorMode()
    args, kwargs = _fake_inputs(example_inputs, fake_mode, device, dtype)
    for x in _tensors((args, kwargs)):
        state.keep.append(x)
        state.input_ids.add(id(x))
    state.aliases = _param_aliases(module)
    tensors = _fake_state(module, state, fake_mode, device, dtype)
    training = {m: m.training for m in module.modules()}
    module.train()
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    log_level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)     # a failing meta kernel is reported as an opaque leaf, not a log
    try:
        with _Wrappers(module, state), fake_mode, Recorder(state):
            with torch.autograd.graph.saved_tensors_hooks(state.pack, lambda t: t):
                out = functional_call(module, tensors, args, kwargs, tie_weights=True, strict=False)
                state.flush()
                state.in_loss = True
                try:
                    loss = training_loss(out, (args, kwargs), loss_fn)
                except ValueError as e:
                    raise UserError(f"cannot train on the module's output: {e}; pass loss_fn",
                                    source=type(module).__name__) from None
                state.flush()
                state.in_loss = False
            state.stamp([loss], "")
            try:
                if not loss.requires_grad:      # every parameter frozen: autograd has no backward to run
                    state.warnings.append("no parameter has requires_grad=True: nothing trains (under --finetune "
                                          "lora or qlora the adapters do) and backward could not be traced; backward "
                                          "costs are estimated from the forward")
                else:
                    loss.backward()
            except UserError:
                raise
            except Exception as e:     # forward is known; backward is then derived from it
                state.warnings.append(f"backward could not be traced ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''}); backward costs are "
                                      "estimated from the forward")
    finally:
        fake_log.setLevel(log_level)
        for m, was in training.items():
            m.training = was
    first = _tensors((args, kwargs))
    return Capture(records=tuple(state.records), saved=tuple(state.saved), modules=dict(state.modules),
                   classes=dict(state.classes), params={n: tuple(p.shape) for n, p in state.original_params.items()},
                   frozen_params=frozenset(n for n, p in state.original_params.items() if not p.requires_grad),
                   param_aliases=dict(state.aliases), batch=int(first[0].shape[0]) if first and first[0].dim() else 1,
                   input_shapes=tuple((tuple(int(s) for s in t.shape), str(t.dtype)) for t in first),
                   activation_dtype=_activation_dtype(tensors), device=device, opaque=tuple(state.opaque),
                   warnings=tuple(state.warnings), replays=state.replays, windows=dict(state.windows),
                   linears=frozenset(state.linears))


def _activation_dtype(tensors: dict) -> str:
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    return str(max(set(floats), key=floats.count)) if floats else "torch.float32"
