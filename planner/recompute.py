"""Activation recompute policies: one record each, the one home of everything meshplan knows about a policy.

A policy decides what one transformer block keeps for backward and what it redoes or moves. Its
record holds its names (``--recompute`` and plan.json, and in Megatron-LM, torchtitan, DeepSpeed
and Colossal-AI), what it keeps on the device and what it redoes (``cost``: a function of the
block's facts, which the cost model measures op by op in planner/cost/layer.py), and what it needs
of the runtime. The runtime table offers a policy to a framework that has a name for it
(planner/runtimes.py); the stage ILP chooses one per block among those; the executor applies them
(executor/activations.py, which implements each by name); the exports and the readers of other
frameworks' files translate them by these names.

``every-K`` is not a policy of its own: it is a pattern of the plan, full recompute on every K-th
block and none on the others (torchtitan's layer-wise selective checkpointing), expanded into the
per-layer policies; ``ParallelConfig.recompute`` names it (``every-K``) beside them.

Adding a policy: a record here, and its application in executor/activations.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .errors import UserError, one_of


@dataclass(frozen=True, kw_only=True)
class BlockFacts:
    """What one layer is for one micro-batch on one rank, as the policies' costs read it (bytes and
    seconds; planner/cost/layer.py measures each, op by op)."""

    saved_bytes: float              # what autograd keeps for backward without any policy
    attention_core_bytes: float     # of it, what the attention core keeps beyond its inputs (unfused scores;
                                    # the flash kernels' log-sum-exp, which selective recompute keeps)
    attention_core_fwd_s: float     # the unfused attention core's forward (its exposed CP exchange included)
    input_bytes: float              # the layer's input: all a checkpoint of the whole layer keeps
    fwd_s: float                    # the layer's forward, its exposed communication included
    bwd_s: float                    # its backward
    matmul_flops_fwd: float         # matmul FLOPs of its forward
    workspace_bytes: float          # transient while the layer runs backward
    op_kept_bytes: float            # what operator-level selective checkpointing saves (besides the input)
    op_kept_s: float                # the forward seconds of the ops whose outputs it saves
    op_redo_flops: float            # matmul FLOPs of the ops it recomputes
    saved_comm_s: float             # exposed forward TP time whose outputs it saves (the reduce-scatters)
    host_copy_s: float              # one copy of ``saved_bytes`` between device and host at the offload rate
    device_is_host: bool            # a CPU process: its host memory is its device memory
    tail_fwd_s: float = 0.0         # the forward after the last op whose saved tensor backward needs, which a
                                    # checkpoint that stops early does not redo (``Timing.checkpoint_early_stop``)
    tail_flops: float = 0.0         # its matmul FLOPs
    discard_bytes: float = 0.0      # of ``saved_bytes``, what Megatron-Core's output-discarding checkpoint drops
                                    # (``discarded_ops``): a MoE block's pre-MLP norm output, the experts'
                                    # activation output, MLA's input-norm output and its up-projected q, k and v
    discard_fwd_s: float = 0.0      # the forward seconds of the ops that rebuild them
    discard_flops: float = 0.0      # their matmul FLOPs (MLA's up-projections)


@dataclass(frozen=True, kw_only=True)
class PolicyCost:
    """What a policy costs one layer per micro-batch."""

    recompute_s: float = 0.0        # seconds added before backward: the forward redone, or the host
                                    # transfer that compute does not hide
    act_bytes: float                # kept on the device for backward
    peak_extra_bytes: float         # transient on top while this layer runs backward
    host_bytes: float = 0.0         # kept in host memory
    recompute_flops: float = 0.0    # matmul FLOPs redone


@dataclass(frozen=True, kw_only=True)
class RecomputePolicy:
    """One activation recompute policy: its names, what it keeps and redoes, what it needs."""

    name: str                       # --recompute, plan.json (config.recompute, recompute_per_layer)
    aliases: tuple[str, ...] = ()   # earlier names, still read
    title: str                      # in sentences
    description: str                # one line: --help, the README and the reports say the same
    needs: str                      # what it needs of the runtime
    cost: Callable[[BlockFacts], PolicyCost]   # memory kept and time redone, from the block's facts
    # -- names in each framework (None: it has none; whole-block frameworks recompute such blocks in full)
    megatron: str | None            # --recompute-granularity (""; no recompute flags)
    torchtitan: tuple[tuple[str, str], ...] | None    # [activation_checkpoint] settings
    deepspeed: str | None
    reruns_block: bool = False      # the block's sub-modules run forward again before backward (their forward
                                    # hooks fire again: ZeRO-3 runtimes that fetch per sub-module fetch again)


def _none(f: BlockFacts) -> PolicyCost:
    return PolicyCost(act_bytes=f.saved_bytes, peak_extra_bytes=f.workspace_bytes)


def _selective(f: BlockFacts) -> PolicyCost:
    """Korthikanti et al. 2022, Sec 5: drop the attention core's internals and redo the core. Under flash
    attention the core keeps nothing to drop (its log-sum-exp stays), so this is "none"."""
    if not f.attention_core_fwd_s:
        return _none(f)
    kept = f.saved_bytes - f.attention_core_bytes
    return PolicyCost(recompute_s=f.attention_core_fwd_s, act_bytes=kept,
                      peak_extra_bytes=f.workspace_bytes + f.saved_bytes - kept)


def _op(f: BlockFacts) -> PolicyCost:
    """torchtitan's operator-level selective checkpointing: keep the block's input and the outputs of the
    saved ops; backward first reruns the forward with the saved ops replaced by their outputs, so everything
    else is redone (norms, activations, RoPE, the recomputed mms, the TP collectives whose outputs are not
    saved), and the saved tensors are rebuilt while the backward runs."""
    return PolicyCost(recompute_s=max(0.0, f.fwd_s - f.op_kept_s - f.saved_comm_s),
                      act_bytes=f.input_bytes + f.op_kept_bytes,
                      peak_extra_bytes=f.workspace_bytes + f.saved_bytes, recompute_flops=f.op_redo_flops)


def _discard(f: BlockFacts) -> PolicyCost:
    """Megatron-Core's output-discarding checkpoint (tensor_parallel.CheckpointWithoutOutput, core_v0.15.0: the
    ``layernorm``, ``moe_act`` and ``mla_up_proj`` recompute modules): a cheap op's output is freed once its consumer
    has run forward, and the op is run again just before that consumer's backward. What the consumers kept of
    those outputs goes (``discard_bytes``); the ops are redone once each, and while the layer runs backward the
    rebuilt outputs are back on top of its workspace. Where the block has none of those ops this is "none"."""
    if not f.discard_bytes:
        return _none(f)
    return PolicyCost(recompute_s=f.discard_fwd_s, act_bytes=f.saved_bytes - f.discard_bytes,
                      peak_extra_bytes=f.workspace_bytes + f.discard_bytes, recompute_flops=f.discard_flops)


def _full(f: BlockFacts) -> PolicyCost:
    """Chen et al. 2016: keep the input, redo the forward before backward, which rebuilds every saved tensor
    while the backward runs: all of it, or up to the last tensor backward needs where the runtime's checkpoint
    stops early (``tail_fwd_s``: zero elsewhere)."""
    return PolicyCost(recompute_s=f.fwd_s - f.tail_fwd_s, act_bytes=min(f.input_bytes, f.saved_bytes),
                      peak_extra_bytes=f.workspace_bytes + f.saved_bytes,
                      recompute_flops=f.matmul_flops_fwd - f.tail_flops)


def _activation_offload(f: BlockFacts) -> PolicyCost:
    """The saved tensors go to the host during forward and come back during backward on a copy stream
    beside the compute stream (torchtune OffloadActivations, use_streams=True; executor/activations.py): the
    copy out of one layer runs beside the next layer's forward, the copy in beside the backward of the
    layer before it, and only what exceeds that compute is exposed. Two layers' tensors are on the device
    at a time: the one whose backward runs and the next, copied in beside it (while forward copies one
    out, the next computes: two again).

    In a CPU process the host memory is the device memory: the executor's host stash clones the saved
    storages beside the originals, which live until the block's forward ends, and hands the clones back
    to backward as they are (executor/activations.py HostStash). It then keeps what no recompute keeps, one
    block's twice while its forward runs, and costs the clone (``host_copy_s`` is then the copy's time)."""
    if f.device_is_host:
        return PolicyCost(recompute_s=f.host_copy_s, act_bytes=f.saved_bytes,
                          peak_extra_bytes=f.workspace_bytes + f.saved_bytes)
    return PolicyCost(recompute_s=max(0.0, f.host_copy_s - f.fwd_s) + max(0.0, f.host_copy_s - f.bwd_s),
                      act_bytes=0.0, peak_extra_bytes=f.workspace_bytes + 2 * f.saved_bytes,
                      host_bytes=f.saved_bytes)


NONE = RecomputePolicy(
    name="none", title="no recompute", description="keep every activation autograd saves",
    needs="nothing", cost=_none, megatron="", torchtitan=(("mode", "none"),), deepspeed="")
SELECTIVE = RecomputePolicy(
    name="selective", title="selective (attention-core) recompute",
    description="recompute the attention core only (Korthikanti et al. 2022, Sec 5; Megatron-LM "
                "--recompute-granularity selective); saves nothing under flash attention, which keeps no scores",
    needs="a checkpoint around the attention core (torch.utils.checkpoint)", cost=_selective,
    megatron="--recompute-granularity selective", torchtitan=None,
    deepspeed="--recompute-granularity selective (Megatron-DeepSpeed)")
DISCARD = RecomputePolicy(
    name="discard", title="output-discarding recompute",
    description="free the outputs of a block's cheap ops once their consumer has run and redo them before its "
                "backward: a MoE block's pre-MLP norm, the experts' activation, MLA's input norm, up-projections "
                "and RoPE (Megatron-Core --recompute-granularity selective --recompute-modules layernorm moe_act "
                "mla_up_proj, those the model has); the same as none where a block has none of them",
    needs="Megatron-Core's output-discarding checkpoint (tensor_parallel.CheckpointWithoutOutput)", cost=_discard,
    megatron="--recompute-granularity selective --recompute-modules (layernorm, moe_act, mla_up_proj: those the "
             "model has)", torchtitan=None, deepspeed=None)
OP = RecomputePolicy(
    name="op", title="operator-level selective recompute (op)",
    description="operator-level selective checkpointing: keep the outputs of matmuls (every other mm), attention "
                "and reduce-scatters, recompute the rest (torchtitan SelectiveAC, selective_ac_option 'op', with "
                "torch.utils.checkpoint.create_selective_checkpoint_contexts)",
    needs="torch's selective checkpointing contexts (torch.utils.checkpoint.create_selective_checkpoint_contexts)",
    cost=_op, megatron=None, torchtitan=(("mode", "selective"), ("selective_ac_option", "op")), deepspeed=None,
    reruns_block=True)
FULL = RecomputePolicy(
    name="full", title="full recompute",
    description="keep the block's input only and recompute the block before its backward (Chen et al. 2016; "
                "Megatron-LM --recompute-granularity full)",
    needs="a checkpoint around the block (torch.utils.checkpoint)", cost=_full,
    megatron="--recompute-granularity full", torchtitan=(("mode", "full"),),
    deepspeed="deepspeed.checkpointing.checkpoint around the block", reruns_block=True)
ACTIVATION_OFFLOAD = RecomputePolicy(
    name="activation-offload", aliases=("offload",), title="activation offload to host memory",
    description="move the block's saved activations to host memory in forward and back in backward, over the "
                "host link and beside compute (torch saved-tensor hooks; torchtune OffloadActivations)",
    needs="saved-tensor hooks with a copy stream, and host memory for the micro-batches in flight",
    cost=_activation_offload, megatron=None, torchtitan=None, deepspeed=None)

POLICY_RECORDS: tuple[RecomputePolicy, ...] = (NONE, SELECTIVE, DISCARD, OP, FULL, ACTIVATION_OFFLOAD)
RECOMPUTE_POLICIES: dict[str, RecomputePolicy] = {p.name: p for p in POLICY_RECORDS}
POLICIES: tuple[str, ...] = tuple(RECOMPUTE_POLICIES)     # simplest first: the order ties are broken in
ALIASES: dict[str, str] = {alias: p.name for p in POLICY_RECORDS for alias in p.aliases}
DESCRIPTIONS = {p.name: p.description for p in POLICY_RECORDS}
EVERY_K_DESCRIPTION = "full recompute on every K-th block, none on the others (torchtitan selective_ac_option = 'K')"

_EVERY = re.compile(r"every-(\d+)")


def _moe_and_mla(ops) -> tuple[bool, bool]:
    """(some op is a routed expert's linear, some op is MLA's kv down-projection)."""
    return (any(op.kind == "linear" and op.expert for op in ops),
            any(op.name.endswith(".attn.kv_down") for op in ops))


def discarded_ops(ops) -> tuple[frozenset[str], frozenset[str]]:
    """(names of the ops "discard" redoes, names of the ops whose kept tensors it frees) among one block's ``ops``, as
    Megatron-Core's recompute modules reach them (core_v0.15.0): ``layernorm`` the norms that are modules of their
    own (gpt_layer_specs.py: the pre-MLP norm of a MoE block, the input norm under MLA; elsewhere TransformerEngine
    fuses them into the next linear), whose output the router or MLA's down-projections keep; ``moe_act`` the
    experts' activation (experts.py), whose output their down-projection keeps; ``mla_up_proj`` MLA's up-projections
    and RoPE (multi_latent_attention.py), whose q, k and v the attention core keeps."""
    moe, mla = _moe_and_mla(ops)
    redo, freed = set(), set()
    for op in ops:
        name = op.name
        if moe and (name.endswith(".mlp_norm") or (op.expert and name.endswith(".mlp.act"))):
            redo.add(name)
        if moe and (name.endswith(".mlp.router") or (op.expert and name.endswith(".mlp.down_proj"))):
            freed.add(name)
        if mla and name.endswith((".attn_norm", ".attn.q_up", ".attn.kv_up", ".attn.rope")):
            redo.add(name)
        if mla and name.endswith((".attn.q_down", ".attn.q_proj", ".attn.kv_down", ".attn.core")):
            freed.add(name)
    return frozenset(redo), frozenset(freed)


def discard_modules(layers) -> tuple[str, ...]:
    """Megatron-Core's ``--recompute-modules`` that are "discard" on a model of these ``layers`` (a LayerGraph's):
    layernorm with a MoE block or MLA, moe_act with a MoE block, mla_up_proj with MLA."""
    moe, mla = _moe_and_mla([op for layer in layers if layer.is_block for op in layer.ops])
    return tuple(m for m, has in (("layernorm", moe or mla), ("moe_act", moe), ("mla_up_proj", mla)) if has)


def canonical(name: str) -> str:
    """A policy's name now, for a name or an earlier one (``aliases``); anything else as it is."""
    return ALIASES.get(name, name) if isinstance(name, str) else name


def runs_in(framework: str) -> tuple[str, ...]:
    """The policies a framework has a name for (``megatron``, ``torchtitan`` or ``deepspeed``)."""
    return tuple(p.name for p in POLICY_RECORDS if getattr(p, framework) is not None)


def every_k(policy: str | None) -> int | None:
    """K of an ``every-K`` pattern, or None for a per-block policy (or nothing)."""
    match = _EVERY.fullmatch(policy or "")
    return int(match.group(1)) if match else None


def parse_recompute(text: str, field: str = "--recompute") -> str:
    """A --recompute value: a policy (or an earlier name of one) or ``every-K`` with K >= 1; UserError
    otherwise."""
    if canonical(text) in RECOMPUTE_POLICIES:
        return canonical(text)
    k = every_k(text)
    if k is not None and k >= 1:
        return f"every-{k}"
    if k is not None or text.startswith("every-"):
        raise UserError(f"{text!r}: K must be a positive integer (every-1 is full recompute on every block)",
                        field=field)
    raise UserError(f"{text!r} is not allowed; allowed: {one_of(POLICIES + ('every-K',))}", field=field)


def every_k_layers(graph, k: int) -> tuple[str, ...]:
    """The per-layer policies of ``every-K``: full on the K-th, 2K-th, ... transformer block (counted from 1
    in model order, as torchtitan's ``_apply_layer_sac`` counts the blocks it wraps), none elsewhere."""
    out, n = [], 0
    for layer in graph.layers:
        if layer.is_block:
            n += 1
            out.append("full" if n % k == 0 else "none")
        else:
            out.append("none")
    return tuple(out)


def first_blocks(graph, n: int, policy: str, stage_layers: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """The per-layer policies of ``policy`` on the first ``n`` transformer blocks of each (virtual) stage
    (``stage_layers``: layers per stage in order; None: the model as one), none elsewhere: Megatron-Core's
    --cpu-offloading-num-layers n (activation offload: TransformerEngine's cpu_offload.py offloads layers 0 to
    n - 1) and --recompute-method block --recompute-num-layers n (full recompute of the first n layers of each
    model chunk: transformer_block.py ``_checkpointed_forward``)."""
    out, start = [], 0
    for count in stage_layers or (len(graph.layers),):
        seen = 0
        for layer in graph.layers[start:start + count]:
            out.append(policy if layer.is_block and seen < n else "none")
            seen += layer.is_block
        start += count
    return tuple(out)



def policy_rank(name: str) -> int:
    """The order of ``POLICIES`` (simplest first), an ``every-K`` pattern ranked with full recompute."""
    return POLICIES.index("full" if every_k(name) else name)


def summary_policy(policies) -> str:
    """One policy naming a per-layer mix (ParallelConfig.recompute): the only one used, else the last of
    ``POLICIES`` among those used (the per-layer list says the rest)."""
    used = set(policies) - {"none"}
    return max(used, key=POLICIES.index) if used else "none"


def expand_recompute(config, policy: str, graph):
    """``config`` recomputing every block with ``policy``, or per layer in the ``every-K`` pattern."""
    k = every_k(policy)
    if k is None:
        return config.but(recompute=policy, recompute_layers=None)
    return config.but(recompute=f"every-{k}", recompute_layers=every_k_layers(graph, k))
