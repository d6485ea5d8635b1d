"""Training modes: full training, LoRA and QLoRA. One home for what a mode is.

A mode says which parameters train (get a gradient, optimizer states, a data-parallel reduction, a
place in the optimizer step and a weight-gradient GEMM) and which are frozen, what is added to the
model (LoRA's adapters), and how the frozen weights are stored (QLoRA's NF4). The cost model
(planner/cost/layer.py, planner/cost/step.py, planner/cost/memory.py) and the search read these
records; ``Workload.finetune`` names the mode, ``Workload.lora_rank`` and ``Workload.lora_targets`` its
adapters (``meshplan plan --finetune``, ``--lora-rank``, ``--lora-targets``; plan.json's workload).

- ``full``: every parameter trains (what meshplan priced before modes existed), except those a traced module
  froze itself (``requires_grad=False``; planner/layers.py ``Op.frozen``): each such op is priced as LoRA's
  frozen base is, per op instead of per model (``Adapters.trains``), with no flag.
- ``lora`` (Hu et al. 2021, arXiv:2106.09685, Sec 4.1): every base parameter is frozen; each target
  projection W (in x out) gets A (in x r) and B (r x out), trainable, and computes x W + s (x A) B. As
  PEFT does by default, embeddings, norms and the LM head are frozen too (peft/tuners/lora/config.py:
  ``modules_to_save`` None, ``bias`` "none": only the lora_A / lora_B weights require gradients,
  peft/tuners/tuners_utils.py ``_mark_only_adapters_as_trainable``).
- ``qlora`` (Dettmers et al. 2023, arXiv:2305.14314, Sec 2-3): LoRA over a base whose linear weights are
  stored as 4-bit NormalFloat with double quantization (``NF4_BITS_PER_WEIGHT``); embeddings, norms and the
  head stay 16-bit (bitsandbytes replaces nn.Linear modules only; transformers' BitsAndBytesConfig keeps
  ``lm_head`` out of the quantized modules by default, ``llm_int8_skip_modules``). Each use of a quantized
  weight dequantizes it to bf16 first (``dequantize_bytes_per_weight``).

What a frozen linear saves for backward: nothing for itself. Autograd keeps a matmul's input only where the
weight needs a gradient (torch's tools/autograd/gen_variable_type.py ``guard_for``: a saved input used in one
derivative formula is saved under ``grad_fn->should_compute_output``), and bitsandbytes' MatMul4Bit keeps
the packed weight alone (bitsandbytes/autograd/_functions.py: ``ctx.tensors = (None, B)``). LoRA's A reads
the same input (PEFT's ``lora_dropout`` defaults to 0.0: ``nn.Identity``, the same tensor) and keeps it for
its own weight gradient, so a target's input stays saved; B keeps the r-wide A output.

How a runtime lays its adapters over the model is its LoRA style (``STYLES``; ``Runtime.lora_style``): PEFT's, one
adapter per target projection, or Megatron-Bridge's, one adapter per fused Megatron-Core module (linear_qkv: q, k and
v; linear_fc1: gate and up) whose projections are all targets, A reading the module's input once and B writing all
of its outputs (``Adapters.adapters``), each with its defaults.

Under tensor parallelism the adapters are sharded as the base linear is (Megatron-Bridge's LoRA,
megatron/bridge/peft/lora.py with utils.py ``ParallelLinearAdapter``, NeMo's before it): a column-parallel
base splits B's output features (A whole on every rank), a row-parallel base splits A's input features (B
whole). The row-parallel A's r-wide partial sums are all-reduced: r elements per token, not priced (under
0.2% of the block's TP traffic at r 16 and hidden 8192).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import UserError, one_of

if TYPE_CHECKING:
    from .layers import LayerGraph, Op

# Dettmers et al. 2023, Sec 3 (Double Quantization): 4-bit weights in blocks of 64, whose fp32 absmax
# constants are quantized to 8 bits in blocks of 256 with one fp32 second-level constant each:
# 4 + 8/64 + 32/(64 x 256) = 4.127 bits per parameter (the paper's own arithmetic)
NF4_BITS_PER_WEIGHT = 4 + 8 / 64 + 32 / (64 * 256)
NF4_BYTES_PER_WEIGHT = NF4_BITS_PER_WEIGHT / 8
# and per quantized tensor its two code tables in fp32, which bitsandbytes' QuantState holds with each weight
# (bitsandbytes/functional.py quantize_4bit: the 16 NF4 values, ``get_4bit_type``; under double quantization the
# 256-entry dynamic map of the absmaxes, ``create_dynamic_map``): a kilobyte, which only tiny models notice
NF4_TABLE_BYTES_PER_TENSOR = (16 + 256) * 4

# The projections a LoRA adapter may target, by their name in the layer graph (planner/layers.py: Llama's
# q_proj ... down_proj, Hugging Face's module names) and in --lora-targets
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_OP_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
             "down_proj": "down"}


@dataclass(frozen=True, kw_only=True)
class Style:
    """How a runtime's LoRA lays its adapters over the model, and its defaults (``Runtime.lora_style``)."""

    name: str
    rank: int                   # --lora-rank left out
    targets: tuple[str, ...]    # --lora-targets left out
    fuses_modules: bool         # one adapter over each fused module whose projections are all targets
    source: str


# PEFT (meshplan's executor, Hugging Face Trainer under DeepSpeed): one adapter per target projection; defaults: its
# LoraConfig (peft/tuners/lora/config.py: r = 8) with its target modules for Llama (peft/utils/constants.py
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"] = ["q_proj", "v_proj"]), which Hugging Face's Trainer
# and DeepSpeed runs use; torchtune's lora_llama3 recipes also default to rank 8 on q and v (NeMo AutoModel's
# Llama 3 70B benchmark: rank 16 on every linear, ``match_all_linear``, given by --lora-rank and --lora-targets).
# Megatron-Bridge's LoRA (src/megatron/bridge/peft/lora.py ``LoRA``, and its PEFT guide, "Canonical LoRA:
# Performant vs Canonical Variants", at 067f987df): dim 32 on target_modules linear_qkv, linear_proj, linear_fc1 and
# linear_fc2 by default, and, being the "performant" variant, one adapter on each of Megatron-Core's fused linears,
# linear_qkv (q, k and v) and linear_fc1 (gate and up), not one per projection: A reads the module's input once and B
# writes all of its outputs. Its CanonicalLoRA adapts linear_q, linear_k, linear_v, linear_fc1_gate and linear_fc1_up
# apart, which is what targets naming only some projections of a fused module need.
STYLES: dict[str, Style] = {s.name: s for s in (
    Style(name="peft", rank=8, targets=("q", "v"), fuses_modules=False,
          source="peft/tuners/lora/config.py (r = 8); peft/utils/constants.py (q_proj, v_proj for Llama)"),
    Style(name="megatron-bridge", rank=32, targets=TARGETS, fuses_modules=True,
          source="Megatron-Bridge src/megatron/bridge/peft/lora.py LoRA (dim 32; linear_qkv, linear_proj, linear_fc1, "
                 "linear_fc2) and docs/training/peft.md (performant LoRA: one adapter per fused module)"),
)}


@dataclass(frozen=True, kw_only=True)
class Mode:
    """One training mode."""

    name: str                   # --finetune and plan.json's workload.finetune
    what: str                   # one line for --help and reports
    source: str
    trains_base: bool           # the model's own parameters train
    adapters: bool              # LoRA adapters are added (and train)
    quantized_base: bool        # the frozen base linears are stored as NF4 (dequantized per use)


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode(name="full", what="every parameter trains (gradients, AdamW states, weight-gradient GEMMs) but those a "
                            "traced module froze (requires_grad=False)",
         source="", trains_base=True, adapters=False, quantized_base=False),
    Mode(name="lora", what="base frozen (16-bit), low-rank adapters A (in x r), B (r x out) on the target linears "
                           "train", source="Hu et al. 2021, arXiv:2106.09685",
         trains_base=False, adapters=True, quantized_base=False),
    Mode(name="qlora", what="LoRA over a base whose linears are NF4 with double quantization (4.127 bits a weight), "
                            "dequantized at each use (bitsandbytes: DeepSpeed on CUDA; meshplan's executor on CUDA "
                            "and CPU, tp 1)",
         source="Dettmers et al. 2023, arXiv:2305.14314", trains_base=False, adapters=True, quantized_base=True),
)}
NAMES = tuple(MODES)


def mode(name: str) -> Mode:
    if name not in MODES:
        raise UserError(f"{name!r} is not a training mode; allowed: {one_of(NAMES)}", field="--finetune")
    return MODES[name]


def parse_targets(text: str, field: str = "--lora-targets") -> tuple[str, ...]:
    """``q,k,v`` -> ("q", "k", "v") in TARGETS order; errors name the flag and the allowed values."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise UserError(f"{', '.join(unknown) or repr(text)} is not a LoRA target; allowed: a comma-separated list "
                        f"of {one_of(TARGETS)}", field=field)
    return tuple(t for t in TARGETS if t in names)


def check(finetune: str, lora_rank: int, lora_targets: tuple[str, ...], source: str = "", prefix: str = "--") -> None:
    """Refuse a mode, rank or target list that is not one (``prefix``: "--" for flags, "workload." for plan.json)."""
    def name(flag: str) -> str:
        return prefix + (flag.replace("_", "-") if prefix == "--" else flag)
    if finetune not in MODES:
        raise UserError(f"{finetune!r} is not a training mode; allowed: {one_of(NAMES)}", source=source,
                        field=name("finetune"))
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise UserError(f"must be a positive integer, got {lora_rank!r}", source=source, field=name("lora_rank"))
    if not isinstance(lora_targets, tuple) or any(t not in TARGETS for t in lora_targets):
        raise UserError(f"{lora_targets!r} is not a list of LoRA targets; allowed: {one_of(TARGETS)}", source=source,
                        field=name("lora_targets"))
    if not MODES[finetune].adapters and (lora_rank or lora_targets):
        raise UserError(f"LoRA adapters with --finetune {finetune}; allowed: with --finetune lora or qlora",
                        source=source, field=name("lora_rank" if lora_rank else "lora_targets"))


@dataclass(frozen=True)
class Adapters:
    """The trainable part and storage of one training mode, as the cost model asks for it (``of``)."""

    mode: Mode
    rank: int                           # r of every adapter (0 without adapters)
    targets: frozenset[str]             # TARGETS names
    fuses_modules: bool = False         # the runtime's LoRA adapts a fused module as one (``Style``)

    @property
    def full(self) -> bool:
        """The mode trains the base: every parameter but those the model itself froze (``trains``)."""
        return self.mode.trains_base

    def trains(self, op: Op) -> bool:
        """Whether ``op``'s own parameters train: they get a gradient, optimizer states, a data-parallel reduction
        and (a linear) a weight-gradient GEMM. Under full training unless the traced module froze them
        (``Op.frozen``); never where the mode freezes the base (LoRA's adapters are ``target``'s)."""
        return self.mode.trains_base and not op.frozen

    def trains_tied(self, graph: LayerGraph) -> bool:
        """Whether a tied embedding's shared parameters train (``trains`` of the table, which the head's copy
        shares: ``LayerGraph.tied_frozen``)."""
        return self.mode.trains_base and not graph.tied_frozen

    def target(self, op_name: str) -> bool:
        """Whether the linear named ``op_name`` (a path; its last part decides) carries an adapter."""
        return self.mode.adapters and _OP_NAMES.get(op_name.rsplit(".", 1)[-1]) in self.targets

    def adapters(self, ops: tuple[Op, ...] | list[Op]) -> dict[int, tuple[float, float]]:
        """The adapters on a layer's linears: {index in ``ops`` of the linear carrying one: (in, out) features of
        the adapter}, split over TP as that linear is. Each target carries its own (in, out); where the runtime
        fuses modules (``Style.fuses_modules``), a run of linears reading one input (the first, then those with
        ``Op.reads_previous_input``: q, k, v; gate, up), every one a target, carries one adapter on its first
        linear, as wide as their outputs together."""
        out: dict[int, tuple[float, float]] = {}
        group: list[int] = []

        def close() -> None:
            if self.fuses_modules and len(group) > 1 and all(self.target(ops[i].name) for i in group):
                out[group[0]] = (ops[group[0]].in_features, sum(ops[i].out_features for i in group))
            else:
                out.update({i: (ops[i].in_features, ops[i].out_features) for i in group if self.target(ops[i].name)})
            group.clear()

        for i, op in enumerate(ops):
            if op.kind != "linear":
                continue
            if not op.reads_previous_input:
                close()
            group.append(i)
        close()
        return out

    def quantized(self, op_kind: str, op_name: str) -> bool:
        """Whether a frozen parameter is stored as NF4: QLoRA's base linears, not the head (module docstring)."""
        return self.mode.quantized_base and op_kind == "linear" and op_name.rsplit(".", 1)[-1] != "lm_head"


def of(finetune: str, lora_rank: int = 0, lora_targets: tuple[str, ...] = (), style: str = "peft") -> Adapters:
    """The mode's record with its rank and targets, the runtime's LoRA ``style``'s defaults filled in."""
    m, st = MODES[finetune], STYLES[style]
    if not m.adapters:
        return Adapters(mode=m, rank=0, targets=frozenset())
    return Adapters(mode=m, rank=lora_rank or st.rank, targets=frozenset(lora_targets or st.targets),
                    fuses_modules=st.fuses_modules)


def adapter_params(in_features: float, out_features: float, rank: int, split: str, tp: int) -> float:
    """Parameters of one linear's adapter on one TP rank: A (in x r) and B (r x out), B's output split by a
    column-parallel base, A's input by a row-parallel one (module docstring)."""
    a_in = in_features / (tp if split == "row" else 1)
    b_out = out_features / (tp if split == "column" else 1)
    return rank * (a_in + b_out)


def dequantize_bytes_per_weight(dtype_bytes: float = 2.0) -> float:
    """HBM bytes per weight of one NF4 dequantization: the packed weight (with its constants) read, the bf16 weight
    written (bitsandbytes' ``dequantize_4bit`` before its GEMM, which bnb.matmul_4bit runs for inputs of more than
    one token: bitsandbytes/autograd/_functions.py ``matmul_4bit``)."""
    return NF4_BYTES_PER_WEIGHT + dtype_bytes


def model_flops_per_token(graph: LayerGraph, seq_len: int, adapters: Adapters) -> float:
    """The model FLOPs of one token of a training step in this mode, without recompute (``LayerGraph.
    model_flops_per_token``'s convention: matmuls, attention scores in full). Full training: 3x the forward. A
    frozen linear (the base under LoRA, a traced module's ``Op.frozen``) runs its forward and its input gradient
    (2x), attention its forward and backward (3x: the gradient flows through it to what trains below), each adapter
    its three passes (3 x 2 r (in + out), ``Adapters.adapters``)."""
    if adapters.full and not any(op.frozen for layer in graph.layers for op in layer.ops):
        return graph.model_flops_per_token(seq_len)
    out = 0.0
    for layer in graph.layers:
        on = adapters.adapters(layer.ops)
        for i, op in enumerate(layer.ops):
            if op.kind == "linear":
                out += (3.0 if adapters.trains(op) else 2.0) * op.fwd_flops_per_token
                if i in on:
                    out += 3.0 * 2.0 * adapters.rank * sum(on[i]) * op.tokens_factor
            elif op.kind == "attention":
                kv = min(seq_len, op.window) if op.window else seq_len
                out += 3.0 * 4.0 * op.heads * op.head_dim * kv
    return out


def describe(finetune: str, lora_rank: int, lora_targets: tuple[str, ...]) -> str:
    """", LoRA rank 8 on q,v" for a plan's first line; "" under full training."""
    if finetune == "full":
        return ""
    name = {"lora": "LoRA", "qlora": "QLoRA (NF4 base)"}[finetune]
    return f", {name} rank {lora_rank} on {','.join(lora_targets)}"


# Which runtimes fine-tune with which modes is planner/runtimes.py's ``Combinations.finetune_modes``.
