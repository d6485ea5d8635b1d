"""What every meshplan command shares: the parser that fails on one line, argument types, the job and
knob flags, and turning parsed flags into the library's values (``planner.api.JobInputs``, ``Knobs``)."""
from __future__ import annotations

import argparse
import re
import sys
import time

from .. import finetune as finetune_modes
from .. import schedules
from ..api import DEFAULT_CLUSTER, DEFAULT_MODEL, JobInputs
from ..config import COMPILE_PRICED_AS, DEFAULT_MEMORY_HEADROOM, FRAMEWORKS
from ..errors import UserError
from ..precision import PRECISION_CHOICES, RECIPES
from ..recompute import DESCRIPTIONS, EVERY_K_DESCRIPTION, parse_recompute
from ..search import Knobs

KNOB_NAMES = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "vpp", "schedule", "recompute", "sequence_parallel",
              "optimizer_offload", "param_offload", "nvme_offload")

RECOMPUTE_HELP = ("recompute policies (--recompute; the search chooses one per block among those the runtime "
                  "runs):\n" + "".join(f"  {name:<18} {text}\n" for name, text in DESCRIPTIONS.items())
                  + f"  {'every-K':<18} {EVERY_K_DESCRIPTION}\n")
SCHEDULE_HELP = ("pipeline schedules (--schedule; the search chooses among those the runtime runs):\n"
                 + "".join(f"  {s.name:<18} {s.description} ({s.source})\n" for s in schedules.SCHEDULES.values()))


class BadFlags(Exception):
    """A flag argparse refuses: one line, exit code 2 (``planner.cli.main`` says it)."""

    def __init__(self, prog: str, message: str):
        super().__init__(f"{message} (see {prog} --help)")
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag on one line, exit code 2 (``BadFlags``)."""

    def error(self, message: str):
        raise BadFlags(self.prog, message)


def add_debug(p: argparse.ArgumentParser) -> None:
    """--debug after the subcommand too (it shows the traceback of an error)."""
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


# -- argument types: one line on a bad value --------------------------------------------------------

def int_at_least(minimum: int, what: str):
    """An argparse type: an integer >= ``minimum``, described as ``what`` in the error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


positive_int = int_at_least(1, "a positive integer")


def on_off(text: str) -> bool:
    if text.lower() in ("on", "true", "yes", "1"):
        return True
    if text.lower() in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def token_count(text: str) -> float:
    """'300B', '1.5T', '2e12' -> a number of tokens."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a token count such as 300B, 1.5T or 2e12, got {text!r}")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    value = float(match.group(1)) * scale
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive token count, got {text!r}")
    return value


def headroom(text: str) -> float:
    """A memory headroom: a fraction (0.18) or a percentage (18%), from 0 to 100%."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction (0.18) or a percentage (18%), got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 100%, got {text!r}")
    return value


def imbalance(text: str) -> float:
    """An expert imbalance factor: a number of at least 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1 (1.3: 30% more), got {text!r}") from None
    if not value >= 1 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of at least 1 (1: balanced), got {text!r}")
    return value


def recompute(text: str) -> str:
    """A recompute policy (or an earlier name of one) or ``every-K`` (planner/recompute.py)."""
    try:
        return parse_recompute(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(e.detail) from None


def positive_number(unit: str):
    """An argparse type: a finite number > 0 of ``unit`` (seconds, hours)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit} > 0, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a number of {unit} > 0, got {text!r}")
        return value
    return parse


seconds = positive_number("seconds")
hours = positive_number("hours")


# -- the job and its knobs --------------------------------------------------------------------------

def add_example_input_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--example-input", metavar="SHAPE:DTYPE[,...]",
                   help="example input of a traced --model file.py:factory, e.g. 1x512:int64 (several: comma "
                        "separated); overrides the factory's own example inputs")


def add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"zoo name (see `meshplan models`), a Hugging Face config.json, or an nn.Module to trace: "
                        f"path/to/file.py:factory or package.module:factory (default {DEFAULT_MODEL})")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER,
                   help=f"built-in profile (see `meshplan clusters`) or a profile TOML (default {DEFAULT_CLUSTER})")
    p.add_argument("--gpus", type=positive_int, help="number of GPUs (default: one node of the cluster)")
    p.add_argument("--global-batch", type=positive_int,
                   help="sequences per optimizer step (default: about 1M tokens, a multiple of the GPUs)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the model's)")
    p.add_argument("--precision", choices=PRECISION_CHOICES, metavar="PRECISION",
                   help="compute dtype, mixed precision with fp32 master weights: bf16, fp16, fp32; or an FP8 "
                        "recipe for the linear layers on top of bf16: " + "; ".join(
                            f"{r.name} ({r.what})" for r in RECIPES.values())
                        + ". FP8 runs on GPUs with an FP8 rate (MXFP8: Blackwell) under --framework megatron "
                          "(TransformerEngine), torchtitan or torch (torchao, with --compile); docs/cost-model.md "
                          "says how each is priced. Left out: bf16 (or what the device supports), and `meshplan plan` also "
                          "tries each FP8 recipe the runtime runs on that GPU, keeping one only where it beats "
                          "bf16 by more than the model's median error")
    p.add_argument("--framework", choices=FRAMEWORKS, default="torch",
                   help="the runtime that will train: the search stays inside what it expresses and its memory "
                        "layout is modelled. torch = meshplan's executor (FSDP2/DDP, everything meshplan plans), "
                        "megatron = Megatron-LM (fp32 main grads, 18 B/param; ZeRO-1 at most), deepspeed = the ZeRO "
                        "paper's 2+2+12 B/param (no SP or CP, balanced stages), torchtitan = FSDP2 as torch, without "
                        "ZeRO-1 or a recompute policy per layer, deepspeed-2021 = DeepSpeed v0.3.13-v0.4.2, whose "
                        "ZeRO-3 gathers one tensor at a time, megatron-2021 = Megatron-LM of 2021, whose pipeline sends block "
                        "and which interleaves only at pp > 2: an overlapped gradient reduction (the default) is its "
                        "--DDP-impl torch, --no-overlap-grad-reduce its local DDP (default torch)")
    p.add_argument("--attention", choices=("flash", "unfused"), default="flash",
                   help="attention kernels: fused (FlashAttention; cuDNN's where the runtime runs it and the profile "
                        "characterises it: megatron and torch on h100-80g, h200, b200 and gb200-nvl72) or materialised scores (default "
                        "flash; --framework torch prices a model with attention sinks or a window shorter than the "
                        "sequence unfused, as `meshplan run` writes its attention out)")
    p.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="model a runtime that reduces gradients after backward instead of overlapping")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="model TP collectives overlapped with GEMMs (TransformerEngine userbuffers)")
    p.add_argument("--ep-comm-overlap", action="store_true",
                   help="--framework megatron, a mixture of experts: run each micro-batch's expert all-to-alls "
                        "beside another micro-batch's compute (Megatron-Core's --overlap-moe-expert-parallel-comm "
                        "with --delay-wgrad-compute): plans then need ep > 1, no full recompute, and virtual stages "
                        "under a pipeline, and hold one forward more"),
    p.add_argument("--compile", action="store_true",
                   help="torch and torchtitan: compile each transformer block with torch.compile, as torchtitan "
                        f"does; `meshplan run` compiles them. Priced as {COMPILE_PRICED_AS}")
    p.add_argument("--fp8-param-gather", action="store_true",
                   help="with an FP8 recipe under --framework megatron: keep and all-gather the converted linears' "
                        "parameters in FP8 (Megatron-LM's --fp8-param-gather, which Megatron-Bridge's FP8 presets "
                        "set): half the bytes of the distributed optimizer's parameter all-gather for them")
    p.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="--framework megatron in bf16 (or FP8): accumulate and reduce gradients in bf16, 2 bytes a "
                        "parameter, instead of Megatron-LM's fp32 main gradients (its --grad-reduce-in-bf16; "
                        "Megatron-Bridge's performance runs set grad_reduce_in_fp32 = False)")
    p.add_argument("--memory-headroom", type=headroom, default=DEFAULT_MEMORY_HEADROOM, metavar="FRACTION",
                   help="memory a plan leaves free, over its predicted peak (0.18 or 18%%; 0: none). Default "
                        f"{DEFAULT_MEMORY_HEADROOM:g}: the largest gap between the predicted peak and the peak torch's "
                        "allocator reserved on meshplan's 18 H100 runs (benchmarks/results/gpu_validate.json, "
                        "gpu_holdout_validate.json)")
    p.add_argument("--expert-imbalance", type=imbalance, default=1.0, metavar="FACTOR",
                   help="mixtures of experts under expert parallelism: the tokens the busiest rank's experts receive "
                        "over the balanced share (1.3: 30%% more). Default 1: balanced routing, as published MoE "
                        "benchmarks force it")
    p.add_argument("--expert-dispatcher", choices=("alltoall", "allgather", "flex"), default="alltoall",
                   help="how tokens reach their experts under expert parallelism: all-to-alls (every runtime; the "
                        "default), all-gather and reduce-scatter over the expert-parallel ranks (Megatron-LM's "
                        "--moe-token-dispatcher-type allgather), or Megatron-LM's flex dispatcher on DeepEP's kernels "
                        "(--moe-token-dispatcher-type flex), which sends a token once to each GPU and, across the "
                        "network, once to each node that holds any of its experts, not once per expert")
    p.add_argument("--finetune", choices=finetune_modes.NAMES, default=None,
                   help="training mode: " + "; ".join(f"{m.name}: {m.what}" for m in finetune_modes.MODES.values())
                        + ". Frozen parameters get no gradient, no optimizer state, no data-parallel reduction and "
                        "no weight-gradient GEMM (default: full; with plan --fit-min, each mode the runtime runs)")
    p.add_argument("--lora-rank", type=positive_int, metavar="R",
                   help="--finetune lora|qlora: the adapters' rank r (default: the runtime's LoRA's, "
                        f"{finetune_modes.STYLES['peft'].rank} as PEFT's LoraConfig, "
                        f"{finetune_modes.STYLES['megatron-bridge'].rank} under --framework megatron as "
                        "Megatron-Bridge's)")
    p.add_argument("--lora-targets", type=lora_targets, metavar="LIST",
                   help="--finetune lora|qlora: the projections with adapters, comma separated, of "
                        f"{','.join(finetune_modes.TARGETS)} (default {','.join(finetune_modes.STYLES['peft'].targets)}, "
                        "PEFT's for Llama; under --framework megatron every linear, Megatron-Bridge's, whose LoRA "
                        "puts one adapter on q,k,v together and one on gate,up where all of them are targets)")
    add_example_input_arg(p)


def lora_targets(text: str) -> tuple[str, ...]:
    """``q,k,v`` -> ("q", "k", "v") (planner/finetune.py TARGETS)."""
    try:
        return finetune_modes.parse_targets(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(e.detail) from None


def add_knob_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("knobs (each one given is fixed; the rest are searched)")
    g.add_argument("--dp", type=positive_int, help="data-parallel degree")
    g.add_argument("--tp", type=positive_int, help="tensor-parallel degree (divides the attention heads)")
    g.add_argument("--pp", type=positive_int, help="pipeline stages")
    g.add_argument("--cp", type=positive_int, help="context-parallel degree (splits the sequence)")
    g.add_argument("--ep", type=positive_int,
                   help="expert-parallel degree of a mixture of experts: each MoE layer's routed experts split over "
                        "ep ranks, each expert whole on its rank, tokens sent to them by all-to-all (folded onto the "
                        "dp x cp x tp ranks; DeepSpeed: dividing dp)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO stage: 1 optimizer, 2 +grads, 3 +params (--framework megatron: 1 is its distributed "
                        "optimizer, 2 and 3 Megatron-FSDP, without a pipeline)")
    g.add_argument("--micro-batch", type=positive_int, help="sequences per micro-batch per replica")
    g.add_argument("--vpp", type=positive_int, help="virtual stages per pipeline rank (a schedule with virtual "
                                                    f"stages: {', '.join(schedules.virtual_names())})")
    g.add_argument("--schedule", choices=schedules.NAMES, help="pipeline schedule (one line on each below)")
    g.add_argument("--recompute", type=recompute, metavar="POLICY",
                   help="activation recompute policy of every block: none, selective, discard (Megatron-LM), op, full, "
                        "activation-offload, "
                        "or every-K (one line on each below); left out, the search picks one per block where the "
                        "runtime takes one per block, else one for all of them (under --framework megatron also full on "
                        "the first N blocks of every stage, its --recompute-method block, and with no pipeline "
                        "activation offload of the first N, its --cpu-offloading-num-layers)")
    g.add_argument("--sequence-parallel", type=on_off, metavar="on|off", help="sequence parallelism (tp >= 2)")
    g.add_argument("--optimizer-offload", type=on_off, metavar="on|off",
                   help="optimizer states (and fp32 master weights) in host memory: ZeRO-Offload, ZeRO >= 1")
    g.add_argument("--param-offload", type=on_off, metavar="on|off",
                   help="ZeRO-3's parameter shards in host memory, copied up for every gather (DeepSpeed's "
                        "offload_param, --framework deepspeed); never searched: off unless given")
    g.add_argument("--nvme-offload", type=on_off, metavar="on|off",
                   help="what optimizer and parameter offload offload kept on the node's local NVMe rather than in "
                        "host memory (ZeRO-Infinity: DeepSpeed's offload device nvme, ZeRO-3; the cluster profile's "
                        "[host] nvme_GiB and rates); never searched: off unless given")
    g.add_argument("--offload", choices=("none", "optimizer"), help=argparse.SUPPRESS)   # the earlier name


def job_inputs(args: argparse.Namespace) -> JobInputs:
    """The job the flags describe."""
    return JobInputs(model=args.model, cluster=args.cluster, gpus=args.gpus, global_batch=args.global_batch,
                     seq_len=args.seq_len, precision=args.precision, framework=args.framework,
                     attention=args.attention, overlap_grad_reduce=not args.no_overlap_grad_reduce,
                     tp_comm_overlap=args.tp_comm_overlap, ep_comm_overlap=getattr(args, "ep_comm_overlap", False),
                     example_input=getattr(args, "example_input", None),
                     memory_headroom=args.memory_headroom,
                     expert_imbalance=getattr(args, "expert_imbalance", 1.0),
                     expert_dispatcher=getattr(args, "expert_dispatcher", "alltoall"),
                     compile=getattr(args, "compile", False),
                     fp8_param_gather=getattr(args, "fp8_param_gather", False),
                     grad_reduce_in_bf16=getattr(args, "grad_reduce_in_bf16", False),
                     finetune=getattr(args, "finetune", None) or "full", lora_rank=getattr(args, "lora_rank", None),
                     lora_targets=getattr(args, "lora_targets", None))


def knobs(args: argparse.Namespace) -> Knobs:
    """The knobs the flags fix (``--offload none|optimizer`` is the earlier name of ``--optimizer-offload``)."""
    values = {name: getattr(args, name) for name in KNOB_NAMES}
    if getattr(args, "offload", None) is not None:
        earlier = args.offload == "optimizer"
        if values["optimizer_offload"] is not None and values["optimizer_offload"] != earlier:
            raise UserError("--offload is the earlier name of --optimizer-offload; allowed: one of them",
                            field="--offload")
        values["optimizer_offload"] = earlier
    return Knobs(**values)


def warn(text: str) -> None:
    sys.stderr.write(f"meshplan: warning: {text}\n")


def search_progress():
    """A one-line progress indicator on stderr for searches that take more than a moment (a terminal only)."""
    if not sys.stderr.isatty():
        return None
    start = time.perf_counter()

    def show(done: int, total: int) -> None:
        if time.perf_counter() - start > 1.0 and total:
            sys.stderr.write(f"\rsearching: {done}/{total} layouts")
            if done + 1 >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()
    return show
