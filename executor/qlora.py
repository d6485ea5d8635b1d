"""QLoRA's frozen base (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314):
every linear of the blocks stored as 4-bit NormalFloat with double quantization, dequantized at each use, under
LoRA's adapters (executor/lora.py).

The weights are quantized by bitsandbytes (``bitsandbytes.functional.quantize_4bit``: NF4, blocks of 64 weights
with one absmax each, the absmaxes quantized again in blocks of 256: ``compress_statistics``, the paper's Sec 3)
and multiplied by ``bitsandbytes.matmul_4bit``, which dequantizes the weight to the input's dtype and runs a
plain GEMM (its ``MatMul4Bit`` keeps only the packed weight for backward and returns no weight gradient), as
bitsandbytes' ``Linear4bit`` and PEFT's QLoRA recipes run them. Embeddings, norms and the head stay at the
training dtype, as transformers' ``BitsAndBytesConfig`` leaves ``lm_head`` unquantized (planner/finetune.py
prices the same split).

Each base weight is quantized whole, from its real value, once the model is materialised (``quantize_base``,
called by executor/parallelize.py after ``materialize``): the base's initial values are a function of the
parameter's name and the seed (executor/models.py ``full_init``), so every plan quantizes the same tensors into
the same blocks and a distributed run equals a single-process one. That is why the runtime table
(planner/runtimes.py ``nf4_base_*``) keeps QLoRA off tensor parallelism and FSDP2's wrappers, which hold shards
or DTensors by then. The packed weight stays a (frozen, uint8) parameter of its linear under the name
``weight``, so the rank's parameter bytes count it; the quantization constants live on the module
(``quant_state``) and are rebuilt, not checkpointed: a resumed run quantizes the same initial weights again.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from planner.errors import UserError

from .lora import LoraLinear

BLOCKSIZE = 64          # weights per absmax (Dettmers et al. 2023, Sec 3, Double Quantization: blocks of 64)


@functools.cache
def bitsandbytes():
    """The ``bitsandbytes`` module, or one line saying how to install it (looked up once). Its CPU backend logs a
    warning when an optional kernel package is missing; the PyTorch implementations it falls back to are the ones
    used."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError("QLoRA quantizes the base with bitsandbytes, which is not installed: "
                         "pip install 'meshplan[qlora]' (or plan with --finetune lora)", field="workload.finetune") from None
    return bnb


class NF4Linear(nn.Linear):
    """An ``nn.Linear`` whose ``weight`` is NF4-packed (frozen, uint8) with its ``quant_state``."""

    quant_state: object

    def base(self, x: torch.Tensor) -> torch.Tensor:
        bnb = bitsandbytes()
        return bnb.matmul_4bit(x, self.weight.t(), quant_state=self.quant_state, bias=self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)


class NF4LoraLinear(NF4Linear, LoraLinear):
    """A LoRA target over an NF4 base: ``LoraLinear``'s adapter added to the dequantized product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.adapter(x)


def quantize_base(model: nn.Module) -> list[str]:
    """Quantize every linear of ``model``'s blocks (meshplan's reference model, or a pipeline stage of it) to NF4 in
    place, from its current (real, unsharded) weight; returns their paths. Their biases, the adapters, the
    embedding, the norms and the head are left as they are."""
    functional = bitsandbytes().functional
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise UserError("QLoRA quantizes meshplan's own models (their blocks under `layers`)", field="workload.finetune")
    done = []
    for index, block in layers.items():
        for rel, module in block.named_modules():
            if not isinstance(module, nn.Linear) or isinstance(module, NF4Linear):
                continue
            weight = module.weight
            if type(weight) is not nn.Parameter or weight.device.type == "meta":
                raise UserError(f"layers.{index}.{rel}: QLoRA quantizes real, whole weights (this one is a "
                                f"{type(weight.data).__name__} on {weight.device.type}); allowed: tp 1 and ZeRO-0 "
                                "or ZeRO-1", field="workload.finetune")
            packed, state = functional.quantize_4bit(weight.detach(), blocksize=BLOCKSIZE, compress_statistics=True,
                                                    quant_type="nf4")
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.quant_state = state
            module.__class__ = NF4LoraLinear if isinstance(module, LoraLinear) else NF4Linear
            done.append(f"layers.{index}.{rel}")
    return done
