"""What a plan costs: memory per GPU by category, where the step's time goes, the Estimate of one
config, and a Candidate (a config with its estimate). Plain values with ``to_json`` and ``from_json``:
the cost model (planner/cost/) makes them, the search ranks them, plan.json carries them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .config import ParallelConfig
from .errors import UserError


def _number(raw: dict, key: str, source: str, where: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"must be a number, got {value!r}", source=source, field=f"{where}.{key}")
    return float(value)


def _object(raw, source: str, where: str) -> dict:
    if not isinstance(raw, dict):
        raise UserError(f"must be a JSON object, got {raw!r}", source=source, field=where)
    return raw


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes on one GPU, by category."""

    params: float
    grads: float
    optimizer: float
    activations: float
    other: float                   # runtime reserve, communication and pipeline buffers
    reserve: float = 0.0           # of ``other``, the runtime's own reserve (the device profile's
                                   # reserved_bytes: CUDA context, allocator slack), which no
                                   # allocator counter (max_memory_allocated) sees
    grads_after_activations: bool = False   # the gradients only exist once the activations are freed
                                            # (grads_follow_activations): the peak holds the larger

    @property
    def total(self) -> float:
        if self.grads_after_activations:
            return self.params + self.optimizer + self.other + max(self.grads, self.activations)
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def to_json(self) -> dict:
        out = {k: int(round(v)) for k, v in asdict(self).items() if k != "grads_after_activations"}
        out["total"] = int(round(self.total))
        if self.grads_after_activations:    # the peak holds the larger of the two, not both
            out["grads_after_activations"] = True
        return out

    @classmethod
    def from_json(cls, raw, source: str = "plan.json", where: str = "memory") -> "Memory":
        raw = _object(raw, source, where)
        values = {k: _number(raw, k, source, where) for k in ("params", "grads", "optimizer", "activations", "other")}
        return cls(**values, reserve=_number(raw, "reserve", source, where) if "reserve" in raw else 0.0,
                   grads_after_activations=raw.get("grads_after_activations") is True)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Where one step's time goes on the critical path (seconds)."""

    compute: float                 # forward and backward kernels of the slowest stage, all micro-batches
    recompute: float               # forward work redone before backward
    tp_comm: float                 # exposed tensor/sequence-parallel collectives
    cp_comm: float                 # exposed context-parallel exchange
    pp_comm: float                 # pipeline sends and receives
    bubble: float                  # pipeline fill and drain
    dp_comm: float                 # exposed data-parallel / ZeRO communication
    optimizer: float               # optimizer step (and offload transfers)
    ep_comm: float = 0.0           # expert parallelism's all-to-alls (token dispatch and combine)
    host_wait: float = 0.0         # the GPU idle while the host issues the step (planner.cost.host)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm
                + self.bubble + self.dp_comm + self.optimizer + self.host_wait)

    @classmethod
    def from_json(cls, raw, source: str = "plan.json", where: str = "time_breakdown_s") -> "StepTime":
        raw = _object(raw, source, where)
        # ep_comm, host_wait: absent from plan.json files written before them (0 there)
        return cls(**{f.name: _number(raw, f.name, source, where) for f in fields(cls)
                      if f.name in raw or f.name not in ("ep_comm", "host_wait")})


@dataclass(frozen=True, kw_only=True)
class Estimate:
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float    # model FLOPs (no recompute) per second per GPU
    mfu: float                     # model FLOPs utilisation against the dense peak
    hardware_tflops_per_gpu: float # matmul FLOPs actually executed (recompute included)
    memory: Memory                 # the most loaded GPU
    memory_per_stage: tuple[Memory, ...]
    time: StepTime
    capacity_bytes: float          # the device's memory
    usable_bytes: float            # the most the peak may be: the capacity less the workload's headroom
    host_bytes_per_node: float     # offloaded model states and activations per node
    host_capacity_bytes: float
    fits: bool
    nvme_bytes_per_node: float = 0.0   # offloaded model states on the node's NVMe (ParallelConfig.nvme_offload)
    nvme_capacity_bytes: float = 0.0

    @property
    def peak_stage(self) -> int:
        totals = [m.total for m in self.memory_per_stage]
        return totals.index(max(totals))

    def to_json(self) -> dict:
        return {
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "memory_per_gpu_bytes": self.memory.to_json(), "fits": self.fits,
            "capacity_bytes": int(self.capacity_bytes), "usable_bytes": int(self.usable_bytes),
            "host_bytes_per_node": int(round(self.host_bytes_per_node)),
            "host_capacity_bytes": int(self.host_capacity_bytes),
            "time_breakdown_s": asdict(self.time),
            "memory_per_stage_bytes": [m.to_json() for m in self.memory_per_stage],
            # said only where states are on NVMe: earlier plan.json files read the same
            **({"nvme_bytes_per_node": int(round(self.nvme_bytes_per_node)),
                "nvme_capacity_bytes": int(self.nvme_capacity_bytes)} if self.nvme_bytes_per_node else {}),
        }

    @classmethod
    def from_json(cls, raw, source: str = "plan.json", where: str = "estimate") -> "Estimate":
        """Read what ``to_json`` wrote; every field checked, errors name the file and the field (files
        written before the host fields existed read them as zero)."""
        raw = _object(raw, source, where)
        stages = raw.get("memory_per_stage_bytes")
        if not isinstance(stages, list) or not stages:
            raise UserError(f"must be a non-empty list of objects (bytes by category), got {stages!r}",
                            source=source, field=f"{where}.memory_per_stage_bytes")
        if not isinstance(raw.get("fits"), bool):
            raise UserError(f"must be true or false, got {raw.get('fits')!r}", source=source, field=f"{where}.fits")
        numbers = {k: _number(raw, k, source, where) for k in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu",
                                                               "mfu", "hardware_tflops_per_gpu", "capacity_bytes")}
        host = {k: _number(raw, k, source, where) if k in raw else 0.0
                for k in ("host_bytes_per_node", "host_capacity_bytes", "nvme_bytes_per_node", "nvme_capacity_bytes")}
        # files written before the headroom existed: the whole capacity was usable
        usable = _number(raw, "usable_bytes", source, where) if "usable_bytes" in raw else numbers["capacity_bytes"]
        return cls(**numbers, **host, usable_bytes=usable, fits=raw["fits"],
                   memory=Memory.from_json(raw.get("memory_per_gpu_bytes"), source, f"{where}.memory_per_gpu_bytes"),
                   memory_per_stage=tuple(Memory.from_json(m, source, f"{where}.memory_per_stage_bytes[{i}]")
                                          for i, m in enumerate(stages)),
                   time=StepTime.from_json(raw.get("time_breakdown_s"), source, f"{where}.time_breakdown_s"))


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A config and what it costs."""

    config: ParallelConfig
    estimate: Estimate
