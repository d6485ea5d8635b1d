"""Shared by the executor tests: tiny models, plans written the way the planner writes them,
a gloo process group on localhost, and the single-process reference run."""
from __future__ import annotations

import contextlib
import io
import json
import os
import traceback
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from executor.data import global_batch
from executor.launch import free_port
from executor.models import build_model, full_init, init_key
from executor.moe import update_expert_bias
from executor.train import exit_now
from planner.model import ModelSpec, config_json

SEQ = 16
GLOBAL_BATCH = 8

TINY_GPT = ModelSpec(name="tiny-gpt", num_layers=4, hidden=64, num_heads=4, num_kv_heads=4, head_dim=16,
                     ffn_hidden=256, vocab_size=128, seq_len=SEQ, max_positions=SEQ, mlp="gelu", norm="layernorm",
                     linear_bias=True, qkv_bias=False, tied_embeddings=True, dropout=False, fused_qkv=True)
# a third shape: more, narrower heads sharing one key/value head, six layers, a wider MLP
TINY_GQA = ModelSpec(name="tiny-gqa", num_layers=6, hidden=64, num_heads=8, num_kv_heads=1, head_dim=8,
                     ffn_hidden=192, vocab_size=96, seq_len=SEQ, max_positions=0, mlp="swiglu", norm="rmsnorm",
                     linear_bias=False, qkv_bias=False, tied_embeddings=False, dropout=False)
TINY_LLAMA = ModelSpec(name="tiny-llama", num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       ffn_hidden=160, vocab_size=128, seq_len=SEQ, max_positions=0, mlp="swiglu", norm="rmsnorm",
                       linear_bias=False, qkv_bias=False, tied_embeddings=False, dropout=False)
# Qwen3's block: the Llama one with an RMSNorm of every head's q and k (executor/models.py QKNorm)
TINY_QWEN3 = replace(TINY_LLAMA, name="tiny-qwen3", qk_norm=True)


def write_plan(tmp_path, spec: ModelSpec, *, gpus: int, name: str = "plan", global_batch: int = GLOBAL_BATCH,
               cluster: str = "cpu-gloo", searched: bool = False, precision: str | None = None, **knobs) -> str:
    """plan.json from `meshplan plan` (the planner's CLI) for ``spec`` with fixed knobs: those given,
    and tp 1, pp 1, ZeRO-0, one micro-batch per replica and no recompute unless given; with
    ``searched`` only those given (the planner searches the rest). ``precision``: default fp32 on
    cpu-gloo, bf16 elsewhere."""
    from planner.cli import main as planner_main
    config = tmp_path / f"{spec.name}.json"
    config.write_text(json.dumps(config_json(spec)))
    out = tmp_path / f"{name}.json"
    argv = ["plan", "--model", str(config), "--cluster", cluster, "--gpus", str(gpus),
            "--precision", precision or ("fp32" if cluster == "cpu-gloo" else "bf16"),
            "--global-batch", str(global_batch), "--seq-len", str(spec.seq_len), "--out", str(out), "--json"]
    defaults = {} if searched else {"tp": 1, "pp": 1, "zero": 0, "micro_batch": global_batch // gpus,
                                    "recompute": "none"}
    for key, value in {**defaults, **knobs}.items():
        flag = "--" + key.replace("_", "-")
        if key == "compile":            # a switch: --compile or nothing
            argv += [flag] if value else []
            continue
        argv += [flag, ("on" if value else "off") if isinstance(value, bool) else str(value)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert planner_main(argv) == 0, argv
    return str(out)


def assert_losses(got: list[float], want: list[float], against: str = "uninterrupted") -> None:
    """Step for step, each loss within 1e-4 (relative) of the one in ``want`` (the ``against`` run's)."""
    assert len(got) == len(want), f"{len(got)} losses vs {len(want)} of the {against} run"
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-4 * abs(w), f"step {step}: {g} vs {against} {w}"


def _worker(rank: int, world_size: int, port: int, fn, args, errors, finished, environ: dict[str, str]):
    # the test process's environment as it is now, not as it was when the fork server started
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(*args)
        dist.barrier()      # no rank tears its connections down while another still uses them
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        dist.destroy_process_group()
        raise
    finished.put(rank)      # past the barrier: every rank has finished fn and written what it writes
    dist.destroy_process_group()
    # as the launched ranks do (executor.train.exit_now): gloo's threads releasing tensors during the
    # interpreter's finalization aborted a finished rank (SIGABRT) in a fresh CI run
    exit_now(0)


# Ranks start from a fork server that has imported torch and the executor once (multiprocessing's
# "forkserver"): a fresh interpreter per rank spent about 3 s importing them, on every spawn of every test.
# The fork server is itself a fresh interpreter that has only imported (no thread, no process group, nothing
# of the test process's state), and each rank forks from it before any torch work, so the ranks start as
# clean as spawned ones; each takes the test process's environment as it is at the spawn (``_worker``).
START_METHOD = "forkserver"
PRELOAD = ["executor.train"]


# what gloo raises on a rank whose peer's process died (third_party/gloo/gloo/transport/tcp/pair.cc)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer")


def spawn(fn, world_size: int, *args) -> None:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; re-raise the first rank's error.

    A rank that dies by a signal after some rank has passed the final barrier is not an error of
    ``fn``: the barrier returns only once every rank has finished ``fn``, so its results are complete.
    gloo's teardown still aborted such a rank (SIGABRT once its work was done, in a
    fresh CI run: all 146 tests of one module errored on one finished rank). A rank that dies by a signal
    before, with no Python error from ``fn`` (on the other ranks at most gloo's for its closed connections,
    ``PEER_GONE``), is the process crashing under it: in a fresh CI run
    (2026-11-29) glibc aborted one rank mid-run ("malloc(): unaligned tcache chunk detected") and the 133
    tests of one module errored, where four other fresh runs of the same commit's tree passed; the run is
    made again, at most three times in all, and a crash that repeats fails. Anything else fails at once."""
    ctx = mp.get_context(START_METHOD)
    ctx.set_forkserver_preload(PRELOAD)
    for attempt in range(3):
        errors, finished = ctx.SimpleQueue(), ctx.SimpleQueue()
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), fn, args, errors, finished, dict(os.environ)),
                               nprocs=world_size, start_method=START_METHOD)
            return
        except Exception as e:
            killed = getattr(e, "signal_name", None) is not None
            if killed and errors.empty() and not finished.empty():
                return
            detail = errors.get() if not errors.empty() else ""
            # a rank killed mid-run, the others' only errors gloo's for its closed connections (or none)
            crashed = killed and (not detail or any(m in detail for m in PEER_GONE))
            # the store's port taken between its choice and its bind (before any rank ran fn): choose again
            if "EADDRINUSE" in str(e) and "init_process_group" in str(e) and attempt < 2:
                continue
            if crashed and attempt < 2:
                warnings.warn(f"distributed run: a rank crashed ({e}); running it again")
                continue
            raise AssertionError(f"distributed run failed: {e}\n{detail}") from None


def reference_run(spec: ModelSpec, *, steps: int, seed: int = 0, lr: float = 1e-3,
                  global_batch_size: int = GLOBAL_BATCH, seq_len: int = SEQ,
                  recompute_per_layer: dict[str, str] | None = None):
    """Single process, no parallelism: mean cross-entropy over the global batch, AdamW; with
    ``recompute_per_layer`` (plan.json's), the executor's recompute policies applied (apply_ac).
    Returns (losses, first step's gradients by parameter path)."""
    torch.manual_seed(0)
    model = build_model(spec, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_init(name, p.shape, spec, seed))
    if recompute_per_layer:
        from executor.models import sdpa
        from executor.parallelize import apply_ac
        apply_ac(model, recompute_per_layer, attention_core=sdpa)

    def loss_of(step: int) -> torch.Tensor:
        return batch_loss(model, spec, step, seed=seed, global_batch_size=global_batch_size, seq_len=seq_len)

    return adamw_steps(model, loss_of, steps=steps, lr=lr)


def batch_loss(model, spec: ModelSpec, step: int, *, seed: int = 0, global_batch_size: int = GLOBAL_BATCH,
               seq_len: int = SEQ) -> torch.Tensor:
    """The mean cross-entropy of ``model`` (whole, one process) over step ``step``'s global batch."""
    tokens = global_batch(step, seed=seed, batch=global_batch_size, seq_len=seq_len, vocab_size=spec.vocab_size)
    logits = model(tokens[:, :-1])                                   # (B, S, V)
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def resumed_run(folder: str, spec: ModelSpec, *, steps: int, lr: float = 1e-3) -> list[float]:
    """Single process, no parallelism, in this process: the model and AdamW loaded from the checkpoint in
    ``folder`` (any plan's, executor/checkpoint.py ``load``), then ``steps`` more steps; their losses."""
    from executor.checkpoint import load
    model = build_model(spec, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    start = load(folder, [model], [optimizer], tied=spec.tied_embeddings)
    return adamw_steps(model, lambda step: batch_loss(model, spec, start + step), steps=steps,
                       optimizer=optimizer)[0]


def adamw_steps(model, loss_of, *, steps: int, lr: float = 1e-3, optimizer=None):
    """``steps`` AdamW steps of ``model`` on ``loss_of(step)`` (the loss of step ``step``'s batch), with
    ``optimizer`` (default a new AdamW). Returns (losses, first step's gradients by parameter path)."""
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    losses, grads = [], None
    for step in range(steps):
        loss = loss_of(step)
        loss.backward()
        if grads is None:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        update_expert_bias([model])         # DeepSeek-V3's balancing bias, where the model has one
        losses.append(loss.item())
    return losses, grads


def load_rank_grads(prefix: str, world_size: int, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Merge the per-rank gradient files; keys are the parameters they stand for (tied head -> embedding)."""
    merged = {}
    for rank in range(world_size):
        path = f"{prefix}.rank{rank}.pt"
        if os.path.exists(path):
            for name, g in torch.load(path, weights_only=True).items():
                merged.setdefault(init_key(name, spec), g)
    return merged


def run_plans(jobs: list[tuple[str, str]], out_dir: str, steps: int) -> None:
    """On every rank of a spawned world: each (name, plan.json) trained ``steps`` steps by executor/train.py's
    ``run``; rank 0 writes what it measured to OUT_DIR/NAME.json, every rank its gradients to NAME.grads."""
    from pathlib import Path
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    for name, plan_path in jobs:
        measured = run(load_plan(plan_path), RunOptions(steps=steps, grads_path=f"{out_dir}/{name}.grads"))
        if dist.get_rank() == 0:
            Path(f"{out_dir}/{name}.json").write_text(json.dumps(measured))


def assert_equal_single_process(result, reference, steps: int) -> None:
    """``result`` (measured, gradients by name) against the single-process ``reference`` (losses, gradients):
    ``steps`` losses within 1e-4, every gradient within 1e-4 relative with an absolute floor at 1e-5 of the
    largest (some gradients are zero analytically, a key bias shifts every score of a query equally, which
    softmax ignores, and are float noise in both runs)."""
    measured, grads = result
    ref_losses, ref_grads = reference
    assert len(measured["losses"]) == steps
    assert_losses(measured["losses"], ref_losses, against="single process")
    assert set(grads) == set(ref_grads)
    floor = 1e-5 * max(g.abs().max().item() for g in ref_grads.values())
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=floor, msg=lambda m: f"{name}: {m}")
