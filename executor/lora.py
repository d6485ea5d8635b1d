"""LoRA fine-tuning (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685): the executor's own adapters on meshplan's reference models (executor/models.py),
every base parameter frozen.

A target linear ``y = W x (+ b)`` becomes ``y = W x (+ b) + (alpha / r) B (A x)`` (Hu et al. Sec 4.1,
eq. 3), with A (r, in) initialised as ``nn.Linear``'s weight (Kaiming-uniform, a = sqrt(5): bound
1/sqrt(in)) and B (out, r) zeros, so training starts from the base model. This is PEFT's default
``LoraLayer.reset_lora_parameters`` (huggingface/peft src/peft/tuners/lora/layer.py,
``init_lora_weights=True``); no dropout on the adapter's input (PEFT's ``lora_dropout=0``).

The linear stays an ``nn.Linear`` at its path (its class becomes ``LoraLinear``, a subclass, as FSDP2's
``fully_shard`` swaps a module's class), and A and B are parameters of it (``...q_proj.lora_A``,
``...q_proj.lora_B``), so:

- the adapter runs inside the tensor-parallel plan: DTensor's ``ColwiseParallel``/``RowwiseParallel``
  hooks wrap the linear's whole forward, base and adapter together (``apply_lora`` runs after
  ``apply_tp``, see ``adapter_placements`` for the layout);
- its initial values are a function of its name and the seed only (``adapter_init``, called by
  executor/models.py ``full_init`` as for every parameter), so every plan starts from the same adapters
  and a sharded run equals the single-process one;
- the data-parallel units stay the blocks, frozen base and trainable adapters in one FSDP2 unit (torch
  2.13's FSDP2 reduce-scatters only the parameters with a gradient: ``FSDPParamGroup.post_backward``
  collects ``fsdp_params_with_grad``; it asks only that the *trainable* ones share one dtype,
  ``_init_mp_dtypes``). torchtune's LoRA recipe shards each transformer layer, frozen base and LoRA
  weights together, the same way (pytorch/torchtune recipes/lora_finetune_distributed.py). A separate
  unit for the adapters would save nothing: the frozen weights must be gathered for forward (and, at
  ZeRO-3, again for the input gradients in backward) either way.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from planner.errors import UserError

# short target name -> the linear's path inside a block (executor/models.py's module names)
TARGETS: dict[str, str] = {
    "q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj", "o": "attn.o_proj",      # attention
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",              # SwiGLU MLP (Llama)
    "fc1": "mlp.fc1", "fc2": "mlp.fc2",                                                 # GELU MLP (GPT)
}
ADAPTER_LEAVES = ("lora_A", "lora_B")      # the adapter's parameter names on its linear


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """What a LoRA run adapts; everything else is frozen."""

    rank: int                               # r, the adapter's inner dimension (Hu et al. Sec 4.1)
    alpha: float                            # the update is scaled by alpha / r (Hu et al. Sec 4.1)
    targets: tuple[str, ...] = ("q", "v")   # short names of ``TARGETS`` (Hu et al. Sec 7.1 adapt W_q and W_v)
    nf4_base: bool = False                  # QLoRA: the blocks' base linears stored as NF4 (executor/qlora.py)

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise UserError(f"must be a positive integer, got {self.rank!r}", field="lora.rank")
        if not self.alpha > 0:
            raise UserError(f"must be positive, got {self.alpha!r}", field="lora.alpha")
        object.__setattr__(self, "targets", tuple(self.targets))
        target_paths(self.targets)          # refuses unknown names

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "nf4_base": self.nf4_base}

    @classmethod
    def from_json(cls, doc: dict) -> "LoraConfig":
        return cls(rank=doc["rank"], alpha=float(doc["alpha"]), targets=tuple(doc["targets"]),
                   nf4_base=bool(doc.get("nf4_base", False)))


# the update's scale alpha / r: PEFT's LoraConfig default lora_alpha = 8 (peft/tuners/lora/config.py), which the
# planner's default rank 8 (planner/finetune.py STYLES, PEFT's) makes 1; the plan does not carry alpha (it
# changes no cost)
DEFAULT_ALPHA = 8.0


def finetune_of(plan) -> LoraConfig | None:
    """The LoRA settings of ``plan`` (a ``Plan``): plan.json's workload ``finetune`` "lora" or "qlora" (its base in
    NF4) with its ``lora_rank`` and ``lora_targets`` (planner/finetune.py); None for full training."""
    w = plan.workload
    if w.finetune == "full":
        return None
    return LoraConfig(rank=w.lora_rank, alpha=DEFAULT_ALPHA, targets=tuple(w.lora_targets),
                      nf4_base=w.finetune == "qlora")


def target_paths(targets: tuple[str, ...]) -> tuple[str, ...]:
    """The block-relative paths of ``targets`` (short names, or the linears' own names: "q" or "q_proj");
    an unknown name is refused, naming the allowed ones."""
    by_leaf = {path.rsplit(".", 1)[1]: path for path in TARGETS.values()}
    if not targets:
        raise UserError("name at least one linear to adapt", field="lora.targets")
    paths = []
    for name in targets:
        path = TARGETS.get(name) or by_leaf.get(name)
        if path is None:
            allowed = ", ".join(f"{short} ({path})" for short, path in TARGETS.items())
            raise UserError(f"unknown LoRA target {name!r}; allowed: {allowed}", field="lora.targets")
        if path not in paths:
            paths.append(path)
    return tuple(paths)


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter: ``lora_A`` (r, in), ``lora_B`` (out, r), ``scaling`` alpha / r.
    Under tensor parallelism every tensor here is a DTensor (the TP hooks around ``forward`` made the
    input one), and DTensor keeps the base's and the adapter's partial sums apart until the hooks
    reduce them together (``adapter_placements``)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.adapter(x)      # (..., out)

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        """s B (A x): (..., out), through the r-wide (..., r)."""
        return self.scaling * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def adapter_placements(weight: torch.Tensor) -> tuple[tuple[Placement, ...], tuple[Placement, ...]] | None:
    """The tensor-parallel layout of a linear's adapter (A's placements, B's), from its base weight's
    (W: (out, in)); None for a plain tensor. B follows W's output dimension, A its input dimension
    (Megatron's LoRA layout: PEFT's ``LoraParallelLinear``, huggingface/peft src/peft/tuners/lora/tp_layer.py,
    and Megatron-Bridge/NeMo's ``LoRALinear`` adapters):

    - column-parallel W (Shard(0): output features split): A replicated, B column-sharded (Shard(0)).
      A x is whole on every rank, B A x is this rank's output columns, added to W x's;
    - row-parallel W (Shard(1): input features split, x split likewise): A row-sharded along its input
      (Shard(1)), B replicated. A x is then a partial sum over the tp ranks, and so is B (A x) (B is
      linear), added to W x's partial sum: the one all-reduce (reduce-scatter under sequence parallelism)
      of RowwiseParallel's output reduces both, as Megatron reduces the base's;
    - replicated W: both replicated.
    """
    if not isinstance(weight, DTensor):
        return None
    a, b = [], []
    for placement in weight.placements:
        if placement == Shard(0):
            a.append(Replicate())
            b.append(Shard(0))
        elif placement == Shard(1):
            a.append(Shard(1))
            b.append(Replicate())
        elif placement == Replicate():
            a.append(Replicate())
            b.append(Replicate())
        else:
            raise UserError(f"a LoRA target's weight is laid out as {weight.placements}; allowed: column-parallel, "
                            "row-parallel or replicated linears", field="lora.targets")
    return tuple(a), tuple(b)


def adapter_shapes(out_features: int, in_features: int, rank: int) -> dict[str, tuple[int, int]]:
    """The whole shapes of a linear's adapter, by leaf name: A (r, in), B (out, r) (Hu et al. Sec 4.1)."""
    return {"lora_A": (rank, in_features), "lora_B": (out_features, rank)}


def adapter_init(key: str, shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial value of adapter parameter ``key`` (".lora_A" or ".lora_B"), a function of its
    name and the seed only (as executor/models.py ``full_init``): A Kaiming-uniform with a = sqrt(5)
    (``nn.Linear.reset_parameters``; PEFT's LoRA A), B zeros (PEFT's LoRA B, Hu et al. Sec 4.1)."""
    if key.endswith(".lora_B"):
        return torch.zeros(shape)
    digest = zlib.crc32(key.encode())          # stable across processes (hash() is not)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + digest)
    return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=gen)


def _adapter_param(key: str, shape: tuple[int, int], weight: torch.Tensor, placements, seed: int) -> nn.Parameter:
    """Adapter parameter ``key`` beside base ``weight``: on its device and mesh, with ``placements`` there;
    initialised unless the weight is on the meta device (``materialize`` fills it, by name)."""
    device = weight.device
    full = torch.empty(shape, dtype=weight.dtype, device=device)
    if device.type != "meta":
        full.copy_(adapter_init(key, shape, seed))
    if placements is not None:      # each rank keeps its own shard of the full value: no communication
        full = distribute_tensor(full, weight.device_mesh, placements, src_data_rank=None)
    return nn.Parameter(full)


def apply_lora(model: nn.Module, *, rank: int, alpha: float, targets: tuple[str, ...], seed: int = 0) -> list[str]:
    """Add a LoRA adapter to each ``targets`` linear of every block ``model`` (meshplan's reference model, or a
    pipeline stage of it) holds, and freeze everything else: embeddings, norms, the head and the base linears.
    After ``apply_tp`` (the adapters take their base's layout: ``adapter_placements``) and before the
    data-parallel wrappers (FSDP2 records each parameter's requires_grad when it shards it). On a real model the
    adapters are initialised here (``adapter_init``, from ``seed``); on the meta device ``materialize`` does.
    Returns the adapted linears' paths."""
    config = LoraConfig(rank=rank, alpha=alpha, targets=tuple(targets))
    paths = target_paths(config.targets)
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise UserError("LoRA adapters apply to meshplan's own models (their blocks under `layers`)",
                        field="lora.targets")
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = []
    for index, block in layers.items():
        modules = dict(block.named_modules())
        for rel in paths:
            path = f"layers.{index}.{rel}"
            linear = modules.get(rel)
            if type(linear) is not nn.Linear:
                have = [short for short, p in TARGETS.items() if type(modules.get(p)) is nn.Linear]
                what = "no such linear" if linear is None else f"a {type(linear).__name__}, not a plain nn.Linear"
                raise UserError(f"{path}: {what} in this model; LoRA targets of its blocks: {', '.join(have)}",
                                field="lora.targets")
            weight = linear.weight
            layout = adapter_placements(weight)
            a_placements, b_placements = layout if layout is not None else (None, None)
            linear.__class__ = LoraLinear
            shapes = adapter_shapes(linear.out_features, linear.in_features, config.rank)
            linear.lora_A = _adapter_param(f"{path}.lora_A", shapes["lora_A"], weight, a_placements, seed)
            linear.lora_B = _adapter_param(f"{path}.lora_B", shapes["lora_B"], weight, b_placements, seed)
            linear.scaling = config.scaling
            adapted.append(path)
    return adapted


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's (A or B)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_LEAVES
