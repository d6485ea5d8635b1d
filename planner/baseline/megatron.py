"""Megatron-LM arguments: a file of flags (meshplan's megatron_args.txt), or the launch
script or command line that runs ``pretrain_gpt.py`` (bash arrays, ``NAME=value``
variables, backslash continuations, ``# comments``).

Flags and defaults as megatron/training/arguments.py (NVIDIA/Megatron-LM) defines them,
read with argparse's rule (the last of a repeated flag wins). Which blocks each pipeline
stage builds follows megatron/core/transformer/transformer_block.py
(``get_num_layers_to_build``) and pipeline_parallel_layer_layout.py (``--pipeline-
model-parallel-layout``); the padded vocabulary megatron/training/vocab_utils.py.
"""
from __future__ import annotations

import ast
import math
import re
import shlex
from dataclasses import replace
from pathlib import Path

from ..config import ParallelConfig
from ..errors import UserError
from ..layers import LayerGraph
from ..model import ModelSpec
from ..precision import RECIPES
from ..recompute import discard_modules
from .values import (Baseline, Context, FileModel, choice, data_parallel, global_batch, microbatches,
                     pipeline_layers, positive_int, recompute_of, schedule_of)

PARALLEL = {   # flags that set the knobs (the values they take are checked where they are read)
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--micro-batch-size", "--global-batch-size", "--seq-length", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--data-parallel-sharding-strategy",
    "--optimizer-offload-fraction", "--attention-backend", "--expert-model-parallel-size",
    "--expert-tensor-parallel-size", "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--fp8-format",
    "--fp8-recipe", "--recompute-modules", "--cpu-offloading-num-layers",
}
# flags that take any number of values (argparse nargs='*'), read as one space-separated string
MULTI = {"--recompute-modules"}
# --recompute-modules: the sub-modules --recompute-granularity selective recomputes (Megatron-LM arguments.py and
# TransformerConfig at core_v0.15.0: these choices, default ["core_attn"]); meshplan's selective policy is core_attn's
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
DISCARD_MODULES = ("layernorm", "moe_act", "mla_up_proj")     # those Megatron-Core discards outputs of (meshplan's
                                                              # "discard", planner/recompute.py)
SWITCHES = {   # store_true flags this reader models
    "--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp", "--use-torch-fsdp2",
    "--optimizer-cpu-offload", "--recompute-activations", "--checkpoint-activations", "--bf16", "--fp16",
    "--overlap-grad-reduce", "--tp-comm-overlap", "--use-flash-attn", "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split", "--swiglu", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--add-qkv-bias", "--group-query-attention", "--moe-shared-expert-gate",
    "--multi-latent-attention", "--qk-layernorm", "--moe-grouped-gemm", "--fp8-param-gather", "--grad-reduce-in-bf16",
    "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--quick-geglu", "--moe-router-pre-softmax",
    "--moe-router-enable-expert-bias",
}
MODEL = {      # architecture flags (read when no --model is given, checked against it otherwise)
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
    "--kv-channels", "--max-position-embeddings", "--position-embedding-type", "--normalization",
    "--attention-dropout", "--hidden-dropout", "--vocab-size", "--make-vocab-size-divisible-by", "--tokenizer-type",
    "--vocab-file", "--merge-file", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
    "--qk-pos-emb-head-dim", "--v-head-dim", "--softmax-type", "--window-size", "--window-attn-skip-freq",
    "--glu-linear-offset", "--activation-func-clamp-value", "--moe-router-score-function", "--moe-router-num-groups",
    "--moe-router-group-topk", "--moe-router-topk-scaling-factor", "--moe-router-bias-update-rate",
}
SHAPE = {"--num-layers": "num_layers", "--hidden-size": "hidden", "--num-attention-heads": "num_heads",
         "--num-query-groups": "num_kv_heads", "--ffn-hidden-size": "ffn_hidden", "--kv-channels": "head_dim",
         "--num-experts": "num_experts"}
GPT2_VOCAB = 50257       # entries of GPT-2's BPE vocabulary (gpt2-vocab.json; Radford et al. 2019)
SHARDING_ZERO = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}   # Megatron-FSDP strategies

_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


# -- the text: flags and their values ---------------------------------------------------------------

def parse(text: str, source: str) -> dict[str, str | bool]:
    """Flag -> its value (True for a flag given without one), variables expanded where the file sets them."""
    variables: dict[str, str] = {}
    args: dict[str, str | bool] = {}
    for number, line in enumerate(text.replace("\\\n", " ").splitlines(), 1):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as e:
            raise UserError(f"line {number} is not a shell line ({e})", source=source) from None
        if tokens[:1] == ["export"]:
            tokens = tokens[1:]
        match = _ASSIGN.match(tokens[0]) if tokens else None
        if match:
            name, value = match.groups()
            if not value.startswith("("):
                variables[name] = _expand(value, variables)
                continue
            tokens = [value[1:]] + tokens[1:]          # NAME=(--flag value ...): a bash array of flags
        _collect(tokens, variables, args)
    return args


def _expand(value: str, variables: dict[str, str]) -> str:
    return _VARIABLE.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), value)


def _collect(tokens: list[str], variables: dict[str, str], args: dict[str, str | bool]) -> None:
    tokens = [t.rstrip(")") for t in tokens if t.rstrip(")")]
    i = 0
    while i < len(tokens):
        flag, eq, value = tokens[i].partition("=")
        if not flag.startswith("--") or len(flag) < 3:
            i += 1
            continue
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if flag in MULTI and not eq:          # every value up to the next flag (none: an empty list)
            j = i + 1
            while j < len(tokens) and not tokens[j].startswith("--"):
                j += 1
            args[flag] = " ".join(_expand(t, variables) for t in tokens[i + 1:j])
            i = j
            continue
        if eq:
            args[flag] = _expand(value, variables)
        elif flag in SWITCHES or not following or following.startswith("--"):
            args[flag] = True
        else:
            args[flag] = _expand(following, variables)
            i += 1
        i += 1


def _value(args: dict, flag: str, source: str) -> str | None:
    value = args.get(flag)
    if value is None:
        return None
    if value is True:
        raise UserError("expects a value", source=source, field=flag)
    if "$" in value:
        raise UserError(f"{value!r} is a shell expression this file does not set; allowed: a number, or "
                        "NAME=value earlier in the file", source=source, field=flag)
    return value


def _int(args: dict, flag: str, source: str, default: int | None = None, minimum: int = 1) -> int | None:
    value = _value(args, flag, source)
    return default if value is None else positive_int(source, flag, value, minimum)


def _float(args: dict, flag: str, source: str, default: float) -> float:
    value = _value(args, flag, source)
    try:
        return default if value is None else float(value)
    except ValueError:
        raise UserError(f"expected a number, got {value!r}", source=source, field=flag) from None


# -- the model the flags describe ---------------------------------------------------------------------

def model_of(args: dict, source: str) -> FileModel:
    shape = {field: (flag, _int(args, flag, source)) for flag, field in SHAPE.items() if args.get(flag) is not None}
    seq = _int(args, "--seq-length", source)
    seq_len = ("--seq-length", seq) if seq else None
    if not {"num_layers", "hidden", "num_heads"} <= shape.keys():
        return FileModel(shape=shape, seq_len=seq_len,
                         missing="the flags give no whole architecture (--num-layers, --hidden-size, "
                                 "--num-attention-heads)")
    vocab, note = _vocab(args, source)
    if vocab is None:
        return FileModel(shape=shape, seq_len=seq_len,
                         missing="the flags give no vocabulary (--vocab-size, --tokenizer-type GPT2BPETokenizer, or "
                                 "--vocab-file with --merge-file)")
    return FileModel(spec=_spec(args, source, {k: v for k, (_, v) in shape.items()}, vocab, seq), shape=shape,
                     seq_len=seq_len, notes=(note,))


def _vocab(args: dict, source: str) -> tuple[int | None, str]:
    """The padded vocabulary and how it was found: the tokenizer's, rounded up to a multiple
    of --make-vocab-size-divisible-by x tp (megatron/training/vocab_utils.py). Without
    --tokenizer-type, Megatron-LM's GPT entry point (pretrain_gpt.py: args_defaults
    tokenizer_type GPT2BPETokenizer) reads --vocab-file and --merge-file as GPT-2's BPE files."""
    size = _int(args, "--vocab-size", source)
    tokenizer = args.get("--tokenizer-type")
    what = f"--vocab-size {size}"
    bpe_files = args.get("--merge-file") is not None or "gpt2" in str(args.get("--vocab-file", "")).lower()
    if size is None and (tokenizer == "GPT2BPETokenizer" or (tokenizer is None and bpe_files)):
        how = ("--tokenizer-type GPT2BPETokenizer" if tokenizer else
               "no --tokenizer-type: pretrain_gpt.py's default GPT2BPETokenizer with --vocab-file and --merge-file")
        size, what = GPT2_VOCAB, f"GPT-2's BPE tokenizer ({GPT2_VOCAB} tokens; {how})"
    if size is None:
        return None, ""
    multiple = _int(args, "--make-vocab-size-divisible-by", source, 128) * _int(
        args, "--tensor-model-parallel-size", source, 1)
    padded = math.ceil(size / multiple) * multiple
    return padded, f"vocabulary: {what}, padded to {padded} (a multiple of {multiple}) as Megatron-LM pads it"


def _spec(args: dict, source: str, shape: dict, vocab: int, seq: int | None) -> ModelSpec:
    """A ModelSpec from the architecture flags, with Megatron's defaults (GELU, LayerNorm,
    learned positions, biases, tied embeddings, dropout 0.1) where a flag is absent."""
    h, heads = shape["hidden"], shape["num_heads"]
    limit = _gpt_oss_glu(args, source)
    swiglu = bool(args.get("--swiglu")) or bool(limit)
    # arguments.py: --ffn-hidden-size defaults to 4h, or int(4h * 2/3 / 64) * 64 with --swiglu
    ffn = shape.get("ffn_hidden") or (int(4 * h * 2 / 3 / 64) * 64 if args.get("--swiglu") else 4 * h)
    seq = seq or 2048
    positions = choice(source, "--position-embedding-type",
                       _value(args, "--position-embedding-type", source) or "learned_absolute",
                       ("learned_absolute", "rope", "mrope", "relative", "none"))
    norm = choice(source, "--normalization", _value(args, "--normalization", source) or "LayerNorm",
                  ("LayerNorm", "RMSNorm"))
    dropout = any(_float(args, f, source, 0.1) > 0 for f in ("--attention-dropout", "--hidden-dropout"))
    experts = shape.get("num_experts") or 0
    mla = bool(args.get("--multi-latent-attention"))
    # Megatron-Core's MLA defaults (arguments.py _add_mla_args): kv rank 32, q/k heads of 128 + 64 (RoPE), v 128
    nope, rope = _int(args, "--qk-head-dim", source, 128), _int(args, "--qk-pos-emb-head-dim", source, 64)
    window = _window(args, source)
    spec = ModelSpec(
        name=Path(source).stem, num_layers=shape["num_layers"], hidden=h, num_heads=heads,
        num_kv_heads=shape.get("num_kv_heads", heads) if args.get("--group-query-attention") else heads,
        head_dim=shape.get("head_dim") or h // heads, ffn_hidden=ffn, vocab_size=vocab, seq_len=seq,
        max_positions=_int(args, "--max-position-embeddings", source, seq) if positions == "learned_absolute" else 0,
        mlp="swiglu" if swiglu else "gelu", norm="rmsnorm" if norm == "RMSNorm" else "layernorm",
        linear_bias=not args.get("--disable-bias-linear"), qkv_bias=bool(args.get("--add-qkv-bias")),
        tied_embeddings=not args.get("--untie-embeddings-and-output-weights"), dropout=dropout,
        num_experts=experts, experts_per_token=_int(args, "--moe-router-topk", source, 2) if experts else 0,
        swiglu_limit=limit, source=f"{source} (Megatron-LM flags)")
    if experts:
        shared = _int(args, "--moe-shared-expert-intermediate-size", source, 0, minimum=0)
        moe_ffn = _int(args, "--moe-ffn-hidden-size", source, 0, minimum=0)
        spec = replace(spec, moe_ffn_hidden=moe_ffn, shared_experts=1 if shared else 0,
                       shared_ffn_hidden=0 if shared == (moe_ffn or ffn) else shared,   # 0: an expert's width
                       shared_expert_gate=bool(shared and args.get("--moe-shared-expert-gate")),
                       dense_layers=_dense_layers(args, source, shape["num_layers"]), **_router(args, source))
    if mla:
        spec = replace(spec, num_kv_heads=heads, head_dim=nope + rope, qk_rope_head_dim=rope,
                       v_head_dim=_int(args, "--v-head-dim", source, 128),
                       q_lora_rank=_int(args, "--q-lora-rank", source, 0, minimum=0),
                       kv_lora_rank=_int(args, "--kv-lora-rank", source, 32))
    softmax = choice(source, "--softmax-type", _value(args, "--softmax-type", source) or "vanilla",
                     ("vanilla", "off-by-one", "learnable"))
    return replace(spec, qk_norm=bool(args.get("--qk-layernorm")), attention_sinks=softmax == "learnable",
                   **window).validate(source)


def _router(args: dict, source: str) -> dict:
    """The router's ModelSpec fields from Megatron-Core's flags (moe_utils.py topk_routing_with_score_function at
    core_v0.15.0: softmax after the top-k, renormalised, unless --moe-router-pre-softmax; sigmoid scores renormalised
    over the top-k; --moe-router-num-groups and --moe-router-group-topk; --moe-router-topk-scaling-factor; the
    expert bias, which it adds to sigmoid scores only)."""
    scores = choice(source, "--moe-router-score-function", _value(args, "--moe-router-score-function", source)
                    or "softmax", ("softmax", "sigmoid"))
    groups = _int(args, "--moe-router-num-groups", source, 0, minimum=0)
    used = _int(args, "--moe-router-group-topk", source, 0, minimum=0)
    if bool(groups) != bool(used):
        raise UserError("group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk",
                        source=source, field="--moe-router-group-topk" if groups else "--moe-router-num-groups")
    scale = _float(args, "--moe-router-topk-scaling-factor", source, 1.0)
    if not scale > 0:
        raise UserError(f"must be > 0, got {scale}", source=source, field="--moe-router-topk-scaling-factor")
    # --moe-router-enable-expert-bias: the bias moved at --moe-router-bias-update-rate (arguments.py default 1e-3)
    rate = _float(args, "--moe-router-bias-update-rate", source, 1e-3) if args.get("--moe-router-enable-expert-bias") \
        else 0.0
    return dict(router_scores=scores, router_renormalize=scores == "sigmoid" or not args.get("--moe-router-pre-softmax"),
                router_groups=groups if groups > 1 else 0, router_groups_used=used if groups > 1 else 0,
                router_scale=scale, router_bias_rate=rate)


def _gpt_oss_glu(args: dict, source: str) -> float:
    """GPT-OSS's clamped SwiGLU experts (``ModelSpec.swiglu_limit``) from the flags Megatron-Bridge's GPT-OSS
    provider sets: --quick-geglu (the gate's x sigmoid(1.702 x)), --glu-linear-offset 1 (times up + 1) and
    --activation-func-clamp-value; 0 without --quick-geglu. Other quick-GEGLU variants are refused."""
    if not args.get("--quick-geglu"):
        for flag in ("--glu-linear-offset", "--activation-func-clamp-value"):
            if _value(args, flag, source) is not None:
                raise UserError("is read with --quick-geglu only (GPT-OSS's experts)", source=source, field=flag)
        return 0.0
    if args.get("--swiglu"):
        raise UserError("--swiglu and --quick-geglu are two activations; give one", source=source,
                        field="--quick-geglu")
    offset = _float(args, "--glu-linear-offset", source, 0.0)
    limit = _float(args, "--activation-func-clamp-value", source, 0.0)
    if offset != 1.0 or not limit > 0:
        raise UserError("meshplan models quick GEGLU as GPT-OSS's experts run it: --glu-linear-offset 1.0 and "
                        "an --activation-func-clamp-value > 0", source=source, field="--quick-geglu")
    return limit


def _layer_pattern(text: str, source: str, flag: str) -> list[int]:
    """A list expression of Megatron's ``moe_freq_type`` ("[0]*3+[1]*58"): list literals of integers joined by
    + and repeated by *, read without running it."""
    def value(node):
        if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts):
            return [e.value for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError
    try:
        out = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        out = None
    if not isinstance(out, list):
        raise UserError(f"{text!r} is not a list expression of 0s and 1s such as \"[0]*3+[1]*58\"", source=source,
                        field=flag)
    return out


def _dense_layers(args: dict, source: str, num_layers: int) -> int:
    """--moe-layer-freq as the count of leading dense blocks (the layouts meshplan expresses)."""
    text = _value(args, "--moe-layer-freq", source)
    if text is None or text.strip() == "1":
        return 0
    pattern = _layer_pattern(text, source, "--moe-layer-freq")
    dense = pattern.index(1) if 1 in pattern else len(pattern)
    if len(pattern) != num_layers or pattern != [0] * dense + [1] * (num_layers - dense):
        raise UserError(f"{text!r}: only leading dense blocks then expert blocks, {num_layers} in all, are "
                        "supported", source=source, field="--moe-layer-freq")
    return dense


def _window(args: dict, source: str) -> dict:
    """--window-size LEFT,RIGHT (causal: RIGHT 0) and --window-attn-skip-freq (2: every other block full)."""
    text = _value(args, "--window-size", source)
    if text is None:
        return {}
    parts = text.strip("()").split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[0]) <= 0 or int(parts[1]):
        raise UserError(f"{text!r}: expected LEFT,0 (a causal window of LEFT tokens)", source=source,
                        field="--window-size")
    skip = _value(args, "--window-attn-skip-freq", source)
    if skip not in (None, "2"):
        raise UserError(f"{skip!r}: only 2 (sliding and full attention alternating) is supported", source=source,
                        field="--window-attn-skip-freq")
    return {"sliding_window": int(parts[0]), "sliding_every": 2 if skip else 0}


# -- the knobs --------------------------------------------------------------------------------------

def read(args: dict, source: str, ctx: Context, graph: LayerGraph) -> Baseline:
    tp = _int(args, "--tensor-model-parallel-size", source, 1)
    pp = _int(args, "--pipeline-model-parallel-size", source, 1)
    cp = _int(args, "--context-parallel-size", source, 1)
    dp = data_parallel(source, ctx.gpus, {"--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp,
                                           "--context-parallel-size": cp})
    micro = _int(args, "--micro-batch-size", source, 1)
    # arguments.py: --global-batch-size defaults to micro-batch x data-parallel size
    batch = global_batch(source, "--global-batch-size", _int(args, "--global-batch-size", source), ctx, micro * dp)
    m = microbatches(source, "--global-batch-size", "--micro-batch-size", batch, dp, micro)
    blocks = _stage_blocks(args, source, graph.num_blocks, pp)
    vpp = len(blocks) // pp if blocks else 1
    per_block, notes = _recompute(args, source, blocks or [graph.num_blocks], graph)
    recompute, recompute_layers = recompute_of(graph, per_block)
    zero, runtime, more = _zero(args, source)
    notes += more
    sp = bool(args.get("--sequence-parallel"))
    if sp and tp == 1:
        sp = False
        notes.append("--sequence-parallel with tensor parallel size 1: Megatron-LM turns it off (arguments.py)")
    ep, more = _expert_parallel(args, source, tp, graph)
    notes += more
    offload = bool(args.get("--optimizer-cpu-offload"))
    fraction = _float(args, "--optimizer-offload-fraction", source, 1.0)
    if offload and fraction < 1.0:
        notes.append(f"--optimizer-offload-fraction {fraction}: meshplan models the whole optimizer offloaded")
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, micro_batch=micro, num_microbatches=m,
                            vpp=vpp, schedule=schedule_of(pp, vpp), recompute=recompute, sequence_parallel=sp,
                            optimizer_offload=offload,
                            recompute_layers=recompute_layers,
                            stage_layers=pipeline_layers(source, "--pipeline-model-parallel-size", graph, blocks))
    return Baseline(source=source, format="megatron", runtime=runtime, config=config, global_batch=batch,
                    seq_len=graph.seq_len, precision=_precision(args, source), attention=_attention(args, source),
                    overlap_grad_reduce=bool(args.get("--overlap-grad-reduce")),
                    tp_comm_overlap=bool(args.get("--tp-comm-overlap")), flags=FLAGS,
                    ep_comm_overlap=bool(args.get("--overlap-moe-expert-parallel-comm")),
                    expert_dispatcher=_dispatcher(args, source), fp8=_fp8(args, source),
                    fp8_param_gather=bool(args.get("--fp8-param-gather")),
                    grad_reduce_in_bf16=bool(args.get("--grad-reduce-in-bf16")),
                    ignored=tuple(sorted(f for f in args if f not in PARALLEL | SWITCHES | MODEL)), notes=tuple(notes))


def _dispatcher(args: dict, source: str) -> str:
    """--moe-token-dispatcher-type: alltoall (Megatron-LM's default), allgather, or flex with
    --moe-flex-dispatcher-backend deepep (its default) or hybridep, NVIDIA's hierarchical kernels, priced as DeepEP's
    (planner/network.py forwarded_exchange_s); ncclep is not modelled."""
    value = _value(args, "--moe-token-dispatcher-type", source)
    kind = "alltoall" if value is None else choice(source, "--moe-token-dispatcher-type", value,
                                                    ("alltoall", "allgather", "flex"))
    backend = _value(args, "--moe-flex-dispatcher-backend", source)
    if kind == "flex" and backend is not None:
        choice(source, "--moe-flex-dispatcher-backend", backend, ("deepep", "hybridep"))
    return kind


def _expert_parallel(args: dict, source: str, tp: int, graph: LayerGraph) -> tuple[int, list[str]]:
    """(ep, notes) of --expert-model-parallel-size and --expert-tensor-parallel-size (Megatron-Core's MoE parallel
    folding): meshplan models experts whole on each of ep ranks (expert tensor parallel 1) or, with ep 1, split over
    the tensor-parallel ranks (the expert tensor-parallel size's default, tp)."""
    ep = _int(args, "--expert-model-parallel-size", source, 1)
    # unset, Megatron-LM takes the tensor-parallel size, with or without expert parallelism (megatron/training/
    # arguments.py at core_r0.14.0: "if args.expert_tensor_parallel_size is None: ... = args.tensor_model_parallel_size")
    given = "--expert-tensor-parallel-size" in args
    etp = _int(args, "--expert-tensor-parallel-size", source, tp)
    if ep > 1 and etp != 1:
        unset = "" if given else " (not given: Megatron-LM's default, the tensor-parallel size)"
        raise UserError(f"{etp}{unset} with --expert-model-parallel-size {ep}: meshplan models experts whole on their "
                        "rank (expert tensor parallel 1) under expert parallelism; allowed: 1", source=source,
                        field="--expert-tensor-parallel-size")
    if ep == 1 and etp != tp:
        raise UserError(f"{etp} without expert parallelism: meshplan splits the experts as the dense layers (over "
                        f"the {tp} tensor-parallel ranks); allowed: {tp}", source=source,
                        field="--expert-tensor-parallel-size")
    notes = []
    if ep > 1 and not args.get("--moe-grouped-gemm"):
        notes.append("no --moe-grouped-gemm: Megatron runs the local experts one after another (SequentialMLP); "
                     "meshplan prices each expert's GEMM alike either way")
    return ep, notes


FLAGS = {   # meshplan's flag (as config.check_config names it) -> this format's
    "--dp/--tp/--pp/--cp": "--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size",
    "--tp": "--tensor-model-parallel-size", "--pp": "--pipeline-model-parallel-size", "--cp": "--context-parallel-size",
    "--ep": "--expert-model-parallel-size",
    "--micro-batch": "--micro-batch-size", "num_microbatches": "--global-batch-size",
    "--vpp": "--num-layers-per-virtual-pipeline-stage", "--schedule": "--num-layers-per-virtual-pipeline-stage",
    "--recompute": "--recompute-granularity", "--sequence-parallel": "--sequence-parallel",
    "--zero": "--use-distributed-optimizer", "--optimizer-offload": "--optimizer-cpu-offload",
    "--precision": "--bf16/--fp16"}


def _precision(args: dict, source: str) -> str:
    if args.get("--bf16") and args.get("--fp16"):
        raise UserError("--bf16 and --fp16 together; allowed: one of them (or neither, for fp32)", source=source,
                        field="--bf16/--fp16")
    return "bf16" if args.get("--bf16") else "fp16" if args.get("--fp16") else "fp32"


# --fp8-recipe (megatron/core/transformer/transformer_config.py fp8_recipe, default "delayed") -> --precision: the
# recipes' own Megatron-LM flags (planner/precision.py Recipe.megatron_flags)
FP8_RECIPES = {r.megatron_flags[r.megatron_flags.index("--fp8-recipe") + 1]: name
               for name, r in RECIPES.items() if r.megatron_flags}


def _fp8(args: dict, source: str) -> str:
    """The FP8 recipe --fp8-format turns on (e4m3 or hybrid), by --fp8-recipe; "" without --fp8-format."""
    fmt, recipe = _value(args, "--fp8-format", source), _value(args, "--fp8-recipe", source) or "delayed"
    if fmt is None:
        return ""
    if fmt not in ("e4m3", "hybrid"):
        raise UserError(f"{fmt!r} is not allowed; allowed: e4m3 or hybrid", source=source, field="--fp8-format")
    if recipe not in FP8_RECIPES:
        raise UserError(f"{recipe!r} is not modelled; allowed: {', '.join(FP8_RECIPES)}", source=source,
                        field="--fp8-recipe")
    return FP8_RECIPES[recipe]


def _attention(args: dict, source: str) -> str:
    backend = _value(args, "--attention-backend", source) or "auto"
    choice(source, "--attention-backend", backend, ("flash", "fused", "unfused", "local", "auto"))
    return "unfused" if backend in ("unfused", "local") and not args.get("--use-flash-attn") else "flash"


def _zero(args: dict, source: str) -> tuple[int, str, list[str]]:
    """(ZeRO stage, runtime, notes): the distributed optimizer is ZeRO-1 in Megatron-LM's own
    layout, Megatron-FSDP's sharding strategies ZeRO-0 to 3 in it too (planner/runtimes.py); torch FSDP2
    shards like meshplan's FSDP2 runtime (torch)."""
    if args.get("--use-megatron-fsdp"):
        strategy = _value(args, "--data-parallel-sharding-strategy", source) or "optim_grads_params"
        zero = SHARDING_ZERO[choice(source, "--data-parallel-sharding-strategy", strategy, SHARDING_ZERO)]
        return zero, "megatron", []
    if args.get("--use-torch-fsdp2"):
        return 3, "torch", []
    return (1 if args.get("--use-distributed-optimizer") else 0), "megatron", []


def _recompute(args: dict, source: str, blocks: list[int], graph: LayerGraph) -> tuple[list[str], list[str]]:
    """(policy per block, notes) from --recompute-granularity/-method/-num-layers."""
    notes = []
    granularity = _value(args, "--recompute-granularity", source)
    if args.get("--recompute-activations"):
        granularity = granularity or "selective"
    if args.get("--checkpoint-activations"):
        notes.append("--checkpoint-activations (Megatron-LM before 2022, Megatron-DeepSpeed) read as full "
                     "recompute of every layer")
        granularity, method = "full", "uniform"
    else:
        method = _value(args, "--recompute-method", source)
    modules = args.get("--recompute-modules")
    modules = None if modules is None else ([] if modules is True else modules.split())
    for module in modules or ():
        choice(source, "--recompute-modules", module, RECOMPUTE_MODULES)
    if modules is not None and granularity != "selective":
        notes.append("--recompute-modules without --recompute-granularity selective: Megatron-LM reads it only "
                     "under selective granularity")
    offloaded = _int(args, "--cpu-offloading-num-layers", source, 0, minimum=0)
    if offloaded:   # the activations of the first N layers to host memory (Megatron-Core's transformer_config.py
        # refuses N >= the layers, a pipeline and any recompute beside it)
        if offloaded >= sum(blocks):
            raise UserError(f"{offloaded} layers of the model's {sum(blocks)} (Megatron-Core raises: only layers less "
                            f"than {sum(blocks)}); allowed: 0 to {sum(blocks) - 1}", source=source,
                            field="--cpu-offloading-num-layers")
        if len(blocks) > 1:
            raise UserError("CPU offloading with pipeline parallelism (Megatron-Core raises: 'no support for "
                            "Pipeline parallelism with CPU offloading'); allowed with it: "
                            "--pipeline-model-parallel-size 1", source=source, field="--cpu-offloading-num-layers")
        if granularity is not None:
            raise UserError("CPU offloading with --recompute-granularity (Megatron-Core raises: 'CPU offloading does "
                            "not work when activation recomputation is enabled'); allowed with it: no recompute",
                            source=source, field="--cpu-offloading-num-layers")
        return [("activation-offload" if i < offloaded else "none") for i in range(sum(blocks))], notes
    if granularity is None:
        return ["none"] * sum(blocks), notes
    choice(source, "--recompute-granularity", granularity, ("full", "selective"))
    if granularity == "full" and method is None:
        raise UserError("full needs a --recompute-method (Megatron-LM raises); allowed: uniform or block",
                        source=source, field="--recompute-granularity")
    if granularity == "selective":
        if method is not None:
            raise UserError(f"{method!r} with --recompute-granularity selective (Megatron-LM asserts none); "
                            "allowed: no --recompute-method", source=source, field="--recompute-method")
        modules = ["core_attn"] if modules is None else modules
        others = [m for m in modules if m not in ("core_attn",) + DISCARD_MODULES]
        if others:
            notes.append(f"--recompute-modules {' '.join(others)}: not modelled; meshplan prices those sub-modules' "
                         "activations as kept (more memory than the run holds) and nothing of them recomputed")
        listed = [m for m in modules if m in DISCARD_MODULES]
        if listed:      # meshplan's "discard": every output-discarding module the model has
            has = discard_modules(graph.layers)
            if sorted(listed) != sorted(has):
                notes.append(f"--recompute-modules {' '.join(listed)}: read as meshplan's output-discarding recompute, "
                             f"which frees what all of this model's output-discarding modules free "
                             f"({' '.join(has) or 'none: it has no MoE block and no MLA'})")
            if "core_attn" in modules:
                notes.append("--recompute-modules core_attn beside the output-discarding modules: priced as those "
                             "alone (under flash attention the attention core keeps nothing more to recompute)")
            return ["discard"] * sum(blocks), notes
        if "core_attn" not in modules:
            notes.append("--recompute-granularity selective without core_attn in --recompute-modules: the attention "
                         "core is not recomputed (read as no recompute, but for the modules above)")
            return ["none"] * sum(blocks), notes
        return ["selective"] * sum(blocks), notes
    choice(source, "--recompute-method", method, ("uniform", "block"))
    count = _int(args, "--recompute-num-layers", source, 1 if method == "uniform" else None, minimum=0)
    if count is None:
        raise UserError("--recompute-method block needs the number of blocks to recompute per stage; allowed: a "
                        "non-negative integer", source=source, field="--recompute-num-layers")
    if method == "uniform":
        if count > 1:
            notes.append(f"--recompute-num-layers {count} with the uniform method keeps one input per {count} "
                         "layers: meshplan models full recompute per layer (a little more memory)")
        return ["full"] * sum(blocks), notes
    # block: the first --recompute-num-layers blocks of every (virtual) stage, the rest none
    return [("full" if i < count else "none") for n in blocks for i in range(n)], notes


def _stage_blocks(args: dict, source: str, num_blocks: int, pp: int) -> list[int] | None:
    """Transformer blocks per virtual stage, in stage order (None without a pipeline)."""
    layout = _value(args, "--pipeline-model-parallel-layout", source)
    per_stage = _int(args, "--num-layers-per-virtual-pipeline-stage", source)
    chunks = _int(args, "--num-virtual-stages-per-pipeline-rank", source) or _int(
        args, "--virtual-pipeline-model-parallel-size", source)
    given = [f for f, v in (("--pipeline-model-parallel-layout", layout), ("--num-layers-per-virtual-pipeline-stage",
                                                                           per_stage),
                            ("--num-virtual-stages-per-pipeline-rank", chunks)) if v is not None]
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)} together (Megatron-LM asserts at most one); allowed: one of them",
                        source=source, field=given[1])
    if pp == 1:
        if given and not (chunks == 1 or per_stage == num_blocks):
            raise UserError("virtual pipeline stages need --pipeline-model-parallel-size > 1", source=source,
                            field=given[0])
        return None
    if layout is not None:
        return _layout_blocks(source, layout, pp, num_blocks)
    ranks = _blocks_per_rank(args, source, num_blocks, pp)
    vpp = chunks or 1
    if per_stage is not None:
        if args.get("--decoder-first-pipeline-num-layers") or args.get("--decoder-last-pipeline-num-layers"):
            raise UserError("with --decoder-first/last-pipeline-num-layers (Megatron-LM asserts); allowed: "
                            "--num-virtual-stages-per-pipeline-rank", source=source,
                            field="--num-layers-per-virtual-pipeline-stage")
        if ranks[0] % per_stage:
            raise UserError(f"{per_stage} does not divide the {ranks[0]} layers of each pipeline rank; allowed: a "
                            "divisor of it", source=source, field="--num-layers-per-virtual-pipeline-stage")
        vpp = ranks[0] // per_stage
    for rank, n in enumerate(ranks):
        if n % vpp:
            raise UserError(f"pipeline rank {rank}'s {n} layers do not split into {vpp} virtual stages; allowed: a "
                            "number of virtual stages dividing every rank's layers", source=source,
                            field="--num-virtual-stages-per-pipeline-rank")
    blocks = [ranks[j % pp] // vpp for j in range(pp * vpp)]    # virtual stage j: rank j % pp, chunk j // pp
    if args.get("--account-for-embedding-in-pipeline-split"):
        blocks[0] -= 1
    if args.get("--account-for-loss-in-pipeline-split"):
        blocks[-1] -= 1
    return blocks


def _blocks_per_rank(args: dict, source: str, num_blocks: int, pp: int) -> list[int]:
    """get_num_layers_to_build: the first and last rank as --decoder-first/last-pipeline-num-layers
    say, the others an equal share of the rest; or all equal, the embedding and loss counted
    as layers when --account-for-*-in-pipeline-split is given."""
    first = _int(args, "--decoder-first-pipeline-num-layers", source, minimum=0)
    last = _int(args, "--decoder-last-pipeline-num-layers", source, minimum=0)
    if first is None and last is None:
        total = num_blocks + bool(args.get("--account-for-embedding-in-pipeline-split")) + bool(
            args.get("--account-for-loss-in-pipeline-split"))
        if total % pp:
            raise UserError(f"{pp} stages do not divide the model's {total} layers (Megatron-LM asserts); allowed: "
                            "a divisor, or --decoder-first/last-pipeline-num-layers", source=source,
                            field="--pipeline-model-parallel-size")
        return [total // pp] * pp
    rest = num_blocks - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise UserError(f"the {num_blocks} layers less the first and last stages' leave {rest} for {middle} middle "
                        "stages; allowed: a multiple of them", source=source,
                        field="--decoder-first-pipeline-num-layers")
    share = rest // middle if middle else 0
    return [first if r == 0 and first is not None else last if r == pp - 1 and last is not None else share
            for r in range(pp)]


def _layout_blocks(source: str, layout: str, pp: int, num_blocks: int) -> list[int]:
    """Blocks per virtual stage of --pipeline-model-parallel-layout: stages split by '|', E
    embedding, t a block, L the loss, m an MTP layer, (...)*n and x*n repeat, commas cosmetic."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    bad = set(text) - set("EtLm|")
    if bad or not text.startswith("E") or not text.endswith("L") or len(stages) % pp:
        raise UserError(f"{layout!r} is not a layout of {pp} ranks; allowed: stages split by '|' (a multiple of the "
                        "pipeline size), E first, L last, t a block, e.g. 'Ett|tt|tt|ttL'", source=source,
                        field="--pipeline-model-parallel-layout")
    blocks = [s.count("t") for s in stages]
    if sum(blocks) != num_blocks:
        raise UserError(f"{layout!r} places {sum(blocks)} blocks but the model has {num_blocks}", source=source,
                        field="--pipeline-model-parallel-layout")
    return blocks
