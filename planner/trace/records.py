"""What a trace records: plain values that outlive the trace (only ``Capture.replays``, kept for
``meshplan profile --ops``, holds torch objects: the aten overloads and dtypes to call again).

``capture.capture`` fills these while the module runs on fake tensors; the
rest of ``planner.trace`` (layers, tensor parallelism, the operator graph)
reads only these values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorMeta:
    """One tensor an operator read or wrote."""

    shape: tuple[int, ...]
    dtype: str                    # "torch.float32"
    itemsize: int
    is_float: bool
    addressed_bytes: int          # bytes a kernel streams (broadcast dimensions once)
    storage: int                  # storage id within this trace (views share it)
    storage_bytes: int
    producer: int = -1            # index of the forward op that wrote it (-1: an input, parameter or buffer)
    param: str = ""               # parameter path when it is a parameter or a view/cast of one
    buffer: bool = False          # a module buffer (or a view of one)
    model_input: bool = False     # one of the example inputs

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class OpRecord:
    """One aten operator call."""

    index: int
    func: str                     # "aten.mm.default"
    name: str                     # "mm"
    module: str                   # innermost module path whose forward ran it ("" = the root)
    phase: Literal["fwd", "bwd"]
    fwd_op: int = -1              # backward: the forward op whose autograd node ran it (-1: unknown)
    flops: float = 0.0            # matrix-multiply FLOPs (see flops.py)
    bytes_read: int = 0
    bytes_written: int = 0
    view: bool = False            # moves no data
    inputs: tuple[TensorMeta, ...] = ()
    outputs: tuple[TensorMeta, ...] = ()
    attrs: tuple[tuple[str, object], ...] = ()   # attention: is_causal, dropout_p, mask flags
    opaque: str = ""              # path of the untraceable module this op ran in for real ("" normally)
    in_loss: bool = False         # part of the training loss the tracer appended

    def attr(self, key: str, default=None):
        return dict(self.attrs).get(key, default)


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedRecord:
    """One tensor autograd kept for backward (saved_tensors_hooks pack)."""

    storage: int
    storage_bytes: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    is_float: bool
    module: str                   # innermost module running when it was saved
    op: int                       # the forward op that saved it
    state: Literal["activation", "parameter", "buffer"]
    producer: int = -1            # forward op that wrote the storage (-1: an input)


@dataclass(frozen=True, kw_only=True)
class ModuleCall:
    """The first call of one module's forward."""

    output: TensorMeta | None     # its largest floating-point output
    order: int                    # position in the order modules were first entered


@dataclass(frozen=True, kw_only=True)
class OpaqueLeaf:
    """A module that could not be traced on fake tensors."""

    path: str
    error: str
    how: Literal["measured", "estimated"]
    fwd_s: float = 0.0            # measured wall time on this machine, whole example input
    bwd_s: float = 0.0
    device: str = ""


@dataclass(frozen=True, kw_only=True)
class Capture:
    """Everything one trace recorded."""

    records: tuple[OpRecord, ...]
    saved: tuple[SavedRecord, ...]
    modules: dict[str, ModuleCall]
    classes: dict[str, str]                  # module path -> class name, every module
    params: dict[str, tuple[int, ...]]       # parameter path -> shape (each shared parameter once)
    frozen_params: frozenset[str] = frozenset()     # of those, the paths with requires_grad False (build.py:
                                                    # ``Op.frozen``)
    param_aliases: dict[str, str]            # other path of a shared parameter -> its first path
    batch: int                               # first dimension of the first example input
    input_shapes: tuple[tuple[tuple[int, ...], str], ...]
    activation_dtype: str                    # dtype of the floating-point parameters
    device: str
    opaque: tuple[OpaqueLeaf, ...] = ()
    windows: dict[str, int] = field(default_factory=dict)     # module path -> sliding-window span it declares
    # module paths tensor parallelism's styles split: nn.Linear and its subclasses (torch's ColwiseParallel
    # and RowwiseParallel take nn.Linear and nn.Embedding only; GPT-2's Conv1D is neither)
    linears: frozenset[str] = frozenset()
    warnings: tuple[str, ...] = field(default=())
    replays: dict[int, object] = field(default_factory=dict)   # op index -> (func, args with TensorMeta)

    def activation_saves(self) -> list[SavedRecord]:
        """The first saved record of each activation storage, in the order they were saved."""
        seen: set[int] = set()
        out = []
        for s in self.saved:
            if s.state == "activation" and s.storage not in seen:
                seen.add(s.storage)
                out.append(s)
        return out
