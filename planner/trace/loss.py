"""The training loss a trace appends when the module does not compute one itself.

Planning is for training, so a trace runs backward from a scalar. In order:

1. ``loss_fn(output, example_args)`` when the caller gives one;
2. ``output.loss`` when the module computed it (Hugging Face models given labels);
3. cross-entropy of the logits (``output.logits``, else the first floating-point
   output) against integer targets, computed in fp32 as language-model and
   classification training does (Megatron-LM and Hugging Face upcast the logits;
   the analytical head of ``planner.layers`` counts the same fp32 softmax);
4. for outputs that are not logits of a class dimension (a regression), the
   mean of squares.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree


def _logits(output):
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    floats = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return floats[0] if floats else None


def default_loss(output, inputs) -> torch.Tensor:
    """Cross-entropy of the logits against all-zero targets (the value does not change the cost)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    logits = _logits(output)
    if logits is None:
        raise ValueError("the module returned no floating-point tensor to train")
    if logits.dim() >= 2 and logits.shape[-1] > 1:
        flat = logits.reshape(-1, logits.shape[-1]).float()          # (tokens, classes) in fp32
        target = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
        return F.cross_entropy(flat, target)
    return logits.float().pow(2).mean()


def training_loss(output, inputs, loss_fn=None) -> torch.Tensor:
    loss = (loss_fn or default_loss)(output, inputs)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"the loss must be a scalar tensor, got {type(loss).__name__}")
    return loss.reshape(())
