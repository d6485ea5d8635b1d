"""The parallel degrees of a run and the named DeviceMesh they make.

Mesh dimensions, outermost first (torchtitan's ``ParallelDims`` order):
``pp`` (pipeline stages), ``dp_replicate`` (replicas that all-reduce gradients:
ZeRO-0/1), ``dp_shard`` (ranks FSDP shards over: ZeRO-2/3), ``cp`` (context
parallel), ``tp`` (tensor parallel, innermost so its ranks are neighbours).
Code fetches a dimension by name (``mesh["tp"]``), never by position.

Under expert parallelism (``ep`` > 1) the routed experts take a second mesh over the same ranks:
the ``dp_cp`` ranks unflattened into ``efsdp`` x ``ep`` (torchtitan's ``ParallelDims`` borrows the
experts' ranks the same way, ep innermost): an expert lives on one ``ep`` rank of each ``efsdp``
group, whose ranks hold the same experts and reduce (ZeRO-2/3: shard) their gradients.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from planner.config import ParallelConfig
from planner.errors import UserError

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def local_device():
    """This process's device: the GPU numbered LOCAL_RANK (made the current one), else the CPU."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_device_kind() -> str:
    """"cuda" where this machine has a GPU (what `meshplan run` launches on), else "cpu"."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_process_group(timeout_s: float) -> None:
    """Join the job's default process group (NCCL on GPUs, gloo otherwise); a collective waiting longer
    than ``timeout_s`` seconds for a peer raises."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=timeout_s))


def from_rank0(fn, *, what: str):
    """Collective: rank 0 computes ``fn()`` (a value ``broadcast_object_list`` can send); every rank returns
    it, or raises rank 0's error: a UserError with its exit code, anything else as a RuntimeError naming
    ``what`` rank 0 failed to do (rank 0 re-raises its own). No rank is left waiting."""
    import torch.distributed as dist
    box: list = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            box = [("value", fn())]
        except UserError as e:
            box = [("user-error", str(e), e.exit_code)]
        except Exception as e:      # a bug, or a module the tracer cannot follow: tell the others first
            failure = e
            box = [("crash", f"{type(e).__name__}: {e}", 1)]
    dist.broadcast_object_list(box, src=0)
    kind, *rest = box[0]
    if failure is not None:
        raise failure
    if kind == "value":
        return rest[0]
    if kind == "user-error":
        error = UserError(rest[0])
        error.exit_code = rest[1]
        raise error
    raise RuntimeError(f"rank 0 failed to {what}: {rest[0]}")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of each mesh dimension; their product is the world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int
    ep: int = 1             # expert parallel: routed experts split over ep of the dp x cp x tp ranks

    def __post_init__(self):
        for name in MESH_DIM_NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"must be a positive integer, got {value!r}", field=f"config.{name}")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise UserError(f"pp x dp x cp x tp = {self.pp} x {self.dp} x {self.cp} x {self.tp} = {product} but "
                            f"the job has {self.world_size} processes; launch with --nproc {product} or plan for "
                            f"{self.world_size} GPUs", field="config")
        if not isinstance(self.ep, int) or self.ep < 1 or (self.dp * self.cp * self.tp) % self.ep:
            raise UserError(f"ep {self.ep} must divide dp x cp x tp = {self.dp * self.cp * self.tp}", field="config.ep")

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int) -> "ParallelDims":
        """ZeRO-0/1 replicate over the data-parallel ranks; ZeRO-2/3 shard over them."""
        sharded = config.zero >= 2
        return cls(pp=config.pp, dp_replicate=1 if sharded else config.dp, dp_shard=config.dp if sharded else 1,
                   cp=config.cp, tp=config.tp, world_size=world_size, ep=config.ep)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks holding the same experts: dp x cp x tp / ep (torchtitan's expert region: the routed experts are
        not tensor parallel, each tp rank routes its own share of the sequence)."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIM_NAMES)

    def build_mesh(self, device_type: str):
        """(the world as a 5-D named mesh; ``dp`` = dp_replicate x dp_shard flattened: the ranks that
        split the batch; ``dp_cp`` = dp_replicate x dp_shard x cp flattened: the ranks that hold the
        same parameters but see different tokens, over which gradients are averaged and ZeRO
        shards, torchtitan's ``dp_shard_cp``)."""
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
        dp_cp = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp"), dp_cp

    def build_expert_mesh(self, mesh):
        """The experts' mesh (``efsdp``, ``ep``) of a pipeline stage's ranks: the data-parallel, context-parallel and
        tensor-parallel ranks of the world ``mesh`` (``build_mesh``'s) flattened and unflattened again, ep innermost
        (torchtitan's sparse mesh); None without expert parallelism. Built once per job (it creates process
        groups)."""
        if self.ep == 1:
            return None
        region = mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("experts")
        return region._unflatten(0, (self.efsdp, self.ep), ("efsdp", "ep"))
