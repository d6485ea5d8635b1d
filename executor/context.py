"""Context parallelism: the sequence split over the ``cp`` ranks, keys and values all-gathered.

The scheme of the Llama 3 paper (Dubey et al. 2024, Sec 3.3.2): the sequence is cut into
2 x cp chunks and cp rank i holds chunks i and 2 cp - 1 - i, so that under the causal mask
every rank has the same attention work (an early chunk and a late one). Each attention
layer all-gathers the keys and values of the whole sequence over the cp group (its backward
reduce-scatters their gradients), puts them in sequence order, and attends each of its two
query chunks to the keys up to that chunk's end (causal, aligned to the chunk's last query:
``torch.nn.attention.bias.causal_lower_right``, which SDPA runs with its flash or efficient
kernels on CUDA and its math kernel on CPU). The collectives are torch.distributed's
``all_gather_single`` and ``reduce_scatter_single``: gloo on CPU, NCCL on GPUs.

Multi-head latent attention gathers its keys and values as they enter the core (every head's,
after the up-projection), as the planner prices its core (planner/layers.py ``_mla_ops``).

Everything else of a block (projections, norms, MLP) is per token and needs nothing: each
rank runs it on its own chunks. Positions (RoPE, GPT's learned positions) are the tokens'
global ones (``SequenceLayout.positions`` in executor/models.py).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .models import Attention, Embedding, LatentAttention, SequenceLayout


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (forward); reduce-scatter the gradient (backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None, None


def gather_sequence(x: torch.Tensor, *, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Every cp rank's keys (or values) in sequence order. x: (B, n, 2c, hd) -> (B, n, 2 c cp, hd),
    where the local 2c tokens are chunks (rank, 2 cp - 1 - rank) of c tokens each."""
    b, n, local, hd = x.shape
    c = local // 2
    ranks = _GatherSequence.apply(x, group, size).view(size, b, n, 2, c, hd)   # (cp, B, n, 2, c, hd)
    early, late = ranks[:, :, :, 0], ranks[:, :, :, 1].flip(0)                 # chunks 0..cp-1, cp..2cp-1
    chunks = torch.cat([early, late])                                          # (2cp, B, n, c, hd)
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, n, 2 * size * c, hd)


def shard_sequence(tokens: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """This cp rank's tokens of a (B, S) batch: its two chunks, (B, S / cp)."""
    local = tokens.shape[1] // layout.cp
    return tokens.index_select(1, layout.positions(local, tokens.device))


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> SequenceLayout:
    """Context parallelism on ``model`` (or a pipeline stage of it): every attention layer gathers
    keys and values over ``cp_mesh``, and every module that uses positions learns this rank's.
    Returns the layout, for cutting the batch (``shard_sequence``)."""
    layout = SequenceLayout(cp=cp_mesh.size(), rank=cp_mesh.get_local_rank())
    exchange = partial(gather_sequence, group=cp_mesh.get_group(), size=cp_mesh.size())
    for module in model.modules():
        if isinstance(module, (Attention, LatentAttention, Embedding)):
            module.layout = layout
        if isinstance(module, (Attention, LatentAttention)):
            module.exchange = exchange
    return layout
