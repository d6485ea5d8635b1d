"""How much host time tensor parallelism adds to the embedding, head and loss in torch eager (a CPU).

    python benchmarks/tp_head_probe.py [--repeat 3]

On 2 gloo processes, the executor's own TP styles for the ends of the model (executor/parallelize.py
tp_style: the vocabulary-parallel embedding, the column-parallel head whose logits stay split for
loss_parallel) against the same modules unsharded, forward and backward with the cross entropy, at a
width (hidden 64, vocabulary 512, 4 x 64 tokens) where the kernels take next to nothing: what is left
is DTensor's dispatch, its redistributions and the collectives of the embedding's all-reduce and of
loss_parallel (max, sum of exponentials, target logits). It prints the median time per micro-batch
(30 samples after a barrier each, the slowest rank's), sharded against unsharded.

The cost model charges the blocks' share of this host time (executor/profile/collectives.py
_tp_block_overhead) but not the ends'. On the 2-core VM the ends cost 10-15 ms per micro-batch more
sharded than unsharded, collectives included: at most 1.5% of the closed loop's TP steps (2
micro-batches, about 2 s), against their measured -4% to +10% over the prediction in the four
recordings of that day.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH, SEQ, HIDDEN, VOCAB = 4, 64, 64, 512


def _worker(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from executor.parallelize import tp_style
    from executor.train import exit_now
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    times = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        ends = torch.nn.ModuleDict({"embed": torch.nn.Embedding(VOCAB, HIDDEN),
                                    "lm_head": torch.nn.Linear(HIDDEN, VOCAB, bias=False)})
        if sharded:
            parallelize_module(ends, mesh, {"embed": tp_style("vocab", False),
                                            "lm_head": tp_style("colwise_loss", False)})
        tokens, targets = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))

        def micro_batch():
            logits = ends["lm_head"](ends["embed"](tokens)).flatten(0, 1)
            if sharded:
                with loss_parallel():
                    F.cross_entropy(logits, targets.flatten()).backward()
            else:
                F.cross_entropy(logits, targets.flatten()).backward()
        for _ in range(3):
            micro_batch()
        samples = []
        for _ in range(30):
            dist.barrier()
            t0 = time.perf_counter()
            micro_batch()
            samples.append(time.perf_counter() - t0)
        slowest = torch.tensor([statistics.median(samples)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times[sharded] = slowest.item()
    if rank == 0:
        print(f"{1e3 * times[False]:>13.2f} {1e3 * times[True]:>11.2f} {1e3 * (times[True] - times[False]):>9.2f}",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # as the profiler's ranks (executor/profile/collectives.py): DTensor's functional collectives can
    # abort the interpreter's exit
    exit_now(0)


def main() -> int:
    import torch.multiprocessing as mp

    from executor.profile.collectives import free_port
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="times the whole probe runs (default 3)")
    args = parser.parse_args()
    print(f"{'unsharded ms':>13} {'sharded ms':>11} {'added ms':>9}   (per micro-batch, 2 gloo processes)")
    for _ in range(args.repeat):
        mp.start_processes(_worker, args=(free_port(),), nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
