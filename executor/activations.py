"""The recompute policies of plan.json as torch runs them on one transformer block (planner/recompute.py
says what each one is; planner/cost/layer.py prices exactly these mechanisms).

- ``op``: operator-level selective activation checkpointing, torchtitan's ``SelectiveAC``
  (torchtitan/distributed/activation_checkpoint.py): the block runs under non-reentrant
  ``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts``; the outputs of the ops in
  ``SAVE_OPS`` are kept (MUST_SAVE), except every second ``aten.mm``, and everything else is recomputed
  (PREFER_RECOMPUTE) when backward reaches the block.
- ``activation-offload``: the tensors autograd saves inside the block go to host memory as they are saved
  (``torch.autograd.graph.saved_tensors_hooks``) and come back for backward, prefetched: when a block's
  backward starts (its first unpack), the copy-in of the block before it (the newest block of the same
  device whose backward has not started and whose forward ran before this one's: the block before, of
  the same micro-batch, under GPipe and 1F1B orders alike) is issued, so that it runs while this block's
  backward computes, as torchtune's ``OffloadActivations`` does with ``use_streams=True``. Two blocks'
  saved tensors are then on the device at once: the one whose backward runs and the one before it,
  copied in beside it (what planner/cost/layer.py prices). On CUDA the copies go through pinned host
  memory on one side stream per device, and the compute stream waits for a copy-in (an event per
  storage) only where it uses it; on CPU a prefetch is the same copy done earlier.
"""
from __future__ import annotations

import threading
import weakref
from functools import partial
from itertools import count
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MM_OPS = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


def _save_ops() -> frozenset:
    """torchtitan's save list (``_get_default_save_ops``): torch's compute-intensive ops (aten.mm,
    addmm, bmm, the flash and efficient attention kernels: torch._functorch.partitioners.get_default_op_list),
    the other SDPA kernels, aten.max, the reduce-scatter and all-to-all; and the CPU flash kernel, the same
    SDPA call on this machine's CPU, which torchtitan (GPU only) does not list. Its MoE-only rules (router
    shapes recomputed, device-to-host copies saved) are left out: the reference models have no experts."""
    from torch._functorch.partitioners import get_default_op_list
    aten, comm = torch.ops.aten, torch.ops._c10d_functional
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops |= {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
            aten._scaled_dot_product_fused_attention_overrideable.default, aten.max.default,
            comm.reduce_scatter_tensor.default, comm.all_to_all_single.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    return frozenset(ops)


SAVE_OPS = _save_ops()


def _op_policy() -> Callable:
    """One block's policy function: a fresh mm count per checkpointed call, kept apart for the forward
    and for the recompute (they must agree on which mm outputs were saved)."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MM_OPS:
            counts[ctx.is_recompute] += 1
        if func in SAVE_OPS and not (func in MM_OPS and counts[ctx.is_recompute] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def op_contexts():
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for the ``op`` policy."""
    return create_selective_checkpoint_contexts(_op_policy())


def checkpoint_forward(module: nn.Module, **kwargs) -> Callable:
    """``module``'s own forward under ``torch.utils.checkpoint`` (non-reentrant), to assign to
    ``module.forward``: the module keeps only its input (and, with ``context_fn=op_contexts``, the outputs
    the selective policy saves) and recomputes the rest in backward."""
    return partial(checkpoint, type(module).forward.__get__(module), use_reentrant=False, **kwargs)


# -- offload ------------------------------------------------------------------------------------------

class _Kept:
    """A saved tensor left where it is (a parameter: the module holds it anyway)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Moved:
    """Where to find a saved tensor again: its storage on the host, and its view of that storage."""

    __slots__ = ("stash", "key", "dtype", "offset", "size", "stride", "spec", "requires_grad")

    def __init__(self, stash: "HostStash", key: int, t: torch.Tensor, spec=None, requires_grad: bool = False):
        self.stash, self.key, self.spec, self.requires_grad = stash, key, spec, requires_grad
        self.dtype, self.offset, self.size, self.stride = t.dtype, t.storage_offset(), t.size(), t.stride()


class _Pending:
    """Per device, the stashes whose backward has not started, in the order of their forwards: weakly held,
    so that a stash leaves when its graph dies without a backward (an eval forward with grad enabled, a
    dropped loss); a forward under ``torch.no_grad`` packs nothing and its stash dies as it returns."""

    def __init__(self):
        self._lock = threading.RLock()      # backward may run on autograd's device threads; gc callbacks anywhere
        self._seq = count()
        self._stashes: dict[torch.device, dict[int, weakref.ref]] = {}   # device -> {creation seq -> stash}

    def add(self, stash: "HostStash") -> int:
        """Register a new stash; its creation number."""
        with self._lock:
            seq = next(self._seq)
            forget = partial(self._drop, stash.device, seq)
            self._stashes.setdefault(stash.device, {})[seq] = weakref.ref(stash, forget)
        return seq

    def _drop(self, device: torch.device, seq: int, _ref=None) -> None:
        with self._lock:
            pending = self._stashes.get(device, {})
            pending.pop(seq, None)
            if not pending:
                self._stashes.pop(device, None)

    def start(self, stash: "HostStash") -> "HostStash | None":
        """``stash``'s backward starts: off the list, and the newest stash still pending on its device that
        was created before it (the block before, whose backward comes next), or None."""
        self._drop(stash.device, stash.seq)
        with self._lock:
            before = [ref for seq, ref in self._stashes.get(stash.device, {}).items() if seq < stash.seq]
        for ref in reversed(before):
            prev = ref()
            if prev is not None:
                return prev
        return None

    def stashes(self, device: torch.device) -> list["HostStash"]:
        """The live stashes pending on ``device``, oldest first."""
        with self._lock:
            refs = list(self._stashes.get(device, {}).values())
        return [s for s in (ref() for ref in refs) if s is not None]

    def __len__(self) -> int:
        """Entries held, all devices (a dead stash's entry leaves as it dies)."""
        with self._lock:
            return sum(len(p) for p in self._stashes.values())


PENDING = _Pending()
_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device):
    """The copy stream of a CUDA ``device``, shared by all offloaded blocks (None elsewhere)."""
    if device.type != "cuda":
        return None
    return _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))


class HostStash:
    """The saved tensors of one forward of one block, in host memory: each storage copied once however
    many saved tensors view it, and brought back once for backward: all of them when the block's
    backward starts, if the block after it has not prefetched them already, and then the block before it
    prefetched (``PENDING``). The copies back live until the block's backward has used them all.
    Parameters stay: the module holds them anyway. ``host_bytes`` is what went to the host."""

    def __init__(self, module: nn.Module, device: torch.device, stream=None):
        self.device, self.stream = device, stream
        self.params = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
        self.host: dict[int, torch.Tensor] = {}        # storage key -> uint8 copy on the host
        self.back: dict[int, torch.Tensor] = {}        # storage key -> uint8 copy on the device again
        self.ready: dict[int, torch.cuda.Event] = {}   # storage key -> its copy-in done (CUDA), until first use
        self._alive: list = []                          # the device storages, until the forward ends
        self.started = False                            # its backward has begun
        self.seq = PENDING.add(self)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() for t in self.host.values())

    def pack(self, tensor: torch.Tensor):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor
        if isinstance(tensor, AsyncCollectiveTensor):
            tensor = tensor.wait()
        spec, t = (tensor._spec, tensor._local_tensor) if isinstance(tensor, DTensor) else (None, tensor)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.params or storage.nbytes() == 0:
            return _Kept(tensor)
        if key not in self.host:
            self.host[key] = self._copy_out(t)
            self._alive.append(storage)     # its address may not be reused while the forward keys by it
        return _Moved(self, key, t, spec, tensor.requires_grad)

    def _copy_out(self, t: torch.Tensor) -> torch.Tensor:
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())   # (nbytes,)
        if self.stream is None:
            return src.clone() if src.device.type == "cpu" else src.to("cpu")
        host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(src.device))    # the tensor is written
        with torch.cuda.stream(self.stream):
            host.copy_(src, non_blocking=True)
        src.record_stream(self.stream)           # its memory is not reused before the copy has read it
        return host

    def _copy_in(self, key: int) -> torch.Tensor:
        """Issue the copy of one storage back to the device (on CUDA on the side stream, after the copy out
        it queued there; ``ready`` marks its end)."""
        host = self.host[key]
        if self.stream is None:
            return host if self.device.type == "cpu" else host.to(self.device)
        with torch.cuda.stream(self.stream):
            dev = host.to(self.device, non_blocking=True)
            self.ready[key] = self.stream.record_event()
        return dev

    def bring_back(self) -> None:
        """Issue the copy-in of every storage not back yet."""
        for key in self.host:
            if key not in self.back:
                self.back[key] = self._copy_in(key)

    def _start_backward(self) -> None:
        """The first unpack: this block's storages back (unless prefetched), then the block before's."""
        self.started = True
        before = PENDING.start(self)
        self.bring_back()
        if before is not None:
            before.bring_back()

    def _on_device(self, key: int) -> torch.Tensor:
        """The storage back on the device, the compute stream ordered after its copy-in (CUDA)."""
        if key not in self.back:            # not met: _start_backward brought every storage back
            self.back[key] = self._copy_in(key)
        dev = self.back[key]
        done = self.ready.pop(key, None)
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            dev.record_stream(current)      # allocated on the side stream, used on this one
        return dev

    @staticmethod
    def unpack(packed) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        stash = packed.stash
        if not stash.started:
            stash._start_backward()
        storage = stash._on_device(packed.key).untyped_storage()
        t = torch.empty(0, dtype=packed.dtype, device=storage.device).set_(storage, packed.offset, packed.size,
                                                                              packed.stride)
        if packed.spec is not None:
            from torch.distributed.tensor import DTensor
            t = DTensor(t, packed.spec, requires_grad=packed.requires_grad)
        return t

    def forward_done(self) -> None:
        self._alive.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def offload_forward(module: nn.Module, on_stash: Callable[[HostStash], None] | None = None) -> Callable:
    """``module``'s own forward with the tensors autograd saves moved to host memory (``HostStash``), to
    assign to ``module.forward``. ``on_stash`` sees each forward's stash (measurements)."""
    forward = type(module).forward.__get__(module)

    def run(*args, **kwargs):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        stash = HostStash(module, device, side_stream(device))
        if on_stash is not None:
            on_stash(stash)
        with torch.autograd.graph.saved_tensors_hooks(stash.pack, HostStash.unpack):
            out = forward(*args, **kwargs)
        stash.forward_done()
        return out
    return run


def _selective(block: nn.Module, attention_core: Callable | None) -> None:
    """Checkpoint the block's own attention core (SDPA, which the caller names as ``attention_core``, or
    executor/models.py ``masked_attention``; of the module ``SinkAttention``, which holds parameters, its forward)."""
    core = block.attn.core
    if isinstance(core, nn.Module):
        core.forward = partial(checkpoint, type(core).forward.__get__(core), use_reentrant=False)
    else:
        block.attn.core = partial(checkpoint, core, use_reentrant=False)


# How this executor applies each policy of planner/recompute.py to a transformer block (a test checks that
# these are the policies the runtime table says the torch runtime runs)
APPLY: dict[str, Callable[[nn.Module, Callable | None], None]] = {
    "none": lambda block, core: None,
    "selective": _selective,
    "op": lambda block, core: setattr(block, "forward", checkpoint_forward(block, context_fn=op_contexts)),
    "full": lambda block, core: setattr(block, "forward", checkpoint_forward(block)),
    "activation-offload": lambda block, core: setattr(block, "forward", offload_forward(block)),
}


def apply_policy(block: nn.Module, policy: str, *, attention_core: Callable | None = None) -> None:
    """Apply one recompute policy to one transformer block (``selective`` checkpoints ``attention_core``,
    the block's attention kernel call, which the caller names)."""
    if policy not in APPLY:
        raise ValueError(f"unknown recompute policy {policy!r}")
    APPLY[policy](block, attention_core)
