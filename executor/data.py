"""Seeded synthetic data: the same global batch for a step whatever the plan.

The global batch of step ``s`` is drawn from a generator seeded by (seed, s);
each data-parallel rank takes its contiguous slice. Losses can therefore be
compared across plans and across a checkpoint/resume.
"""
from __future__ import annotations

import torch


def global_batch(step: int, *, seed: int, batch: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Token ids of the whole step: (batch, seq_len + 1); inputs are [:, :-1], targets [:, 1:]."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)


def local_batch(step: int, *, seed: int, batch: int, seq_len: int, vocab_size: int, dp: int,
                dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one data-parallel rank: (batch / dp, seq_len) each."""
    tokens = global_batch(step, seed=seed, batch=batch, seq_len=seq_len, vocab_size=vocab_size)
    per_rank = batch // dp
    mine = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]     # (B / dp, S + 1)
    return mine[:, :-1], mine[:, 1:]
