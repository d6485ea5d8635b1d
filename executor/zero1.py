"""ZeRO-1 (Rajbhandari et al. 2020, Sec 5.1, P_os): AdamW's states sharded over the data-parallel
replicas, for plain and DTensor (tensor-parallel) parameters alike, under any pipeline schedule.

Every replica keeps its whole parameters and accumulates whole gradients over the step's
micro-batches (no reduction in backward); ``ShardedAdamW.step`` then

1. reduce-scatters the gradients over the replicas, averaging them: each replica keeps the
   rows it owns of each parameter (FSDP2's dim-0 chunks of the local tensor: ``ceil(rows / n)``
   rows each, the last ones shorter or empty);
2. runs AdamW (torch's own single-tensor or fused kernel) on its rows: 8 bytes of state per
   owned parameter;
3. all-gathers the updated rows, so every replica holds the whole parameters again.

Collectives run in buckets of about ``BUCKET_BYTES`` (DDP's default ``bucket_cap_mb=25``).

With ``offload`` (plan.json ``optimizer_offload: true``; ZeRO-Offload, Ren et al. 2021, Sec 4) the
states live in host memory and step 2 runs there: the owned gradient rows are copied to the
host, AdamW updates a host copy of the owned parameter rows, and the updated rows are copied
back into the parameters before the all-gather. The parameters are fp32 on the device (the
torch runtime's layout: planner/runtimes.py), so they are the master weights and no other
master copy is kept; the host holds 8 bytes of state per owned parameter, and one bucket's
rows at a time.

The states are exposed as DTensors over the replicas (and the parameter's own TP mesh) with
the placements FSDP2 gives a sharded parameter, so a DCP checkpoint of a ZeRO-1 run loads
under any other plan and the other way round (executor/checkpoint.py).

Under expert parallelism the routed experts' weights are a second group of parameters, whose
replicas are the ``efsdp`` ranks holding the same experts: their gradients are reduce-scattered
over those ranks and divided by all the dp x cp ranks (an expert's gradient already sums the
tokens of its ep group), as FSDP2 does for them (executor/parallelize.py ``apply_expert_dp``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.adam import adam

BUCKET_BYTES = 25 * 2**20       # torch DDP's bucket_cap_mb default
# ADAM_CPU_NOTE: an offloaded step runs torch's fused CPU AdamW (torch.optim.adam.adam(fused=True) on
# CPU tensors, torch >= 2.4): one pass over the states, as planner/cost/step.py's host step assumes.
# The single-tensor loop takes ten times longer: 21.4 ns against 2.1 ns per parameter, 4M fp32
# parameters, torch 2.13 on this project's 2-core CPU machine (timed with time.perf_counter, 10 steps).
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Shard:
    """One parameter and the rows of its local tensor this replica owns."""

    name: str                   # the parameter's path in the model (checkpoint key)
    param: nn.Parameter
    chunk_rows: int             # rows per replica (the last replicas may own fewer)
    start_row: int
    rows: int                   # rows this replica owns (0 or more)
    row_numel: int              # elements per row
    dim: int = 0                # the dimension whose "rows" are chunked (1: an expert weight with fewer
                                # local experts than replicas, as FSDP2 shards it: parallelize.apply_expert_dp)

    @property
    def numel(self) -> int:      # elements of a full chunk (padded), in the collectives' buffers
        return self.chunk_rows * self.row_numel

    def rows_first(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the local tensor's shape, or its gradient's) with the chunked dimension first (a view)."""
        return t.movedim(self.dim, 0) if self.dim else t

    def owned(self) -> torch.Tensor:
        """View of this replica's rows of the parameter's local tensor. (rows, ...)"""
        return self.rows_first(_local(self.param).detach()).narrow(0, self.start_row, self.rows)


def _shard_of(name: str, param: nn.Parameter, n: int, rank: int, dim: int = 0) -> _Shard:
    local = _local(param)
    total_rows = local.shape[dim] if local.dim() else 1
    chunk = math.ceil(total_rows / n)
    start = min(chunk * rank, total_rows)
    return _Shard(name=name, param=param, chunk_rows=chunk, start_row=start,
                  rows=max(0, min(chunk, total_rows - start)), row_numel=local.numel() // max(total_rows, 1), dim=dim)


def _buckets(shards: list[_Shard], n: int, cap_bytes: int) -> list[list[_Shard]]:
    out: list[list[_Shard]] = [[]]
    size = 0
    for s in shards:
        nbytes = n * s.numel * _local(s.param).element_size()
        if out[-1] and size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(s)
        size += nbytes
    return out


@dataclass
class _Replicas:
    """A group of parameters and the replicas its states are sharded over."""

    mesh: DeviceMesh
    divide: float               # what the summed gradient is divided by (the replicas; for experts dp x cp)
    shards: list[_Shard]
    buckets: list[list[_Shard]]

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def n(self) -> int:
        return self.mesh.size()


def expert_dim(shape, n: int) -> int:
    """The dimension a stack of routed experts ((e, out, in) weights, (e, out) biases: a rank's local experts) is
    sharded along over ``n`` data-parallel ranks: the experts where ``n`` divides them, else the output features
    where it divides those, else the experts unevenly (FSDP2 pads the last ranks' shards along dim 0, and refuses an
    uneven shard along any other; these chunks leave the last ranks short): each rank holds ceil(e / n) experts.
    On one dimension FSDP2 (executor/parallelize.py) and ZeRO-1 agree; planner/cost/step.py
    ``routed_state_shard`` prices what each rank then holds."""
    if shape[0] % n == 0:
        return 0
    return 1 if len(shape) > 1 and shape[1] % n == 0 else 0


def expert_shard_dim(param: nn.Parameter, n: int) -> int:
    """``expert_dim`` of a routed experts' parameter's local tensor over ``n`` replicas."""
    return expert_dim(_local(param).shape, n)


def _replicas(named_params: list[tuple[str, nn.Parameter]], mesh: DeviceMesh, divide: float,
              bucket_bytes: int, stacks: frozenset[int] = frozenset()) -> _Replicas:
    """``stacks``: ids of routed experts' parameters among ``named_params`` (sharded along ``expert_dim``)."""
    n, rank = mesh.size(), mesh.get_local_rank()
    shards = [_shard_of(name, p, n, rank, expert_shard_dim(p, n) if id(p) in stacks else 0)
              for name, p in named_params]
    return _Replicas(mesh=mesh, divide=divide, shards=shards, buckets=_buckets(shards, n, bucket_bytes))


class ShardedAdamW:
    """AdamW over ``named_params`` with its states sharded over ``dp_mesh`` (see the module
    docstring); ``expert_params`` (expert parallelism) over ``expert_mesh``, their gradients divided by
    ``dp_mesh``'s size; ``stacks``: ids of routed experts' parameters without expert parallelism, among
    ``named_params`` (sharded along ``expert_dim``, as the split experts are). ``step`` and ``zero_grad`` as
    torch's optimizers; ``state`` maps each parameter to its owned states (what executor/measure.py counts)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], *, lr: float, dp_mesh: DeviceMesh,
                 bucket_bytes: int = BUCKET_BYTES, offload: bool = False,
                 expert_params: list[tuple[str, nn.Parameter]] = (), expert_mesh: DeviceMesh | None = None,
                 stacks: frozenset[int] = frozenset()):
        self.dp_mesh = dp_mesh
        self.offload = offload      # states in host memory, AdamW stepped there (module docstring)
        self.replicas = [_replicas(named_params, dp_mesh, dp_mesh.size(), bucket_bytes, stacks)]
        if expert_params:
            self.replicas.append(_replicas(list(expert_params), expert_mesh, dp_mesh.size(), bucket_bytes,
                                           frozenset(id(p) for _, p in expert_params)))
        self.shards = [s for r in self.replicas for s in r.shards]
        self._replicas_of = {id(s.param): r for r in self.replicas for s in r.shards}
        # one fused kernel on CUDA (as executor/train.py's make_optimizer), whose step counts live there too,
        # and on the host when offloaded (ADAM_CPU_NOTE)
        self.fused = bool(self.shards) and (_local(self.shards[0].param).device.type == "cuda" or offload)
        # torch.optim.AdamW's hyperparameters and their defaults, as its param_groups hold them
        # (so checkpoints carry the same keys as those of the other plans' optimizers)
        template = torch.optim.AdamW([torch.zeros(1)], lr=lr, foreach=False, fused=self.fused or None)
        self.hyper = {k: v for k, v in template.param_groups[0].items() if k != "params"}
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for s in self.shards:
            owned = s.owned()
            where = "cpu" if offload and not owned.is_meta else owned.device     # a dry run's stay on meta
            step = torch.zeros((), dtype=torch.float32, device=where if self.fused else "cpu")
            self.state[s.param] = {"step": step, "exp_avg": torch.zeros_like(owned, device=where),
                                   "exp_avg_sq": torch.zeros_like(owned, device=where)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards:
            s.param.grad = None

    def replicas_of(self, param: nn.Parameter) -> _Replicas:
        """The replicas ``param``'s states are sharded over, and its gradient's divisor."""
        return self._replicas_of[id(param)]

    @torch.no_grad()
    def step(self) -> None:
        for r in self.replicas:
            for bucket in r.buckets:
                grads = self._reduce_scatter(r, bucket)
                self._adamw(bucket, grads)
                self._all_gather(r, bucket)

    def _local_grad(self, s: _Shard) -> torch.Tensor:
        grad = s.param.grad
        if grad is None:
            return torch.zeros_like(_local(s.param))
        if isinstance(grad, DTensor) and grad.placements != s.param.placements:
            grad = grad.redistribute(placements=s.param.placements)
        return _local(grad)

    @staticmethod
    def _padded_rows(s: _Shard, local: torch.Tensor, n: int) -> torch.Tensor:
        """``local`` (rows, ...) padded to n chunks, as (n, chunk elements)."""
        flat = local.reshape(-1)
        want = n * s.numel
        if flat.numel() < want:
            flat = torch.cat([flat, flat.new_zeros(want - flat.numel())])
        return flat.view(n, s.numel)

    def _reduce_scatter(self, r: _Replicas, bucket: list[_Shard]) -> list[torch.Tensor]:
        """The averaged gradient rows this replica owns, one (rows, ...) tensor per parameter."""
        width = sum(s.numel for s in bucket)
        first = self._local_grad(bucket[0])
        send = first.new_empty(r.n, width)                  # (replica, its chunks of every parameter)
        offset = 0
        for s in bucket:
            send[:, offset:offset + s.numel] = self._padded_rows(s, s.rows_first(self._local_grad(s)), r.n)
            offset += s.numel
        mine = first.new_empty(width)
        dist.reduce_scatter_single(mine, send.view(-1), group=r.group)
        mine /= r.divide
        out, offset = [], 0
        for s in bucket:
            owned_shape = (s.rows, *s.rows_first(_local(s.param)).shape[1:])
            out.append(mine[offset:offset + s.rows * s.row_numel].view(owned_shape))
            offset += s.numel
        return out

    def _adamw(self, bucket: list[_Shard], grads: list[torch.Tensor]) -> None:
        """torch's AdamW update (``torch.optim.adam.adam`` with decoupled weight decay) on the owned rows;
        offloaded, on host copies of them (copied back after the update)."""
        live = [(s, g) for s, g in zip(bucket, grads) if s.rows]
        if not live:
            return
        states = [self.state[s.param] for s, _ in live]
        owned = [s.owned() for s, _ in live]
        grads = [g for _, g in live]
        if self.offload:        # copy=True: a real host copy even where the device is the host (CPU runs)
            params = [p.to("cpu", copy=True) for p in owned]
            grads = [g.to("cpu", copy=True) for g in grads]
        else:
            params = owned
        adam(params, grads, [st["exp_avg"] for st in states],
             [st["exp_avg_sq"] for st in states], [], [st["step"] for st in states], foreach=False,
             fused=self.fused or None, decoupled_weight_decay=True, amsgrad=False, beta1=self.hyper["betas"][0],
             beta2=self.hyper["betas"][1], lr=self.hyper["lr"], weight_decay=self.hyper["weight_decay"],
             eps=self.hyper["eps"], maximize=False)
        if self.offload:
            for device_rows, host_rows in zip(owned, params):
                device_rows.copy_(host_rows)

    def _all_gather(self, r: _Replicas, bucket: list[_Shard]) -> None:
        """Every replica's updated rows into every replica's parameters."""
        width = sum(s.numel for s in bucket)
        first = _local(bucket[0].param)
        mine = first.new_zeros(width)
        offset = 0
        for s in bucket:
            mine[offset:offset + s.rows * s.row_numel] = s.owned().reshape(-1)
            offset += s.numel
        everyone = first.new_empty(r.n, width)
        dist.all_gather_single(everyone.view(-1), mine, group=r.group)
        offset = 0
        for s in bucket:
            local = s.rows_first(_local(s.param).detach())
            rows = everyone[:, offset:offset + s.numel].reshape(-1)[:local.numel()]
            local.copy_(rows.view(local.shape))
            offset += s.numel

    # -- checkpoints: the flattened keys of torch.distributed.checkpoint.state_dict -------------
    def _state_dtensor(self, s: _Shard, local: torch.Tensor) -> DTensor:
        """An owned state tensor as the DTensor of the whole parameter's shape: Shard(0) (an expert's
        ``_Shard.dim``) over the replicas, after the parameter's own TP (EP) placements (FSDP2's layout
        for a sharded DTensor)."""
        p, dp_mesh = s.param, self.replicas_of(s.param).mesh
        local = local.movedim(0, s.dim) if s.dim else local          # back in the parameter's layout
        if not isinstance(p, DTensor):
            return DTensor.from_local(local, dp_mesh, (Shard(s.dim),), run_check=False, shape=p.shape,
                                      stride=p.stride())
        split = math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if pl == Shard(s.dim))
        dp_placement = _StridedShard(s.dim, split_factor=split) if split > 1 else Shard(s.dim)
        mesh = DeviceMesh._concatenate([dp_mesh, p.device_mesh])
        return DTensor.from_local(local, mesh, (dp_placement, *p.placements), run_check=False, shape=p.shape,
                                  stride=p.stride())

    def flat_state_dict(self) -> dict:
        """{"state.NAME.step" | ".exp_avg" | ".exp_avg_sq": tensor, "param_groups.NAME.lr": lr, ...}."""
        out = {}
        for s in self.shards:
            st = self.state[s.param]
            out[f"state.{s.name}.step"] = st["step"]
            out[f"state.{s.name}.exp_avg"] = self._state_dtensor(s, st["exp_avg"])
            out[f"state.{s.name}.exp_avg_sq"] = self._state_dtensor(s, st["exp_avg_sq"])
            out.update({f"param_groups.{s.name}.{k}": v for k, v in self.hyper.items()})
        return out

    def load_flat_state_dict(self, flat: dict) -> None:
        """The inverse of ``flat_state_dict`` (after ``dcp.load`` filled its tensors)."""
        for s in self.shards:
            st = self.state[s.param]
            for key in STATE_KEYS:
                value = flat[f"state.{s.name}.{key}"]
                st[key].copy_(s.rows_first(_local(value)) if isinstance(value, DTensor) else value)
            for k in ("lr", "betas", "eps", "weight_decay"):
                self.hyper[k] = flat[f"param_groups.{s.name}.{k}"]
