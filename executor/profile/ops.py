"""Time each traced operator on the local device (``meshplan profile --ops``).

Every aten call the trace recorded (forward and backward) is replayed alone
with random tensors of the recorded shapes, strides and dtypes, and timed (best
of ``repeat`` after a warm-up). A layer-graph op's time is the sum over its
calls; per token, it is what ``Op.measured_fwd_s`` / ``measured_bwd_s`` hold.
Values the replay cannot know are made valid: integer tensors are zeros
(indices into any table), masks are all true, and the group offsets of
``_grouped_mm`` split the rows evenly among the experts (balanced routing).
Views move no data and are not timed. An op whose calls cannot all be replayed
is left out (the cost model keeps its roofline for it).
"""
from __future__ import annotations

import sys
from pathlib import Path

from planner.trace.measured import op_signature

from .device import best_of


def _make(spec, device: str):
    import torch
    _, shape, stride, dtype, _ = spec
    size = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(s > 0 for s in shape) else 0
    base = torch.empty(max(size, 1), dtype=dtype, device=device)
    if dtype.is_floating_point:
        base.normal_()
    elif dtype == torch.bool:
        base.fill_(True)
    else:
        base.zero_()
    return base.as_strided(shape, stride)


def _offsets(args, device: str):
    """Even group offsets for _grouped_mm(a, b, offs): rows of a split among b's groups."""
    import torch
    a, b, offs = args[0], args[1], args[2]
    total = a.shape[-1] if a.dim() == 2 and b.dim() == 2 else a.shape[0]
    groups = offs.shape[0]
    return torch.tensor([round((e + 1) * total / groups) for e in range(groups)], dtype=offs.dtype, device=device)


def _materialise(func, tree, device: str):
    import torch.utils._pytree as pytree
    args, kwargs = pytree.tree_map(lambda x: _make(x, device) if isinstance(x, tuple) and x and x[0] == "tensor"
                                   else x, tree, is_leaf=lambda x: isinstance(x, tuple) and x[:1] == ("tensor",))
    if func._opname == "_grouped_mm" and len(args) > 2 and args[2] is not None:
        args = (*args[:2], _offsets(args, device), *args[3:])
    return args, kwargs


def time_call(func, tree, device: str, repeat: int) -> float:
    """Best wall time of one aten call on fresh random inputs."""
    import torch
    args, kwargs = _materialise(func, tree, device)
    with torch.no_grad():
        return best_of(lambda: func(*args, **kwargs), device, repeat)


def time_ops(result, *, device: str = "cpu", repeat: int = 3) -> tuple[dict[str, dict], list[str]]:
    """{op signature: per-token forward/backward seconds} for every op of the traced graph, and the
    ops that could not be replayed."""
    cap = result.capture
    if not cap.replays:
        raise ValueError("the trace kept no replays: trace with keep_replays=True")
    entries: dict[str, dict] = {}
    failed: list[str] = []
    for layer in result.graph.layers:
        for op in layer.ops:
            sig = op_signature(op)
            fwd_idx, bwd_idx = result.op_records.get((layer.name, op.name), ((), ()))
            if sig in entries or not fwd_idx:
                continue
            try:
                times = [sum(time_call(*cap.replays[i], device, repeat) for i in idx
                             if not cap.records[i].view and i in cap.replays) for idx in (fwd_idx, bwd_idx)]
            except Exception as e:       # an op replay cannot rebuild: keep the roofline for it
                failed.append(f"{layer.name}/{op.name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            entries[sig] = {"fwd_s_per_token": times[0] / result.tokens, "bwd_s_per_token": times[1] / result.tokens,
                            "example": f"{layer.name}/{op.name}", "kind": op.kind}
    return entries, failed


def profile_ops(model: str, *, example_input: str | None, profile: Path, command: str, device: str,
                threads: int) -> Path:
    """Trace ``model`` keeping its replays, time each of its ops here with ``threads`` CPU threads and
    write them to NAME.ops.json beside the profile TOML ``profile``; that path. An op that could not be
    timed is said on stderr (the cost model keeps its roofline)."""
    import torch

    from planner.trace.load import trace_any
    from planner.trace.measured import ops_path_for, write_ops_profile
    result, _ = trace_any(model, example_input, keep_replays=True, device=device)
    torch.set_num_threads(threads)
    entries, failed = time_ops(result, device=device)
    for line in failed:
        sys.stderr.write(f"meshplan profile: not timed (roofline kept): {line}\n")
    path = ops_path_for(profile)
    write_ops_profile(path, command=command, device=device, dtype=result.capture.activation_dtype.replace("torch.", ""),
                      model=model, seq_len=result.graph.seq_len, tokens=result.tokens, entries=entries)
    return path
