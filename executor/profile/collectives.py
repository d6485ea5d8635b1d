"""Collective bandwidth and latency over torch.distributed between local processes.

    python -m executor.profile.collectives --nproc 2 --backend gloo --out comm.json [--quick] [--threads 1]

`meshplan profile` runs this module in a fresh interpreter (machine.py
measure_collectives), which spawns one process per rank. Each rank runs all-reduce, all-gather, reduce-scatter and a
send/recv pair over message sizes; one sample of a size is the slowest rank's
time for one call after a barrier, and the reported time is the best sample on a
GPU (nccl-tests reports the same kind of number), the mean on a CPU (``collective_time``).
Bus bandwidth follows nccl-tests' definition (NVIDIA/nccl-tests doc/PERFORMANCE.md): all-reduce moves
2(n-1)/n of the buffer through each rank's link, all-gather and reduce-scatter
(n-1)/n. Rank 0 writes the JSON; each rank's resident memory after the process
group is up (CPU: VmRSS; GPU: memory in use on its device) is reported as the
runtime's reserve, and the slowdown of a GEMM while a collective runs beside it
as the contention of overlapped communication.
"""
from __future__ import annotations

import argparse
import json
import os
import time

SIZES = (4, 2**10, 2**16, 2**20, 2**22, 2**24)
SIZES_QUICK = (4, 2**12, 2**18, 2**22)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def collective_time(fn, dist, torch, device, repeat: int) -> float:
    """The slowest rank's time for one call, over ``repeat`` samples after a barrier each: on a GPU
    the best sample (nccl-tests' kind of number: NCCL repeats to within a percent), on a CPU the
    mean. gloo over loopback on cores the ranks share varies from call to call with the scheduler:
    a 2 MiB all-reduce between two processes took 0.96 ms at best, 1.45-3.7 ms at the median and
    2.2-3.3 ms on average over 25 samples, and a training step pays the sum of its
    collectives, so their mean; the best sample predicted a tensor-parallel step's 66 all-reduces at
    a third of the 0.22-0.24 s its ranks waited at them (torch.profiler)."""
    fn()
    samples = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        samples.append(float(dt.item()))
    return min(samples) if device.type == "cuda" else sum(samples) / len(samples)


def _collectives(dist, torch, device, world: int, rank: int, size: int, repeat: int) -> dict:
    elems = max(world, size // 4 // world * world)        # fp32 elements, divisible by the world
    x = torch.ones(elems, device=device)
    shard = torch.ones(elems // world, device=device)
    row = {"bytes": elems * 4}
    row["all_reduce_s"] = collective_time(lambda: dist.all_reduce(x), dist, torch, device, repeat)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        row["all_gather_s"] = collective_time(lambda: gather(x, shard), dist, torch, device, repeat)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        row["all_gather_error"] = str(e).splitlines()[0]
    try:
        row["reduce_scatter_s"] = collective_time(lambda: scatter(shard, x), dist, torch, device, repeat)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        row["reduce_scatter_error"] = str(e).splitlines()[0]

    def p2p():
        if rank == 0:
            dist.send(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
    row["send_recv_s"] = collective_time(p2p, dist, torch, device, repeat)
    factor = 2 * (world - 1) / world
    row["all_reduce_busbw_GBps"] = factor * row["bytes"] / row["all_reduce_s"] / 1e9
    if "all_gather_s" in row:
        row["all_gather_busbw_GBps"] = (world - 1) / world * row["bytes"] / row["all_gather_s"] / 1e9
    return row


def _contention(dist, torch, device, samples: int) -> dict:
    """How much slower compute runs while a collective is in flight on the same device: the
    contention the cost model charges for overlapped communication (``comm_sms``; Rashidi et al.,
    ISCA 2021, on compute-communication overlap). A GEMM's time alone, then the mean time of the
    GEMMs run while an asynchronous all-reduce of 16 MiB is in flight (every rank alike, as in
    data-parallel overlap); contention = 1 - alone / during, the median over samples, in [0, 1]."""
    a = torch.randn(512, 512, device=device)
    x = torch.ones(2**22, device=device)

    def gemm():
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()
    gemm()
    t0 = time.perf_counter()
    for _ in range(8):
        gemm()
    alone = (time.perf_counter() - t0) / 8
    ratios, during_s = [], []
    for _ in range(samples):
        dist.barrier()
        work = dist.all_reduce(x, async_op=True)
        count, t0 = 0, time.perf_counter()
        while not work.is_completed():
            gemm()
            count += 1
        elapsed = time.perf_counter() - t0
        work.wait()
        if count:
            during = elapsed / count
            during_s.append(during)
            ratios.append(max(0.0, min(1.0, 1.0 - alone / during)))
    ratio = sorted(ratios)[len(ratios) // 2] if ratios else 0.0
    value = torch.tensor([ratio], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)       # the most slowed rank sets the pace
    return {"gemm": "512x512x512 fp32", "alone_s": alone,
            "during_s": sorted(during_s)[len(during_s) // 2] if during_s else None,
            "all_reduce_bytes": x.numel() * 4, "fraction": float(value.item())}


def _sync_wait(dist, torch, device, quick: bool) -> dict | None:
    """How long a rank waits at a blocking collective for the others after a stretch of work, beyond
    what the same collective takes when the ranks arrive together: processes sharing a CPU's cores do
    not progress at one steady pace (the OS and the other process take turns), so after every stretch
    the ranks arrive apart, and the wait grows with the stretch. Every rank runs the same stretch of
    GEMMs (about 20 ms and 80 ms, as a layer's work between two tensor-parallel all-reduces), then an
    8-byte all-reduce; per stretch length, the mean over samples and ranks of its time less the mean
    of the same all-reduce right after a barrier. ``coefficient`` fits wait = c sqrt(stretch) (the
    spread of a sum of independent delays grows with its square root) by least squares. On a GPU the
    ranks' kernels repeat to within a percent: not measured."""
    if device.type == "cuda":
        return None
    a, x = torch.randn(512, 512), torch.ones(2)
    a @ a
    t0 = time.perf_counter()
    for _ in range(4):
        a @ a
    per_gemm = (time.perf_counter() - t0) / 4
    samples = 10 if quick else 30

    def mean_over_ranks(values: list[float]) -> float:
        t = torch.tensor([sum(values) / len(values)], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()

    together = []
    for _ in range(samples):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        together.append(time.perf_counter() - t0)
    base = mean_over_ranks(together)
    rows = []
    for target in (0.02, 0.08):
        count = torch.tensor([max(1, round(target / per_gemm))], dtype=torch.float64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)             # every rank the same work
        stretch, waits = [], []
        for _ in range(samples):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(int(count.item())):
                a @ a
            t1 = time.perf_counter()
            dist.all_reduce(x)
            stretch.append(t1 - t0)
            waits.append(time.perf_counter() - t1)
        rows.append({"gemms": int(count.item()), "stretch_s": mean_over_ranks(stretch),
                     "wait_s": max(0.0, mean_over_ranks(waits) - base)})
    coefficient = sum(r["wait_s"] * r["stretch_s"] ** 0.5 for r in rows) / sum(r["stretch_s"] for r in rows)
    return {"gemm": "512x512x512 fp32", "samples": samples, "all_reduce_s": base, "stretches": rows,
            "coefficient": coefficient}


# The products of a transformer's linears as a CPU trains it (executor/profile/collectives.py
# _concurrent_gemm): a micro-batch of LINEAR_TOKENS tokens through (in, out) widths of models a CPU
# trains (hidden 512 and 1024; 4x MLPs up and down; a head over an 8192-entry vocabulary), each as
# its forward x W^T, input gradient g W and weight gradient g^T x (executor/profile/fit.py
# gemm_dims). A CPU's GEMM kernels are not one rate: on the 2-core VM a head's forward
# (1024 x 8192 x 512) ran at 71 GFLOP/s while the layers' products ran at 85-93 (two processes at
# once, 15 s rotating over these products).
LINEAR_TOKENS = 1024
LINEAR_WIDTHS = ((512, 512), (512, 2048), (2048, 512), (1024, 1024), (1024, 4096), (4096, 1024),
                 (512, 8192), (1024, 8192))
LINEAR_WIDTHS_QUICK = ((512, 512), (512, 2048), (2048, 512), (512, 8192))
CONCURRENT_WINDOW_S = {True: 6.0, False: 12.0}     # seconds over all the products: --quick, full


def linear_products(torch, tokens: int, widths) -> list[tuple[dict, object, float]]:
    """(row, product, FLOPs) for each of a linear's three products at each (in, out) width; the row
    holds the product's (m, n, k) (an (m x k) @ (k x n)) and its kind."""
    from .fit import gemm_dims
    out = []
    for i, o in widths:
        x, w, g = torch.randn(tokens, i), torch.randn(o, i), torch.randn(tokens, o)
        flops = 2.0 * tokens * i * o
        for kind, fn in (("fwd", lambda x=x, w=w: x @ w.t()), ("dgrad", lambda g=g, w=w: g @ w),
                         ("wgrad", lambda g=g, x=x: g.t() @ x)):
            m, n, k = gemm_dims({"m": tokens, "n": o, "k": i, "kind": kind})
            out.append(({"m": m, "n": n, "k": k, "kind": kind}, fn, flops))
    return out


def _concurrent_gemm(dist, torch, device, quick: bool) -> list[dict] | None:
    """GEMM rates while every process of the host runs GEMMs at once, as the ranks of a training job
    compute side by side on shared cores, caches and memory (a CPU; a GPU's processes do not share its
    compute), at the products of a transformer's linears (``linear_products``): every rank runs them
    in turn, round after round, for ``CONCURRENT_WINDOW_S`` seconds, and a product's rate is its FLOPs
    over its total time in the window (a step's GEMM time is a sum, so slow calls count as much as
    fast ones); ``tflops`` is the slowest rank's, which paces every rank of a synchronous step (as
    ``collective_time`` and ``_contention`` take the slowest rank), ``tflops_mean`` the mean over the
    ranks.
    One window over all the products, not one per product: the VM's per-core speed swings by tens
    of percent over seconds (one rank's 1024^3 rate over successive half seconds ranged 43-81
    GFLOP/s while the other's stayed at 71-82, two processes timing for 40 s), and a
    rotation spreads that swing over every product alike, where consecutive windows gave each
    product a different moment of it."""
    if device.type == "cuda":
        return None
    products = linear_products(torch, LINEAR_TOKENS, LINEAR_WIDTHS_QUICK if quick else LINEAR_WIDTHS)
    for _, fn, _ in products:
        fn()
    window = CONCURRENT_WINDOW_S[quick]
    spent = [0.0] * len(products)
    rounds = 0
    dist.barrier()
    t_end = time.perf_counter() + window
    while time.perf_counter() < t_end or rounds < 2:
        for i, (_, fn, _) in enumerate(products):
            t0 = time.perf_counter()
            fn()
            spent[i] += time.perf_counter() - t0
        rounds += 1
    rates = torch.tensor([f * rounds / s for (_, _, f), s in zip(products, spent)], dtype=torch.float64)
    total, slowest = rates.clone(), rates.clone()
    dist.all_reduce(total)
    dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
    return [{**row, "tflops": slowest[i].item() / 1e12, "tflops_mean": total[i].item() / dist.get_world_size() / 1e12,
             "window_s": window, "rounds": rounds} for i, (row, _, _) in enumerate(products)]


def _concurrent_kernels(dist, torch, quick: bool) -> dict:
    """The memory-bound work of a step measured as the GEMMs are: every process at once (a CPU).
    The eager elementwise kernels and the executor's AdamW step (executor/profile/kernels.py
    eager_kernels, executor/profile/device.py device_adam, the same calls and sizes as the
    one-process profile) run on every rank after a barrier, and each figure is the slowest rank's:
    ranks stepping in data parallel run the same kernels at the same moment and share the memory
    bus. Measured on the 2-core VM (two processes): the streaming kernels (casts, fp32
    adds, norms) lost 25-30% of their one-process bandwidth with the other process streaming beside
    them; the compute-bound ones (strided RoPE products, SiLU, log-softmax) kept theirs."""
    from .device import device_adam
    from .kernels import eager_kernels

    def slowest(seconds: list[float]) -> list[float]:
        t = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    dist.barrier()
    eager = eager_kernels("cpu", tokens=2048, hidden=1024, vocab=8192, logit_rows=1000)
    times = slowest([r.get("seconds", 0.0) for r in eager])      # a kernel this torch lacks: an error row
    eager = [{**r, "seconds": t, "GBps": r["bytes"] / t / 1e9} if "seconds" in r else r for r, t in zip(eager, times)]
    dist.barrier()
    adam = device_adam(quick, 3 if quick else 5)
    (t,) = slowest([adam["seconds"]])
    adam = {**adam, "seconds": t, "GBps": adam["GBps"] * adam["seconds"] / t}
    return {"eager": eager, "device_adam": adam}


# the executor's blocks at a width where their kernels take next to nothing (executor/profile/collectives.py
# _tp_block_overhead): what is left is the host's time per block
TP_PROBE = {"hidden": 64, "heads": 2, "ffn": 192, "layers": 4, "batch": 4, "seq": 64}


def _tp_block_overhead(dist, torch, device, quick: bool) -> dict | None:
    """The host time tensor parallelism adds to a block in torch eager (a CPU): the executor's own
    Llama-style blocks (executor.models.Block) sharded with the executor's TP styles (Megatron's
    column- then row-parallel linears, executor/parallelize.py tp_style, sequence parallelism off)
    over every rank, against the same blocks unsharded, at a width (TP_PROBE) where the products and
    the elementwise kernels take next to nothing. Forward and forward + backward are timed (median
    over samples, each after a barrier, the slowest rank's); what TP adds is DTensor's dispatch of
    every op and the redistributions and functional collectives at the layer's four all-reduces.
    On the 2-core VM it was 19 ms per block forward and backward, the blocks' own work 3.6 ms; the
    profile subtracts what it charges for the four all-reduces themselves
    (executor/profile/toml.py)."""
    if device.type == "cuda":
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from executor.models import Block
    from executor.parallelize import tp_style
    from planner.model import ModelSpec
    p = TP_PROBE
    spec = ModelSpec(name="tp-probe", num_layers=p["layers"], hidden=p["hidden"], num_heads=p["heads"],
                     num_kv_heads=p["heads"], head_dim=p["hidden"] // p["heads"], ffn_hidden=p["ffn"], vocab_size=512,
                     seq_len=p["seq"], max_positions=0, mlp="swiglu", norm="rmsnorm", linear_bias=False,
                     qkv_bias=False, tied_embeddings=False, dropout=0.0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.o_proj": "rowwise",
              "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    x0 = torch.randn(p["batch"], p["seq"], p["hidden"])
    samples = 10 if quick else 20
    out = {**p, "samples": samples, "activation_bytes": x0.numel() * 4}
    for sharded in (False, True):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList([Block(spec) for _ in range(p["layers"])])
        if sharded:
            parallelize_module(blocks, mesh, {f"{i}.{k}": tp_style(v, False)
                                              for i in range(p["layers"]) for k, v in styles.items()})

        def forward(backward: bool):
            x = x0.clone().requires_grad_()
            for b in blocks:
                x = b(x)
            if backward:
                x.sum().backward()
        for backward in (False, True):
            for _ in range(3):
                forward(backward)
            times = []
            for _ in range(samples):
                dist.barrier()
                t0 = time.perf_counter()
                forward(backward)
                times.append(time.perf_counter() - t0)
            t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[("tp" if sharded else "plain") + ("_fwd_bwd_s" if backward else "_fwd_s")] = t.item()
    return out


def _worker(rank: int, world: int, backend: str, port: int, out: str, quick: bool, threads: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    dist.all_reduce(torch.ones(1, device=device))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = total - free
    else:
        reserved = _rss_bytes()
    reserved_t = torch.tensor([float(reserved)], dtype=torch.float64, device=device)
    dist.all_reduce(reserved_t, op=dist.ReduceOp.MAX)
    # a CPU's collectives vary call to call, and their mean (collective_time) is what a step pays: a
    # scheduler stall of a few ms among 12 samples moved the 8-byte mean from 0.45 to 1.8 ms and a quick
    # profile's ZeRO-2 prediction from 1.74 to 2.43 s minutes apart; 48 samples (96 without
    # --quick) cost about a second
    repeat = (3 if quick else 5) if device.type == "cuda" else (48 if quick else 96)
    rows = [_collectives(dist, torch, device, world, rank, size, repeat)
            for size in (SIZES_QUICK if quick else SIZES)]
    contention = _contention(dist, torch, device, 3 if quick else 7)
    concurrent = _concurrent_gemm(dist, torch, device, quick)
    kernels = _concurrent_kernels(dist, torch, quick) if device.type == "cpu" else None
    tp_block = _tp_block_overhead(dist, torch, device, quick)
    sync_wait = _sync_wait(dist, torch, device, quick)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"backend": backend, "world": world, "threads": threads, "reserved_bytes": reserved_t.item(),
                       "sizes": rows, "contention": contention, "gemm_concurrent": concurrent,
                       "kernels_concurrent": kernels, "tp_block": tp_block,
                       "sync_wait": sync_wait}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    # leave without the C++ runtime's exit handlers: a thread the functional collectives (DTensor, in
    # _tp_block_overhead) leave joinable made one process abort at exit in about 20 profiles
    # ("terminate called without an active exception"), after everything was written
    from executor.train import exit_now
    exit_now(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.nproc < 2:
        p.error("--nproc must be at least 2 to measure collectives")
    import torch.multiprocessing as mp
    from executor.launch import free_port
    mp.spawn(_worker, args=(args.nproc, args.backend, free_port(), args.out, args.quick, args.threads),
             nprocs=args.nproc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
