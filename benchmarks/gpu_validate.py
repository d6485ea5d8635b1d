"""Predicted against measured step time and peak memory of single-GPU plans.

    python benchmarks/gpu_validate.py --measure            # on a GPU: run every case, write the raw runs
    python benchmarks/gpu_validate.py                       # anywhere: predict every measured case, compare

Two halves, so that the cost model can be re-checked against the same runs
without a GPU:

1. ``--measure`` (needs CUDA; ``--quick`` runs two tiny cases on the CPU to
   exercise the code): for each case below it writes the model's config.json,
   plans it with every knob fixed (``meshplan plan``), trains it with meshplan's
   executor in this process (world size 1, NCCL), and records the median step
   time after warm-up (CUDA-synchronised wall time), the peak of
   ``torch.cuda.max_memory_allocated`` over the timed steps, the executor's
   bytes by category, the GPU time of one step's kernels by kind (GEMM,
   attention, optimizer, other; torch.profiler), and the host's side of that
   step: how many kernels and copies it launched and when its last launch
   ended (``kernels.host``: what prices the host's time per launch of a
   host-bound step, issue 24). Writes ``--raw``
   (benchmarks/results/gpu_runs.json).
2. Without ``--measure``: for each recorded run, ``meshplan plan --json`` with the
   same knobs against ``--cluster`` (default: the profile ``meshplan profile
   --device cuda`` measured on that GPU, under profiles/measured/) gives the
   predicted step time and memory. The predicted peak is the estimate's total
   less the runtime reserve (CUDA context, cuBLAS and NCCL workspaces), which
   ``max_memory_allocated`` does not count. Writes ``--out``
   (benchmarks/results/gpu_validate.json) and prints the table the README cites.

It asserts nothing: the errors are what they are.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

# Model shapes (Hugging Face config.json), 0.1B to 3B parameters: GPT-2 small and medium
# (Radford et al. 2019), GPT-3 XL (Brown et al. 2020, Table 2.1), Llama 3.2 1B and 3B (Meta's
# published configs). Positions raised to 8192 so every case's sequence fits a learned table.
MODELS = {
    "gpt2-124m": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
                  "n_positions": 8192, "resid_pdrop": 0.1, "attn_pdrop": 0.1, "embd_pdrop": 0.1},
    "gpt2-355m": {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257,
                  "n_positions": 8192, "resid_pdrop": 0.0, "attn_pdrop": 0.0, "embd_pdrop": 0.0},
    "gpt3-1.3b": {"model_type": "gpt2", "n_layer": 24, "n_embd": 2048, "n_head": 16, "vocab_size": 50257,
                  "n_positions": 8192, "resid_pdrop": 0.0, "attn_pdrop": 0.0, "embd_pdrop": 0.0},
    "llama3.2-1b": {"model_type": "llama", "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                    "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "llama3.2-3b": {"model_type": "llama", "num_hidden_layers": 28, "hidden_size": 3072, "num_attention_heads": 24,
                    "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                    "max_position_embeddings": 8192, "tie_word_embeddings": True},
}
TINY = {
    "tiny-gpt": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 128},
    "tiny-llama": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
                   "max_position_embeddings": 128},
    "tiny-oss": {"model_type": "gpt_oss", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "vocab_size": 512, "sliding_window": 16,
                 "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 128},
}

# name: (model, micro-batch, micro-batches per step, sequence, recompute, zero). Single GPU, bf16.
CASES = {
    "gpt2-124m mb8 s2k": ("gpt2-124m", 8, 1, 2048, "none", 0),
    "gpt2-124m mb2x4 s2k": ("gpt2-124m", 2, 4, 2048, "none", 0),
    "gpt2-355m mb4 s4k sel": ("gpt2-355m", 4, 1, 4096, "selective", 0),
    "gpt2-355m mb2 s8k full": ("gpt2-355m", 2, 1, 8192, "full", 0),
    "gpt3-1.3b mb4 s2k": ("gpt3-1.3b", 4, 1, 2048, "none", 0),
    "gpt3-1.3b mb1 s8k full": ("gpt3-1.3b", 1, 1, 8192, "full", 0),
    "llama-1b mb4 s2k": ("llama3.2-1b", 4, 1, 2048, "none", 0),
    "llama-1b mb2 s4k sel": ("llama3.2-1b", 2, 1, 4096, "selective", 0),
    "llama-1b mb1 s8k full": ("llama3.2-1b", 1, 1, 8192, "full", 0),
    "llama-1b mb4 s2k fsdp": ("llama3.2-1b", 4, 1, 2048, "none", 3),
    "llama-3b mb2 s2k full": ("llama3.2-3b", 2, 1, 2048, "full", 0),
    "llama-3b mb1 s4k": ("llama3.2-3b", 1, 1, 4096, "none", 0),
}
# Held out: planned and predicted (benchmarks/results/gpu_holdout_predicted.json, committed before the
# run) after the cost model's GPU mechanisms were settled on CASES, then measured: an out-of-sample check.
HOLDOUT_MODELS = {
    "qwen2-0.5b": {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                   "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "llama-2.5b": {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 2560, "num_attention_heads": 20,
                   "num_key_value_heads": 4, "intermediate_size": 6912, "vocab_size": 32000,
                   "max_position_embeddings": 8192},
    "gpt3-760m": {"model_type": "gpt2", "n_layer": 24, "n_embd": 1536, "n_head": 16, "vocab_size": 50304,
                  "n_positions": 8192, "resid_pdrop": 0.0, "attn_pdrop": 0.0, "embd_pdrop": 0.0},
}
HOLDOUT = {
    "qwen2-0.5b mb4 s2k": ("qwen2-0.5b", 4, 1, 2048, "none", 0),
    "qwen2-0.5b mb2 s8k full": ("qwen2-0.5b", 2, 1, 8192, "full", 0),
    "llama-2.5b mb2 s4k sel": ("llama-2.5b", 2, 1, 4096, "selective", 0),
    "llama-2.5b mb1 s2k x2 fsdp": ("llama-2.5b", 1, 2, 2048, "none", 3),
    "gpt3-760m mb6 s2k": ("gpt3-760m", 6, 1, 2048, "none", 0),
    "gpt3-760m mb2 s4k full": ("gpt3-760m", 2, 1, 4096, "full", 0),
}
# Round 2: what the planner now recommends and round 1 never timed: activation offload,
# operator-level and every-2 recompute, FSDP with 2-4 micro-batches (host-bound), and mixtures of
# experts with grouped expert GEMMs (torch._grouped_mm, executor/moe.py). Predicted before they ran
# (benchmarks/results/gpu_round2_predicted*.json), then measured.
ROUND2_MODELS = {
    **{name: MODELS[name] for name in ("gpt2-355m", "gpt3-1.3b", "llama3.2-1b", "llama3.2-3b")},
    **HOLDOUT_MODELS,
    # Mixtral-style (Jiang et al. 2024): every block 8 routed SwiGLU experts, top 2; 0.9B parameters
    "moe-8e": {"model_type": "mixtral", "num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
               "num_key_value_heads": 8, "intermediate_size": 2816, "num_local_experts": 8,
               "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 8192},
    # finer experts: 32 of width 512, top 4 (as Qwen3-MoE and DeepSeek split them); 1.1B parameters
    "moe-32e": {"model_type": "mixtral", "num_hidden_layers": 8, "hidden_size": 1536, "num_attention_heads": 12,
                "num_key_value_heads": 4, "intermediate_size": 512, "num_local_experts": 32,
                "num_experts_per_tok": 4, "vocab_size": 32000, "max_position_embeddings": 8192},
}
ROUND2 = {
    "llama-1b mb4 s2k offload": ("llama3.2-1b", 4, 1, 2048, "activation-offload", 0),
    "gpt3-1.3b mb4 s2k offload": ("gpt3-1.3b", 4, 1, 2048, "activation-offload", 0),
    "llama-2.5b mb1 s4k offload": ("llama-2.5b", 1, 1, 4096, "activation-offload", 0),
    "llama-1b mb2 s4k op": ("llama3.2-1b", 2, 1, 4096, "op", 0),
    "gpt2-355m mb8 s2k op": ("gpt2-355m", 8, 1, 2048, "op", 0),
    "llama-3b mb2 s2k every-2": ("llama3.2-3b", 2, 1, 2048, "every-2", 0),
    "gpt3-760m mb4 s4k every-2": ("gpt3-760m", 4, 1, 4096, "every-2", 0),
    "llama-1b mb1 s2k x4 fsdp": ("llama3.2-1b", 1, 4, 2048, "none", 3),
    "gpt2-355m mb2 s2k x3 fsdp": ("gpt2-355m", 2, 3, 2048, "none", 3),
    "qwen2-0.5b mb2 s4k x2 fsdp sel": ("qwen2-0.5b", 2, 2, 4096, "selective", 3),
    "moe-8e mb4 s2k": ("moe-8e", 4, 1, 2048, "none", 0),
    "moe-8e mb2 s2k x2 fsdp": ("moe-8e", 2, 2, 2048, "none", 3),
    "moe-32e mb2 s4k sel": ("moe-32e", 2, 1, 4096, "selective", 0),
}
# Held out from round 2: planned and predicted after the host-bound mechanism (planner/cost/host.py) was
# built on round 2's rows, in the same job as the probe that measures its host times
# (benchmarks/gpu_round2.sh --holdout), before any of them ran.
HOLDOUT2 = {
    "gpt2-124m mb4 s1k x4 fsdp": ("gpt2-124m", 4, 4, 1024, "none", 3),
    "llama-1b mb2 s2k x2 fsdp": ("llama3.2-1b", 2, 2, 2048, "none", 3),
    "gpt3-760m mb1 s2k x3 fsdp full": ("gpt3-760m", 1, 3, 2048, "full", 3),
    "llama-3b mb1 s2k x2 fsdp op": ("llama3.2-3b", 1, 2, 2048, "op", 3),
    "qwen2-0.5b mb8 s1k op": ("qwen2-0.5b", 8, 1, 1024, "op", 0),
    "llama-1b mb1 s8k op": ("llama3.2-1b", 1, 1, 8192, "op", 0),
    "gpt2-355m mb4 s2k every-3": ("gpt2-355m", 4, 1, 2048, "every-3", 0),
    "gpt3-1.3b mb2 s2k offload": ("gpt3-1.3b", 2, 1, 2048, "activation-offload", 0),
    "moe-8e mb2 s4k": ("moe-8e", 2, 1, 4096, "none", 0),
    "moe-8e mb1 s2k x4": ("moe-8e", 1, 4, 2048, "none", 0),
    "moe-32e mb4 s2k x2 fsdp": ("moe-32e", 4, 2, 2048, "none", 3),
}
# FP8 on the torch runtime (torchao's float8 linears, compiled blocks as torchao and torchtitan run them):
# the same plan in bf16 and in two recipes, so that the measured ratios test the FP8 pricing
# (planner/precision.py) whatever the profile's absolute error. A seventh field: extra plan flags.
FP8 = {
    "llama-3b mb1 s4k compiled bf16": ("llama3.2-3b", 1, 1, 4096, "none", 0, ("--compile", "--precision", "bf16")),
    "llama-3b mb1 s4k compiled fp8-tensorwise": ("llama3.2-3b", 1, 1, 4096, "none", 0,
                                                 ("--compile", "--precision", "fp8-tensorwise")),
    "llama-3b mb1 s4k compiled fp8-rowwise": ("llama3.2-3b", 1, 1, 4096, "none", 0,
                                              ("--compile", "--precision", "fp8-rowwise")),
}
# GPT-OSS's block (round 5, issue 25): attention sinks and a 128-token window on every other block, which the
# executor writes out (executor/models.py masked_attention: the scores materialised, priced unfused), biased
# experts with the clamped SwiGLU (executor/moe.py ClampedSwiGLU); gpt-oss-20b's widths (hidden 2880, 64 heads of
# 64, 8 kv heads, experts of 2880) at 4 layers and 8 experts, top 2: 1.5B parameters. Predicted before any run
# (benchmarks/results/gpu_oss_predicted.json: `--set oss --predict-only`).
OSS_MODELS = {
    "oss-8e": {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 2880, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 8,
               "num_experts_per_tok": 2, "vocab_size": 32000, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 8192},
}
OSS = {
    "oss-8e mb1 s2k": ("oss-8e", 1, 1, 2048, "none", 0),
    "oss-8e mb2 s4k sel": ("oss-8e", 2, 1, 4096, "selective", 0),
    "oss-8e mb1 s4k full": ("oss-8e", 1, 1, 4096, "full", 0),
}
QUICK_CASES = {
    "tiny-gpt mb2 s64": ("tiny-gpt", 2, 1, 64, "none", 0),
    "tiny-llama mb1x2 s64 full": ("tiny-llama", 1, 2, 64, "full", 3),
    "tiny-oss mb2 s64 sel": ("tiny-oss", 2, 1, 64, "selective", 0),
}


def plan_args(model_path: str, case: tuple, cluster: str) -> list[str]:
    _, mb, m, seq, recompute, zero, *flags = case
    return ["plan", "--model", model_path, "--cluster", cluster, "--gpus", "1", "--dp", "1", "--tp", "1", "--pp", "1",
            "--cp", "1", "--zero", str(zero), "--micro-batch", str(mb), "--global-batch", str(mb * m), "--seq-len",
            str(seq), "--recompute", recompute, "--optimizer-offload", "off", *(flags[0] if flags else ())]


def meshplan(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "planner.cli", *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"meshplan {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


# -- measuring (torch) ------------------------------------------------------------------------------

KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa")),
                ("optimizer", ("multi_tensor", "adam", "foreach")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_")),
                ("nccl", ("nccl",)))


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(mark in low for mark in marks):
            return kind
    return "other"


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync",
                "cudaLaunchCooperativeKernel")


def host_issue(events) -> dict:
    """The host's side of a step from torch.profiler's CPU events: how many kernels and copies it launched
    (the CUDA runtime's launch calls) and when it issued its last one, after the step's first event. A step
    whose last launch comes about when the step ends kept the GPU waiting for the host (host-bound): the
    launch count and that span price the host's time per launch."""
    launches, first, last = 0, None, None
    for evt in events:
        start = getattr(evt, "time_range", None)
        if start is None:
            continue
        begin, end = start.start, start.end
        first = begin if first is None else min(first, begin)
        if any(evt.name.startswith(call) for call in LAUNCH_CALLS):
            launches += 1
            last = end if last is None else max(last, end)
    span = (last - first) * 1e-6 if launches and first is not None else 0.0
    return {"launches": launches, "last_launch_s": span}


def profile_step(step_fn) -> dict:
    """GPU seconds and kernel count of one step, by kernel kind (torch.profiler, CUDA activity), and the host's
    launches (``host_issue``, CPU activity)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    try:
        host = {**host_issue(e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU),
                "profiled_step_s": wall}
    except Exception as e:      # the kernels below are the run's purpose: a parsing failure must not lose them
        host = {"error": f"{type(e).__name__}: {e}"}
    out: dict[str, dict] = {}
    names: dict[str, list] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        seconds = (getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0)) * 1e-6
        kind = kernel_kind(evt.name)
        row = out.setdefault(kind, {"s": 0.0, "kernels": 0})
        row["s"] += seconds
        row["kernels"] += 1
        entry = names.setdefault(evt.name, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    kernels = sorted(names.items(), key=lambda kv: -kv[1][0])
    return {"by_kind": out, "kernels": [{"name": n[:200], "s": s, "count": c} for n, (s, c) in kernels if s > 2e-5],
            "host": host}


def measure_case(plan_path: Path, *, steps: int, warmup: int, device) -> dict:
    import torch
    from executor.plan_file import load_plan
    from executor.train import Job, RunOptions, measured_step, train_step
    cuda = device.type == "cuda"
    plan = load_plan(plan_path)
    job = Job(plan, RunOptions(steps=warmup + steps), device)
    loss, categories, _ = measured_step(job, 0, None)
    for step in range(1, warmup):
        train_step(job, step)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        loss = train_step(job, step)          # returns a Python float: the step is synchronised
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    row = {"step_times_s": times, "measured_step_s": statistics.median(times), "loss": loss,
           "categories_bytes": categories}
    if cuda:
        row["measured_peak_bytes"] = torch.cuda.max_memory_allocated()
        row["measured_reserved_bytes"] = torch.cuda.max_memory_reserved()
        row["kernels"] = profile_step(lambda: train_step(job, warmup + steps))
    del job
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def environment(device) -> dict:
    import torch
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name()
        env["sdpa_flash_enabled"] = torch.backends.cuda.flash_sdp_enabled()
    else:
        env["device"] = "cpu"
    return env


def capabilities(device) -> dict:
    """What runs on this device: torch's flash SDPA with grouped key/value heads, and torch's
    context-parallel attention (torch.distributed.tensor.experimental.context_parallel) on a
    one-rank mesh. Each entry is "ok" or the error's first line."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {}
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 8, 256, 64, device=device, dtype=dt, requires_grad=True)
    kv = torch.randn(1, 2, 256, 64, device=device, dtype=dt, requires_grad=True)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in (False, True):
            k = kv if gqa else kv.repeat_interleave(4, dim=1)
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=gqa).sum().backward()
                out[f"sdpa_{name}{'_gqa' if gqa else ''}"] = "ok"
            except RuntimeError as e:
                out[f"sdpa_{name}{'_gqa' if gqa else ''}"] = str(e).strip().splitlines()[0][:300]
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("cp",))
        qq, kk, vv = (torch.randn(2, 8, 512, 64, device=device, dtype=dt) for _ in range(3))
        ref = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        with context_parallel(mesh, buffers=[qq, kk, vv], buffer_seq_dims=[2, 2, 2]):   # shards them in place
            q, k, v = (t.detach().requires_grad_() for t in (qq, kk, vv))
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            got.sum().backward()
        out["torch_context_parallel_1rank"] = f"ok (max |diff| {float((got - ref).abs().max()):.2e})"
    except Exception as e:
        out["torch_context_parallel_1rank"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    return out


def measure(args) -> None:
    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        sys.exit("gpu_validate --measure: no CUDA device; --quick runs the tiny CPU cases")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo")
    models, cases = (TINY, QUICK_CASES) if args.quick else case_set(args.set)
    cluster = "h100-80g" if cuda else "cpu-gloo"
    tmp = Path(tempfile.mkdtemp(prefix="meshplan-gpu-validate-"))
    out = {"environment": environment(device), "command": " ".join(["python", "benchmarks/gpu_validate.py",
                                                                    *sys.argv[1:]]), "rows": []}
    out["capabilities"] = capabilities(device)
    print(json.dumps(out["capabilities"], indent=1), flush=True)
    for name, case in cases.items():
        if args.only and name not in args.only:
            continue
        model_path = tmp / f"{case[0]}.json"
        model_path.write_text(json.dumps(models[case[0]]))
        plan_path = tmp / "plan.json"
        row = {"name": name, "model": case[0], "model_config": models[case[0]], "micro_batch": case[1],
               "num_microbatches": case[2], "seq_len": case[3], "recompute": case[4], "zero": case[5],
               "plan_flags": list(case[6]) if len(case) > 6 else []}
        t0 = time.perf_counter()
        try:
            meshplan(plan_args(str(model_path), case, cluster) + (["--precision", "fp32"] if not cuda else [])
                     + ["--out", str(plan_path)])
            row.update(measure_case(plan_path, steps=args.steps, warmup=args.warmup, device=device))
        except Exception as e:          # an OOM or a refusal is a result: record it, go on
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        row["wall_s"] = time.perf_counter() - t0
        print(f"{name:<28} {row.get('measured_step_s', float('nan')):>9.4f} s "
              f"{row.get('measured_peak_bytes', 0) / 2**30:>7.2f} GiB  {row.get('error', '')}", flush=True)
        out["rows"].append(row)
        # after every case: a run stopped at its time limit keeps the cases it finished
        Path(args.raw).parent.mkdir(parents=True, exist_ok=True)
        Path(args.raw).write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()
    Path(args.raw).parent.mkdir(parents=True, exist_ok=True)
    Path(args.raw).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.raw}")


# -- predicting (no torch) --------------------------------------------------------------------------

class Predictor:
    """Estimates of single-GPU cases against one cluster profile (``meshplan plan --json``): the step
    time, and the peak less the runtime reserve, which torch.cuda.max_memory_allocated does not count."""

    def __init__(self, cluster: str | None):
        from planner.cluster import load_cluster
        self.named = cluster or default_cluster()
        # a path under the checkout (so any working directory works), or a built-in name
        self.cluster = str(ROOT / self.named) if (ROOT / self.named).is_file() else self.named
        self.reserved = load_cluster(self.cluster, 1).device.reserved_bytes
        self.tmp = Path(tempfile.mkdtemp(prefix="meshplan-gpu-predict-"))

    def estimate(self, model: str, config: dict, case: tuple) -> tuple[dict, float]:
        """(the estimate, the predicted peak bytes) of ``case`` for ``model`` (its config.json)."""
        model_path = self.tmp / f"{model}.json"
        model_path.write_text(json.dumps(config))
        est = json.loads(meshplan(plan_args(str(model_path), case, self.cluster) + ["--json"]))["estimate"]
        return est, est["memory_per_gpu_bytes"]["total"] - self.reserved


def predict(args) -> None:
    raw = json.loads(Path(args.raw).read_text())
    predictor = Predictor(args.cluster)
    named = predictor.named
    env = raw["environment"]
    out = {"device": env["device"], "torch": env["torch"], "cuda": env["cuda"], "cluster": named,
           "measured_by": raw["command"], "predicted_by": " ".join(["python", "benchmarks/gpu_validate.py",
                                                                     *sys.argv[1:]]), "rows": []}
    print(f"cluster profile: {named}")
    print(f"{'plan':<26} {'pred s':>8} {'meas s':>8} {'err':>6}   {'pred GiB':>8} {'meas GiB':>8} {'err':>6}")
    for r in raw["rows"]:
        if "measured_step_s" not in r or "measured_peak_bytes" not in r:
            print(f"{r['name']:<26} not measured: {r.get('error', 'no peak memory (not a GPU run)')}")
            continue
        case = (r["model"], r["micro_batch"], r["num_microbatches"], r["seq_len"], r["recompute"], r["zero"],
                tuple(r.get("plan_flags", ())))
        est, pred_b = predictor.estimate(r["model"], r["model_config"], case)
        pred_s = est["step_time_s"]
        row = {"name": r["name"], "predicted_step_s": pred_s, "measured_step_s": r["measured_step_s"],
               "predicted_peak_bytes": int(pred_b), "measured_peak_bytes": r["measured_peak_bytes"],
               "step_error": r["measured_step_s"] / pred_s - 1, "peak_error": r["measured_peak_bytes"] / pred_b - 1,
               "predicted_time_breakdown_s": est["time_breakdown_s"],
               "predicted_memory_bytes": est["memory_per_gpu_bytes"],
               "measured_kernels": r.get("kernels", {}).get("by_kind")}
        out["rows"].append(row)
        print(f"{r['name']:<26} {pred_s:>8.4f} {r['measured_step_s']:>8.4f} {100 * row['step_error']:>+5.1f}%   "
              f"{pred_b / 2**30:>8.2f} {r['measured_peak_bytes'] / 2**30:>8.2f} {100 * row['peak_error']:>+5.1f}%")
    if out["rows"]:
        errs = [abs(r["step_error"]) for r in out["rows"]]
        mems = [abs(r["peak_error"]) for r in out["rows"]]
        print(f"step time: mean |error| {100 * statistics.mean(errs):.1f}%, max {100 * max(errs):.1f}%; "
              f"peak memory: mean {100 * statistics.mean(mems):.1f}%, max {100 * max(mems):.1f}%")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


def case_set(name: str) -> tuple[dict, dict]:
    return {"holdout": (HOLDOUT_MODELS, HOLDOUT), "round2": (ROUND2_MODELS, ROUND2),
            "holdout2": ({**MODELS, **ROUND2_MODELS}, HOLDOUT2), "fp8": (MODELS, FP8),
            "oss": (OSS_MODELS, OSS)}.get(name, (MODELS, CASES))


def predict_only(args) -> None:
    """Predictions of a case set before any run (the holdout's pre-registration)."""
    models, cases = case_set(args.set)
    predictor = Predictor(args.cluster)
    rows = []
    for name, case in cases.items():
        est, peak = predictor.estimate(case[0], models[case[0]], case)
        rows.append({"name": name, "predicted_step_s": est["step_time_s"], "predicted_peak_bytes": int(peak)})
        print(f"{name:<28} {est['step_time_s']:.4f} s {peak / 2**30:.2f} GiB")
    Path(args.out).write_text(json.dumps({"cluster": predictor.named, "set": args.set, "rows": rows}, indent=1)
                              + "\n")
    print(f"wrote {args.out}")


def default_cluster() -> str:
    found = sorted((ROOT / "profiles" / "measured").glob("*h100*.toml")) + sorted(
        (ROOT / "profiles" / "measured").glob("*h200*.toml"))
    return str(found[0].relative_to(ROOT)) if found else "h100-80g"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="run the cases on this machine's GPU")
    parser.add_argument("--quick", action="store_true", help="with --measure: two tiny cases on the CPU")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="with --measure: only these cases")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case (default 6)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (default 3)")
    parser.add_argument("--raw", default=str(RESULTS / "gpu_runs.json"), help="the measured runs")
    parser.add_argument("--cluster", help="the profile to predict with (default: the measured H100/H200 one)")
    parser.add_argument("--out", default=str(RESULTS / "gpu_validate.json"))
    parser.add_argument("--set", choices=("main", "holdout", "round2", "holdout2", "fp8", "oss"), default="main",
                        help="the cases: the main set, the holdout predicted before it ran, round 2 "
                             "(offload, op and every-2 recompute, FSDP micro-batches, experts), its holdout, FP8 "
                             "against bf16 (compiled; needs torchao), or GPT-OSS's block (sinks, windows, biased "
                             "clamped experts)")
    parser.add_argument("--predict-only", action="store_true", help="predict the set without any measurement")
    args = parser.parse_args()
    if args.measure:
        measure(args)
    elif args.predict_only:
        predict_only(args)
    else:
        predict(args)


if __name__ == "__main__":
    main()
