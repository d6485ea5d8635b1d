"""What is computed: a model as an ordered list of layers of operators.

The layer graph is the one type the cost model and the search consume. Config
models get theirs analytically here (``build_layer_graph``); traced modules get
the same type from ``planner.trace``. Quantities are *per token* (one position
of one sequence) so one graph serves every micro-batch size and every context-
parallel split; only attention depends on the sequence length, and it keeps
its shape (heads, head size, causal) so the cost model can price each kernel.

Saved activations follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", arXiv:2205.05198, Sec 4.1): each
saved tensor says how tensor/sequence parallelism splits it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from .eager_bytes import layer_eager_bytes
from .model import ModelSpec

Split = Literal["tp", "sp", "none"]
"""How tensor parallelism of degree t divides a per-rank quantity:
``tp``: always by t (inside the column/row-parallel region); ``sp``: by t only
with sequence parallelism (layer inputs, norms, residual dropout), replicated
otherwise; ``none``: never."""


@dataclass(frozen=True, kw_only=True)
class Saved:
    """One tensor autograd keeps for backward, per token."""

    elems: float                    # elements per token
    split: Split
    dtype_bytes: int = 0            # 0: the activation dtype; 1: masks; 4: fp32 statistics
    gathered_input: bool = False    # input of a column-parallel linear: with sequence parallel,
                                    # Megatron saves the shard, torch's DTensor keeps the gathered copy
    residual: bool = False          # the residual stream (a norm's input): fp32 under torch's autocast


@dataclass(frozen=True, kw_only=True)
class Op:
    """One operator. ``kind`` decides which fields matter.

    linear:      y = x W with W of shape (in_features, out_features); ``tp`` is
                 ``column`` (splits out_features), ``row`` (splits in_features) or
                 ``replicate``; ``tokens_factor`` is the share of tokens that reach it
                 (top-k over experts for a mixture of experts).
    attention:   scaled dot-product attention of ``heads`` query heads and
                 ``kv_heads`` key/value heads of size ``head_dim`` (split by tp).
    elementwise: memory-bound work of ``bytes_fwd``/``bytes_bwd`` per token at
                 2-byte activations (norms, activations, dropout, residual adds,
                 the loss), split as ``split`` says.
    embedding:   a table lookup of ``params`` parameters (vocab-parallel under tp).

    ``frozen``: none of the parameters the op uses trains (a traced module's ``requires_grad=False``, set by
    planner/trace/build.py). Under full training such an op is priced as LoRA prices the frozen base
    (planner/finetune.py ``Adapters.trains``): no gradient, no optimizer state, no data-parallel reduction, a
    linear without its weight-gradient GEMM, an embedding without backward. An op whose parameters are a mix
    (a frozen weight with a bias that trains) is not frozen: all of it is priced as training.
    """

    name: str
    kind: Literal["linear", "attention", "elementwise", "embedding"]
    params: int = 0
    in_features: int = 0
    out_features: int = 0
    tp: Literal["column", "row", "replicate"] = "replicate"
    tokens_factor: float = 1.0
    num_gemms: int = 1              # experts of a MoE layer are num_gemms GEMMs sharing the tokens
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    causal: bool = True
    window: int = 0                 # sliding-window attention span (0: full)
    attn_dropout: bool = False
    bytes_fwd: float = 0.0
    bytes_bwd: float = 0.0
    split: Split = "none"
    saved: tuple[Saved, ...] = ()
    workspace: tuple[Saved, ...] = ()     # transient tensors its backward allocates (freed after)
    eager_workspace: tuple[Saved, ...] | None = None   # the loss's transient where the runtime's loss is
                                    # torch's eager cross-entropy (Runtime.loss "eager"), where it differs
    norm: bool = False                    # a LayerNorm/RMSNorm (sharded along the sequence with SP)
    unfused: str = ""                     # the fused kernel this op runs as where the device has one
    unfused_saved: tuple[Saved, ...] = ()  # what it also keeps for backward where it does not
    measured_fwd_s: float | None = None   # per token, from `meshplan profile --ops` (preferred when set)
    fused_with_previous: bool = False     # its parameters are part of the previous linear's tensors (k and v of
                                          # a fused qkv projection: ModelSpec.fused_qkv)
    expert: bool = False                  # runs on the tokens routed to experts (a MoE layer's routed experts and
                                          # their activation): under expert parallelism, on the tokens its rank's
                                          # experts receive
    measured_bwd_s: float | None = None
    reads_previous_input: bool = False    # a linear reading the same input as the linear before it (k and v after
                                          # q, up after gate): an FP8 recipe casts that input once for both
    compiled_saved: tuple[Saved, ...] | None = None    # what it keeps where its block is torch.compile'd, when
                                          # that differs from ``saved``: AOTAutograd's min-cut partitioner
                                          # (torch/_functorch/partitioners.py min_cut_rematerialization_partition)
                                          # recomputes pointwise ops and norms in backward from what is saved
                                          # anyway instead of saving their outputs: a norm's output (the next
                                          # linear's input) and an activation's output (the down projection's)
    frozen: bool = False                  # it uses parameters and none of them trains (see the class docstring)
    fused_saved: tuple[Saved, ...] | None = None    # what it keeps where the runtime runs it as one fused kernel
                                          # (``Timing.fuses_swiglu``): Megatron-Core's SwiGLU (bias_swiglu_impl and
                                          # weighted_bias_swiglu_impl, megatron/core/fusions/fused_bias_swiglu.py at
                                          # 92c8482e, on by default: --no-bias-swiglu-fusion turns it off) keeps
                                          # its input alone, the gate's and up's outputs
    route_groups: tuple[int, int] = (0, 0)    # a routed expert's router picks its top-k from the best second of
                                          # first groups of experts (DeepSeek-V3's node-limited routing:
                                          # ModelSpec.router_groups, router_groups_used); (0, 0): from all experts
    saves_linear_input: bool = False      # its first kept tensor is the next linear's input, kept for that linear's
                                          # weight gradient (the experts' permuted tokens): an FP8 recipe of
                                          # TransformerEngine keeps the linear's FP8 copy instead (``_fp8_saved_share``)

    @property
    def routed(self) -> bool:
        """One of a MoE layer's routed-expert linears: ``num_gemms`` experts sharing the tokens."""
        return self.expert and self.kind == "linear"

    @property
    def fwd_flops_per_token(self) -> float:
        """Matrix-multiply FLOPs of the forward pass per token (attention: per unit of kv length)."""
        if self.kind == "linear":
            return 2.0 * self.in_features * self.out_features * self.tokens_factor
        return 0.0


@dataclass(frozen=True, kw_only=True)
class Layer:
    """A unit the pipeline split places whole on one stage."""

    name: str                                   # module path, e.g. "layers.3"
    kind: Literal["embedding", "block", "norm", "head"]
    signature: str                              # equal signatures: identical blocks, costed once
    ops: tuple[Op, ...]
    # Tensor-parallel collectives (Megatron's pattern, Shoeybi et al. 2019 Sec 3):
    # all-reduces of this many activation elements per token in forward / backward.
    tp_allreduce_fwd_elems: float = 0.0
    tp_allreduce_bwd_elems: float = 0.0
    # elements per token that leave this layer (what a pipeline stage boundary sends)
    output_elems: float = 0.0
    # parameters that TP cannot split (norms, biases of row-parallel linears, routers)
    params_replicated: int = 0
    # of the TP collectives, the elements per token (each way) around routed experts: the MLP's pair of a block
    # whose MLP is routed experts alone. Under expert parallelism (ep > 1) each expert is whole on its rank and
    # the tokens stay split along the sequence, so these collectives give way to the all-to-alls (Megatron-Core
    # with --expert-tensor-parallel-size 1); shared experts keep theirs
    tp_allreduce_expert_elems: float = 0.0
    # elementwise bytes per token as torch runs the layer eagerly, per mixed-precision regime
    # (planner.cost.eager); () where the operators' own bytes price it (traced modules, other families)
    eager: tuple = ()

    @property
    def params(self) -> int:
        return sum(op.params for op in self.ops)

    @property
    def is_block(self) -> bool:
        return self.kind == "block"


@dataclass(frozen=True, kw_only=True)
class LayerGraph:
    """The model as the cost model sees it."""

    name: str
    layers: tuple[Layer, ...]
    seq_len: int                    # default sequence length
    hidden: int                     # width of the activations between layers
    vocab_size: int
    num_heads: int                  # the smallest head count: tp must divide it
    num_kv_heads: int
    tied_embeddings: bool           # first and last stage all-reduce the shared embedding's gradient
    tied_params: int = 0            # parameters shared between embedding and head
    tied_frozen: bool = False       # those shared parameters do not train (a traced module's requires_grad=False):
                                    # the head's copy has no gradient to sum with the embedding's
    num_experts: int = 0            # routed experts per MoE layer (0: a dense model); ep must divide it
    latent_attention: bool = False  # multi-head latent attention (ModelSpec.is_mla): some runtimes refuse SP with it
    # whether meshplan's executor can split the experts over ranks (its own reference models, and a traced module's
    # transformers grouped experts: executor/moe.py, planner/trace/experts.py), and why not
    splits_experts: bool = True
    experts_why: str = ""
    # whether the executor can cut the model into pipeline stages (a traced module: planner/trace/cut.py),
    # and why not
    pipelines: bool = True
    pipeline_why: str = ""
    source: str = ""
    warnings: tuple[str, ...] = field(default=())

    @property
    def num_params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def num_blocks(self) -> int:
        return sum(1 for layer in self.layers if layer.is_block)

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token without recompute: 3x the forward matmuls.

        The convention of Korthikanti et al. 2022 (Appendix A) and PaLM (Chowdhery
        et al. 2022, Appendix B): attention scores count in full (no causal halving).
        """
        fwd = 0.0
        for layer in self.layers:
            for op in layer.ops:
                if op.kind == "linear":
                    fwd += op.fwd_flops_per_token
                elif op.kind == "attention":
                    kv = min(seq_len, op.window) if op.window else seq_len
                    fwd += 4.0 * op.heads * op.head_dim * kv
        return 3.0 * fwd


def replicated_params(ops) -> int:
    """Parameters tensor parallelism cannot split (``Layer.params_replicated``): those of elementwise ops
    (norms) and replicated linears (routers), and what a row-parallel linear holds beyond its weight
    matrices (its bias)."""
    return sum(op_replicated_params(op) for op in ops)


def op_replicated_params(op: Op) -> int:
    """Of one op's parameters, those tensor parallelism cannot split (``replicated_params``)."""
    if op.kind == "elementwise" or (op.kind == "linear" and op.tp == "replicate"):
        return op.params
    if op.kind == "linear" and op.tp == "row":
        return max(0, op.params - op.num_gemms * op.in_features * op.out_features)
    return 0


# -- analytical layer graph of a config model ----------------------------------------------------

def _norm(name: str, spec: ModelSpec, width: int = 0, split: Split = "sp") -> Op:
    """LayerNorm/RMSNorm over ``width`` (0: the hidden size) features, split as ``split`` says: reads and
    writes them; backward reads grad and input, writes grad."""
    h = width or spec.hidden
    params = 2 * h if spec.norm == "layernorm" else h
    stats = 2 if spec.norm == "layernorm" else 1      # mean and rstd, or rstd: fp32 per token
    # RMSNorm without a fused kernel (torch 2.13 on CPU runs F.rms_norm as composite ops)
    # also keeps the normalised input: h more per token (measured with saved-tensor hooks)
    unfused = "rmsnorm" if spec.norm == "rmsnorm" else ""
    extra = (Saved(elems=h, split=split),) if unfused else ()
    return Op(name=name, kind="elementwise", params=params, bytes_fwd=4 * h, bytes_bwd=6 * h, split=split, norm=True,
              unfused=unfused, unfused_saved=extra,
              saved=(Saved(elems=h, split=split, residual=True), Saved(elems=stats, split=split, dtype_bytes=4)))


def _linear(name: str, spec: ModelSpec, k: int, n: int, tp: str, *, bias: bool, saves_input: bool = True,
            input_split: Split = "tp", tokens_factor: float = 1.0, num_gemms: int = 1,
            pointwise_input: bool = False) -> Op:
    """``pointwise_input``: its input is a norm's or an activation's output, which a compiled block recomputes
    rather than saves (``Op.compiled_saved``)."""
    saved = (Saved(elems=k * tokens_factor, split=input_split, gathered_input=(tp == "column")),) \
        if saves_input else ()
    return Op(name=name, kind="linear", params=num_gemms * (k * n + (n if bias else 0)), in_features=k,
              out_features=n, tp=tp, tokens_factor=tokens_factor, num_gemms=num_gemms, saved=saved,
              compiled_saved=() if pointwise_input and saved else None)


def _dropout_add(name: str, spec: ModelSpec) -> Op:
    """Residual add (fused with bias and dropout where the model has dropout)."""
    h = spec.hidden
    if spec.dropout:   # reads x and residual, writes out and a 1-byte mask
        return Op(name=name, kind="elementwise", bytes_fwd=6 * h + h / 2, bytes_bwd=4 * h + h / 2, split="sp",
                  saved=(Saved(elems=h, split="sp", dtype_bytes=1),))
    return Op(name=name, kind="elementwise", bytes_fwd=6 * h, bytes_bwd=4 * h, split="sp")


def _mla_ops(prefix: str, spec: ModelSpec, window: int) -> list[Op]:
    """Multi-head latent attention (DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434, Sec 2.1; Megatron-Core's
    MLASelfAttention): q through a rank-r_q bottleneck (down-projection replicated over TP, a norm, an up-projection
    column parallel), k and v from one latent of rank r_kv plus a shared RoPE key (down-projection replicated, a
    norm, an up-projection column parallel to every head's no-RoPE key and value). The core's q.k width is
    ``head_dim`` (no-RoPE + RoPE) and its v width ``v_head_dim``: it is priced at their mean width, exact for its
    two products' FLOPs and for the keys and values it moves."""
    h, heads, q = spec.hidden, spec.num_heads, spec.q_dim
    rope, v = spec.qk_rope_head_dim, spec.v_head_dim or spec.head_dim
    r_q, r_kv = spec.q_lora_rank, spec.kv_lora_rank
    ops = []
    if r_q:
        ops += [_linear(f"{prefix}.q_down", spec, h, r_q, "replicate", bias=False, input_split="sp"),
                _norm(f"{prefix}.q_norm", spec, r_q, "none"),
                _linear(f"{prefix}.q_up", spec, r_q, q, "column", bias=False, input_split="none")]
    else:
        ops.append(_linear(f"{prefix}.q_proj", spec, h, q, "column", bias=False, input_split="sp"))
    ops += [_linear(f"{prefix}.kv_down", spec, h, r_kv + rope, "replicate", bias=False, saves_input=not r_q),
            _norm(f"{prefix}.kv_norm", spec, r_kv, "none"),
            _linear(f"{prefix}.kv_up", spec, r_kv, heads * (spec.head_dim - rope + v), "column", bias=False,
                    input_split="none"),
            Op(name=f"{prefix}.rope", kind="elementwise", bytes_fwd=4 * (heads + 1) * rope,
               bytes_bwd=4 * (heads + 1) * rope, split="tp"),
            Op(name=f"{prefix}.core", kind="attention", heads=heads, kv_heads=heads, head_dim=(spec.head_dim + v) // 2,
               causal=True, window=window, attn_dropout=spec.dropout,
               saved=(Saved(elems=2 * q + heads * v, split="tp"), Saved(elems=heads * v, split="tp"))),
            _linear(f"{prefix}.o_proj", spec, heads * v, h, "row", bias=False, saves_input=False)]
    return ops


def _attention_ops(prefix: str, spec: ModelSpec, window: int) -> list[Op]:
    """q/k/v projections (column parallel), the attention core, the output projection (row); ``window``: the
    block's sliding window (0: none)."""
    if spec.is_mla:
        return _mla_ops(prefix, spec, window)
    h, q, kv = spec.hidden, spec.q_dim, spec.kv_dim
    bias = spec.linear_bias or spec.qkv_bias
    # q, k and v read the same normed input: it is saved once (on q_proj)
    ops = [_linear(f"{prefix}.q_proj", spec, h, q, "column", bias=bias, input_split="sp", pointwise_input=True),
           replace(_linear(f"{prefix}.k_proj", spec, h, kv, "column", bias=bias, saves_input=False),
                   fused_with_previous=spec.fused_qkv, reads_previous_input=True),
           replace(_linear(f"{prefix}.v_proj", spec, h, kv, "column", bias=bias, saves_input=False),
                   fused_with_previous=spec.fused_qkv, reads_previous_input=True)]
    if spec.qk_norm:           # RMSNorm of each head's q and k (Qwen3): reads and writes them, keeps rstd; as
        # composite ops (no fused RMSNorm kernel: torch 2.13 on CPU) also the normalised q and k, as ``_norm``'s
        ops.append(Op(name=f"{prefix}.qk_norm", kind="elementwise", params=2 * spec.head_dim, bytes_fwd=4 * (q + kv),
                      bytes_bwd=6 * (q + kv), split="tp", norm=True, unfused="rmsnorm",
                      unfused_saved=(Saved(elems=q + kv, split="tp"),),
                      saved=(Saved(elems=q + kv, split="tp"),
                             Saved(elems=spec.num_heads + spec.num_kv_heads, split="tp", dtype_bytes=4))))
    if spec.mlp == "swiglu":   # RoPE on q and k: elementwise, saves only its cos/sin tables
        ops.append(Op(name=f"{prefix}.rope", kind="elementwise", bytes_fwd=4 * (q + kv), bytes_bwd=4 * (q + kv),
                      split="tp"))
    # the core saves q, k, v (its inputs) and its output (the projection's input, one tensor); attention sinks
    # (GPT-OSS) add one learned logit per head to every softmax: its parameters, no work worth a kernel
    ops.append(Op(name=f"{prefix}.core", kind="attention", heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                  head_dim=spec.head_dim, causal=True, window=window, attn_dropout=spec.dropout,
                  params=spec.num_heads if spec.attention_sinks else 0,
                  saved=(Saved(elems=q + 2 * kv, split="tp"), Saved(elems=q, split="tp"))))
    ops.append(_linear(f"{prefix}.o_proj", spec, q, h, "row", bias=spec.linear_bias, saves_input=False))
    return ops


def _swiglu_ops(prefix: str, spec: ModelSpec, f: int, *, saves_input: bool = True) -> list[Op]:
    """A dense SwiGLU MLP of inner width ``f`` (a dense block's, or the shared experts' together)."""
    h = spec.hidden
    return [
        _linear(f"{prefix}.gate_proj", spec, h, f, "column", bias=spec.linear_bias, saves_input=saves_input,
                input_split="sp", pointwise_input=True),
        replace(_linear(f"{prefix}.up_proj", spec, h, f, "column", bias=spec.linear_bias, saves_input=False),
                reads_previous_input=True),
        # eager: silu keeps the gate's output, the product silu's output and up's; compiled: gate's and up's
        Op(name=f"{prefix}.act", kind="elementwise", bytes_fwd=10 * f, bytes_bwd=16 * f, split="tp",
           saved=(Saved(elems=3 * f, split="tp"),), compiled_saved=(Saved(elems=2 * f, split="tp"),),
           fused_saved=(Saved(elems=2 * f, split="tp"),)),
        _linear(f"{prefix}.down_proj", spec, f, h, "row", bias=spec.linear_bias, pointwise_input=True),
    ]


def _mlp_ops(prefix: str, spec: ModelSpec, moe: bool) -> list[Op]:
    """The block's MLP: dense (GELU or SwiGLU of ``ffn_hidden``), or routed experts (``moe``: this block routes)
    of ``expert_ffn`` each, top-k of them per token, beside the shared experts."""
    h, f = spec.hidden, spec.ffn_hidden
    if spec.mlp == "swiglu" and not moe:
        return _swiglu_ops(prefix, spec, f)
    if spec.mlp == "gelu":
        return [
            _linear(f"{prefix}.fc1", spec, h, f, "column", bias=spec.linear_bias, input_split="sp",
                    pointwise_input=True),
            Op(name=f"{prefix}.gelu", kind="elementwise", bytes_fwd=4 * f, bytes_bwd=6 * f, split="tp",
               saved=(Saved(elems=f, split="tp"),)),
            _linear(f"{prefix}.fc2", spec, f, h, "row", bias=spec.linear_bias, pointwise_input=True),
        ]
    k, e, f = spec.experts_per_token, spec.num_experts, spec.expert_ffn
    # router: a replicated h x E linear, then a softmax in fp32 over the experts (its output kept), top-k (the
    # chosen experts' int64 ids kept) and the weights' renormalisation (the k weights and their sum kept): Megatron-
    # Core's TopKRouter and Mixtral's router alike (measured with saved-tensor hooks on the executor's block,
    # executor/moe.py). The tokens are permuted to their experts: k copies of each (kept for the experts' first GEMMs)
    # and the int64 index of the gather
    ops = [_linear(f"{prefix}.router", spec, h, e, "replicate", bias=spec.linear_bias, input_split="sp"),
           Op(name=f"{prefix}.route", kind="elementwise", bytes_fwd=8 * e + 16 * k, bytes_bwd=8 * e + 8 * k,
              split="sp", saved=(Saved(elems=e, split="sp", dtype_bytes=4), Saved(elems=k, split="sp", dtype_bytes=8),
                                 Saved(elems=k + 1, split="sp", dtype_bytes=4))),
           Op(name=f"{prefix}.permute", kind="elementwise", bytes_fwd=4 * h * k, bytes_bwd=4 * h * k,
              split="sp", saved=(Saved(elems=h * k, split="sp"), Saved(elems=k, split="sp", dtype_bytes=8)),
              saves_linear_input=True)]
    routed = [
        # gate and up share their input: one saved copy (the permuted tokens, above)
        _linear(f"{prefix}.gate_proj", spec, h, f, "column", bias=spec.linear_bias, saves_input=False,
                input_split="sp", tokens_factor=k, num_gemms=e),
        replace(_linear(f"{prefix}.up_proj", spec, h, f, "column", bias=spec.linear_bias, saves_input=False,
                        tokens_factor=k, num_gemms=e), reads_previous_input=True),
        # silu saves the gate output; the product saves silu's output and up's output
        Op(name=f"{prefix}.act", kind="elementwise", bytes_fwd=10 * f * k, bytes_bwd=16 * f * k, split="tp",
           saved=(Saved(elems=3 * f * k, split="tp"),), fused_saved=(Saved(elems=2 * f * k, split="tp"),)),
        _linear(f"{prefix}.down_proj", spec, f, h, "row", bias=spec.linear_bias, tokens_factor=k, num_gemms=e),
    ]
    ops += [replace(op, expert=True, route_groups=(spec.router_groups, spec.router_groups_used)) for op in routed]
    # combine: each copy's output scaled by its weight and summed back into its token (Megatron-Core's unpermute with
    # probs; the executor's index_add): the k outputs at hidden width, their k weights and the int64 index are kept.
    # Reads k h twice and writes them and the token's h
    ops.append(Op(name=f"{prefix}.combine", kind="elementwise", bytes_fwd=2 * (3 * k * h + h),
                  bytes_bwd=2 * (3 * k * h + h), split="sp",
                  saved=(Saved(elems=k * h, split="sp"), Saved(elems=k, split="sp"),
                         Saved(elems=k, split="sp", dtype_bytes=8))))
    if spec.shared_experts:    # every token through the shared experts too: one dense MLP of their total width
        ops += _swiglu_ops(f"{prefix}.shared", spec, spec.shared_ffn, saves_input=False)
        if spec.shared_expert_gate:
            ops.append(_linear(f"{prefix}.shared.gate", spec, h, 1, "replicate", bias=False, saves_input=False))
    return ops


def _block(index: int, spec: ModelSpec) -> Layer:
    """Block ``index``: its signature names what sets it apart from the model's other blocks (a dense MLP among
    experts, full attention among sliding windows), so that blocks alike are priced once."""
    prefix = f"layers.{index}"
    h = spec.hidden
    moe, window = spec.is_moe_block(index), spec.sliding_window if spec.slides(index) else 0
    ops = [_norm(f"{prefix}.attn_norm", spec), *_attention_ops(f"{prefix}.attn", spec, window),
           _dropout_add(f"{prefix}.residual1", spec), _norm(f"{prefix}.mlp_norm", spec),
           *_mlp_ops(f"{prefix}.mlp", spec, moe), _dropout_add(f"{prefix}.residual2", spec)]
    signature = "block" + ("-dense" if spec.is_moe and not moe else "") \
        + ("-full" if spec.sliding_window and not window else "")
    return Layer(name=prefix, kind="block", signature=signature, ops=tuple(ops),
                 tp_allreduce_fwd_elems=2 * h, tp_allreduce_bwd_elems=2 * h, output_elems=h,
                 tp_allreduce_expert_elems=h if moe and not spec.shared_experts else 0.0,
                 params_replicated=replicated_params(ops), eager=layer_eager_bytes(spec, "block"))


def build_layer_graph(spec: ModelSpec) -> LayerGraph:
    """The analytical layer graph of a config model: embedding, blocks, final norm, LM head."""
    h, v = spec.hidden, spec.vocab_size
    embed_ops = [Op(name="embed.tokens", kind="embedding", params=v * h, bytes_fwd=2 * h + 8, bytes_bwd=4 * h,
                    split="sp", saved=(Saved(elems=1, split="none", dtype_bytes=8),))]
    if spec.max_positions:
        embed_ops.append(Op(name="embed.positions", kind="elementwise", params=spec.max_positions * h,
                            bytes_fwd=6 * h, bytes_bwd=4 * h, split="sp"))
    if spec.dropout:
        embed_ops.append(Op(name="embed.dropout", kind="elementwise", bytes_fwd=4 * h + h / 2,
                            bytes_bwd=4 * h + h / 2, split="sp", saved=(Saved(elems=h, split="sp", dtype_bytes=1),)))
    embed = Layer(name="embed", kind="embedding", signature="embed", ops=tuple(embed_ops),
                  tp_allreduce_fwd_elems=h, output_elems=h,
                  params_replicated=sum(op.params for op in embed_ops if op.kind != "embedding"),
                  eager=layer_eager_bytes(spec, "embedding"))
    blocks = [_block(i, spec) for i in range(spec.num_layers)]
    final_norm = Layer(name="norm", kind="norm", signature="norm", ops=(_norm("norm", spec),), output_elems=h,
                       params_replicated=spec.final_norm_params(), eager=layer_eager_bytes(spec, "norm"))
    # LM head: a vocab-parallel linear, then the loss in fp32. Forward: 3 small all-reduces
    # (max, sum, target logit) per token. Bytes per logit of Megatron-LM's vocab-parallel
    # cross-entropy (megatron/core/tensor_parallel/cross_entropy.py): upcast r2 w4, max r4,
    # subtract r4 w4, exp r4 w4, sum r4, divide r4 w4 = 38; backward multiply r4 w4 and the
    # cast back r4 w2 = 14. Both losses the runtimes run (planner/runtimes.py ``Runtime.loss``) keep
    # 4 bytes per logit for backward: Megatron's the fp32 softmax (_VocabParallelCrossEntropy saves
    # exp_logits), torch's the fp32 log-probabilities (log_softmax's output).
    head_ops = (
        _linear("lm_head", spec, h, v, "column", bias=False, input_split="sp") if not spec.tied_embeddings else
        Op(name="lm_head", kind="linear", params=0, in_features=h, out_features=v, tp="column",
           saved=(Saved(elems=h, split="sp", gathered_input=True),)),
        Op(name="loss", kind="elementwise", bytes_fwd=38 * v, bytes_bwd=14 * v, split="tp",
           saved=(Saved(elems=v, split="tp", dtype_bytes=4),),
           # vocab-parallel backward: the gradient is written into the saved fp32 softmax in place
           # (grad_input = softmax; grad_input.mul_(grad_output)), then cast to the logits' dtype
           workspace=(Saved(elems=v, split="tp"),),
           # eager backward: nll_loss_backward writes a dense fp32 gradient of the log-probabilities and
           # log_softmax_backward another beside it (aten's cross_entropy = log_softmax + nll_loss)
           eager_workspace=(Saved(elems=v, split="tp", dtype_bytes=4), Saved(elems=v, split="tp", dtype_bytes=4))),
    )
    head = Layer(name="lm_head", kind="head", signature="head", ops=head_ops, tp_allreduce_fwd_elems=3 * 2,
                 tp_allreduce_bwd_elems=h, output_elems=0, eager=layer_eager_bytes(spec, "head"))
    return LayerGraph(name=spec.name, layers=(embed, *blocks, final_norm, head), seq_len=spec.seq_len,
                      hidden=h, vocab_size=v, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                      tied_embeddings=spec.tied_embeddings,
                      tied_params=v * h if spec.tied_embeddings else 0, num_experts=spec.num_experts,
                      latent_attention=spec.is_mla,
                      source=spec.source)


def attention_flops(batch: float, heads: float, q_len: float, kv_len: float, head_dim: int, *,
                    causal: bool, window: int = 0) -> float:
    """Forward matmul FLOPs a fused kernel really does: QK^T and PV, skipping masked blocks.

    Full attention is 4 b a s_q s_kv d (two matmuls); a causal mask halves it
    (FlashAttention-2, Dao 2023, Sec 3.1.1: blocks above the diagonal are skipped);
    a sliding window of w keys costs 4 b a s_q d w (1 - w / 2 s).
    """
    full = 4.0 * batch * heads * q_len * kv_len * head_dim
    if window and window < kv_len:
        return 4.0 * batch * heads * q_len * head_dim * window * (1 - window / (2 * kv_len))
    return full * (0.5 if causal else 1.0)
