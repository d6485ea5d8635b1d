"""`meshplan run --dry-run`: a plan's job at its full world size, built in one process, trained never.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``: collectives that
return at once, no data) stands in for the world, and every module is built on the meta
device (shapes, no memory). The job is built for one representative rank of each role: every
pipeline rank, once as the first rank of its data-, context- and tensor-parallel groups and
once as the last (the last ranks hold the shorter shards where a dimension does not divide).
Two fake worlds are started (as rank 0 and as the last rank); in each, every pipeline rank's
stages are built with that world's data/context/tensor coordinates, and the rank's own
pipeline schedule is constructed.

For each representative it checks every parameter against the plan, computed here from the
plan alone (the TP style per module in ``tp_plan``, the ZeRO stage, the degrees): which mesh
dimension shards which tensor dimension, and the local shard's shape (torch.chunk's split, as
DTensor and FSDP2 cut); under ZeRO-1, the shape of the optimizer rows the rank owns. It then
counts the rank's parameter, gradient and optimizer bytes and puts them next to the plan's
prediction for its pipeline stage; under optimizer offload, what stays in host memory (FSDP2's
offloaded parameter shards, their gradients and optimizer states; ZeRO-1's offloaded states) is
counted apart. Under expert parallelism the representatives are also the first and last ranks of the
experts' ``efsdp`` and ``ep`` groups, whose routed experts are checked the same way. No step runs: activations and the buffers a step holds (gathered parameters,
autocast copies) are not built.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from planner.errors import UserError
from planner.plan import Plan

from .measure import offloaded_params, padded_shards
from .mesh import ParallelDims
from .models import canonical_name
from .lora import ADAPTER_LEAVES, adapter_shapes, finetune_of
from .parallelize import shard_model
from .pipeline import build_schedule, build_stage_model, stage_indices
from .support import check_stages, check_supported
from .zero1 import ShardedAdamW, expert_dim, expert_shard_dim

# The tensor dimension each TP style shards (torch.distributed.tensor.parallel: ColwiseParallel
# splits a linear's output features, RowwiseParallel its input features, and an embedding's rows);
# a rowwise linear's bias and SequenceParallel's norm parameters stay replicated.
# A LoRA adapter follows its base (executor/lora.py adapter_placements): a colwise base's B split along its
# output features, a rowwise base's A along its input features, the other factor whole.
TP_SHARD_DIM = {("colwise", "weight"): 0, ("colwise", "bias"): 0, ("rowwise", "weight"): 1,
                ("vocab", "weight"): 0, ("colwise_loss", "weight"): 0, ("colwise_loss", "bias"): 0,
                ("colwise", "lora_B"): 0, ("rowwise", "lora_A"): 1}
ADAMW_STATE_BYTES_PER_ELEMENT = 8       # exp_avg and exp_avg_sq in fp32 (torch.optim.AdamW)
ADAMW_STEP_BYTES = 4                    # one float32 step count per parameter tensor
# a rank's built gradients or optimizer states above the plan's by more than this share (and 64 KiB: the step counts
# and a tiny model's rounding) mean the plan underestimates what the rank holds: the dry run fails
STATE_TOLERANCE = 0.05
STATE_SLACK_BYTES = 64 * 1024


@dataclass(kw_only=True)
class RankReport:
    """What one representative rank holds, against the plan."""

    rank: int
    pp_rank: int
    coordinates: dict[str, int]          # its place in the dp_cp and tp groups
    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    host_bytes: int = 0                  # model states optimizer offload keeps in host memory
    predicted: dict = field(default_factory=dict)     # the plan's bytes for its pipeline stage
    problems: list[str] = field(default_factory=list)

    def over_plan(self) -> list[str]:
        """The gradient and optimizer bytes this rank holds beyond the plan's (``STATE_TOLERANCE``): the plan would
        put more on the GPU than it says. Parameters are not compared: the plan's include the working copies a
        step holds, which a dry run does not build."""
        out = []
        for key, got in (("grads", self.grads_bytes), ("optimizer", self.optimizer_bytes)):
            want = self.predicted.get(key) or 0
            if got > (1 + STATE_TOLERANCE) * want + STATE_SLACK_BYTES:
                share = f" ({100 * (got / want - 1):+.0f}%)" if want else ""
                out.append(f"{key}: {got} B built against {want} B predicted{share}")
        return out

    def to_json(self) -> dict:
        return {"rank": self.rank, "pp_rank": self.pp_rank, "coordinates": self.coordinates,
                "params": self.params_bytes, "grads": self.grads_bytes, "optimizer": self.optimizer_bytes,
                "host": self.host_bytes,
                "predicted": {k: self.predicted.get(k) for k in ("params", "grads", "optimizer")},
                "problems": self.problems, "over_plan": self.over_plan()}


def _chunk(size: int, parts: int, index: int) -> int:
    """torch.chunk's length of piece ``index`` of ``size`` cut into ``parts`` (DTensor's Shard)."""
    piece = math.ceil(size / parts)
    return max(0, min(piece, size - piece * index))


def is_expert_param(name: str, plan: Plan) -> bool:
    """Whether ``name`` is a MoE block's routed experts' weight (executor/moe.py: ``layers.{i}.mlp.gate_proj``,
    ``up_proj``, ``down_proj``, each (E, out, in))."""
    parts = name.split(".")
    return (plan.spec is not None and len(parts) == 5 and parts[0] == "layers" and parts[2] == "mlp"
            and parts[3] in ("gate_proj", "up_proj", "down_proj") and plan.spec.is_moe_block(int(parts[1])))


def expected_expert_shards(shape: torch.Size, plan: Plan, dims: ParallelDims,
                           coords: dict[str, int]) -> tuple[dict[str, int], tuple[int, ...]]:
    """Under expert parallelism a routed experts' weight (E, out, in): dim 0 over ``ep`` (rank r holds
    experts [r E/ep, (r+1) E/ep)), then ZeRO-2/3 over ``efsdp`` along ``expert_dim`` of the local stack
    (executor/parallelize.py ``apply_expert_dp``)."""
    local = list(shape)
    local[0] = _chunk(shape[0], dims.ep, coords["ep"])
    sharded = {"ep": 0}
    if plan.config.zero >= 2:
        dim = expert_dim(local, dims.efsdp)
        sharded["efsdp"] = dim
        local[dim] = _chunk(local[dim], dims.efsdp, coords["efsdp"])
    return sharded, tuple(local)


def expected_shards(name: str, shape: torch.Size, plan: Plan, dims: ParallelDims,
                    coords: dict[str, int]) -> tuple[dict[str, int], tuple[int, ...]]:
    """({mesh dimension: tensor dimension it shards}, local shape) of parameter ``name`` under the
    plan: its TP style's dimension over ``tp``, then ZeRO-2/3's dim 0 over ``dp_cp`` (a stack of routed experts:
    ``expert_dim``, executor/parallelize.py ``apply_fsdp``); a routed experts' weight under expert parallelism
    ``expected_expert_shards``'."""
    if dims.ep > 1 and is_expert_param(name, plan):
        return expected_expert_shards(shape, plan, dims, coords)
    module, _, leaf = name.rpartition(".")
    local = list(shape)
    sharded: dict[str, int] = {}
    tp_dim = TP_SHARD_DIM.get((plan.tp_plan.get(module), leaf)) if dims.tp > 1 else None
    if leaf == "sinks" and dims.tp > 1 and plan.tp_plan.get(f"{module.rpartition('.')[0]}.q_proj") == "colwise":
        tp_dim = 0      # GPT-OSS's sinks, one per head: split with the heads (executor/parallelize.py apply_tp)
    if tp_dim is not None:
        sharded["tp"] = tp_dim
        local[tp_dim] = _chunk(local[tp_dim], dims.tp, coords["tp"])
    if plan.config.zero >= 2:
        dim = expert_dim(local, dims.dp * dims.cp) if is_expert_param(name, plan) else 0
        sharded["dp_cp"] = dim
        local[dim] = _chunk(local[dim], dims.dp * dims.cp, coords["dp_cp"])
    return sharded, tuple(local)


def built_shards(param: torch.Tensor) -> tuple[dict[str, int], tuple[int, ...]]:
    """({mesh dimension: tensor dimension it shards}, local shape) of a built parameter."""
    if not isinstance(param, DTensor):
        return {}, tuple(param.shape)
    names = param.device_mesh.mesh_dim_names
    sharded = {names[i]: p.dim for i, p in enumerate(param.placements) if isinstance(p, (Shard, _StridedShard))}
    return sharded, tuple(param.to_local().shape)


def _full_shape(name: str, full_shapes: dict[str, torch.Size], plan: Plan) -> torch.Size:
    """The whole shape of parameter ``name``: the reference model's, or for a LoRA adapter, which the reference
    model has not, A (r, in) and B (out, r) of its base linear's weight (out, in) (executor/lora.py)."""
    module, _, leaf = name.rpartition(".")
    if name in full_shapes or leaf not in ADAPTER_LEAVES:
        return full_shapes[name]
    out, inp = full_shapes[f"{module}.weight"]
    return torch.Size(adapter_shapes(out, inp, finetune_of(plan).rank)[leaf])


def _check_params(model: nn.Module, plan: Plan, dims: ParallelDims, coords: dict[str, int],
                  full_shapes: dict[str, torch.Size]) -> list[str]:
    problems = []
    for raw, param in model.named_parameters():
        name = canonical_name(raw)
        want = expected_shards(name, _full_shape(name, full_shapes, plan), plan, dims, coords)
        got = built_shards(param)
        if got != want:
            problems.append(f"{name}: sharded {got[0]} to {list(got[1])}, the plan says {want[0]} to {list(want[1])}")
    return problems


def _check_zero1(optimizer: ShardedAdamW, coords: dict[str, int], n: int, efsdp: int, plan: Plan) -> list[str]:
    """The AdamW rows each ZeRO-1 rank owns: its chunk of the local tensor's rows over the ``n``
    dp_cp ranks, a split expert's over the ``efsdp`` ranks (a stack of routed experts' along ``expert_dim``)."""
    problems = []
    for s in optimizer.shards:
        local = s.param.to_local() if isinstance(s.param, DTensor) else s.param
        experts = optimizer.replicas_of(s.param).mesh is not optimizer.dp_mesh
        where, among = (coords["efsdp"], efsdp) if experts else (coords["dp_cp"], n)
        dim = expert_shard_dim(s.param, among) if experts or is_expert_param(s.name, plan) else 0
        rows = _chunk(local.shape[dim] if local.dim() else 1, among, where)
        got = optimizer.state[s.param]["exp_avg"].shape
        if got[0] != rows or s.dim != dim:
            problems.append(f"{s.name}: ZeRO-1 owns {got[0]} rows of {local.shape[s.dim]} along dim {s.dim}, "
                            f"expected {rows} along dim {dim}")
    return problems


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _unsharded_over_dp_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p`` gathered over the data-parallel mesh dimensions but still split by TP (and a
    routed experts' weight by EP): what a pipeline's deferred FSDP gradient holds (planner/runtimes.py
    pp_defers_sharded_dp_sync)."""
    if not isinstance(p, DTensor):
        return _local_bytes(p)
    numel = p.numel()
    for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
        if name in ("tp", "ep") and placement.is_shard():
            numel = -(-numel // p.device_mesh.size(p.device_mesh.mesh_dim_names.index(name)))
    return numel * p.element_size()


def _state_bytes(model: nn.Module, optimizer, deferred: bool = False) -> tuple[dict[str, int], dict[str, int]]:
    """({category: bytes on the device}, {category: bytes in host memory}) of the parameters, their
    gradients (fp32, shaped as the shard, FSDP2's padded as it allocates them: ``padded_shards``; ``deferred``:
    gathered over the data-parallel ranks, as a pipeline accumulates them under FSDP before its one
    reduce-scatter, on the device also where the shards are offloaded) and the states the optimizer holds after
    its first step:
    ZeRO-1's (built now, on meta), or AdamW's two fp32 moments of every local parameter and its step
    count; the frozen parameters' alone. In host memory: FSDP2's offloaded parameters with their gradients and
    states, and an offloaded ZeRO-1 optimizer's states (executor/measure.py tells them apart the same way)."""
    device, host = dict.fromkeys(("params", "grads", "optimizer"), 0), dict.fromkeys(("params", "grads", "optimizer"), 0)
    offloaded, padded = offloaded_params([model]), padded_shards([model])
    for p in model.parameters():
        where = host if id(p) in offloaded else device
        # FSDP2's shard and reduced gradient as allocated, padded to the first rank's; AdamW's moments as the shard
        held = padded[id(p)] * p.element_size() if id(p) in padded else _local_bytes(p)
        where["params"] += held
        if not p.requires_grad:     # frozen (a LoRA run's base): no gradient, no optimizer state
            continue
        if deferred:       # the unsharded accumulator on the device; an offloaded shard's reduced copy on the host
            device["grads"] += _unsharded_over_dp_bytes(p)
            host["grads"] += held if where is host else 0
        else:
            where["grads"] += held
        if not isinstance(optimizer, ShardedAdamW):
            where["optimizer"] += _local_bytes(p) // p.element_size() * ADAMW_STATE_BYTES_PER_ELEMENT + ADAMW_STEP_BYTES
    if isinstance(optimizer, ShardedAdamW):
        where = host if optimizer.offload else device
        where["optimizer"] += sum(_local_bytes(v) for st in optimizer.state.values() for v in st.values())
    return device, host


def _coordinates(mesh, dp_cp_mesh, expert_mesh=None) -> dict[str, int]:
    coords = {"dp_cp": dp_cp_mesh.get_local_rank(), "tp": mesh["tp"].get_local_rank()}
    if expert_mesh is not None:
        coords.update(efsdp=expert_mesh["efsdp"].get_local_rank(), ep=expert_mesh["ep"].get_local_rank())
    return coords


def _build_rank(plan: Plan, dims: ParallelDims, meshes, pp_rank: int, own: bool) -> RankReport:
    """Every stage of pipeline rank ``pp_rank`` with this fake world's other coordinates; its
    schedule too where ``own`` (the world's own pipeline rank)."""
    from .train import make_optimizer
    mesh, _, dp_cp_mesh, expert_mesh = meshes
    c, spec = plan.config, plan.spec
    coords = _coordinates(mesh, dp_cp_mesh, expert_mesh)
    where = list(mesh.get_coordinate())
    where[0] = pp_rank                           # the same place in another pipeline stage
    report = RankReport(rank=int(mesh.mesh[tuple(where)]), pp_rank=pp_rank, coordinates=coords,
                        predicted=plan.estimate.memory_per_stage[pp_rank].to_json())
    mine = stage_indices(len(plan.stages), c.pp, pp_rank, c.schedule)
    parts = []
    for j in mine:
        part = build_stage_model(spec, plan.stages[j])
        full_shapes = {canonical_name(n): p.shape for n, p in part.named_parameters()}
        shard_model(part, plan, dims, mesh, dp_cp_mesh, "meta", expert_mesh, finetune_of(plan))
        report.problems += _check_params(part, plan, dims, coords, full_shapes)
        optimizer = make_optimizer(part, lr=1e-3, zero=c.zero, dp_mesh=dp_cp_mesh, optimizer_offload=c.optimizer_offload,
                                   expert_mesh=expert_mesh)
        if isinstance(optimizer, ShardedAdamW):
            report.problems += _check_zero1(optimizer, coords, dp_cp_mesh.size(), dims.efsdp, plan)
        device, host = _state_bytes(part, optimizer, deferred=c.pp > 1 and c.zero >= 2)
        report.params_bytes += device["params"]
        report.grads_bytes += device["grads"]
        report.optimizer_bytes += device["optimizer"]
        report.host_bytes += sum(host.values())
        parts.append(part)
    if own and c.pp > 1:
        build_schedule(list(zip(mine, parts)), num_stages=len(plan.stages), pp_mesh=mesh["pp"], schedule=c.schedule,
                       num_microbatches=c.num_microbatches, loss_fn=lambda out, target: out.sum(),
                       device=torch.device("meta"))
    return report


def _fake_world(plan: Plan, dims: ParallelDims, rank: int) -> list[RankReport]:
    """Start a fake world as ``rank``, build every pipeline rank's stages in it, end it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        meshes = dims.build_mesh("cpu")
        meshes = (*meshes, dims.build_expert_mesh(meshes[0]))
        own = meshes[0]["pp"].get_local_rank()
        return [_build_rank(plan, dims, meshes, r, own=r == own) for r in range(plan.config.pp)]
    finally:
        dist.destroy_process_group()


def dry_run(plan: Plan, device_kind: str = "cuda") -> tuple[list[RankReport], float]:
    """(a report per representative rank, seconds it took). Raises UserError for a plan the
    executor does not run on ``device_kind`` (the plan's GPUs: "cuda")."""
    if dist.is_initialized():
        raise UserError("a dry run starts its own fake process group; run it outside a torch.distributed job",
                        field="--dry-run")
    check_supported(plan.config, plan.spec, device_kind, plan.source, plan.workload.fp8, plan.workload.compile,
                    finetune=plan.workload.finetune)
    check_stages(plan.stages, plan.spec, plan.source)
    t0 = time.perf_counter()
    dims = ParallelDims.from_config(plan.config, plan.world_size)
    reports = _fake_world(plan, dims, 0)
    if plan.world_size > 1:
        reports += _fake_world(plan, dims, plan.world_size - 1)
    return reports, time.perf_counter() - t0


def format_dry_run(plan: Plan, reports: list[RankReport], seconds: float) -> str:
    """The table `meshplan run --dry-run` prints: bytes per representative rank against the plan."""
    c = plan.config
    experts = f", ep {c.ep}" if c.ep > 1 else ""
    lines = [f"dry run of {plan.source}: {plan.world_size} ranks (dp {c.dp} x tp {c.tp} x pp {c.pp} x cp {c.cp}{experts}, "
             f"ZeRO-{c.zero}), {len(reports)} representative ranks built on the meta device in {seconds:.1f} s",
             f"{'rank':>6} {'stage':>5} {'dp_cp':>5} {'tp':>3}  {'category':<10} {'predicted B':>16} {'built B':>16} "
             f"{'error':>7}"]
    for r in reports:
        rows = [("params", r.params_bytes), ("grads", r.grads_bytes), ("optimizer", r.optimizer_bytes)]
        for key, got in rows + ([("(host)", r.host_bytes)] if r.host_bytes else []):     # offloaded states
            want = r.predicted.get(key)
            error = f"{100 * (got / want - 1):+6.1f}%" if want else "     -"
            lines.append(f"{r.rank:>6} {r.pp_rank:>5} {r.coordinates['dp_cp']:>5} {r.coordinates['tp']:>3}  "
                         f"{key:<10} {want if want is not None else '-':>16} {got:>16} {error:>7}")
    problems = [p for r in reports for p in r.problems]
    lines.append("placements and shard shapes: " + ("every parameter as the plan says" if not problems else
                                                    f"{len(problems)} differ from the plan:"))
    lines += [f"  rank {r.rank} stage {r.pp_rank}: {p}" for r in reports for p in r.problems[:20]]
    over = [(r, p) for r in reports for p in r.over_plan()]
    lines.append("model states: " + ("no rank holds more than the plan predicts" if not over else
                                     f"{len(over)} above the plan's (more than {100 * STATE_TOLERANCE:.0f}%):"))
    lines += [f"  rank {r.rank} stage {r.pp_rank}: {p}" for r, p in over]
    lines.append("predicted params include the working copies a step holds (autocast's 16-bit copy, ZeRO-2's "
                 "gathered parameters), which a dry run does not build")
    if plan.workload.finetune == "qlora":
        lines.append("QLoRA's base is quantized to NF4 once its weights are real (executor/qlora.py): a dry run builds "
                     "it at the training dtype, about 4x the predicted NF4 bytes")
    return "\n".join(lines) + "\n"
