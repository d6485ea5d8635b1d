"""NeMo AutoModel's published LoRA fine-tuning run through `meshplan plan`: tokens per second per GPU predicted
against the published.

The run (NVIDIA-NeMo/Automodel docs/performance-summary.md, "Fine-Tuning (LoRA) Performance", DGX-H100, BF16):
Llama 3 70B on 8 H100, TP 2, PP 4, VP 10, global batch 32 of 4096 tokens, micro-batch 1. Its table gave
608.42 tokens/s per GPU (26.92 s a step) from commit b3c51c328 (2025-11-12) to 507bfb751 (2025-12-16), and
658.62 (24.87 s) from 822effa16 (2026-01-27) on, with the same recipe. The recipe
(examples/llm_finetune/llama3_3/custom_llama3_3_70b_instruct_peft_benchmark.yaml at b3c51c328):
``peft: match_all_linear: True, dim: 16, alpha: 32``; ``distributed: tp_size: 2, pp_size: 4,
sequence_parallel: false, activation_checkpointing: true``; ``local_batch_size: 4, pp_microbatch_size: 1,
layers_per_stage: 2`` (80 layers in 40 stages: 10 per rank). Each pipeline run takes the local batch, 4
micro-batches, and the 32 sequences are 8 such runs accumulated; meshplan has no knob for gradient accumulation
over pipeline flushes, so one flush is planned (``--global-batch 4``): the step's tokens per second are the
flush's, the optimizer of the adapters aside (milliseconds).

    python benchmarks/fidelity_lora.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import api  # noqa: E402

PUBLISHED = {"2025-11-12 (b3c51c328)": 608.42, "2026-01-27 (822effa16)": 658.62}
JOB = dict(cluster="h100-80g", gpus=8, global_batch=4, seq_len=4096, framework="torch", precision="bf16",
           finetune="lora", lora_rank=16, lora_targets=("q", "k", "v", "o", "gate", "up", "down"))
KNOBS = dict(tp=2, pp=4, vpp=10, dp=1, micro_batch=1, recompute="full", sequence_parallel=False)
COMMAND = ("meshplan plan --model llama3-70b --cluster h100-80g --gpus 8 --global-batch 4 --seq-len 4096 "
           "--framework torch --precision bf16 --finetune lora --lora-rank 16 --lora-targets q,k,v,o,gate,up,down "
           "--tp 2 --pp 4 --vpp 10 --dp 1 --micro-batch 1 --recompute full --sequence-parallel off")


def predicted_tokens_per_gpu() -> tuple[float, object]:
    """(tokens per second per GPU, the plan) of the published recipe as `meshplan plan` plans it (``COMMAND``)."""
    plan = api.plan(api.load_job("llama3-70b", **JOB), api.Knobs(**KNOBS), top_k=1)
    return plan.best.estimate.tokens_per_s / JOB["gpus"], plan


def main() -> int:
    predicted, plan = predicted_tokens_per_gpu()
    print(f"NeMo AutoModel LoRA, Llama 3 70B on 8 H100 (tp 2, pp 4, vp 10), through:\n    {COMMAND}")
    print(f"predicted {predicted:.1f} tokens/s per GPU, step {plan.best.estimate.step_time_s:.3f} s per pipeline flush "
          f"of 4 micro-batches")
    for version, published in PUBLISHED.items():
        print(f"  published {published:.2f} (table of {version}): error {100 * (predicted / published - 1):+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
