"""The cluster profile TOML that ``meshplan profile`` writes (the schema of profiles/*.toml).

Each number says it was measured and by which command; the raw measurements
follow under ``[measured]`` (``planner.cluster.parse_cluster`` reads only the
fields it knows). Derived fields say how they were derived:

- ``peak_tflops``: the best GEMM rate over the measured shapes on a GPU without
  kernel sweeps, the median over them on a CPU (whose rate varies with the shape
  by how its operands fit the caches, 45-85 GFLOP/s on the development machine:
  one rate stands for all, and the typical one errs least), so
  ``gemm_efficiency`` is 1 and ``gemm_tile`` is [1, 1] (the measured rates
  already contain the tile and wave effects of those shapes);
- ``attention_efficiency``: the measured causal SDPA rate (forward + backward,
  FLOPs counted as ``planner.cost.compute.flash_attention_s`` does) over the GEMM
  rate measured the same way (one process; on a CPU the peak is the concurrent rate,
  and attention is taken to slow with the GEMMs);
- intra-node ``link_GBps``: the all-reduce bus bandwidth at the largest message;
  ``latency_us``: the smallest all-reduce's time over 2(n-1) steps, the latency
  term of the ring all-reduce in ``planner.network.all_reduce_s``;
- host ``memory_efficiency``: the CPU AdamW rate (28 B per parameter, as
  ``planner.cost.step`` charges it) over the measured copy bandwidth.
"""
from __future__ import annotations

import math
import statistics

from planner.cluster import GiB
from .device import nccl_arch


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _num(x: float, digits: int = 4) -> str:
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)
    if x == 0:
        return "0.0"
    return repr(float(f"{x:.{digits}g}"))


def _peaks(m: dict, cpu: bool) -> dict[str, float]:
    """{dtype: TFLOP/s}: the best measured GEMM, or on a CPU the median over the shapes."""
    rates: dict[str, list[float]] = {}
    for row in m["gemm"]:
        rates.setdefault(row["dtype"], []).append(row["tflops"])
    return {d: statistics.median(r) if cpu else max(r) for d, r in rates.items()}


def _collective_fields(comm: dict | None, m: dict) -> tuple[float, float, str]:
    """(link GB/s, latency us, source) from the collective measurements."""
    if not comm:
        return m["copy"]["GBps"], 0.0, "one process: no collective measured; the device copy bandwidth stands in"
    sizes = comm["sizes"]
    n = comm["world"]
    big, small = max(sizes, key=lambda r: r["bytes"]), min(sizes, key=lambda r: r["bytes"])
    latency = small["all_reduce_s"] / (2 * (n - 1)) * 1e6
    src = (f"{comm['backend']} all_reduce {big['bytes']} B x{n}: busbw {big['all_reduce_busbw_GBps']:.3g} GB/s; "
           f"{small['bytes']} B: {small['all_reduce_s'] * 1e6:.0f} us = 2(n-1) x {latency:.0f} us")
    return big["all_reduce_busbw_GBps"], latency, src


def _collective_ratio_lines(comm: dict | None, measured: str) -> list[str]:
    """All-gather's and reduce-scatter's bus bandwidth against all-reduce's (link_GBps), at the largest
    size measured: gloo runs all-reduce with its own ring algorithm but the other two far slower,
    where NCCL runs all three at one bus bandwidth (nccl-tests doc/PERFORMANCE.md). Not written where
    they were not measured (the ratios default to 1)."""
    if not comm:
        return []
    big = max(comm["sizes"], key=lambda r: r["bytes"])
    n, ar = comm["world"], big["all_reduce_busbw_GBps"]
    out = []
    for name, key in (("all_gather", "all_gather_s"), ("reduce_scatter", "reduce_scatter_s")):
        if key in big and ar:
            busbw = (n - 1) / n * big["bytes"] / big[key] / 1e9
            src = (f"{measured}: {comm['backend']} {name} {big['bytes']} B x{n}: busbw {busbw:.3g} GB/s against "
                   f"all_reduce {ar:.3g} GB/s")
            out += [f"{name}_busbw_ratio = {_num(busbw / ar)}", f"{name}_busbw_ratio_source = {_q(src)}"]
    return out


def _contention_lines(comm: dict | None, m: dict, measured: str) -> list[str]:
    """comm_sms: the share of the device that a running collective takes from compute, as
    collectives.py measured it (1 - GEMM time alone / GEMM time beside an all-reduce), in SMs."""
    c = (comm or {}).get("contention")
    if not c:
        return []
    sms = m["device"]["sm_count"] * c["fraction"]
    alone_ms = c["alone_s"] * 1e3
    during = f"{c['during_s'] * 1e3:.3g} ms" if c.get("during_s") else "n/a"
    src = (f"{measured}: GEMM {c['gemm']} {alone_ms:.3g} ms alone, {during} beside an all_reduce of "
           f"{c['all_reduce_bytes']} B")
    out = [f"comm_sms = {_num(sms)}   # measured: compute lost while a collective runs, x sm_count",
           f"comm_sms_source = {_q(src)}"]
    w = (comm or {}).get("sync_wait")
    if w:
        parts = "; ".join(f"{r['stretch_s'] * 1e3:.3g} ms of GEMMs {w['gemm']}: {r['wait_s'] * 1e3:.3g} ms"
                          for r in w["stretches"])
        src = (f"{measured}: the wait at an 8-byte all_reduce after a stretch of work on every rank, less the "
               f"same all_reduce after a barrier ({w['all_reduce_s'] * 1e3:.3g} ms), {w['samples']} samples: "
               f"{parts}; least squares of wait = c sqrt(stretch) (executor/profile/collectives.py _sync_wait)")
        out += [f"sync_wait_coefficient = {_num(w['coefficient'])}   # measured: seconds of wait per sqrt(second) "
                "of work between blocking collectives", f"sync_wait_coefficient_source = {_q(src)}"]
    return out


def render(m: dict, comm: dict | None, *, name: str, command: str, host: str, date: str, nproc: int) -> str:
    """The profile text for measurements ``m`` (device.measure) and ``comm`` (collectives.py)."""
    cpu = m["device_type"] != "cuda"
    measured = f"measured: `{command}` on {host} ({date})"
    peaks = _peaks(m, cpu)
    alone = dict(peaks)
    concurrent = (comm or {}).get("gemm_concurrent") if cpu else None
    if concurrent:      # the slowest process's rate while all compute at once (executor/profile/collectives.py)
        peaks[max(peaks, key=peaks.get)] = statistics.median(r["tflops"] for r in concurrent)
    first = max(peaks, key=peaks.get)
    attn = m["attention"].get(first, {})
    # attention over the GEMM rate measured as it was (one process, moments apart), so that the
    # fraction holds under the concurrent peak too: the machine's speed swings by tens of percent
    # within seconds (executor/profile/collectives.py _concurrent_gemm), and a ratio of rates measured in
    # different conditions carried that swing (0.31-0.55 over four quick profiles in a row)
    attn_eff = min(1.0, attn.get("tflops", 0.0) / alone[first]) if alone[first] else 0.5
    link, latency, comm_src = _collective_fields(comm, m)
    threads = m["threads"]
    dev_name = f"CPU process ({threads} thread{'s' if threads != 1 else ''})" if cpu else m["device"]["name"]
    memory_gib = (m["host_memory_bytes"] / nproc if cpu else m["device"]["memory_bytes"]) / GiB
    host_copy = m["host_copy"]["GBps"]
    adam_eff = min(1.0, m["adam"]["GBps"] / host_copy)
    pcie = m["h2d"]["GBps"] if m.get("h2d") else host_copy
    reserved = (comm or {}).get("reserved_bytes", 0.0) / GiB
    best = max(m["gemm"], key=lambda r: r["tflops"])
    gemm_text = (f"median GEMM over {len(concurrent)} shapes of the slowest of {nproc} processes computing at once "
                 f"{peaks[first] * 1e3:.1f} GFLOP/s (alone: median {statistics.median(r['tflops'] for r in m['gemm']) * 1e3:.1f})"
                 if concurrent else
                 f"median GEMM over {len(m['gemm'])} shapes {peaks[first] * 1e3:.1f} GFLOP/s (best "
                 f"{best['m']}x{best['n']}x{best['k']} {best['tflops'] * 1e3:.1f})" if cpu else
                 f"GEMM {best['m']}x{best['n']}x{best['k']} {best['dtype']}: {best['tflops'] * 1e3:.1f} GFLOP/s")
    gpu_src = f"{measured}: {gemm_text}; copy {m['copy']['GBps']:.1f} GB/s"
    attn_src = (f"{measured}: causal SDPA {first} fwd+bwd {_attn_text(attn)} over the GEMM rate of one process"
                f" ({alone[first] * 1e3:.1f} GFLOP/s)")
    reserved_src = measured + (": resident memory of a rank after init_process_group" if comm
                               else ": no process group started (--nproc 1)")
    kernel_lines = [
        "gemm_tile = [1, 1]",
        f"gemm_tile_source = {_q('derived: the measured GEMM rates already include tile and wave effects')}",
        "gemm_efficiency = 1.0",
        f"gemm_efficiency_source = {_q('derived: the peak above is the measured achieved rate')}",
        "hbm_efficiency = 1.0",
        f"hbm_efficiency_source = {_q('derived: the bandwidth above is the measured achieved rate')}",
        f"attention_efficiency = {_num(max(attn_eff, 1e-3))}",
        f"attention_efficiency_source = {_q(attn_src)}",
    ]
    # on a CPU with several processes, the memory-bound kernels as they ran in all of them at once
    # (executor/profile/collectives.py _concurrent_kernels), else as one process ran them alone
    together = ((comm or {}).get("kernels_concurrent") or {}) if cpu else {}
    at_once = f", in each of {nproc} processes at once, the slowest"
    a = together.get("device_adam") or m.get("device_adam")
    if cpu and a:
        adam_src = (f"{measured}: torch.optim.AdamW(foreach=False) as the executor steps a CPU device, "
                    f"{a['params'] / 2**20:.0f}M parameters in {a['tensors']} tensors, at 28 B per parameter"
                    + (at_once if together.get("device_adam") else ""))
        kernel_lines += [f"optimizer_GBps = {_num(a['GBps'])}", f"optimizer_GBps_source = {_q(adam_src)}"]
    if cpu and m.get("kernels"):
        eager = {"eager": together["eager"]} if together.get("eager") else {}
        kernel_lines += _cpu_eager_lines({**m["kernels"], **eager}, measured, at_once if eager else "")
    if concurrent:
        kernel_lines += _gemm_shape_lines(concurrent, peaks[first], measured, nproc)
    if cpu and (comm or {}).get("tp_block"):
        kernel_lines += tp_block_lines(comm["tp_block"], comm["world"], link, latency, measured)
    if not cpu and m.get("kernels"):
        peaks, kernel_lines, gpu_src = _fitted(m, peaks, measured)
        fp8 = [r["tflops"] for r in m["kernels"].get("fp8_gemm", []) if "tflops" in r]
        if fp8:         # the best FP8 GEMM (torch._scaled_mm, executor/profile/kernels.py fp8_gemm_sweep)
            peaks = {**peaks, "fp8": max(fp8)}
    lines = [
        f"# Written by `{command}` on {host} ({date}). Every number below was measured on that machine",
        "# by that command (the raw measurements are under [measured]); see executor/profile/toml.py",
        "# for how the derived fields follow from them.",
        "schema = 1",
        f"name = {_q(name)}",
        f"description = {_q(f'{dev_name} x {nproc} on {host}' + (', gloo over TCP loopback' if cpu else ''))}",
        f"gpus_per_node = {nproc}               # processes per host (--nproc)",
        "max_nodes = 1",
        f"source = {_q(measured)}",
        "",
        "[gpu]",
        f"name = {_q(dev_name)}",
        f"memory_GiB = {_num(memory_gib)}" + ("   # host memory divided among the processes (a budget)" if cpu
                                              else "   # reported by torch.cuda.get_device_properties"),
        f"hbm_GBps = {_num(m['copy']['GBps'])}   # measured: {m['copy']['bytes'] >> 20} MiB copy, read + write",
        "peak_tflops = { " + ", ".join(f"{d} = {_num(v)}" for d, v in peaks.items()) + " }   # measured: "
        + ("median GEMM over the shapes" if cpu else "best GEMM"),
        f"sm_count = {m['device']['sm_count']}" + ("   # one CPU process" if cpu else "   # reported by the runtime"),
        *([f"nccl_arch = {_q(nccl_arch(m['device']['compute_capability']))}   # NCCL's tuning row for compute "
           f"capability {'.'.join(map(str, m['device']['compute_capability']))} (reported by the runtime)"]
          if not cpu and m["device"].get("compute_capability") else []),
        *([f"threads = {threads}   # compute threads per process, as measured (torch.set_num_threads)"] if cpu
          else []),
        f"source = {_q(gpu_src)}",
        "",
        "[gpu.kernels]",
        *kernel_lines,
        "",
        "[runtime]",
        f"reserved_GiB = {_num(reserved)}",
        f"reserved_source = {_q(reserved_src)}",
        *_contention_lines(comm, m, measured),
        "",
        "[intra_node]",
        f"fabric = {_q('loopback' if cpu else 'pcie')}",
        f"link_GBps = {_num(link)}",
        "efficiency = 1.0                # the bandwidth above is the measured achieved one",
        f"latency_us = {_num(latency)}",
        f"source = {_q(f'{measured}: {comm_src}')}",
        *_collective_ratio_lines(comm, measured),
        "",
        "[host]",
        *([f"cores = {m['cores']}   # the CPUs the processes share (os.sched_getaffinity)"]
          if cpu and m.get("cores") else []),
        f"memory_GBps = {_num(host_copy)}   # measured: host memory copy",
        f"memory_efficiency = {_num(adam_eff)}   # measured: CPU AdamW {m['adam']['GBps']:.3g} GB/s at 28 B/param",
        f"pcie_GBps = {_num(pcie)}" + ("   # the host is the device: the copy bandwidth" if cpu
                                       else "   # measured: pinned host-to-device copy"),
        f"memory_GiB = {_num(m['host_memory_bytes'] / GiB)}   # read from the OS (sysconf)",
        *([f"cpu_vendor = {_q(m['device']['cpu_vendor'])}   # read from the OS (/proc/cpuinfo, the machine type)"]
          if m["device"].get("cpu_vendor") else []),
        f"source = {_q(measured)}",
        "",
        "[network]",
        "nics_per_node = 0",
        "nic_Gbps = 0",
        "efficiency = 1.0",
        "latency_us = 0",
        "oversubscription = 1.0",
        f"source = {_q('one host: meshplan profile measures no network')}",
        "",
    ]
    return "\n".join(lines) + _raw(m, comm)


TILE_SOURCE = ("cuBLAS tile shapes (NVIDIA DU-09799, 'Tile quantization'); the kernel names of "
               "benchmarks/results/gpu_runs.json carry them")


def _fitted(m: dict, peaks: dict[str, float], measured: str) -> tuple[dict[str, float], list[str], str]:
    """A GPU with kernel sweeps: (peaks, [gpu.kernels] lines, [gpu] source) from the fits of
    executor.profile.fit (GEMM tile/wave/split-K model, attention rate)."""
    from .fit import GPU_TILES, eager_bandwidths, fit_attention, fit_gemm
    k = m["kernels"]
    g = fit_gemm(k["gemm"], sm_count=m["device"]["sm_count"], hbm_bytes_per_s=m["copy"]["GBps"] * 1e9)
    dtype = k["gemm"][0]["dtype"]
    scale = g["rate_flops"] / 1e12 / peaks[dtype]          # the fitted rate against the best timed GEMM
    peaks = {d: v * scale if d != "fp32" else v for d, v in peaks.items()}
    a = fit_attention(k["attention"], peak_flops=g["rate_flops"])
    unaligned = (f"derived: median over the {g['unaligned_rows']} GEMMs with a dimension not a multiple of 8 "
                 "of the efficiency at which the fitted model reproduces its measured time")
    fit = (f"derived: least mean |log error| over the {g['rows']} aligned GEMMs of the sweep in "
           f"NAME.kernels.json (executor/profile/fit.py; mean |log error| {g['error']:.3f})")
    lines = [
        "gemm_tiles = [" + ", ".join(f"[{a_}, {b_}]" for a_, b_ in GPU_TILES) + "]",
        f"gemm_tile_source = {_q(TILE_SOURCE)}",
        "gemm_efficiency = 1.0",
        f"gemm_efficiency_source = {_q(fit + ': the peak above is the fitted rate')}",
        f"gemm_latency_us = {_num(g['latency_s'] * 1e6)}",
        f"gemm_wave_latency_us = {_num(g['wave_latency_s'] * 1e6)}",
        f"gemm_latency_source = {_q(fit)}",
        f"gemm_unaligned_efficiency = {_num(g['unaligned_efficiency'])}",
        f"gemm_unaligned_efficiency_source = {_q(unaligned)}",
        "hbm_efficiency = 1.0",
        f"hbm_efficiency_source = {_q('derived: the bandwidth above is the measured achieved rate')}",
    ]
    eager = eager_bandwidths(k.get("eager", []))
    if eager:
        lines += ["eager_GBps = { " + ", ".join(f"{c} = {_num(v / 1e9)}" for c, v in eager.items()) + " }",
                  f"eager_GBps_source = {_q(measured + ': eager elementwise kernels at 8192 x 2048 (executor/profile/kernels.py eager_kernels), the median of each class (executor.profile.fit.EAGER_CLASS_KERNELS)')}"]
    if k.get("gap"):
        lines += [f"kernel_gap_us = {_num(k['gap']['s_per_kernel'] * 1e6)}",
                  f"kernel_gap_source = {_q(measured + ': a CUDA graph of tiny kernels, GPU time per kernel')}"]
    lines += strided_reduce_lines(k.get("fp8_cast", []), eager, measured)
    lines += host_lines(k.get("executor_host"), measured)
    if a:
        attn = (f"{measured}: causal SDPA fwd+bwd {a['shape']} (the largest timed) at "
                f"{a['rate_flops'] / 1e12:.0f} TFLOP/s over the fitted GEMM rate")
        lines += [f"attention_efficiency = {_num(a['efficiency'])}", f"attention_efficiency_source = {_q(attn)}"]
    src = (f"{measured}: GEMM model fitted to {g['rows']} GEMMs ({g['rate_flops'] / 1e12:.0f} TFLOP/s, "
           f"{g['latency_s'] * 1e6:.0f} us per kernel); copy {m['copy']['GBps']:.1f} GB/s")
    return peaks, lines, src


def strided_reduce_lines(casts: list[dict], eager: dict[str, float], measured: str) -> list[str]:
    """``strided_reduce_GBps`` from the compiled column-wise FP8 cast (executor/profile/kernels.py ``fp8_casts``
    ``cast_colwise_compiled``: one kernel that reduces n elements along their strided dimension and writes them cast):
    the cost model prices its amax's 2 n bytes at that rate and its n written bytes at the ``cast_down`` class
    (planner/cost/layer.py), so the rate is 2 n / (t - n / cast_down). Nothing where the case did not run or the
    write alone would take longer than the kernel."""
    row = next((r for r in casts if r.get("kernel") == "cast_colwise_compiled" and r.get("seconds")), None)
    if row is None or not eager.get("cast_down"):
        return []
    n = row["tokens"] * row["hidden"]
    left = row["seconds"] - n / eager["cast_down"]
    if left <= 0:
        return []
    rate = 2 * n / left
    src = (f"{measured}: the compiled column-wise amax and cast of {row['tokens']} x {row['hidden']} bf16 "
           f"(executor/profile/kernels.py fp8_casts cast_colwise_compiled, {row['seconds'] * 1e6:.0f} us): its 2 bytes "
           "an element of amax over the time its 1 written byte at the cast_down class leaves")
    return [f"strided_reduce_GBps = {_num(rate / 1e9)}", f"strided_reduce_source = {_q(src)}"]


def host_lines(probe: dict | None, measured: str) -> list[str]:
    """[gpu.kernels] host_us from the executor's host probe (executor/profile/host.py), the regimes that ran."""
    from .host import fit
    # a probe that kept its steps is fitted here (its medians), one written before that as it stored it
    rows = {name: {**r, **fit(r)} if "step_times_s" in r else r
            for name, r in (probe or {}).get("regimes", {}).items() if "error" not in r}
    if "eager" not in rows:
        return []
    keys = ("block_microbatch_s", "block_step_s", "rest_microbatch_s", "rest_step_s")
    table = ", ".join(f"{name} = [" + ", ".join(_num(r[k] * 1e6) for k in keys) + "]" for name, r in rows.items())
    if probe.get("command"):            # measured by its own command, added to an earlier profile's raw file
        measured = f"measured: `{probe['command']}`"
    depths = [str(blocks) for blocks in sorted({blocks for blocks, _ in probe.get("depths", [(2, 1), (6, 1)])})]
    statistic = " (the median of each run's steps)" if any("step_times_s" in r for r in rows.values()) else ""
    src = (f"{measured}: the executor's step of a tiny model (executor/profile/host.py: hidden 256, 64 tokens, "
           f"the GPU idle) at {', '.join(depths[:-1])} and {depths[-1]} blocks with 1 and 2 micro-batches, solved "
           f"per block and for the rest{statistic}")
    return [f"host_us = {{ {table} }}   # per block per micro-batch, per block per step, rest per micro-batch, "
            "rest per step", f"host_source = {_q(src)}"]


def _gemm_shape_lines(rows: list[dict], peak: float, measured: str, nproc: int) -> list[str]:
    """A CPU's GEMM efficiency by shape: each product of the concurrent sweep (executor/profile/collectives.py
    _concurrent_gemm) at its rate over the peak (their median), which planner.cost.compute reads for
    the nearest measured shape."""
    # the products of a linear of equal widths share (m, n, k) in another layout: their time-weighted
    # rate (equal FLOPs each: the harmonic mean), as the cost model asks by (m, n, k) alone
    by_shape: dict[tuple[int, int, int], list[float]] = {}
    for r in rows:
        by_shape.setdefault((r["m"], r["n"], r["k"]), []).append(r["tflops"])
    table = ", ".join(f"[{m}, {n}, {k}, {_num(len(rates) / sum(1 / x for x in rates) / peak)}]"
                      for (m, n, k), rates in by_shape.items())
    src = (f"{measured}: the products of transformer linears (forward, input and weight gradient; "
           f"executor/profile/collectives.py linear_products) in each of {nproc} processes at once, the slowest "
           f"process's rate over the median ({peak * 1e3:.1f} GFLOP/s)")
    return [f"gemm_shapes = [{table}]   # [m, n, k, efficiency] of (m x k) @ (k x n)",
            f"gemm_shapes_source = {_q(src)}"]


def tp_block_lines(b: dict, world: int, link_GBps: float, latency_us: float, measured: str) -> list[str]:
    """The host time TP adds to a block beyond its collectives (executor/profile/collectives.py
    _tp_block_overhead): per block, the sharded blocks' time less the unsharded ones', less the four
    all-reduces of the block's activation (two each way: Shoeybi et al. 2019, Fig. 3) as the cost model
    charges them from this profile (planner/network.py all_reduce_s, ring: 2(n-1) latencies and
    2(n-1)/n of the bytes at the bus bandwidth), forward and backward apart; none below zero."""
    n, layers = world, b["layers"]
    all_reduce_s = 2 * (n - 1) * latency_us * 1e-6 + 2 * (n - 1) / n * b["activation_bytes"] / (link_GBps * 1e9)
    fwd = max(0.0, (b["tp_fwd_s"] - b["plain_fwd_s"]) / layers - 2 * all_reduce_s)
    bwd = max(0.0, ((b["tp_fwd_bwd_s"] - b["tp_fwd_s"]) - (b["plain_fwd_bwd_s"] - b["plain_fwd_s"])) / layers
              - 2 * all_reduce_s)
    src = (f"{measured}: {layers} of the executor's Llama blocks (hidden {b['hidden']}, {b['batch']} x {b['seq']} tokens) "
           f"tensor-parallel over {n} processes against unsharded, forward {b['tp_fwd_s'] * 1e3:.3g} against "
           f"{b['plain_fwd_s'] * 1e3:.3g} ms, forward and backward {b['tp_fwd_bwd_s'] * 1e3:.3g} against "
           f"{b['plain_fwd_bwd_s'] * 1e3:.3g} ms, per block less 2 all-reduces of {b['activation_bytes']} B each way "
           f"({all_reduce_s * 1e3:.3g} ms each as charged) (executor/profile/collectives.py _tp_block_overhead)")
    return [f"tp_block_overhead_us = [{_num(fwd * 1e6)}, {_num(bwd * 1e6)}]   # forward, backward: DTensor's "
            "dispatch and redistributions per tensor-parallel block", f"tp_block_overhead_source = {_q(src)}"]


def _cpu_eager_lines(k: dict, measured: str, at_once: str = "") -> list[str]:
    """A CPU's eager elementwise kernels by bandwidth class (the same classes and kernels as on a GPU:
    fit.EAGER_CLASS_KERNELS; a CPU streams norms, softmax and activations far below its copy
    bandwidth), and the time a process spends dispatching each op, which runs in series with the ops
    on a CPU as the issue gap does on a GPU (kernels.dispatch_overhead)."""
    from .fit import eager_bandwidths
    out = []
    eager = eager_bandwidths(k.get("eager", []))
    if eager:
        src = (f"{measured}: eager elementwise kernels at 2048 x 1024, the log-softmax forward and backward "
               "at 1000 x 8192 (executor/profile/kernels.py eager_kernels), the median of each class "
               "(executor.profile.fit.EAGER_CLASS_KERNELS)" + at_once)
        out += ["eager_GBps = { " + ", ".join(f"{c} = {_num(v / 1e9)}" for c, v in eager.items()) + " }",
                f"eager_GBps_source = {_q(src)}"]
    d = k.get("dispatch")
    if d and d.get("op_s"):
        src = f"{measured}: the dispatch time of a small op (executor/profile/kernels.py dispatch_overhead)"
        out += [f"kernel_gap_us = {_num(d['op_s'] * 1e6)}", f"kernel_gap_source = {_q(src)}"]
    return out


def _attn_text(attn: dict) -> str:
    if not attn:
        return "(not measured)"
    return (f"b{attn['batch']} h{attn['heads']} s{attn['seq']} d{attn['head_dim']}: "
            f"{attn['tflops'] * 1e3:.1f} GFLOP/s")


def _value(v) -> str:
    return _q(v) if isinstance(v, str) else _num(v, 6)


def _raw(m: dict, comm: dict | None) -> str:
    out = ["", "[measured]", f"threads_per_process = {m['threads']}"]
    for row in m["gemm"]:
        out += ["", "[[measured.gemm]]"] + [f"{k} = {_value(v)}" for k, v in row.items()]
    for dtype, row in m["attention"].items():
        out += ["", "[[measured.attention]]"] + [f"{k} = {_value(v)}" for k, v in row.items()]
    for row in (comm or {}).get("gemm_concurrent") or []:
        out += ["", "[[measured.gemm_concurrent]]"] + [f"{k} = {_value(v)}" for k, v in row.items()]
    for row in (comm or {}).get("sizes", []):
        out += ["", "[[measured.collectives]]"] + [
            f"{k} = {_value(v)}" for k, v in row.items()
            if isinstance(v, (int, float, str)) and not (isinstance(v, float) and math.isnan(v))]
    return "\n".join(out) + "\n"
