"""A module that cannot be traced on fake tensors becomes one opaque leaf, never a crash.

Fake tensors have shapes but no values, so a module whose Python depends on
values (``if x.sum() > 0``, ``nonzero`` routing, ``.item()``) fails there. The
module wrapper (capture.py) catches the failure in the innermost module and
calls ``run_opaque``:

- measured: when its parameters fit ``real_budget_bytes``, the module runs for
  real on the local CPU with random weights and random inputs of the traced
  shapes, forward and backward, with the recorder on: its operators, FLOPs,
  bytes and saved tensors are counted as they really happen, and its wall time
  is timed (best of 3) for the warning.
- estimated: otherwise its forward is taken as 2 FLOPs per parameter per row
  (the 2N rule, Kaplan et al. 2020, arXiv:2001.08361, Sec 2.1) and its output as
  shaped like its first input.

Either way the rest of the model goes on tracing on fake tensors: the opaque
module hands back fake outputs of the right shapes, connected to its inputs by
an autograd function whose backward returns zeros, so earlier modules still get
their backward traced.
"""
from __future__ import annotations


import torch
import torch.utils._pytree as pytree

from ..errors import UserError
from .measured import best_of
from .records import OpaqueLeaf, OpRecord


class _OpaqueOutputs(torch.autograd.Function):
    """Fake outputs of given shapes that depend on the module's inputs (zero gradients back)."""

    @staticmethod
    def forward(ctx, state, device, metas, *inputs):
        ctx.state = state
        ctx.metas_in = [(i.shape, i.dtype) for i in inputs]
        with state.suppressed():
            outs = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        with ctx.state.suppressed():
            zeros = [torch.zeros(shape, dtype=dtype, device=grads[0].device) if dtype.is_floating_point else None
                     for shape, dtype in ctx.metas_in]
        return (None, None, None, *zeros)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160]}" if text else type(error).__name__


def _real_tensor(t: torch.Tensor, original: torch.Tensor | None = None) -> torch.Tensor:
    """A real CPU tensor for a fake one: the user's values when real, else random weights."""
    if original is not None and original.device.type != "meta":
        return original.detach().clone().requires_grad_(original.requires_grad)
    if t.is_floating_point():
        out = torch.randn(t.shape, dtype=t.dtype) * 0.02
        return out.requires_grad_(t.requires_grad)
    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=torch.bool)
    return torch.zeros(t.shape, dtype=t.dtype)       # valid indices into any table


def _real_state(state, path: str, module: torch.nn.Module) -> dict:
    prefix = f"{path}." if path else ""
    out = {}
    with state.suppressed():
        for name, p in module.named_parameters():
            out[name] = _real_tensor(p, state.original_params.get(state.canonical(prefix + name)))
            state.register_param(out[name], state.canonical(prefix + name), buffer=False)
        for name, b in module.named_buffers():
            out[name] = _real_tensor(b, state.original_buffers.get(prefix + name))
            state.register_param(out[name], prefix + name, buffer=True)
    return out


def _fake_outputs(state, real_out, args, kwargs):
    """Fake tensors shaped like ``real_out``, attached to the fake inputs that need gradients."""
    flat, spec = pytree.tree_flatten(real_out)
    metas = [(tuple(t.shape), t.dtype) for t in flat if isinstance(t, torch.Tensor)]
    needs_grad = [t for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.requires_grad]
    fakes = iter(_OpaqueOutputs.apply(state, state.device, metas, *needs_grad))
    return pytree.tree_unflatten([next(fakes) if isinstance(t, torch.Tensor) else t for t in flat], spec)


def _run_real(state, module, real, args, kwargs):
    """Forward and backward for real with the recorder on; returns (outputs, fwd_s, bwd_s)."""
    from torch.func import functional_call
    from torch.utils._python_dispatch import _disable_current_modes

    def forward():
        return functional_call(module, real, r_args, r_kwargs, tie_weights=True, strict=False)

    def backward(out):
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            with state.suppressed():
                grads = [torch.randn_like(t) for t in outs]
            torch.autograd.backward(outs, grads)

    with state.suppressed():
        r_args, r_kwargs = pytree.tree_map(lambda x: _real_tensor(x) if isinstance(x, torch.Tensor) else x,
                                           (args, kwargs))
    with torch.enable_grad():
        out = forward()                         # recorded: these are the module's operators
        backward(out)
        with _disable_current_modes(), state.suppressed():     # timed without the recorder
            fwd_s = best_of(forward)
            bwd_s = best_of(lambda: backward(forward())) - fwd_s
    return out, fwd_s, max(bwd_s, 0.0)


def run_opaque(state, path: str, module: torch.nn.Module, args, kwargs, error: Exception):
    """Outputs for a module that failed on fake tensors (see the module docstring)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    where = path or "<root module>"
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    if params > state.real_budget_bytes:
        return _estimated(state, path, module, args, kwargs, error)
    state.real_mode += 1
    state.opaque_path = path
    try:
        with unset_fake_temporarily():
            real = _real_state(state, path, module)
            real_out, fwd_s, bwd_s = _run_real(state, module, real, args, kwargs)
    except UserError:
        raise
    except Exception as real_error:
        raise UserError(f"{where} fails on the example input even when run for real "
                        f"({_first_line(real_error)}; on fake tensors: {_first_line(error)})",
                        source=where) from None
    finally:
        state.real_mode -= 1
        state.opaque_path = ""
    state.flush()
    state.opaque.append(OpaqueLeaf(path=path, error=_first_line(error), how="measured", fwd_s=fwd_s, bwd_s=bwd_s,
                                   device="cpu"))
    state.warnings.append(
        f"{where}: cannot be traced on fake tensors ({_first_line(error)}); ran it for real on the CPU with "
        f"random weights and counted its operators as they ran (forward {fwd_s * 1e3:.2f} ms, backward "
        f"{bwd_s * 1e3:.2f} ms on this machine for the example input)")
    return _fake_outputs(state, real_out, args, kwargs)


def _estimated(state, path, module, args, kwargs, error):
    """Too large to run here: 2 FLOPs per parameter per row, output shaped like the first input."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    floats = [t for t in tensors if t.is_floating_point()] or tensors
    if not floats:
        raise UserError(f"cannot be traced ({_first_line(error)}) and has no tensor input to size it by",
                        source=path or "<root module>")
    first = floats[0]
    numel = sum(p.numel() for p in module.parameters())
    rows = first.numel() // max(1, first.shape[-1]) if first.dim() else 1
    with state.suppressed():
        meta = state.meta(first)
    state.records.append(OpRecord(index=len(state.records), func="opaque", name="opaque", module=path, phase="fwd",
                                  flops=2.0 * numel * rows, bytes_read=meta.addressed_bytes,
                                  bytes_written=meta.addressed_bytes, inputs=(meta,), outputs=(meta,),
                                  opaque=path or "<root>"))
    state.opaque.append(OpaqueLeaf(path=path, error=_first_line(error), how="estimated"))
    state.warnings.append(
        f"{path or '<root module>'}: cannot be traced on fake tensors ({_first_line(error)}) and is too large to "
        f"run for real here ({numel:,} parameters): estimated as 2 FLOPs per parameter per row (Kaplan et al. "
        "2020), output shaped like its input")
    return _fake_outputs(state, first, args, kwargs)
