"""A plan in the words of the frameworks people train with.

Each export uses only the keys and flags its framework documents (the tests hold
the documented lists, with their sources), and says in its notes what the
framework cannot express: a choice is never dropped silently.

- DeepSpeed: the JSON config (https://www.deepspeed.ai/docs/config-json/); the
  pipeline lives in code (``deepspeed.pipe.PipelineModule``).
- Megatron-LM: ``pretrain_gpt.py`` arguments (megatron/training/arguments.py).
- Colossal-AI: ``HybridParallelPlugin(...)`` (colossalai/booster/plugin/
  hybrid_parallel_plugin.py) with ``PipelineGradientCheckpointConfig``.
- torchtitan: the job config TOML (torchtitan/config/job_config.py).
- meshplan's own executor: ``meshplan run`` (planner/cli/run.py) and the torchrun line.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .describe import runs
from .recompute import POLICIES, RECOMPUTE_POLICIES, discard_modules, every_k
from .placement import balanced_stage_layers, layer_policies
from .precision import RECIPES
from .schedules import SCHEDULES

DOCS = {
    "deepspeed": "https://www.deepspeed.ai/docs/config-json/",
    "megatron": "https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/training/arguments.py",
    "colossalai": ("https://github.com/hpcaitech/ColossalAI/blob/main/"
                   "colossalai/booster/plugin/hybrid_parallel_plugin.py"),
    "torchtitan": "https://github.com/pytorch/torchtitan/blob/main/torchtitan/config/job_config.py",
    "meshplan": "planner/cli/run.py (`meshplan run --help`); torchrun: https://pytorch.org/docs/stable/elastic/run.html",
    "slurm": "https://slurm.schedmd.com/sbatch.html; srun: https://slurm.schedmd.com/srun.html",
}


@dataclass(frozen=True, kw_only=True)
class Export:
    framework: str               # a key of DOCS
    filename: str
    text: str                    # the file's content
    notes: tuple[str, ...]       # what the framework cannot express, and what to do instead


# -- what the plan says, framework-neutral ------------------------------------------------------

def recompute_per_stage(plan) -> list[dict[str, int]]:
    """Per virtual stage, in order: how many blocks use each recompute policy (planner/recompute.py)."""
    c = plan.best.config
    counts = c.stage_layers or balanced_stage_layers(plan.graph, c.pp * c.vpp)
    policies = layer_policies(plan.graph, c)
    out, start = [], 0
    for count in counts:
        stage = {p: 0 for p in POLICIES}
        for layer, policy in zip(plan.graph.layers[start:start + count], policies[start:start + count]):
            if layer.is_block:
                stage[policy] += 1
        out.append(stage)
        start += count
    return out


def _blocks_per_stage(plan) -> list[int]:
    """Transformer blocks per virtual stage, in order (embedding, norm and head excluded)."""
    return [sum(s.values()) for s in recompute_per_stage(plan)]


def _balanced(plan) -> bool:
    c = plan.best.config
    return c.stage_layers is None or tuple(c.stage_layers) == balanced_stage_layers(plan.graph, c.pp * c.vpp)


def _checkpointed(stage: dict[str, int]) -> int:
    """Blocks of a stage a framework that only checkpoints whole blocks recomputes: every policy but none
    (selective and op keep more than a whole-block checkpoint; activation offload keeps less on the device
    but has no equivalent there: full recompute is the nearest that fits)."""
    return sum(n for p, n in stage.items() if p != "none")


def _recomputed_as_full(rec: list[dict[str, int]]) -> list[str]:
    """A note per policy other than none and full that a whole-block checkpoint stands in for."""
    return [f"{RECOMPUTE_POLICIES[p].title} is not an option here: those blocks recompute in full" for p in POLICIES
            if p not in ("none", "full") and any(s[p] for s in rec)]


def _uniform_recompute(plan) -> str | None:
    """The one policy every block uses, or None when they differ."""
    used = {s for stage in recompute_per_stage(plan) for s, n in stage.items() if n}
    return used.pop() if len(used) == 1 else None


def _runs_instead(framework: str, joiner: str = " or ") -> str:
    """The schedules ``framework`` runs, by their names there (planner/schedules.py)."""
    names = [getattr(s, framework) for s in SCHEDULES.values() if getattr(s, framework)]
    return joiner.join(names) + (" only" if len(names) == 1 else "")


# -- DeepSpeed ---------------------------------------------------------------------------------

NVME_PATH = "/local_nvme"
PARAM_OFFLOAD_NOTE = ("{framework} has no parameter offload of its own (DeepSpeed's offload_param): the parameters "
                      "stay on the GPU, more memory than planned")
NVME_NOTE = ("{framework} has no offload to NVMe (DeepSpeed's ZeRO-Infinity): what this file offloads goes to host "
             "memory, more of it than planned")


def _compile_note(plan, framework: str) -> list[str]:
    """What an export that has no torch.compile of the blocks says of a plan that compiles them."""
    if not plan.workload.compile:
        return []
    return [f"the plan compiles each block with torch.compile (meshplan run, torchtitan); {framework} is given no "
            "such setting here: its blocks run as it runs them"]


def _fp8_note(plan, framework: str) -> list[str]:
    """What an export whose runtime has no FP8 recipe says of a plan that runs one."""
    if not plan.workload.fp8:
        return []
    return [f"the plan runs its linears in FP8 ({plan.workload.fp8}); {framework} is given no FP8 setting here "
            "(none of its configuration keys selects an FP8 recipe): it trains in bf16, slower than planned"]


def _ep_overlap_note(plan, framework: str) -> list[str]:
    """What an export whose runtime does not overlap the expert all-to-alls says of a plan priced with them
    overlapped (--ep-comm-overlap)."""
    if not (plan.workload.ep_comm_overlap and plan.best.config.ep > 1):
        return []
    return [f"the plan runs its expert all-to-alls beside another micro-batch's compute (Megatron-Core's "
            f"--overlap-moe-expert-parallel-comm); {framework} is given no such setting here: they run exposed, "
            "slower than planned"]


def deepspeed(plan) -> Export:
    c, w = plan.best.config, plan.workload
    notes = _compile_note(plan, "DeepSpeed") + _fp8_note(plan, "DeepSpeed") + _ep_overlap_note(plan, "DeepSpeed")
    cfg: dict = {"train_batch_size": w.global_batch, "train_micro_batch_size_per_gpu": c.micro_batch,
                 "gradient_accumulation_steps": c.num_microbatches, "gradient_clipping": 1.0}
    if w.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif w.precision == "fp16":
        cfg["fp16"] = {"enabled": True}
    zero: dict = {"stage": c.zero, "overlap_comm": w.overlap_grad_reduce, "contiguous_gradients": True}
    # ZeRO-Infinity: device nvme with the path of the node's local NVMe volume (DeepSpeed's nvme_path)
    device = {"device": "nvme", "nvme_path": NVME_PATH} if c.nvme_offload else {"device": "cpu"}
    if c.optimizer_offload:
        zero["offload_optimizer"] = {**device, "pin_memory": True}
    if c.param_offload:
        zero["offload_param"] = {**device, "pin_memory": True}
    if c.nvme_offload:
        notes.append(f"offload to NVMe: nvme_path {NVME_PATH} stands for the node's local NVMe volume (the cluster "
                     "profile's [host] nvme_GiB, one RAID-0 of its drives): set it to its mount point")
    cfg["zero_optimization"] = zero
    if c.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": c.tp}
        notes.append(f"tensor parallel {c.tp} via AutoTP (`tensor_parallel.autotp_size`); its sharding follows "
                     "DeepSpeed's presets, not meshplan's tp_plan")
    if c.ep > 1 and (c.dp % c.ep or c.tp > 1):
        notes.append(f"expert parallelism {c.ep} over dp {c.dp} x cp {c.cp} x tp {c.tp}: DeepSpeed-MoE's ep_size must "
                     "divide the data-parallel size, with experts not tensor parallel (plan with --framework deepspeed "
                     "for a layout it runs)")
    elif c.ep > 1:
        notes.append(f"expert parallelism {c.ep}: build each MoE layer as deepspeed.moe.layer.MoE(..., num_experts="
                     f"{plan.spec.num_experts if plan.spec else 'E'}, ep_size={c.ep}) in code (not a config key); "
                     f"`meshplan compare --ep {c.ep}` reads this file back with it")
    if c.sequence_parallel:
        notes.append("Megatron-style sequence parallelism has no DeepSpeed config key (DeepSpeed-Ulysses "
                     "splits attention heads instead): run without it or use Megatron-DeepSpeed")
    if c.cp > 1:
        notes.append(f"context parallelism {c.cp} has no DeepSpeed config key")
    if c.pp > 1:
        method = "uniform" if _balanced(plan) else "a manual split"
        notes.append(f"pipeline: build `deepspeed.pipe.PipelineModule(layers=..., num_stages={c.pp}, "
                     f"partition_method='uniform')` in code (not a config key); blocks per stage "
                     f"{runs(_blocks_per_stage(plan))} ({method})")
        if not _balanced(plan):
            notes.append("DeepSpeed's partition_method offers 'uniform', 'parameters' and 'type:<regex>' only: "
                         f"the unequal split {runs(_blocks_per_stage(plan))} cannot be given exactly")
        schedule = SCHEDULES[c.schedule]
        if schedule.deepspeed is None and schedule.virtual_stages:
            notes.append(f"DeepSpeed's pipeline engine runs {_runs_instead('deepspeed')}: {schedule.title} "
                         f"(vpp {c.vpp}) cannot be expressed; expect a larger bubble")
        elif schedule.deepspeed is None:
            notes.append(f"DeepSpeed's pipeline engine runs {_runs_instead('deepspeed')}: {schedule.title} runs "
                         f"as {SCHEDULES[schedule.nearest].title}")
        if c.zero > 1:
            notes.append(f"DeepSpeed refuses ZeRO-{c.zero} with pipeline parallelism: use stage 0 or 1")
    rec = recompute_per_stage(plan)
    per_stage = [_checkpointed(s) for s in rec]
    if sum(per_stage):
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
        notes.append(f"activation checkpointing is applied in code: wrap {sum(per_stage)} block forwards in "
                     f"`deepspeed.checkpointing.checkpoint` (per stage: {runs(per_stage)})")
        notes += _recomputed_as_full(rec)
    return Export(framework="deepspeed", filename="deepspeed_config.json", text=json.dumps(cfg, indent=2) + "\n",
                  notes=tuple(notes))


# -- Megatron-LM -------------------------------------------------------------------------------

def _layout(plan) -> str:
    """Megatron's --pipeline-model-parallel-layout: E embedding, t block, L loss (head), stages by |."""
    stages = _blocks_per_stage(plan)
    parts = []
    for j, blocks in enumerate(stages):
        parts.append(("E" if j == 0 else "") + "t" * blocks + ("L" if j == len(stages) - 1 else ""))
    return "|".join(parts)


def _megatron_model(plan) -> tuple[list[list[str]], list[str]]:
    s, w = plan.spec, plan.workload
    if s is None:
        return [], ["the model is a traced module: give Megatron its architecture flags yourself"]
    args = [["--num-layers", str(s.num_layers)], ["--hidden-size", str(s.hidden)],
            ["--ffn-hidden-size", str(s.ffn_hidden)], ["--num-attention-heads", str(s.num_heads)],
            ["--seq-length", str(w.seq_len)]]
    notes = [f"the vocabulary ({s.vocab_size}) comes from the tokenizer arguments, which are yours to give"]
    if s.num_kv_heads != s.num_heads:
        args += [["--group-query-attention"], ["--num-query-groups", str(s.num_kv_heads)]]
    if s.head_dim * s.num_heads != s.hidden and not s.is_mla:      # MLA's head widths have flags of their own
        args.append(["--kv-channels", str(s.head_dim)])
    if s.max_positions:
        args += [["--max-position-embeddings", str(s.max_positions)], ["--position-embedding-type", "learned_absolute"]]
    else:
        args += [["--max-position-embeddings", str(w.seq_len)], ["--position-embedding-type", "rope"]]
    args.append(["--normalization", "RMSNorm" if s.norm == "rmsnorm" else "LayerNorm"])
    if s.swiglu_limit:     # GPT-OSS's clamped SwiGLU as Megatron-Bridge's GPT-OSS provider sets it: quick_gelu's
        # x sigmoid(1.702 x) of the gate times (up + 1), both clamped (TransformerConfig glu_linear_offset and
        # activation_func_clamp_value, flags of Megatron-LM's arguments.py from its ArgumentGroupFactory)
        args += [["--quick-geglu"], ["--glu-linear-offset", "1.0"], ["--activation-func-clamp-value",
                                                                    f"{s.swiglu_limit:g}"]]
    elif s.mlp == "swiglu":
        args.append(["--swiglu"])
    if not s.tied_embeddings:
        args.append(["--untie-embeddings-and-output-weights"])
    if not s.linear_bias:
        args.append(["--disable-bias-linear"])
    if s.qkv_bias:
        args.append(["--add-qkv-bias"])
    if not s.dropout:
        args += [["--attention-dropout", "0.0"], ["--hidden-dropout", "0.0"]]
    if s.num_experts:
        args += [["--num-experts", str(s.num_experts)], ["--moe-router-topk", str(s.experts_per_token)]]
        if s.moe_ffn_hidden:
            args.append(["--moe-ffn-hidden-size", str(s.moe_ffn_hidden)])
        if s.shared_experts:
            args.append(["--moe-shared-expert-intermediate-size", str(s.shared_ffn)])
            if s.shared_expert_gate:
                args.append(["--moe-shared-expert-gate"])
        if s.dense_layers:      # moe_freq_type: a list expression, 0 a dense block, 1 an expert block
            args.append(["--moe-layer-freq", f"[0]*{s.dense_layers}+[1]*{s.num_layers - s.dense_layers}"])
        args += _router_args(s, notes)
    if s.is_mla:                # Megatron-Core's MLA: --qk-head-dim is the no-RoPE part of a q/k head
        args.append(["--multi-latent-attention"])
        if s.q_lora_rank:
            args.append(["--q-lora-rank", str(s.q_lora_rank)])
        args += [["--kv-lora-rank", str(s.kv_lora_rank)], ["--qk-head-dim", str(s.head_dim - s.qk_rope_head_dim)],
                 ["--qk-pos-emb-head-dim", str(s.qk_rope_head_dim)], ["--v-head-dim", str(s.v_head_dim or s.head_dim)]]
    if s.qk_norm:
        args.append(["--qk-layernorm"])
    if s.attention_sinks:
        args += [["--softmax-type", "learnable"]]
    if s.sliding_window:        # TransformerConfig.window_size (left, right); window_attn_skip_freq N: every N-th full
        args.append(["--window-size", f"{s.sliding_window},0"])
        if s.sliding_every:
            args.append(["--window-attn-skip-freq", str(s.sliding_every)])
    return args, notes


def _megatron_pipeline(plan) -> tuple[list[list[str]], list[str]]:
    c = plan.best.config
    if c.pp == 1:
        return [], []
    notes = []
    schedule = SCHEDULES[c.schedule]
    if schedule.megatron is None:
        notes.append(f"Megatron-LM has no {schedule.title} schedule: it runs {SCHEDULES[schedule.nearest].title}"
                     + (" (the same step time, fewer micro-batches in flight)" if schedule.dominated_by else ""))
    stages = _blocks_per_stage(plan)
    if len(set(stages)) == 1 and c.vpp == 1:        # Megatron's default: as many blocks on every stage
        return [], notes
    if len(set(stages)) == 1:
        return [["--num-layers-per-virtual-pipeline-stage", str(stages[0])]], notes
    if c.vpp == 1 and len(set(stages[1:-1])) <= 1:      # only the first and last stage differ
        return [["--decoder-first-pipeline-num-layers", str(stages[0])],
                ["--decoder-last-pipeline-num-layers", str(stages[-1])]], notes
    return [["--pipeline-model-parallel-layout", _layout(plan)]], notes


def _megatron_recompute(plan) -> tuple[list[list[str]], list[str]]:
    rec = recompute_per_stage(plan)
    uniform = _uniform_recompute(plan)
    if uniform == "none":
        return [], []
    used = {p for stage in rec for p, n in stage.items() if n}
    if "activation-offload" in used and used <= {"none", "activation-offload"} and len(rec) == 1:
        # the activations of the first N layers to host memory (Megatron-Core's cpu_offloading_num_layers, which
        # sets cpu_offloading; TransformerEngine's cpu_offload offloads layers 0 to N - 1): what the search plans
        # (planner/search/space.py ``offloads_first_blocks``), with no pipeline and no recompute; N below the layers
        n, blocks = rec[0]["activation-offload"], sum(rec[0].values())
        if n < blocks:
            return [["--cpu-offloading-num-layers", str(n)]], []
        return [["--cpu-offloading-num-layers", str(blocks - 1)]], [
            f"Megatron-LM offloads the activations of at most {blocks - 1} of the {blocks} layers "
            "(--cpu-offloading-num-layers below --num-layers): the last layer's stay on the device, one layer's "
            "more than meshplan planned"]
    if uniform == "selective":
        return [["--recompute-granularity", "selective"]], []
    if uniform == "discard":        # the output-discarding modules this model has (recompute.discard_modules)
        modules = discard_modules(plan.graph.layers)
        if not modules:
            return [], ["the output-discarding recompute frees nothing in this model (no MoE block, no MLA): "
                        "no recompute flags"]
        return [["--recompute-granularity", "selective"], ["--recompute-modules", *modules]], []
    if uniform is not None:
        return [["--recompute-granularity", "full"], ["--recompute-method", "uniform"],
                ["--recompute-num-layers", "1"]], _recomputed_as_full(rec)
    notes = []
    full = [s["full"] for s in rec]
    if any(s[p] for s in rec for p in POLICIES if p not in ("none", "full")):
        notes.append("Megatron applies one recompute granularity to every layer: the blocks meshplan recomputes "
                     "with another policy are recomputed in full here (less memory, slower)")
        notes += _recomputed_as_full(rec)
        full = [_checkpointed(s) for s in rec]
    most = max(full)
    if len(set(full)) > 1:
        notes.append(f"--recompute-method block recomputes the same number of blocks on every (virtual) stage: "
                     f"meshplan recomputes {runs(full)} per stage; {most} on each is safe on memory and costs "
                     f"{sum(most - f for f in full)} more block recomputes per micro-batch")
    return [["--recompute-granularity", "full"], ["--recompute-method", "block"],
            ["--recompute-num-layers", str(most)]], notes


def _router_args(s, notes: list[str]) -> list[list[str]]:
    """Megatron-Core's flags for the model's router (moe_utils.py topk_routing_with_score_function at core_v0.15.0:
    softmax after the top-k unless --moe-router-pre-softmax, which is the softmax over every expert un-renormalised;
    sigmoid scores renormalised over the top-k; groups scored by the sum of their best top-k / group-topk; the
    weights times --moe-router-topk-scaling-factor; the expert bias and its update rate)."""
    args = []
    if s.router_scores == "sigmoid":
        args.append(["--moe-router-score-function", "sigmoid"])
        if not s.router_renormalize and s.experts_per_token > 1:
            notes.append("Megatron-LM renormalises a sigmoid router's top-k weights, which this model does not")
    elif not s.router_renormalize:
        args.append(["--moe-router-pre-softmax"])
    if s.router_groups:
        args += [["--moe-router-num-groups", str(s.router_groups)],
                 ["--moe-router-group-topk", str(s.router_groups_used)]]
    if s.router_scale != 1.0:
        args.append(["--moe-router-topk-scaling-factor", f"{s.router_scale:g}"])
    if s.router_bias_rate:
        args += [["--moe-router-enable-expert-bias"], ["--moe-router-bias-update-rate", f"{s.router_bias_rate:g}"]]
    return args


def megatron(plan) -> Export:
    c, w = plan.best.config, plan.workload
    args = [["--tensor-model-parallel-size", str(c.tp)], ["--pipeline-model-parallel-size", str(c.pp)],
            ["--context-parallel-size", str(c.cp)], ["--micro-batch-size", str(c.micro_batch)],
            ["--global-batch-size", str(w.global_batch)]]
    notes = _compile_note(plan, "Megatron-LM")
    model, more = _megatron_model(plan)
    args += model
    notes += more
    for part in (_megatron_pipeline, _megatron_recompute):
        a, n = part(plan)
        args += a
        notes += n
    if c.sequence_parallel:
        args.append(["--sequence-parallel"])
    if plan.spec is not None and plan.spec.is_moe:
        # MoE parallel folding: experts whole on each of ep ranks (expert tensor parallel 1), tokens sent by all-to-all
        # in TransformerEngine's GroupedLinear, as meshplan priced them (planner/cost/layer.py expert_linear_s,
        # expert_gemms_at_once); with ep 1 the experts
        # split over the tensor-parallel ranks (--expert-tensor-parallel-size defaults to tp)
        args += [["--expert-model-parallel-size", str(c.ep)],
                 ["--expert-tensor-parallel-size", "1" if c.ep > 1 else str(c.tp)],
                 ["--moe-token-dispatcher-type", w.expert_dispatcher], ["--moe-grouped-gemm"]]
        if w.expert_dispatcher == "flex":       # DeepEP's kernels, as priced (planner/network.py forwarded_exchange_s)
            args.append(["--moe-flex-dispatcher-backend", "deepep"])
    if w.precision in ("bf16", "fp16"):
        args.append([f"--{w.precision}"])
    if w.grad_reduce_in_bf16:
        args.append(["--grad-reduce-in-bf16"])
    if w.fp8:           # TransformerEngine's recipe (megatron/core/transformer/transformer_config.py fp8_recipe)
        flags = RECIPES[w.fp8].megatron_flags
        args += [list(flags[i:i + 2]) for i in range(0, len(flags), 2)]
        if w.fp8_param_gather:
            args.append(["--fp8-param-gather"])
    args.append(["--attention-backend", "flash" if w.attention == "flash" else "unfused"])
    if c.zero == 1:
        args.append(["--use-distributed-optimizer"])
    elif c.zero >= 2:
        args += [["--use-megatron-fsdp"],
                 ["--data-parallel-sharding-strategy", "optim_grads" if c.zero == 2 else "optim_grads_params"],
                 ["--ckpt-format", "fsdp_dtensor"]]     # Megatron-FSDP's checkpoint format (arguments.py asserts it)
    if c.optimizer_offload:
        args += [["--optimizer-cpu-offload"], ["--optimizer-offload-fraction", "1.0"]]
    if c.param_offload:
        notes.append(PARAM_OFFLOAD_NOTE.format(framework="Megatron-LM"))
    if c.nvme_offload:
        notes.append(NVME_NOTE.format(framework="Megatron-LM"))
    if w.overlap_grad_reduce and c.dp * c.cp > 1:
        args.append(["--overlap-grad-reduce"])
        if c.zero >= 1:
            args.append(["--overlap-param-gather"])
    if w.tp_comm_overlap and c.tp > 1:
        args.append(["--tp-comm-overlap"])
    if w.ep_comm_overlap and c.ep > 1:      # as meshplan priced it: the weight gradients deferred into the overlap
        args += [["--overlap-moe-expert-parallel-comm"], ["--delay-wgrad-compute"]]
    header = [f"# Megatron-LM pretrain_gpt.py arguments for {plan.model_name} on {plan.cluster.num_gpus} x "
              f"{plan.cluster.name} (written by meshplan; flags from megatron/training/arguments.py)",
              "# one flag per line; add your data, tokenizer, optimizer and checkpoint arguments"]
    text = "\n".join(header + [" ".join(shlex.quote(x) for x in a) for a in args]) + "\n"   # as a shell reads them
    return Export(framework="megatron", filename="megatron_args.txt", text=text, notes=tuple(notes))


# -- Colossal-AI -------------------------------------------------------------------------------

def colossalai(plan) -> Export:
    c, w = plan.best.config, plan.workload
    notes = _compile_note(plan, "Colossal-AI") + _fp8_note(plan, "Colossal-AI") + _ep_overlap_note(plan, "Colossal-AI")
    kwargs: dict = {"tp_size": c.tp, "pp_size": c.pp, "precision": w.precision,
                    "zero_stage": min(c.zero, 1 if c.pp > 1 else 2),
                    "microbatch_size": c.micro_batch, "max_norm": 1.0,
                    "enable_flash_attention": w.attention == "flash",
                    "overlap_communication": w.overlap_grad_reduce}
    if c.zero == 3:
        notes.append("HybridParallelPlugin supports ZeRO stages 0-2: ZeRO-3 becomes 2 here (more memory); "
                     "Colossal-AI's GeminiPlugin shards parameters but does not combine with TP/PP this way")
    if c.pp > 1 and c.zero > 1:
        notes.append(f"HybridParallelPlugin allows ZeRO 0 or 1 with pipeline parallelism, not {c.zero}")
    if c.optimizer_offload:
        kwargs["cpu_offload"] = True
    if c.param_offload:
        notes.append(PARAM_OFFLOAD_NOTE.format(framework="Colossal-AI's HybridParallelPlugin"))
    if c.nvme_offload:
        notes.append(NVME_NOTE.format(framework="Colossal-AI's HybridParallelPlugin"))
    if c.ep > 1:
        notes.append(f"expert parallelism {c.ep}: HybridParallelPlugin has none; Colossal-AI's MoeHybridParallelPlugin "
                     f"(ep_size={c.ep}) is not written here, so this file keeps every expert on every rank")
    if c.cp > 1:
        kwargs.update(sp_size=c.cp, enable_sequence_parallelism=True, sequence_parallelism_mode="ring_attn")
        if c.sequence_parallel:
            notes.append("Colossal-AI runs one sequence-parallel mode: ring attention for the context-parallel "
                         "degree is set; Megatron-style sequence parallelism inside the TP group is not")
    elif c.sequence_parallel:
        kwargs.update(enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")
    if c.pp > 1:
        kwargs["num_microbatches"] = c.num_microbatches
        del kwargs["microbatch_size"]
        schedule = SCHEDULES[c.schedule]
        kwargs["pp_style"] = schedule.colossalai or SCHEDULES[schedule.nearest].colossalai
        if c.vpp > 1:
            kwargs["num_model_chunks"] = c.vpp
        if schedule.colossalai is None:
            notes.append(f"Colossal-AI's pipeline styles are {_runs_instead('colossalai', ' and ')}: "
                         f"{schedule.title} runs as {SCHEDULES[schedule.nearest].title}")
        if not _balanced(plan):
            kwargs["num_layers_per_stage"] = _blocks_per_stage(plan)
    rec = recompute_per_stage(plan)
    checkpoint = None
    if any(_checkpointed(s) for s in rec):
        checkpoint = [_checkpointed(s) for s in rec]
        notes += [f"Colossal-AI checkpoints whole layers: {n}" for n in _recomputed_as_full(rec)]
        if c.pp == 1:
            notes.append(f"without a pipeline, call model.gradient_checkpointing_enable() for the {checkpoint[0]} "
                         "recomputed blocks (Hugging Face models); the pipeline config below is then unused")
    lines = [f"# Colossal-AI HybridParallelPlugin for {plan.model_name} on {plan.cluster.num_gpus} x "
             f"{plan.cluster.name} (written by meshplan)", "from colossalai.booster import Booster",
             "from colossalai.booster.plugin import HybridParallelPlugin"]
    if checkpoint and c.pp > 1:
        lines.append("from colossalai.shardformer import PipelineGradientCheckpointConfig")
        lines += ["", "checkpointing = PipelineGradientCheckpointConfig(",
                  f"    num_ckpt_layers_per_stage={checkpoint},", ")"]
        kwargs["gradient_checkpoint_config"] = "checkpointing"
    lines += ["", "plugin = HybridParallelPlugin("]
    for key, value in kwargs.items():
        lines.append(f"    {key}={value if key == 'gradient_checkpoint_config' else repr(value)},")
    lines += [")", "booster = Booster(plugin=plugin)",
              f"# per data-parallel rank and step: plugin.prepare_dataloader(dataset, "
              f"batch_size={c.micro_batch * c.num_microbatches})"]
    return Export(framework="colossalai", filename="colossalai_plugin.py", text="\n".join(lines) + "\n",
                  notes=tuple(notes))


# -- torchtitan --------------------------------------------------------------------------------

def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


# meshplan's layer names -> torchtitan's module names (torchtitan/models/llama3/model/model.py)
_TORCHTITAN_MODULES = {"embed": "tok_embeddings", "lm_head": "output"}


def _modules_per_stage(plan) -> list[list[str]]:
    """The modules of each virtual stage, in order, under torchtitan's names: its
    ``module_fqns_per_model_part`` (torchtitan/distributed/pipeline_parallel.py; the older
    ``pipeline_parallel_split_points`` is refused there as deprecated)."""
    return [[_TORCHTITAN_MODULES.get(name, name) for name in modules] for modules in plan.stages]


def _torchtitan_sections(plan, python: bool = False) -> tuple[dict, list[str]]:
    """[training], [parallelism] and [activation_checkpoint] in the TOML form's words (torchtitan v0.2.2's
    job_config.py), and what torchtitan cannot express of the plan; ``python``: what the current Python form
    cannot (it says sequence parallelism, ParallelismConfig.enable_sequence_parallel, and accumulates gradients
    itself, num_tokens_per_train_step over the micro-batch's tokens x dp)."""
    c, w = plan.best.config, plan.workload
    notes = _ep_overlap_note(plan, "torchtitan")
    parallelism: dict = {"tensor_parallel_degree": c.tp, "pipeline_parallel_degree": c.pp,
                         "context_parallel_degree": c.cp}
    if plan.spec is not None and plan.spec.is_moe:
        # experts whole on each of ep ranks (torchtitan's expert_tensor_parallel_degree 1, its default)
        parallelism["expert_parallel_degree"] = c.ep
    if c.zero >= 2:
        parallelism.update(data_parallel_shard_degree=c.dp, data_parallel_replicate_degree=1,
                           fsdp_reshard_after_forward="always" if c.zero == 3 else "never")
    else:
        parallelism.update(data_parallel_replicate_degree=c.dp, data_parallel_shard_degree=1)
        if c.zero == 1:
            notes.append("torchtitan has no ZeRO-1: data parallelism is DDP (replicate) here, optimizer states "
                         "unsharded; or shard with data_parallel_shard_degree for FSDP (ZeRO-3)")
    if c.cp > 1 and c.zero <= 1:
        notes.append(f"torchtitan shards parameters with FSDP over the context-parallel ranks too (its dp_shard_cp "
                     f"mesh, torchtitan/distributed/parallel_dims.py): with cp {c.cp} the model states are sharded "
                     f"{c.cp} ways (ZeRO-3 over cp) where the plan keeps ZeRO-{c.zero}")
    if c.tp > 1 and not c.sequence_parallel and not python:
        notes.append("torchtitan's tensor parallelism always shards norms along the sequence (sequence "
                     "parallelism on): less activation memory than planned")
    if c.pp > 1:
        parallelism["pipeline_parallel_schedule"] = SCHEDULES[c.schedule].torch_name
        parallelism["pipeline_parallel_microbatch_size"] = c.micro_batch
        parallelism["module_fqns_per_model_part"] = _modules_per_stage(plan)
    local = c.micro_batch * (c.num_microbatches if c.pp > 1 else 1)
    training = {"local_batch_size": local, "global_batch_size": w.global_batch,
                "seq_len": w.seq_len, "max_norm": 1.0,
                "mixed_precision_param": "bfloat16" if w.precision == "bf16" else "float32",
                "mixed_precision_reduce": "float32"}
    if w.precision == "fp16":
        notes.append("torchtitan's mixed precision is bfloat16 or float32: fp16 is not offered")
    if c.pp == 1 and c.num_microbatches > 1 and not python:
        notes.append(f"gradient accumulation over {c.num_microbatches} micro-batches: global_batch_size / "
                     "(local_batch_size x data-parallel degree); torchtitan versions without gradient "
                     "accumulation need local_batch_size = global_batch_size / dp instead (more memory)")
    if c.nvme_offload:
        notes.append(NVME_NOTE.format(framework="torchtitan"))
    if c.param_offload and not c.optimizer_offload:
        notes.append("torchtitan offloads parameters only with everything else (enable_cpu_offload, FSDP2's "
                     "CPUOffloadPolicy): parameter offload alone is not offered")
    if c.optimizer_offload:
        training["enable_cpu_offload"] = True
        if c.zero < 2:      # at ZeRO-2/3 the plan's offload is FSDP2's CPUOffloadPolicy, as torchtitan's
            notes.append("torchtitan's CPU offload (FSDP) moves parameters and gradients too, not only the optimizer")
    checkpoint, more = _torchtitan_checkpoint(plan)
    notes += more
    sections = {"training": training, "parallelism": parallelism, "activation_checkpoint": checkpoint}
    if w.compile:       # per-block torch.compile of the model, as meshplan run does; the loss stays eager
        sections["compile"] = {"enable": True, "components": ["model"]}
        if python:
            notes.append("compile: the Python form's compile config is not written here; enable torch.compile of "
                         "the model (components model) in your config, as torchtitan.toml's [compile] says")
    if w.fp8:
        sections.update(_torchtitan_fp8(plan, notes, python))
    return sections, notes


def _torchtitan_fp8(plan, notes: list[str], python: bool) -> dict:
    """torchtitan's float8 or MX converter for the plan's recipe (v0.2.2's TOML keys: torchtitan/config/
    job_config.py Float8Linear, MXLinear): the output head left in bf16 and torchao's auto filter of small linears
    (``auto_filter_small_kn``), as meshplan priced them (planner/cost/layer.py fp8_converts)."""
    recipe, c = RECIPES[plan.workload.fp8], plan.best.config
    if recipe.gemm_dtype == "mxfp8":
        converter, body = "quantize.linear.mx", {"recipe_name": recipe.torchao_name, "filter_fqns": ["output"]}
    else:
        gather = recipe.fp8_all_gather and c.zero >= 2
        converter = "quantize.linear.float8"
        body = {"recipe_name": recipe.torchao_name, "enable_fsdp_float8_all_gather": gather,
                "precompute_float8_dynamic_scale_for_fsdp": gather, "filter_fqns": ["output", "auto_filter_small_kn"]}
        if recipe.name == "fp8-tensorwise":
            notes.append("recipe_name tensorwise and its FP8 all-gather are keys of torchtitan v0.2.2's TOML form; "
                         "the Python config of later torchtitan (6348d93, April 2026) offers rowwise recipes only")
    if python:
        notes.append(f"FP8: the Python form's converter is not written here; add {converter} with the settings "
                     "torchtitan.toml gives")
    return {"model": {"converters": [converter]}, converter: body}


def _torchtitan_model(plan) -> tuple[str, str] | None:
    """(torchtitan's model module, flavor) of the plan's model, where torchtitan has it."""
    from .baseline.torchtitan import ZOO
    return next((key for key, name in ZOO.items() if name == plan.model_name), None)


def torchtitan(plan) -> Export:
    """The last TOML form (torchtitan v0.2.2 and earlier: torchtitan/config/job_config.py)."""
    sections, notes = _torchtitan_sections(plan)
    model = _torchtitan_model(plan)
    head = {"job": {"description": f"meshplan plan: {plan.model_name} on {plan.cluster.num_gpus} x {plan.cluster.name}"}}
    if model:
        head["model"] = {"name": model[0], "flavor": model[1]}
    if "model" in sections:         # the converters of an FP8 recipe
        head["model"] = {**head.get("model", {}), **sections.pop("model")}
    lines = [f"# torchtitan job config for {plan.model_name} (written by meshplan): the TOML form of torchtitan "
             "v0.2.2 and earlier; later torchtitan reads the Python config in torchtitan_config.py. Set [model] "
             "and [training] dataset/steps for your run"]
    for name, body in {**head, **sections}.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    return Export(framework="torchtitan", filename="torchtitan.toml", text="\n".join(lines) + "\n",
                  notes=tuple(notes))


# The current form (torchtitan/config/configs.py since pytorch/torchtitan PR 2386, February 2026; batch sizes in
# tokens since PR 4121, August 2026): the TOML keys that were renamed, and the activation-checkpointing classes
TORCHTITAN_RENAMED = {"seq_len": "max_context_length"}
TORCHTITAN_AC = {"full": "FullAC.Config()", "selective": "SelectiveAC.Config()", "none": "None",
                 "memory_budget": "MemoryBudgetAC.Config()"}


def torchtitan_python(plan) -> Export:
    """The current torchtitan form: a config module whose function returns the job's ``Trainer.Config``
    (run with ``--module <module> --config meshplan_plan``)."""
    c, w = plan.best.config, plan.workload
    sections, notes = _torchtitan_sections(plan, python=True)
    training = {TORCHTITAN_RENAMED.get(k, k): v for k, v in sections["training"].items()
                if k not in ("local_batch_size", "global_batch_size")}
    training = {"num_tokens_per_microbatch_per_dp_rank": c.micro_batch * w.seq_len,
                "num_tokens_per_train_step": w.global_batch * w.seq_len, **training}
    parallelism = {k: v for k, v in sections["parallelism"].items() if k != "pipeline_parallel_microbatch_size"}
    if c.pp > 1:
        parallelism["num_pp_microbatches"] = c.num_microbatches
    if c.tp > 1:        # the current form says it (ParallelismConfig.enable_sequence_parallel, default on)
        parallelism["enable_sequence_parallel"] = c.sequence_parallel
    ac = sections["activation_checkpoint"]
    mode = ac.get("mode", "selective")
    if mode == "selective" and ac.get("selective_ac_option", "op") != "op":
        notes = notes + [f"torchtitan's Python configs checkpoint every block alike (SelectiveAC is per operator): "
                         f"one block in every {ac['selective_ac_option']} in full is not offered; SelectiveAC instead"]
    model = _torchtitan_model(plan)
    registry = (f"from torchtitan.models.{model[0]} import model_registry" if model else
                "from torchtitan.models.llama3 import model_registry   # set your model's module")
    flavor = model[1] if model else "FLAVOR"
    if not model:
        notes = notes + [f"{plan.model_name} is not one of torchtitan's registered models: set model_spec"]

    def call(name: str, values: dict) -> list[str]:
        return ([f"        {name}={_CONFIG_CLASS[name]}("] + [f"            {k}={v!r}," for k, v in values.items()]
                + ["        ),"])

    lines = [f'"""torchtitan config for {plan.model_name} on {plan.cluster.num_gpus} x {plan.cluster.name} (written by '
             "meshplan): the Python form\ntorchtitan reads since February 2026 (torchtitan/config/configs.py). Run "
             "with --module <this module> --config meshplan_plan;\nset the dataset, tokenizer and steps for your run. "
             'The TOML form of torchtitan v0.2.2 and earlier is torchtitan.toml."""',
             "from torchtitan.config import ParallelismConfig, TrainingConfig",
             "from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC",
             registry, "from torchtitan.trainer import Trainer", "", "",
             "def meshplan_plan() -> Trainer.Config:", "    return Trainer.Config(",
             f"        model_spec=model_registry({flavor!r}),"]
    lines += call("training", training) + call("parallelism", parallelism)
    lines += [f"        activation_checkpoint={TORCHTITAN_AC[mode]},", "    )"]
    return Export(framework="torchtitan", filename="torchtitan_config.py", text="\n".join(lines) + "\n",
                  notes=tuple(notes))


_CONFIG_CLASS = {"training": "TrainingConfig", "parallelism": "ParallelismConfig"}


def _torchtitan_layer_sac(plan) -> int | None:
    """K where the plan's per-layer policies are exactly what torchtitan's ``selective_ac_option = "K"`` does:
    its ``_apply_layer_sac`` counts the blocks it wraps in one process-wide counter, so on each pipeline rank
    (its stages built in order) the K-th, 2K-th... of the rank's blocks are checkpointed in full."""
    k = every_k(plan.best.config.recompute)
    if k is None:
        return None
    c = plan.best.config
    policies = layer_policies(plan.graph, c)
    counts = c.stage_layers or balanced_stage_layers(plan.graph, c.pp * c.vpp)
    starts = [sum(counts[:j]) for j in range(len(counts))]
    for rank in range(c.pp):
        n = 0
        for j in range(rank, len(counts), c.pp):
            for i in range(starts[j], starts[j] + counts[j]):
                if plan.graph.layers[i].is_block:
                    n += 1
                    if policies[i] != ("full" if n % k == 0 else "none"):
                        return None
    return k


def _torchtitan_checkpoint(plan) -> tuple[dict, list[str]]:
    """[activation_checkpoint] (torchtitan's modes none, full and selective with selective_ac_option "op" or
    "K"), and what it cannot say."""
    uniform = _uniform_recompute(plan)
    if uniform is not None and RECOMPUTE_POLICIES[uniform].torchtitan:      # its own name there
        return dict(RECOMPUTE_POLICIES[uniform].torchtitan), []
    if uniform == "selective":
        return {"mode": "selective", "selective_ac_option": "op"}, [
            "torchtitan has no attention-core recompute: its per-op selective checkpointing ('op') keeps matmul "
            "and attention outputs and recomputes the rest (less memory, more recompute than planned)"]
    if uniform == "activation-offload":
        return {"mode": "full"}, ["torchtitan has no activation offload: full recompute instead (less memory, "
                                  "slower); or wrap the blocks' forward in torch.autograd.graph.save_on_cpu"]
    if uniform == "discard":
        return {"mode": "full"}, ["torchtitan has no output-discarding recompute (Megatron-Core's): full recompute "
                                  "instead (less memory, slower)"]
    k = _torchtitan_layer_sac(plan)
    if k is not None:
        return {"mode": "selective", "selective_ac_option": str(k)}, []
    rec = recompute_per_stage(plan)
    done, total = sum(_checkpointed(s) for s in rec), sum(sum(s.values()) for s in rec)
    per_stage = runs([_checkpointed(s) for s in rec])
    if all(n == 0 for s in rec for p, n in s.items() if p not in ("none", "op")):    # op on some blocks, none on others
        return {"mode": "selective", "selective_ac_option": "op"}, [
            f"meshplan recomputes {done} of {total} blocks operator by operator ({per_stage} per stage); "
            "torchtitan applies one policy to every block: 'op' on all of them (more recompute than planned)"]
    every = max(1, round(total / done))
    if every == 1 and done < total:     # most blocks recomputed: the nearest that holds no more is full on all
        return {"mode": "full"}, [
            f"meshplan recomputes {done} of {total} blocks ({per_stage} per stage); torchtitan's nearest that holds "
            "no more memory is full on every block (more recompute than planned)"] + _recomputed_as_full(rec)
    if every == 1:      # every block recomputed, some of them by another policy: full on all of them
        return {"mode": "full"}, [
            f"meshplan recomputes every block ({per_stage} per stage), not all of them in full; torchtitan applies "
            "one mode to every block: full (less memory, more recompute than planned)"] + _recomputed_as_full(rec)
    return {"mode": "selective", "selective_ac_option": str(every)}, [
        f"meshplan recomputes {done} of {total} blocks ({per_stage} per stage); torchtitan's nearest is one "
        f"block in every {every} in full (activation_checkpoint.selective_ac_option)"] + _recomputed_as_full(rec)


# -- meshplan run / torchrun ----------------------------------------------------------------------

def meshplan_run(plan) -> Export:
    nodes, nproc = plan.cluster.launch        # hosts (a GB200 rack's trays), each with its GPUs
    model = plan.model_source
    lines = ["# meshplan's executor (written by meshplan): the same plan.json on every node",
             f"meshplan run --plan plan.json --model {model} --steps 10 --nproc {nproc} --nnodes {nodes} "
             "--node-rank $NODE_RANK --rdzv-endpoint $MASTER_ADDR:29500" if nodes > 1 else
             f"meshplan run --plan plan.json --model {model} --steps 10 --nproc {nproc}",
             "", "# or torchrun directly (what meshplan run launches)"]
    rendezvous = (f"--nnodes {nodes} --node-rank $NODE_RANK --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500"
                  if nodes > 1 else "--standalone")
    lines.append(f"torchrun --nproc-per-node {nproc} {rendezvous} -m executor.train --plan plan.json "
                 f"--model {model} --steps 10 --out measured.json")
    notes = () if plan.spec is not None else (
        "a traced module's plan runs inside your own torchrun script with executor.auto_parallelize",)
    return Export(framework="meshplan", filename="meshplan_run.sh", text="\n".join(lines) + "\n", notes=notes)


def slurm(plan) -> Export:
    """An sbatch script (https://slurm.schedmd.com/sbatch.html): the plan's nodes with one task each and its
    GPUs per node; ``srun`` starts `meshplan run` once per node, torchrun's c10d rendezvous on the job's
    first node (Slurm's SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_NODEID)."""
    nodes, nproc = plan.cluster.launch        # Slurm's nodes are hosts: a GB200 rack's trays of 4 GPUs
    name = re.sub(r"[^\w.-]", "-", f"meshplan-{plan.model_name}")
    lines = ["#!/bin/bash", f"# {plan.model_name} on {nodes} node(s) x {nproc} GPUs of {plan.cluster.name} (written by "
             "meshplan); submit with: sbatch meshplan_sbatch.sh", f"#SBATCH --job-name={name}",
             f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={nproc}",
             "#SBATCH --exclusive", "set -euo pipefail", "",
             "# the rendezvous: torchrun's c10d store on the job's first node (read whole: a pipe into head would",
             "# end scontrol with SIGPIPE on a long node list, which pipefail turns into a failed job)",
             'mapfile -t job_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
             'head_node=${job_nodes[0]}', "",
             "# one task per node; each starts torchrun with the node's GPUs (meshplan run launches it)",
             f"srun --kill-on-bad-exit=1 bash -c 'meshplan run --plan plan.json --model {shlex.quote(plan.model_source)} "
             f"--steps 10 --nproc {nproc} --nnodes \"$SLURM_NNODES\" --node-rank \"$SLURM_NODEID\" "
             "--rdzv-endpoint \"$1\":29500' _ \"$head_node\""]
    notes = () if plan.spec is not None else (
        "a traced module's plan runs inside your own torchrun script with executor.auto_parallelize",)
    return Export(framework="slurm", filename="meshplan_sbatch.sh", text="\n".join(lines) + "\n", notes=notes)


EXPORTERS = (deepspeed, megatron, colossalai, torchtitan_python, torchtitan, meshplan_run, slurm)


def exports(plan) -> tuple[Export, ...]:
    return tuple(export(plan) for export in EXPORTERS)


def write_exports(plan, folder: Path, exported: tuple[Export, ...] | None = None) -> list[Path]:
    """Every export (``exported``, else ``exports(plan)``) into ``folder``, and NOTES.md with what
    each cannot express."""
    folder.mkdir(parents=True, exist_ok=True)
    written, notes = [], ["# What the exports cannot express", ""]
    for export in exported or exports(plan):
        path = folder / export.filename
        path.write_text(export.text)
        written.append(path)
        notes.append(f"## {export.filename} ({DOCS[export.framework]})")
        notes += [f"- {n}" for n in export.notes] or ["- everything in the plan is expressed"]
        notes.append("")
    (folder / "NOTES.md").write_text("\n".join(notes))
    return written + [folder / "NOTES.md"]

