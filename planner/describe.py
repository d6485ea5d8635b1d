"""Text for plain values (configs, byte counts, runs of numbers): shared by the CLI's output, the
exports and the reports, which read the Plan and never the CLI layer."""
from __future__ import annotations

from .cluster import GiB
from .config import ParallelConfig
from .recompute import POLICIES, every_k


def runs(values) -> str:
    """[2, 1, 1, 1, 3] as "2, 1 x3, 3"."""
    out, values = [], list(values)
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(f"{values[i]}" + (f" x{j - i}" if j - i > 1 else ""))
        i = j
    return "[" + ", ".join(out) + "]"


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f}"


def describe_recompute(c: ParallelConfig) -> str:
    """The recompute policy, or the policies per layer: "op on 30 of 35 layers, full on 2 of 35 layers";
    an every-K pattern by its name."""
    if not c.recompute_layers:
        return c.recompute
    used = list(c.recompute_layers)
    if every_k(c.recompute):
        return f"{c.recompute} (full on {used.count('full')} of {len(used)} layers)"
    counts = {p: used.count(p) for p in POLICIES if p != "none" and used.count(p)}
    if not counts:
        return "none"
    return ", ".join(f"{p} on {n} of {len(used)} layers" for p, n in counts.items())


def describe_config(c: ParallelConfig) -> str:
    sched = c.schedule + (f" (vpp {c.vpp})" if c.vpp > 1 else "") if c.pp > 1 else "no pipeline"
    return (f"dp {c.dp} x tp {c.tp} x pp {c.pp} x cp {c.cp}" + (f", ep {c.ep}" if c.ep > 1 else "")
            + f", ZeRO-{c.zero}, micro-batch {c.micro_batch} "
            f"x {c.num_microbatches}, {sched}, recompute {describe_recompute(c)}, "
            f"sequence parallel {'on' if c.sequence_parallel else 'off'}, "
            f"optimizer offload {'on' if c.optimizer_offload else 'off'}"
            + (", parameter offload on" if c.param_offload else "")
            + (", offloaded to NVMe" if c.nvme_offload else ""))


def cost_per_million_tokens(gpu_hour_usd: float, gpus: int, tokens_per_s: float) -> float:
    """US dollars per million tokens: what the GPUs cost per hour over the tokens they train per hour."""
    return gpu_hour_usd * gpus / (tokens_per_s * 3600) * 1e6


def schedule_words(config) -> str:
    """The schedule in words, for titles: "1f1b, 2 virtual stages per rank"."""
    if config.pp == 1:
        return f"no pipeline, {config.num_microbatches} micro-batches accumulated"
    return config.schedule + (f", {config.vpp} virtual stages per rank" if config.vpp > 1 else "")


def short_config(c) -> str:
    sched = f", {c.schedule}" + (f" v{c.vpp}" if c.vpp > 1 else "") if c.pp > 1 else ""
    ep = f" ep{c.ep}" if getattr(c, "ep", 1) > 1 else ""
    return f"dp{c.dp} tp{c.tp} pp{c.pp} cp{c.cp}{ep} ZeRO-{c.zero} mb{c.micro_batch}{sched}"
