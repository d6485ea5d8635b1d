"""Every recompute policy as the executor runs it (executor/activations.py): the same training as no
recompute, and the bytes it keeps for backward, per layer and in total, against the cost model.

Kept bytes are measured by liveness (tests/held_bytes.py): the storages a forward creates that are
still alive after it, whatever holds them (autograd's saved tensors, selective checkpointing's cache, a
checkpoint's input), each counted once; what offload moved to the host is counted apart. Predictions
are planner/cost/layer.py's for the same shapes on the cpu-gloo profile (fp32, flash attention).

Known and measured: without recompute the executor keeps the attention output twice (the kernel keeps
its output for its backward, the output projection its contiguous copy), which the layer graph counts
once: "none" (and what "offload" moves) measures about 6% above the prediction on these models.
"""
from __future__ import annotations

import weakref

import pytest
import torch

from executor.data import global_batch
from held_bytes import block_held_bytes, model_held_bytes
from executor.models import build_model, sdpa
from executor.activations import PENDING, HostStash, _Moved, apply_policy
from executor_support import SEQ, TINY_GPT, TINY_LLAMA, assert_losses, reference_run
from planner.cluster import load_cluster
from planner.cost.layer import Context, layer_cost
from planner.layers import build_layer_graph
from planner.recompute import every_k_layers
from planner.runtimes import ALL_RECOMPUTES as POLICIES     # what the executor applies (no Megatron "discard")

STEPS = 3
MODELS = {"gpt": TINY_GPT, "llama": TINY_LLAMA}
PLANS = [*POLICIES[1:], "every-2"]          # "none" is the reference
MICRO_BATCH = 2


def per_layer(spec, plan: str) -> dict[str, str]:
    """plan.json's recompute_per_layer for every block under ``plan`` (a policy, or every-K)."""
    graph = build_layer_graph(spec)
    if plan.startswith("every-"):
        policies = every_k_layers(graph, int(plan.split("-")[1]))
    else:
        policies = [plan if layer.is_block else "none" for layer in graph.layers]
    return {layer.name: p for layer, p in zip(graph.layers, policies)}


@pytest.fixture(scope="module")
def references():
    return {model: reference_run(spec, steps=STEPS) for model, spec in MODELS.items()}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_policy_trains_like_no_recompute(references, model, plan):
    losses, grads = reference_run(MODELS[model], steps=STEPS, recompute_per_layer=per_layer(MODELS[model], plan))
    ref_losses, ref_grads = references[model]
    assert_losses(losses, ref_losses, against="no recompute")
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


# -- what each policy keeps, measured against the cost model --------------------------------------

CTX = Context(micro_batch=MICRO_BATCH, seq_len=SEQ, tp=1, cp=1, sequence_parallel=False, precision="fp32",
              attention="flash", framework="torch", tp_comm_overlap=False)


def predicted(spec, index: int, policy: str) -> tuple[float, float]:
    """(device bytes, host bytes) the cost model keeps for layer ``index`` of ``spec`` at MICRO_BATCH x SEQ,
    as the executor's bookkeeping splits them: what offload moves is in its host stash (``host``), which on
    this CPU is the same memory; the cost model of a CPU cluster counts it on the device (test below)."""
    cost = layer_cost(build_layer_graph(spec).layers[index], CTX, load_cluster("cpu-gloo"))
    device, host = cost.policy(policy).act_bytes, cost.policy(policy).host_bytes
    return (0.0, device + host) if policy == "activation-offload" else (device, host)


def test_offload_on_a_cpu_keeps_what_no_recompute_keeps_and_costs_one_clone():
    layer = build_layer_graph(TINY_LLAMA).layers[1]
    cpu = load_cluster("cpu-gloo")
    cost = layer_cost(layer, CTX, cpu)
    none_keep, off = cost.policy("none").act_bytes, cost.policy("activation-offload")
    assert off.act_bytes == none_keep and off.host_bytes == 0
    # the clone reads and writes the kept bytes once, at the profile's copy rate (read + write bytes per second)
    d = cpu.device
    assert off.recompute_s == pytest.approx(2 * none_keep / (d.hbm_bytes_per_s * d.hbm_efficiency))
    # one block's originals beside their clones while its forward runs: one block more at the peak
    assert off.peak_extra_bytes == pytest.approx(cost.policy("none").peak_extra_bytes + none_keep)


def close(measured: float, want: float) -> bool:
    """Within 10% of the prediction; a prediction of nothing must measure nothing."""
    return measured == 0 if want == 0 else abs(measured - want) <= 0.10 * want


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", list(MODELS))
def test_kept_bytes_per_block_match_the_cost_model(model, policy):
    spec = MODELS[model]
    torch.manual_seed(0)
    blocks = build_model(spec, "cpu").layers
    x = torch.randn(MICRO_BATCH, SEQ, spec.hidden)                                   # (B, S, h)
    for index, block in blocks.items():
        device, host = block_held_bytes(block, policy, x, attention_core=sdpa)
        want_device, want_host = predicted(spec, 1 + int(index), policy)
        assert close(device, want_device), (f"layers.{index} {policy}: kept {device} B on the device, "
                                            f"predicted {want_device:.0f}")
        assert close(host, want_host), f"layers.{index} {policy}: moved {host} B to the host, predicted {want_host:.0f}"


def test_policies_keep_what_they_should_relative_to_each_other():
    """The measurement can tell the policies apart: full keeps only the input, op less than none,
    offload nothing on the device and none's bytes on the host."""
    spec = TINY_LLAMA
    x = torch.randn(MICRO_BATCH, SEQ, spec.hidden)
    kept = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        kept[policy] = block_held_bytes(build_model(spec, "cpu").layers["0"], policy, x, attention_core=sdpa)
    assert kept["full"] == (x.numel() * 4, 0)
    assert kept["full"][0] < kept["op"][0] < kept["none"][0]
    assert kept["activation-offload"] == (0, kept["none"][0])


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("model", list(MODELS))
def test_kept_bytes_of_the_whole_model_match_the_cost_model(model, plan):
    """Embedding, blocks under the plan's policies, final norm, head and loss: the total."""
    spec = MODELS[model]
    policies = per_layer(spec, plan)
    torch.manual_seed(0)
    tokens = global_batch(0, seed=0, batch=MICRO_BATCH, seq_len=SEQ, vocab_size=spec.vocab_size)
    device, host = model_held_bytes(build_model(spec, "cpu"), policies, tokens[:, :-1], tokens[:, 1:],
                                    attention_core=sdpa)
    layers = build_layer_graph(spec).layers
    want = [predicted(spec, i, policies[layer.name]) for i, layer in enumerate(layers)]
    assert close(device, sum(d for d, _ in want)), (device, sum(d for d, _ in want))
    assert close(host, sum(h for _, h in want)), (host, sum(h for _, h in want))


# -- offload prefetch: the copy-in of the block before runs beside a block's backward -----------------

STACK = TINY_LLAMA.num_layers                # blocks in the offload stack


def offload_stack(offload: bool):
    """TINY_LLAMA's blocks alone (input and output (B, S, h)), every one offloaded where ``offload``; the
    same parameters either way."""
    torch.manual_seed(0)
    model = build_model(TINY_LLAMA, "cpu", keep=tuple(f"layers.{i}" for i in range(STACK)))
    if offload:
        for block in model.layers.values():
            apply_policy(block, "activation-offload")
    return model


def stack_grads(micro_batches, order) -> dict[str, torch.Tensor]:
    """Gradients of a no-recompute stack: forward every micro-batch, then backward in ``order``."""
    model = offload_stack(offload=False)
    xs = [x.detach().requires_grad_() for x in micro_batches]
    losses = [model(x).square().mean() for x in xs]
    for m in order:
        losses[m].backward()
    return {**{n: p.grad for n, p in model.named_parameters()}, **{f"x{m}": x.grad for m, x in enumerate(xs)}}


def run_logged(monkeypatch, micro_batches, order):
    """The offloaded stack on ``micro_batches`` (every forward first, then the backwards in ``order``),
    with every copy-in and every unpack logged as (event, stash seq, storage key, micro-batch in backward).
    Returns (log, stash seqs per micro-batch in block order, gradients)."""
    log, backward_of = [], [None]
    copy_in, unpack = HostStash._copy_in, HostStash.unpack

    def logged_copy_in(self, key):
        log.append(("in", self.seq, key, backward_of[0]))
        return copy_in(self, key)

    def logged_unpack(packed):
        if isinstance(packed, _Moved):
            log.append(("unpack", packed.stash.seq, packed.key, backward_of[0]))
        return unpack(packed)

    monkeypatch.setattr(HostStash, "_copy_in", logged_copy_in)
    monkeypatch.setattr(HostStash, "unpack", staticmethod(logged_unpack))
    model = offload_stack(offload=True)
    xs = [x.detach().requires_grad_() for x in micro_batches]
    seqs, losses = [], []
    for x in xs:
        first = len(PENDING)
        losses.append(model(x).square().mean())
        seqs.append([s.seq for s in PENDING.stashes(torch.device("cpu"))][-STACK:])
        assert len(PENDING) == first + STACK
    for m in order:
        backward_of[0] = m
        losses[m].backward()
    grads = {**{n: p.grad for n, p in model.named_parameters()}, **{f"x{m}": x.grad for m, x in enumerate(xs)}}
    return log, seqs, grads


def assert_prefetched(log, seqs):
    """In each micro-batch, block k-1's storages are each copied in once, while block k's backward runs:
    after block k's first unpack, before its last, and before block k-1's first unpack; the last block's
    right at its own first unpack (no block after it prefetches it)."""
    def unpacks(seq):
        return [i for i, e in enumerate(log) if e[:2] == ("unpack", seq)]

    for blocks in seqs:
        for k, seq in enumerate(blocks):
            copies = [i for i, e in enumerate(log) if e[:2] == ("in", seq)]
            keys = [log[i][2] for i in copies]
            assert copies and len(keys) == len(set(keys)), f"block {k}: copied in {keys}"
            assert set(keys) == {log[i][2] for i in unpacks(seq)}, f"block {k}: copied in what it unpacks"
            if k + 1 < len(blocks):
                after = unpacks(blocks[k + 1])
                assert after[0] < min(copies) and max(copies) < min(after[-1], unpacks(seq)[0]), (
                    f"block {k}: copy-ins at {copies}, block {k + 1}'s unpacks at {after}, its own at {unpacks(seq)}")
            else:
                assert copies == list(range(unpacks(seq)[0] + 1, unpacks(seq)[0] + 1 + len(copies))), (
                    f"last block: copy-ins at {copies}, unpacks at {unpacks(seq)}")


def assert_grads(got, want):
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_offload_prefetches_the_block_before_while_a_backward_runs(monkeypatch):
    torch.manual_seed(1)
    x = torch.randn(MICRO_BATCH, SEQ, TINY_LLAMA.hidden)                              # (B, S, h)
    log, seqs, grads = run_logged(monkeypatch, [x], order=[0])
    assert_prefetched(log, seqs)
    assert_grads(grads, stack_grads([x], order=[0]))


def test_offload_prefetch_stays_within_a_micro_batch(monkeypatch):
    """Forward mb0, forward mb1, backward mb0, backward mb1: mb1's blocks are newer than mb0's, so none
    is fetched during mb0's backward, and mb0's have all started when mb1's backward runs."""
    torch.manual_seed(1)
    xs = [torch.randn(MICRO_BATCH, SEQ, TINY_LLAMA.hidden) for _ in range(2)]       # 2 x (B, S, h)
    log, seqs, grads = run_logged(monkeypatch, xs, order=[0, 1])
    assert_prefetched(log, seqs)
    for event, seq, key, during in log:
        assert seq in seqs[during], f"{event} of stash {seq} during micro-batch {during}'s backward"
    assert_grads(grads, stack_grads(xs, order=[0, 1]))


def test_offload_pending_stashes_do_not_leak():
    """After a backward no stash is pending; a forward whose graph is dropped (grad enabled) or that
    keeps none (no_grad) leaves nothing behind, step after step; a live graph's stashes stay pending."""
    cpu = torch.device("cpu")
    before = len(PENDING)
    model = offload_stack(offload=True)
    x = torch.randn(MICRO_BATCH, SEQ, TINY_LLAMA.hidden, requires_grad=True)       # (B, S, h)
    y = model(x)
    mine = PENDING.stashes(cpu)[-STACK:]
    assert len(PENDING) == before + STACK and all(not s.started for s in mine)
    y.sum().backward()
    assert len(PENDING) == before and all(s.started for s in mine)
    refs = [weakref.ref(s) for s in mine]
    del y, mine
    assert all(ref() is None for ref in refs), "a stash outlived its backward"
    for _ in range(3):
        y = model(x)                        # an eval forward with grad enabled: its graph is dropped
        assert len(PENDING) == before + STACK
        del y
        assert len(PENDING) == before
        with torch.no_grad():
            model(x)
        assert len(PENDING) == before
