"""Megatron-Bridge's runs release by release, mixtures of experts and the dense Llamas beside them: what the software
changed on the same GPUs, and where meshplan lands. Held out but for the 25.11 rows on DGX B200 and H100, which are
../shared/validation/public_cases.json's MBRIDGE2511-* cases; nothing is fitted to any of them.

    python benchmarks/megatron_bridge_releases.py [--dispatcher alltoall|flex] [--out FILE.json]

NVIDIA publishes the pre-training throughput of each NeMo container release (Megatron-Bridge
docs/performance-summary.md, the newest, and docs/performance-summary-archive.md, the earlier ones; all benchmarks
force-balanced and token-dropless). The same configuration (model, GPUs, precision, batch, micro-batch and every
parallel degree) recurs over releases; its spread is what the software did on unchanged hardware. Each
configuration on a system meshplan has a profile of (DGX H100: h100-80g, DGX B200: b200, GB200 NVL72:
gb200-nvl72) is planned with its published knobs as benchmarks/fidelity.py plans the 25.11 rows (Megatron-LM,
ZeRO-1 distributed optimizer, no memory headroom, bf16 gradient reduction, FP8 parameter gather under an FP8
recipe, recompute and optimizer offload searched), once without and once with Megatron-Core's overlapped expert
all-to-all (`--ep-comm-overlap`), which the summary does not say, with the all-to-all dispatcher or
(`--dispatcher flex`) Megatron's flex dispatcher, which the later releases' recipes set for some rows
(`moe_token_dispatcher_type` flex with HybridEP: Megatron-Bridge src/megatron/bridge/perf_recipes/) and which the
summary does not say either. Recipes: BF16 -> bf16, FP8 / FP8-CS (current
scaling) -> fp8-tensorwise, MXFP8 / FP8-MX -> mxfp8. Left out: GB300 and B300 (no profile), NVFP4 (not priced),
DeepSeek-V3 with multi-token prediction (not modelled). Beside pre-training, the summary's SFT rows (full fine-tuning,
priced as training) and LoRA rows (``FINE_TUNING``). The dense rows run as benchmarks/fidelity_fp8.py runs the
25.11 ones: TransformerEngine's overlapped TP communication wherever tp > 1 (the Llama recipes' userbuffers), the
summary's FSDP column as Megatron-FSDP (ZeRO-3).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402  (benchmarks/fidelity.py: plan_or_closest)
from planner.errors import NoFeasiblePlan, UserError  # noqa: E402

ARCHIVE = "Megatron-Bridge docs/performance-summary-archive.md at 4ab94dfad (2026-08-11)"
CURRENT = "Megatron-Bridge docs/performance-summary.md at 067f987df (the 26.08 container)"
MODELS = {"DeepSeekV3": "deepseek-v3", "DeepSeekV3 (w/o MTP)": "deepseek-v3", "GPT OSS 120B": "gpt-oss-120b",
          "Qwen3_30B_a3B": "qwen3-30b-a3b", "Qwen3_235B_a22B": "qwen3-235b-a22b", "LLAMA3_8B": "llama3-8b",
          "LLAMA3_70B": "llama3-70b", "LLAMA3.1_405B": "llama3-405b"}
SYSTEMS = {"DGX-H100": "h100-80g", "DGX-B200": "b200", "DGX-GB200": "gb200-nvl72"}
RECIPES = {"BF16": "bf16", "FP8": "fp8-tensorwise", "FP8-CS": "fp8-tensorwise", "MXFP8": "mxfp8",
           "FP8-MX": "mxfp8"}

# (release, system, model, precision, GPUs, GBS, MBS, sequence, TP, PP, CP, VP (None: n/a or 1), EP, tokens/s/GPU,
#  the file's line: C = CURRENT, A = ARCHIVE[, Megatron-FSDP: the summary's FSDP column not 0])
ROWS = [
    ("26.08", "DGX-GB200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 4, 1, 4, 64, 4912, "C46"),
    ("26.08", "DGX-GB200", "GPT OSS 120B", "MXFP8", 64, 1280, 4, 4096, 1, 1, 1, None, 64, 28672, "C60"),
    ("26.08", "DGX-GB200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 39936, "C67"),
    ("26.08", "DGX-GB200", "Qwen3_235B_a22B", "MXFP8", 256, 8192, 1, 4096, 1, 8, 1, 3, 32, 7280, "C74"),
    ("26.06.01", "DGX-GB200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 4, 1, 4, 64, 4928, "A51"),
    ("26.06.01", "DGX-GB200", "GPT OSS 120B", "MXFP8", 64, 1280, 4, 4096, 1, 1, 1, None, 64, 18304, "A58"),
    ("26.06.01", "DGX-GB200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 40960, "A65"),
    ("26.06.01", "DGX-GB200", "Qwen3_235B_a22B", "MXFP8", 256, 8192, 1, 4096, 1, 8, 1, 3, 32, 7360, "A72"),
    ("26.06", "DGX-GB200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 4, 1, 4, 64, 4969, "A114"),
    ("26.06", "DGX-GB200", "GPT OSS 120B", "MXFP8", 64, 1280, 4, 4096, 1, 1, 1, None, 64, 28947, "A122"),
    ("26.06", "DGX-GB200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 40706, "A130"),
    ("26.06", "DGX-H100", "Qwen3_30B_a3B", "FP8", 16, 1024, 1, 4096, 1, 1, 1, None, 16, 8826, "A132"),
    ("26.06", "DGX-GB200", "Qwen3_235B_a22B", "MXFP8", 256, 8192, 1, 4096, 1, 8, 1, 3, 32, 7376, "A139"),
    ("26.04.01", "DGX-GB200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 4, 1, 4, 64, 4256, "A226"),
    ("26.04.01", "DGX-B200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 8, 1, 2, 32, 3328, "A228"),
    ("26.04.01", "DGX-GB200", "GPT OSS 120B", "BF16", 64, 1280, 4, 4096, 1, 1, 1, None, 64, 16640, "A235"),
    ("26.04.01", "DGX-B200", "GPT OSS 120B", "BF16", 64, 1280, 4, 4096, 1, 1, 1, None, 8, 13568, "A237"),
    ("26.04.01", "DGX-H100", "GPT OSS 120B", "BF16", 64, 1280, 1, 4096, 1, 4, 1, None, 8, 5824, "A238"),
    ("26.04.01", "DGX-GB200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 26112, "A245"),
    ("26.04.01", "DGX-B200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 27136, "A247"),
    ("26.04.01", "DGX-H100", "Qwen3_30B_a3B", "FP8", 16, 1024, 1, 4096, 1, 1, 1, None, 16, 8960, "A248"),
    ("26.04.01", "DGX-GB200", "Qwen3_235B_a22B", "MXFP8", 256, 8192, 1, 4096, 1, 8, 1, 3, 32, 5680, "A255"),
    ("26.04.01", "DGX-B200", "Qwen3_235B_a22B", "MXFP8", 256, 8192, 1, 4096, 1, 8, 1, None, 8, 3776, "A257"),
    ("26.04.01", "DGX-H100", "Qwen3_235B_a22B", "FP8", 256, 8192, 1, 4096, 2, 8, 1, 4, 32, 1712, "A258"),
    ("26.04", "DGX-GB200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 4, 1, 4, 64, 4193, "A326"),
    ("26.04", "DGX-B200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 16, 1, None, 8, 2815, "A328"),
    ("26.04", "DGX-GB200", "GPT OSS 120B", "BF16", 64, 1280, 4, 4096, 1, 1, 1, None, 64, 15938, "A335"),
    ("26.04", "DGX-B200", "GPT OSS 120B", "BF16", 64, 1280, 4, 4096, 1, 1, 1, None, 8, 13045, "A337"),
    ("26.04", "DGX-H100", "GPT OSS 120B", "BF16", 64, 1280, 1, 4096, 1, 4, 1, None, 8, 5810, "A338"),
    ("26.04", "DGX-GB200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 26032, "A345"),
    ("26.04", "DGX-B200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 26859, "A347"),
    ("26.04", "DGX-H100", "Qwen3_30B_a3B", "FP8", 16, 1024, 1, 4096, 1, 1, 1, None, 16, 8901, "A348"),
    ("26.04", "DGX-GB200", "Qwen3_235B_a22B", "MXFP8", 256, 8192, 1, 4096, 1, 8, 1, 3, 32, 5672, "A355"),
    ("26.04", "DGX-H100", "Qwen3_235B_a22B", "FP8", 256, 8192, 1, 4096, 2, 8, 1, 4, 32, 1686, "A357"),
    ("26.02.01", "DGX-GB200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 4, 1, 4, 64, 4021, "A423"),
    ("26.02.01", "DGX-B200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 16, 1, None, 8, 2790, "A425"),
    ("26.02.01", "DGX-GB200", "GPT OSS 120B", "BF16", 64, 1280, 4, 4096, 1, 1, 1, None, 64, 15754, "A432"),
    ("26.02.01", "DGX-B200", "GPT OSS 120B", "BF16", 64, 1280, 4, 4096, 1, 1, 1, None, 8, 13722, "A434"),
    ("26.02.01", "DGX-H100", "GPT OSS 120B", "BF16", 64, 1280, 1, 4096, 1, 4, 1, None, 8, 5984, "A435"),
    ("26.02.01", "DGX-GB200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 26373, "A442"),
    ("26.02.01", "DGX-B200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 26695, "A444"),
    ("26.02.01", "DGX-H100", "Qwen3_30B_a3B", "FP8", 16, 1024, 1, 4096, 1, 2, 1, 12, 8, 9058, "A445"),
    ("26.02.01", "DGX-GB200", "Qwen3_235B_a22B", "MXFP8", 256, 8192, 1, 4096, 1, 8, 1, None, 32, 5530, "A452"),
    ("26.02.01", "DGX-H100", "Qwen3_235B_a22B", "FP8", 256, 8192, 1, 4096, 2, 8, 1, 4, 32, 1611, "A454"),
    ("26.02", "DGX-GB200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 4, 1, 4, 64, 3955, "A508"),
    ("26.02", "DGX-B200", "DeepSeekV3", "MXFP8", 256, 4096, 1, 4096, 1, 16, 1, None, 8, 2689, "A510"),
    ("26.02", "DGX-GB200", "GPT OSS 120B", "BF16", 64, 1280, 4, 4096, 1, 1, 1, None, 64, 15784, "A517"),
    ("26.02", "DGX-B200", "GPT OSS 120B", "BF16", 64, 1280, 4, 4096, 1, 1, 1, None, 64, 8047, "A519"),
    ("26.02", "DGX-H100", "GPT OSS 120B", "BF16", 64, 1280, 1, 4096, 1, 4, 1, None, 8, 5993, "A520"),
    ("26.02", "DGX-GB200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 4, 4096, 1, 1, 1, None, 8, 26084, "A527"),
    ("26.02", "DGX-B200", "Qwen3_30B_a3B", "MXFP8", 8, 512, 1, 4096, 1, 1, 1, None, 8, 9691, "A529"),
    ("26.02", "DGX-H100", "Qwen3_30B_a3B", "FP8", 16, 1024, 1, 4096, 1, 2, 1, 12, 8, 5113, "A530"),
    ("26.02", "DGX-GB200", "Qwen3_235B_a22B", "MXFP8", 256, 8192, 1, 4096, 1, 8, 1, None, 32, 5448, "A537"),
    ("26.02", "DGX-B200", "Qwen3_235B_a22B", "MXFP8", 256, 8192, 1, 4096, 1, 8, 1, None, 8, 3805, "A539"),
    ("26.02", "DGX-H100", "Qwen3_235B_a22B", "FP8", 256, 8192, 1, 4096, 2, 8, 1, 4, 32, 1633, "A540"),
    ("25.11", "DGX-GB200", "DeepSeekV3 (w/o MTP)", "BF16", 256, 4096, 1, 4096, 1, 4, 1, 4, 64, 3139, "A568"),
    ("25.11", "DGX-GB200", "DeepSeekV3 (w/o MTP)", "FP8-MX", 256, 4096, 1, 4096, 1, 8, 1, 4, 32, 4018, "A569"),
    ("25.11", "DGX-GB200", "GPT OSS 120B", "BF16", 64, 1280, 1, 8192, 1, 1, 1, None, 64, 15876, "A570"),
    ("25.11", "DGX-GB200", "Qwen3_30B_a3B", "FP8-MX", 8, 512, 4, 4096, 1, 1, 1, None, 8, 23766, "A571"),
    ("25.11", "DGX-GB200", "Qwen3_235B_a22B", "BF16", 256, 8192, 1, 4096, 1, 8, 1, 3, 32, 4916, "A572"),
    ("25.11", "DGX-B200", "GPT OSS 120B", "BF16", 64, 512, 4, 4096, 1, 1, 1, None, 8, 8213, "A581"),
    ("25.11", "DGX-B200", "Qwen3_30B_a3B", "FP8-MX", 8, 512, 1, 4096, 1, 1, 1, None, 8, 9299, "A582"),
    ("25.11", "DGX-B200", "Qwen3_235B_a22B", "FP8-MX", 64, 1024, 1, 4096, 1, 8, 1, 2, 8, 3269, "A583"),
    ("25.11", "DGX-H100", "GPT OSS 120B", "BF16", 64, 512, 4, 4096, 1, 4, 1, None, 8, 5630, "A592"),
    ("25.11", "DGX-H100", "Qwen3_30B_a3B", "FP8-CS", 16, 512, 2, 4096, 1, 2, 1, 24, 8, 5275, "A593"),
    ("25.11", "DGX-H100", "Qwen3_235B_a22B", "FP8-CS", 256, 2048, 1, 4096, 2, 8, 1, 4, 32, 1575, "A594"),
    ("26.06", "DGX-GB200", "LLAMA3.1_405B", "FP8", 256, 1536, 1, 8192, 4, 16, 1, 4, 1, 843, "A103"),
    ("26.06", "DGX-GB200", "LLAMA3.1_405B", "MXFP8", 256, 1536, 1, 8192, 4, 16, 1, 8, 1, 783, "A104"),
    ("26.06", "DGX-H100", "LLAMA3.1_405B", "FP8", 1024, 1536, 1, 8192, 8, 8, 2, 8, 1, 326, "A106"),
    ("26.06", "DGX-GB200", "LLAMA3_70B", "FP8", 32, 32, 1, 4096, 1, 8, 1, 10, 1, 3864, "A177"),
    ("26.06", "DGX-GB200", "LLAMA3_70B", "MXFP8", 32, 32, 1, 4096, 1, 8, 1, 10, 1, 3593, "A178"),
    ("26.06", "DGX-H100", "LLAMA3_70B", "FP8", 32, 32, 1, 4096, 4, 4, 1, 5, 1, 1638, "A179"),
    ("26.06", "DGX-GB200", "LLAMA3_70B", "FP8", 8, 32, 1, 4096, 1, 2, 1, 20, 1, 6206, "A189"),
    ("26.06", "DGX-GB200", "LLAMA3_70B", "MXFP8", 8, 32, 1, 4096, 1, 4, 1, 20, 1, 5958, "A190"),
    ("26.06", "DGX-H100", "LLAMA3_70B", "FP8", 8, 32, 1, 4096, 2, 4, 1, 20, 1, 2643, "A191"),
    ("26.04.01", "DGX-GB200", "LLAMA3_70B", "FP8", 64, 256, 2, 8192, 1, 1, 1, None, 1, 4224, "A204", True),
    ("26.04.01", "DGX-GB200", "LLAMA3_70B", "MXFP8", 64, 256, 1, 8192, 2, 4, 1, 5, 1, 3712, "A205"),
    ("26.04.01", "DGX-H100", "LLAMA3_70B", "FP8", 64, 256, 1, 8192, 4, 8, 1, 5, 1, 1664, "A207"),
    ("26.04.01", "DGX-GB200", "LLAMA3.1_405B", "FP8", 256, 1536, 1, 8192, 4, 16, 1, 4, 1, 864, "A216"),
    ("26.04.01", "DGX-GB200", "LLAMA3.1_405B", "MXFP8", 256, 1536, 1, 8192, 4, 16, 1, 8, 1, 800, "A217"),
    ("26.04.01", "DGX-H100", "LLAMA3.1_405B", "FP8", 1024, 1536, 1, 8192, 8, 8, 2, 8, 1, 328, "A219"),
    ("26.04", "DGX-GB200", "LLAMA3_70B", "MXFP8", 64, 256, 1, 8192, 2, 4, 1, 5, 1, 3828, "A305"),
    ("26.04", "DGX-GB200", "LLAMA3_70B", "FP8", 64, 256, 2, 8192, 1, 1, 1, None, 1, 4143, "A307", True),
    ("26.04", "DGX-H100", "LLAMA3_70B", "FP8", 64, 256, 1, 8192, 4, 8, 1, 5, 1, 1633, "A308"),
    ("26.04", "DGX-GB200", "LLAMA3.1_405B", "MXFP8", 256, 1536, 1, 8192, 4, 16, 1, 8, 1, 793, "A317"),
    ("26.04", "DGX-GB200", "LLAMA3.1_405B", "FP8", 256, 1536, 1, 8192, 4, 16, 1, 4, 1, 842, "A319"),
    ("26.02.01", "DGX-GB200", "LLAMA3_70B", "MXFP8", 64, 256, 1, 8192, 2, 4, 1, 5, 1, 3837, "A402"),
    ("26.02.01", "DGX-GB200", "LLAMA3_70B", "FP8", 64, 256, 2, 8192, 1, 1, 1, None, 1, 4357, "A404", True),
    ("26.02.01", "DGX-H100", "LLAMA3_70B", "FP8", 64, 256, 1, 8192, 4, 8, 1, 5, 1, 1639, "A405"),
    ("26.02.01", "DGX-GB200", "LLAMA3.1_405B", "MXFP8", 256, 1536, 1, 8192, 4, 16, 1, 8, 1, 775, "A414"),
    ("26.02.01", "DGX-GB200", "LLAMA3.1_405B", "FP8", 256, 1536, 1, 8192, 4, 16, 1, 4, 1, 818, "A416"),
    ("26.02", "DGX-GB200", "LLAMA3_70B", "MXFP8", 64, 256, 1, 8192, 2, 4, 1, 5, 1, 3613, "A486"),
    ("26.02", "DGX-GB200", "LLAMA3_70B", "FP8", 64, 256, 2, 8192, 1, 1, 1, None, 1, 4040, "A488", True),
    ("26.02", "DGX-H100", "LLAMA3_70B", "FP8", 64, 256, 1, 8192, 4, 8, 1, 5, 1, 1621, "A489"),
    ("26.02", "DGX-GB200", "LLAMA3.1_405B", "MXFP8", 256, 1536, 1, 8192, 4, 16, 1, 8, 1, 786, "A498"),
    ("26.02", "DGX-GB200", "LLAMA3.1_405B", "FP8", 256, 1536, 1, 8192, 4, 16, 1, 4, 1, 793, "A500"),
    ("26.02", "DGX-H100", "LLAMA3.1_405B", "FP8", 1024, 1536, 1, 8192, 8, 8, 2, 8, 1, 311, "A501"),
    ("25.11", "DGX-GB200", "LLAMA3_8B", "FP8-CS", 8, 128, 2, 8192, 1, 1, 1, None, 1, 31508, "A565"),
    ("25.11", "DGX-GB200", "LLAMA3_70B", "FP8-CS", 64, 256, 2, 8192, 1, 1, 1, None, 1, 4312, "A566", True),
    ("25.11", "DGX-GB200", "LLAMA3.1_405B", "FP8-CS", 256, 1536, 1, 8192, 4, 16, 1, 4, 1, 813, "A567"),
    ("25.11", "DGX-B200", "LLAMA3_8B", "FP8-CS", 8, 128, 2, 8192, 1, 1, 1, None, 1, 30624, "A578"),
    ("25.11", "DGX-B200", "LLAMA3.1_405B", "FP8-CS", 128, 64, 1, 8192, 4, 8, 2, 8, 1, 661, "A579"),
    ("25.11", "DGX-H100", "LLAMA3_8B", "FP8-CS", 8, 128, 1, 8192, 1, 1, 1, None, 1, 14451, "A589", True),
    ("25.11", "DGX-H100", "LLAMA3_70B", "FP8-CS", 64, 128, 1, 8192, 4, 8, 1, 5, 1, 1602, "A590"),
    ("25.11", "DGX-H100", "LLAMA3.1_405B", "FP8-CS", 1024, 512, 1, 8192, 8, 8, 2, 8, 1, 292, "A591"),
]
# the rows of the summary's "SFT Performance" (full fine-tuning: priced as training) and "LoRA Performance" sections,
# the others being "Pre-Training Performance"; LoRA as the performance scripts of those releases set it: Llama 3 70B's
# PEFT recipe (src/megatron/bridge/recipes/llama/h100/llama3.py llama3_70b_peft_8gpu_h100_bf16_config: dim 16, alpha
# 32) with ``cfg.peft.target_modules = ["linear_qkv"]`` ("Override target_modules to only apply LoRA to QKV",
# scripts/performance/configs/llama/llama3_llm_finetune.py, every llama3_70b_lora_config_* from b9819cec5,
# 2026-02-26, to b7b4e11b0, 2026-07-08): one adapter on the fused q, k and v (meshplan's q,k,v under --framework
# megatron, planner/finetune.py STYLES). Not modelled: their packed SQuAD sequences (offline_packing_specs), whose
# attention spans each packed sample, not the 4096 tokens
FINE_TUNING = {"A177": "sft", "A178": "sft", "A179": "sft", "A189": "lora", "A190": "lora", "A191": "lora"}
LORA = {"finetune": "lora", "lora_rank": 16, "lora_targets": ("q", "k", "v")}
RELEASE_ORDER = ["25.11", "26.02", "26.02.01", "26.04", "26.04.01", "26.06", "26.06.01", "26.08"]


def config_key(row: tuple) -> tuple:
    """What makes two rows the same run: everything but the release, the throughput and the line."""
    _, system, model, precision, *knobs = row[:13]
    return (system, MODELS[model], RECIPES[precision], *knobs, len(row) > 15 and row[15],
            FINE_TUNING.get(row[14], "pretrain"))


def plan_row(key: tuple, ep_comm_overlap: bool, dispatcher: str = "alltoall") -> dict:
    """meshplan's prediction of one configuration (tokens/s per GPU), or why it has none."""
    system, model, recipe, gpus, gbs, mbs, seq, tp, pp, cp, vp, ep, fsdp, mode = key
    job = {**(LORA if mode == "lora" else {}), "cluster": SYSTEMS[system], "gpus": gpus, "global_batch": gbs, "seq_len": seq, "framework": "megatron",
           "precision": recipe, "attention": "flash", "memory_headroom": 0.0, "grad_reduce_in_bf16": True,
           "fp8_param_gather": recipe != "bf16"}
    if ep > 1:
        job.update(ep_comm_overlap=ep_comm_overlap, expert_dispatcher=dispatcher)
    elif tp > 1:
        job["tp_comm_overlap"] = True
    knobs = {"tp": tp, "pp": pp, "cp": cp, "dp": gpus // (tp * pp * cp), "ep": ep, "micro_batch": mbs,
             "zero": 3 if fsdp else 1}
    if pp > 1:
        knobs["vpp"] = vp or 1
    try:
        e, c, note = fidelity.plan_or_closest(model, job, knobs)
    except NoFeasiblePlan:
        return {"error": "no plan of these knobs fits meshplan's memory"}
    except UserError as err:
        return {"error": str(err)}
    return {"tokens_per_s_per_gpu": e.tokens_per_s / gpus, "step_s": e.step_time_s, "ep_comm_s": e.time.ep_comm,
            "recompute": c.recompute, "optimizer_offload": c.optimizer_offload, **({"note": note} if note else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dispatcher", choices=("alltoall", "flex"), default="alltoall",
                        help="Megatron's token dispatcher to plan with (default alltoall)")
    parser.add_argument("--out", type=Path, help="also write the table as JSON here")
    args = parser.parse_args()
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for row in ROWS:
        groups[config_key(row)].append(row)
    out, t0 = [], time.perf_counter()
    print(f"{'model':<16} {'system':<11} {'recipe':<14} {'GPUs':>4} {'GBS':>5} {'MB':>2} {'TP/PP/CP/VP/EP':<15} "
          f"{'published by release (tokens/s per GPU)':<58} {'spread':>6} {'meshplan':>8} {'+ovl':>8} "
          f"{'err':>7} {'+ovl':>7}")
    for key, rows in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][3], kv[0][2])):
        rows.sort(key=lambda r: RELEASE_ORDER.index(r[0]))
        latest = rows[-1][13]
        values = [r[13] for r in rows]
        pred = {overlap: plan_row(key, overlap, args.dispatcher) for overlap in ((False, True) if key[11] > 1
                                                                                 else (False,))}
        pred.setdefault(True, {"error": ""})
        err = {k: (p["tokens_per_s_per_gpu"] / latest - 1) if "tokens_per_s_per_gpu" in p else None
               for k, p in pred.items()}
        system, model, recipe, gpus, gbs, mbs, seq, tp, pp, cp, vp, ep, fsdp, mode = key
        published = " ".join(f"{r[0]}:{r[13]}" for r in rows)
        cell = lambda p: f"{p['tokens_per_s_per_gpu']:8.0f}" if "tokens_per_s_per_gpu" in p else f"{'-':>8}"  # noqa: E731
        pct = lambda x: f"{100 * x:+6.1f}%" if x is not None else f"{'-':>7}"  # noqa: E731
        print(f"{model + ('' if mode == 'pretrain' else ' ' + mode):<16} {system:<11} {recipe:<14} {gpus:>4} {gbs:>5} {mbs:>2} "
              f"{f'{tp}/{pp}/{cp}/{vp or 1}/{ep}':<15} {published:<58} {max(values) / min(values):6.2f} "
              f"{cell(pred[False])} {cell(pred[True])} {pct(err[False])} {pct(err[True])}")
        for overlap, p in pred.items():
            if p.get("error") or p.get("note"):
                print(f"    {'with --ep-comm-overlap: ' if overlap else ''}{p.get('error') or p['note']}")
        out.append({"model": model, "system": system, "recipe": recipe, "gpus": gpus, "global_batch": gbs,
                    "micro_batch": mbs, "seq_len": seq, "tp": tp, "pp": pp, "cp": cp, "vpp": vp or 1, "ep": ep,
                    "fsdp": fsdp, "moe": ep > 1, "mode": mode,
                    "published": {r[0]: r[13] for r in rows},
                    "sources": {r[0]: (CURRENT if r[14][0] == "C" else ARCHIVE) + f", line {r[14][1:]}" for r in rows},
                    "spread": max(values) / min(values), "predicted": pred[False], "predicted_ep_comm_overlap": pred[True],
                    "error_vs_latest": err[False], "error_vs_latest_ep_comm_overlap": err[True]})
    for kind, moe in (("mixtures of experts", True), ("dense", False)):
        sub = [o for o in out if o["moe"] == moe]
        repeated = [o for o in sub if len(o["published"]) > 1]
        print(f"\n{kind}: {len(sub)} configurations, {len(repeated)} published by more than one release; the same "
              f"configuration's throughput varies by up to {max(o['spread'] for o in repeated):.2f}x over releases "
              f"(median {statistics.median(o['spread'] for o in repeated):.2f}x)")
        for overlap, name in ((False, "error_vs_latest"), (True, "error_vs_latest_ep_comm_overlap")):
            errs = [o[name] for o in sub if o[name] is not None]
            if errs:
                print(f"  meshplan against each configuration's latest release"
                      f"{' with --ep-comm-overlap' if overlap else ''}: mean |error| "
                      f"{100 * statistics.mean(abs(e) for e in errs):.1f}%, median "
                      f"{100 * statistics.median(abs(e) for e in errs):.1f}%, range {100 * min(errs):+.1f}% to "
                      f"{100 * max(errs):+.1f}% over {len(errs)}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"measured_by": f"python benchmarks/megatron_bridge_releases.py --dispatcher "
                                                       f"{args.dispatcher} --out {args.out}", "dispatcher": args.dispatcher,
                                        "sources": [CURRENT, ARCHIVE], "rows": out},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
