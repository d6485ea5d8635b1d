"""Precision recipes: the compute dtypes, and FP8 training recipes on top of bf16.

One home for what a recipe is: which GEMMs of a linear layer run in FP8, the cast kernels each
recipe needs and the bytes they move, whether weight casts are cached over the micro-batches of a
step, and which runtimes run which recipe (planner/runtimes.py ``Combinations.fp8_recipes`` says
per runtime and device kind). A recipe keeps bf16 for everything but the GEMMs of the linear layers
it converts (activations, norms, attention, communication, with the exceptions named below), so a
``Workload`` holds ``precision = "bf16"`` and ``fp8 = <recipe>``; ``--precision`` and plan.json's
``workload.fp8`` name the recipe.

Cast traffic per element of each GEMM operand (bytes read + written, forward and backward apart):

- torchao (the ``torch`` and ``torchtitan`` runtimes): torchao/testing/training/roofline_utils.py
  ``get_tensor_memory_traffic_ovhd_s`` (pytorch/ao @36027d82d), kernels not fused with the op before
  them (``fuse_with_prev=False``), per recipe and operand role. tensorwise: the input's amax pass (read
  2) and one cast writing the row- and column-major FP8 copies (read 2, write 1 + 1); the weight's amax
  (2) and a cast for forward (2 + 1) and again for backward (2 + 1); the output gradient like the input.
  rowwise: the input's first kernel reads 2 and writes the FP8 rows and a transposed bf16 copy (1 + 2),
  its second casts that copy (2 + 1); the weight's forward cast (2 + 1), a transpose (2 + 2) and its
  cast (2 + 1) in backward; the output gradient like the input, in backward. rowwise with a
  high-precision weight gradient (``fp8-rowwise-gw-hp``): one cast each (2 + 1), the weight's twice,
  and the weight-gradient GEMM in bf16. MXFP8 (``mxfp8_cublas``): two casts per operand (2 + 1 each).
  Of the amax bytes, those of an operand scaled per column (rowwise's backward operands: the input and the output
  gradient for the weight gradient, the weight's transpose for the input gradient; ``amax_strided``) are read by a
  reduction along the tensor's strided dimension, which inductor fuses with the cast: on one H100 such a kernel
  ran 640 us a call (docs/validation.md, round 3), and they run at the profile's strided-reduction rate.
  torchao's docs: 'enable torch.compile for competitive performance'; uncompiled, its casts are several
  eager kernels each, which the cost model does not price: the torch runtimes run FP8 with ``--compile``.
  Compiled, the bytes its reductions read (the amax: each kernel that reads a bf16 tensor to scale it
  reduces over it, per tensor or per row) run at the device's reduction rate and the rest at its
  cast rate (the ``reduce`` and ``cast_down`` classes of ``[gpu.kernels] eager_GBps``): on the H200,
  ``meshplan profile`` timed a compiled tensorwise amax-and-cast of 8192 x 4096 at 64 us
  (profiles/measured/h200.kernels.json fp8_cast), and its classes (reduce 1529, cast_down 3974 GB/s)
  give 44 + 25 = 69 us.
- TransformerEngine (the ``megatron`` runtime): a fused cast-transpose writes both FP8 layouts in one
  pass (read 2, write 1 + 1: TE's ``cast_transpose`` and its MXFP8 and blockwise quantizers, which
  write the row- and column-wise data together); current (per-tensor) scaling first reads the tensor
  for its amax (2 more: TE's ``Float8CurrentScalingQuantizer`` computes the amax, then casts), delayed
  scaling takes its scale from the amax history and records the amax inside the cast. Weights are cast
  once per step and the FP8 copies reused by every micro-batch (TE's ``is_first_microbatch``, which
  Megatron-LM passes), held as an FP8 weight and its transpose (2 bytes per parameter).
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "fp32")            # compute dtypes (mixed precision with fp32 master weights)

# the operands of one linear's three GEMMs (forward: input x weight; dgrad: grad_output x weight;
# wgrad: input x grad_output), each cast as (forward bytes, backward bytes) per element
Roles = dict[str, tuple[float, float]]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One FP8 training recipe."""

    name: str                       # the --precision value
    what: str                       # one line for --help and reports
    scaling: str                    # how the scales are taken
    gemm_dtype: str = "fp8"         # the peak the FP8 GEMMs run at: "fp8", or "mxfp8" (block-scaled, Blackwell)
    fp8_gemms: frozenset[str] = frozenset({"fwd", "dgrad", "wgrad"})
    torchao: Roles | None = None    # cast bytes as torchao runs the recipe (None: torchao has no such recipe)
    te: Roles | None = None         # cast bytes as TransformerEngine runs it (None: TE has no such recipe)
    amax: Roles | None = None       # of the torchao bytes above, those read by the amax reductions (forward,
                                    # backward): priced at the device's reduction rate (planner/cost/layer.py)
    amax_strided: Roles | None = None   # of the amax bytes, those reduced along the operand's strided dimension
                                    # (a scale per column of a (tokens, features) operand, or per row of a
                                    # weight's transpose): priced at the device's strided-reduction rate
    torchao_kernels: Roles | None = None    # the cast kernels of each operand (forward, backward), each at least
    te_kernels: Roles | None = None         # CAST_KERNEL_MIN_S
    fp8_all_gather: bool = False    # FSDP2 gathers the converted weights in FP8 (torchao's
                                    # enable_fsdp_float8_all_gather: tensorwise scales only)
    te_param_gather_bytes: float = 1.0  # bytes per converted parameter of Megatron-LM's --fp8-param-gather
    te_operand_kernels: int = 0     # kernels TransformerEngine runs on each operand of each FP8 GEMM before it, besides
                                    # the casts (MXFP8: the operand's scales swizzled), at CAST_KERNEL_MIN_S each at
                                    # least, moving ``te_operand_bytes`` per element of the operand
    te_operand_bytes: float = 0.0
    scale_bytes: float = 0.0        # bytes of scales TransformerEngine writes and keeps per element of an activation or
                                    # gradient operand, for each layout it writes (0: one scale per tensor)
    torchao_name: str = ""          # torchao's Float8LinearRecipeName / MX recipe
    megatron_flags: tuple[str, ...] = ()    # Megatron-LM's arguments for it


# TransformerEngine's fused casts: (2 read + 1 + 1 written) per element; current scaling reads for its amax first
_TE_FUSED = 4.0
_TE_AMAX = 2.0
_MX_SCALE = 1 / 32          # MXFP8: one 1-byte (e8m0) scale per 32 values
# blockwise: a 4-byte (fp32) scale per 1 x 128 block of an activation or gradient and per 128 x 128 block of a weight
# (TransformerEngine v2.9 transformer_engine/pytorch/tensor/float8_blockwise_tensor.py: Float8BlockQuantizer's
# make_empty allocates float32 scale_inv tensors of ceil(K / 128) x M per layout, 1D, and ceil(M / 128) x
# ceil(K / 128), 2D)
_BLOCK_SCALE, _BLOCK_SCALE_2D = 4 / 128, 4 / (128 * 128)

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe(name="fp8-tensorwise", what="FP8 linears, one scale per tensor from its current amax",
           scaling="per tensor, current amax",
           torchao={"input": (6.0, 0.0), "weight": (5.0, 3.0), "grad_output": (0.0, 6.0)},
           amax={"input": (2.0, 0.0), "weight": (2.0, 0.0), "grad_output": (0.0, 2.0)},
           te={"input": (_TE_AMAX + _TE_FUSED, 0.0), "weight": (_TE_AMAX + _TE_FUSED, 0.0),
               "grad_output": (0.0, _TE_AMAX + _TE_FUSED)},
           torchao_kernels={"input": (3, 0), "weight": (3, 1), "grad_output": (0, 3)},
           te_kernels={"input": (2, 0), "weight": (2, 0), "grad_output": (0, 2)},
           fp8_all_gather=True, torchao_name="tensorwise",
           megatron_flags=("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")),
    Recipe(name="fp8-rowwise", what="FP8 linears, one scale per row (torchao rowwise)",
           scaling="per row, current amax",
           torchao={"input": (5.0, 3.0), "weight": (3.0, 7.0), "grad_output": (0.0, 8.0)},
           amax={"input": (2.0, 2.0), "weight": (2.0, 2.0), "grad_output": (0.0, 4.0)},
           amax_strided={"input": (0.0, 2.0), "weight": (0.0, 2.0), "grad_output": (0.0, 2.0)},
           torchao_kernels={"input": (1, 1), "weight": (1, 2), "grad_output": (0, 2)},
           torchao_name="rowwise"),
    Recipe(name="fp8-rowwise-gw-hp", what="FP8 rowwise, the weight gradient GEMM kept in bf16",
           scaling="per row, current amax", fp8_gemms=frozenset({"fwd", "dgrad"}),
           torchao={"input": (3.0, 0.0), "weight": (3.0, 3.0), "grad_output": (0.0, 3.0)},
           amax={"input": (2.0, 0.0), "weight": (2.0, 2.0), "grad_output": (0.0, 2.0)},
           amax_strided={"input": (0.0, 0.0), "weight": (0.0, 2.0), "grad_output": (0.0, 0.0)},
           torchao_kernels={"input": (1, 0), "weight": (1, 2), "grad_output": (0, 1)},
           torchao_name="rowwise_with_gw_hp"),
    Recipe(name="fp8-delayed", what="FP8 linears, per-tensor scales from an amax history (TransformerEngine)",
           scaling="per tensor, delayed (amax history)",
           te={"input": (_TE_FUSED, 0.0), "weight": (_TE_FUSED, 0.0), "grad_output": (0.0, _TE_FUSED)},
           te_kernels={"input": (1, 0), "weight": (1, 0), "grad_output": (0, 1)},
           megatron_flags=("--fp8-format", "hybrid", "--fp8-recipe", "delayed")),
    Recipe(name="fp8-blockwise", what="FP8 linears, 1x128 activation and 128x128 weight blocks (DeepSeek-V3)",
           scaling="1x128 blocks (activations, gradients), 128x128 blocks (weights)",
           # both layouts written, each with its scales
           te={"input": (_TE_FUSED + 2 * _BLOCK_SCALE, 0.0), "weight": (_TE_FUSED + 2 * _BLOCK_SCALE_2D, 0.0),
               "grad_output": (0.0, _TE_FUSED + 2 * _BLOCK_SCALE)},
           te_kernels={"input": (1, 0), "weight": (1, 0), "grad_output": (0, 1)}, scale_bytes=_BLOCK_SCALE,
           megatron_flags=("--fp8-format", "e4m3", "--fp8-recipe", "blockwise")),
    Recipe(name="mxfp8", what="MXFP8 linears, an 8-bit exponent scale per 32 values (Blackwell)",
           scaling="1x32 blocks, e8m0 scales", gemm_dtype="mxfp8",
           torchao={"input": (3.0, 3.0), "weight": (3.0, 3.0), "grad_output": (0.0, 6.0)},
           amax={"input": (2.0, 2.0), "weight": (2.0, 2.0), "grad_output": (0.0, 4.0)},
           # TE's MXFP8 quantizer writes both layouts and, with each, an e8m0 scale per 32 values (1/32 byte apiece)
           te={"input": (_TE_FUSED + 2 * _MX_SCALE, 0.0), "weight": (_TE_FUSED + 2 * _MX_SCALE, 0.0),
               "grad_output": (0.0, _TE_FUSED + 2 * _MX_SCALE)}, scale_bytes=_MX_SCALE,
           torchao_kernels={"input": (1, 1), "weight": (1, 1), "grad_output": (0, 2)},
           te_kernels={"input": (1, 0), "weight": (1, 0), "grad_output": (0, 1)},
           # before every MXFP8 GEMM TransformerEngine swizzles both operands' scales into the layout cuBLAS reads
           # (transformer_engine/pytorch/csrc/extensions/gemm.cpp at v2.9: swizzle_scaling_factors of A and of B, into
           # new tensors kept for that GEMM only): a kernel per operand, reading and writing its scales
           te_operand_kernels=1, te_operand_bytes=2 / 32,
           # MXFP8 parameters are gathered in bf16: Megatron-Core maps the distributed optimizer's parameter buffer
           # of MXFP8 parameters onto the gradient buffer as bf16 and quantizes each parameter from it after the
           # all-gather (megatron/core/distributed/param_and_grad_buffer.py at core_v0.15.0: ``shared_buffer``,
           # ``param.data.copy_(param_slice)``; its MoE README: FP8 primary weights halve the parameter
           # all-gather 'except MXFP8')
           te_param_gather_bytes=2.0,
           torchao_name="mxfp8_cublas", megatron_flags=("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8")),
)}

PRECISION_CHOICES = (*DTYPES, *RECIPES)

# the least GPU time of one cast kernel, however few its bytes: torchao's roofline (roofline_utils.py
# KERNEL_LAUNCH_OVERHEAD_SEC, 'run a triton kernel with a single element read/write on an H100 and measure GPU time
# from the trace'), which it takes as the floor of every cast kernel, the amax's second stage included
CAST_KERNEL_MIN_S = 2e-6


def split(name: str) -> tuple[str, str]:
    """(compute dtype, FP8 recipe or "") of a --precision value."""
    return ("bf16", name) if name in RECIPES else (name, "")


def library(framework: str) -> str:
    """Whose FP8 kernels a runtime runs: TransformerEngine under Megatron-LM, else torchao."""
    return "te" if framework == "megatron" else "torchao"


def cast_roles(recipe: Recipe, framework: str) -> tuple[Roles, Roles]:
    """(bytes per element, kernels) of each operand's casts, forward and backward, as the runtime's library runs
    them."""
    te = library(framework) == "te"
    roles, kernels = (recipe.te, recipe.te_kernels) if te else (recipe.torchao, recipe.torchao_kernels)
    assert roles is not None and kernels is not None, (recipe.name, framework)
    return roles, kernels


def weight_cast_per_step(framework: str) -> bool:
    """TransformerEngine casts a weight once per step and keeps the FP8 copies for every micro-batch."""
    return library(framework) == "te"


def converts_linear(name: str, out_features: int, in_features: int, recipe: str, framework: str,
                    routed: bool = False) -> bool:
    """Whether ``framework`` runs the linear ``name`` (a path: its last part is what decides) under ``recipe``.
    Never the LM head (torchtitan's float8 converter skips "output" by default, and Megatron-LM's output layer is
    not a TransformerEngine module) nor a MoE router (Megatron-Core's TopKRouter multiplies in its own dtype;
    torchao's filter skips its few columns). Under TransformerEngine (Megatron-LM) every other linear of a block,
    routed experts included (its grouped linears run the recipe); under torchao (torch, torchtitan) the nn.Linear
    its auto filter converts (``torchao_converts``), not routed experts, which are grouped GEMMs its linear converter
    leaves alone (torchtitan's quantize.grouped_mm converter, which meshplan neither prices nor exports, converts
    them). The planner (planner/cost/layer.py fp8_converts) and the executor (executor/parallelize.py
    fp8_module_filter) both ask here."""
    if name.rsplit(".", 1)[-1] in ("lm_head", "router"):
        return False
    if library(framework) == "te":
        return True
    return not routed and torchao_converts(RECIPES[recipe], out_features, in_features)


# torchao's auto filter (torchao/float8/float8_linear_utils.py ``_auto_filter_for_recipe``, @36027d82d), which the
# torch runtime applies when it converts a model: a linear of weight (N out, K in) stays bf16 when a dimension is
# not a multiple of 16, or below these sizes, where torchao's H100 tables show FP8 slower
def torchao_converts(recipe: Recipe, out_features: int, in_features: int) -> bool:
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe.torchao_name == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    if recipe.torchao_name == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    return True         # no auto filter for the other recipes: every linear whose dims allow it
