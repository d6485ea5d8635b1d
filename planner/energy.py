"""Energy of a plan: its GPUs at the plan's modelled utilisation, and its nodes' hosts and network.

Each GPU draws its idle power plus the span up to its power limit (TDP) in proportion to the share of
the step its SMs run the model's kernels on the critical path, (compute + recompute) / step time
(planner/estimate.py StepTime): a linear power model between two datasheet-like points. Exposed
communication, the pipeline bubble and the optimizer step count at idle power. Each node adds its host
(CPUs, memory, NVSwitches, NICs, fans) and its share of the network fabric at a constant power; a job on part
of a node made of several hosts (``Cluster.host_share``: 2 of a GB200 NVL72 rack's 18 trays) the share its hosts
draw. Every number comes from the cluster profile's [power] table, which names its sources; the model itself is
not validated against measured power (no power measurements are recorded in benchmarks/results).
"""
from __future__ import annotations

from dataclasses import dataclass

J_PER_KWH = 3.6e6


@dataclass(frozen=True, kw_only=True)
class Energy:
    gpus: int
    nodes: int
    gpu_w: float                  # one GPU's mean draw over the step
    utilisation: float            # the share of the step its kernels run: where between idle and TDP it sits
    host_w: float                 # per node
    network_w: float              # per node
    step_s: float
    tokens_per_step: float
    source: str

    @property
    def watts(self) -> float:
        return self.gpus * self.gpu_w + self.nodes * (self.host_w + self.network_w)

    @property
    def kwh_per_step(self) -> float:
        return self.watts * self.step_s / J_PER_KWH

    @property
    def kwh_per_million_tokens(self) -> float:
        return self.kwh_per_step / self.tokens_per_step * 1e6

    def run_kwh(self, tokens: float) -> float:
        return self.kwh_per_million_tokens * tokens / 1e6

    def to_json(self, tokens: float | None = None) -> dict:
        out = {"gpus": self.gpus, "nodes": self.nodes, "gpu_w": self.gpu_w, "utilisation": self.utilisation,
               "host_w_per_node": self.host_w, "network_w_per_node": self.network_w, "watts": self.watts,
               "kwh_per_step": self.kwh_per_step, "kwh_per_million_tokens": self.kwh_per_million_tokens,
               "source": self.source}
        if tokens:
            out.update(tokens=tokens, run_kwh=self.run_kwh(tokens))
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "Energy":
        return cls(gpus=raw["gpus"], nodes=raw["nodes"], gpu_w=raw["gpu_w"], utilisation=raw["utilisation"],
                   host_w=raw["host_w_per_node"], network_w=raw["network_w_per_node"],
                   step_s=raw["kwh_per_step"] * J_PER_KWH / raw["watts"] if raw["watts"] else 0.0,
                   tokens_per_step=raw["kwh_per_step"] / raw["kwh_per_million_tokens"] * 1e6
                   if raw["kwh_per_million_tokens"] else 0.0, source=raw["source"])

    def line(self, tokens: float | None = None) -> str:
        hosts = (f", {self.nodes} node(s) at {(self.host_w + self.network_w) / 1e3:.2f} kW besides the GPUs"
                 if self.host_w + self.network_w else ", the GPUs only (the profile has no host power)")
        run = f"; {energy_words(self.run_kwh(tokens))} for {tokens:.3g} tokens" if tokens else ""
        return (f"{self.kwh_per_step:.3g} kWh per step, {self.kwh_per_million_tokens:.3g} kWh per million tokens"
                f"{run}: {self.gpus} GPUs at {self.gpu_w:.0f} W ({100 * self.utilisation:.0f}% of the step running "
                f"kernels){hosts}")


def energy_words(kwh: float) -> str:
    """kWh, MWh or GWh, whichever reads best."""
    for unit, scale in (("GWh", 1e6), ("MWh", 1e3)):
        if kwh >= scale:
            return f"{kwh / scale:.3g} {unit}"
    return f"{kwh:.3g} kWh"


def energy(estimate, cluster, workload) -> Energy | None:
    """The plan's energy (None where the cluster profile has no [power] table)."""
    power = cluster.power
    if power is None or estimate.step_time_s <= 0:
        return None
    t = estimate.time
    busy = min(1.0, max(0.0, (t.compute + t.recompute) / estimate.step_time_s))
    gpu_w = power.gpu_idle_w + (power.gpu_tdp_w - power.gpu_idle_w) * busy
    # a job on part of a node of several hosts (8 GPUs of a GB200 NVL72 rack) draws its hosts' share of the node's power
    share = cluster.host_share
    return Energy(gpus=cluster.num_gpus, nodes=cluster.num_nodes, gpu_w=gpu_w, utilisation=busy,
                  host_w=power.host_w * share, network_w=power.network_w * share, step_s=estimate.step_time_s,
                  tokens_per_step=workload.global_batch * workload.seq_len,
                  source=f"{cluster.name} profile [power]: {power.source}")
