"""LoRA fine-tuning in the executor (executor/lora.py): a tiny Llama with rank-4 adapters on q and v, and on
all seven projections, trains three AdamW steps to the losses and the adapters' gradients of a single-process
LoRA run (within 1e-4) under data parallelism (FSDP2 ZeRO-3, also with full recompute; DDP ZeRO-0; meshplan's
ZeRO-1), tensor parallelism (with and without sequence parallelism), dp 2 x tp 2 (FSDP2 ZeRO-3, replicate
ZeRO-0) and pipelines (1F1B; ZB-V, whose split backward meets a stage holding only the frozen embedding; pp 2 x
tp 2); the frozen parameters hold no gradient on any rank, and each rank's bytes of parameters, gradients and
AdamW moments are printed (pytest -rP shows them) and checked against a hand computation.

The gradients compared are the last step's: B starts at zero, so A's first-step gradient is zero too
(dL/dA = scaling B^T dL/dy x^T) and would compare nothing. Plans are written by `meshplan plan`; each world
size runs all its plans in one set of gloo processes (process start-up dominates on 2 cores).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from executor.lora import LoraConfig, adapter_init, adapter_placements, apply_lora, target_paths
from executor_support import GLOBAL_BATCH, SEQ, TINY_GPT, TINY_LLAMA, assert_losses, spawn, write_plan

STEPS = 3
RANK, ALPHA = 4, 8.0
TARGET_SETS = {"qv": ("q", "v"), "all": ("q", "k", "v", "o", "gate", "up", "down")}
# name -> (world size, knobs of `meshplan plan`)
LAYOUTS = {
    "dp2-zero3": (2, {"dp": 2, "zero": 3}),                 # FSDP2 fully_shard, frozen and trainable in one unit
    # checkpointed blocks whose input needs no gradient (the embedding is frozen)
    "dp2-zero3-full-recompute": (2, {"dp": 2, "zero": 3, "recompute": "full"}),
    "dp2-zero0": (2, {"dp": 2}),                            # DDP
    "dp2-zero1": (2, {"dp": 2, "zero": 1}),                 # ShardedAdamW (executor/zero1.py)
    "tp2": (2, {"tp": 2}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),    # row-parallel partial sums reduce-scattered
    "dp2-tp2-zero3": (4, {"dp": 2, "tp": 2, "zero": 3}),
    "dp2-tp2-zero0": (4, {"dp": 2, "tp": 2}),               # torch's FSDP2-based replicate
    "pp2": (2, {"pp": 2, "micro_batch": 2, "schedule": "1f1b"}),
    # a split-backward schedule whose first stage holds only the frozen embedding (STAGES): it has nothing to
    # train, and the next stage's adapters get their gradients through the graph from its input
    "pp2-zbv": (2, {"pp": 2, "vpp": 2, "micro_batch": 2, "schedule": "zbv"}),
    "pp2-tp2": (4, {"pp": 2, "tp": 2, "micro_batch": 2, "schedule": "1f1b"}),
}
# plan.json's stages cut by hand where the planner's cut would not reach the case
STAGES = {"pp2-zbv": [["embed"], ["layers.0", "layers.1"], ["layers.2"], ["layers.3", "norm", "lm_head"]]}
# every layout with all seven projections adapted; q and v alone (a block's linears partly adapted, the frozen ones
# beside them) on the layouts whose bytes are checked against the cost model (test_bytes_per_rank_match_the_cost_model)
QV_LAYOUTS = ("dp2-zero3", "dp2-zero0", "dp2-zero1", "tp2")
CASES = [(layout, targets) for layout in LAYOUTS for targets in TARGET_SETS
         if targets == "all" or layout in QV_LAYOUTS]


# -- the single-process LoRA run -------------------------------------------------------------------------------

def lora_reference(spec, targets: tuple[str, ...], *, steps: int = STEPS, seed: int = 0):
    """One process, no parallelism, the base initialised as every plan is (``full_init``), adapters by
    ``apply_lora``; AdamW (lr 1e-3, executor/train.py's) over the adapters only. Returns (losses, the last
    step's adapter gradients by path)."""
    from executor.data import global_batch
    from executor.models import build_model, full_init
    model = build_model(spec, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_init(name, p.shape, spec, seed))
    apply_lora(model, rank=RANK, alpha=ALPHA, targets=targets, seed=seed)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-3, foreach=False)
    losses, grads = [], {}
    for step in range(steps):
        tokens = global_batch(step, seed=seed, batch=GLOBAL_BATCH, seq_len=SEQ, vocab_size=spec.vocab_size)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        grads = {n: p.grad.clone() for n, p in trainable}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


# -- the distributed runs ----------------------------------------------------------------------------------------

def _forward_collectives(job) -> dict[str, int]:
    """Collectives of one forward of step 0's batch, by op name: a dispatch mode that lets DTensor desugar
    its ops into functional collectives first (returning NotImplemented for DTensor arguments, as torch's
    CommDebugMode does; its module tracker is not used: it fails on this model, IndexError in torch 2.13)."""
    from collections import Counter

    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            if any(t is DTensor for t in types):
                return NotImplemented
            if func.namespace in ("_c10d_functional", "c10d") and "wait" not in str(func) and "wrap" not in str(func):
                self.counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    inputs, _ = job.batch(0)
    with torch.no_grad(), Collectives() as mode:
        job.trained[0](inputs)
    return dict(mode.counts)


def _train(jobs: list[tuple[str, str, tuple[str, ...]]], out_dir: str) -> None:
    """Each job: three steps of executor/train.py's ``train_step`` with LoRA; this rank's record (losses,
    frozen parameters found with a gradient, bytes by category, adapter layouts) to NAME.rankR.json and
    the last step's gradients to NAME.grads.rankR.pt."""
    import torch.distributed as dist

    from executor.measure import grad_bytes, param_bytes, storage_bytes
    from executor.models import canonical_name
    from executor.plan_file import load_plan
    from executor.train import Job, RunOptions, train_step
    rank = dist.get_rank()
    for name, plan_path, targets in jobs:
        start_s = time.perf_counter()
        plan = load_plan(plan_path)
        # the adapters come from plan.json's workload (`meshplan plan --finetune lora`: executor/lora.py finetune_of)
        job = Job(plan, RunOptions(steps=STEPS), torch.device("cpu"))
        assert job.lora == LoraConfig(rank=RANK, alpha=ALPHA, targets=targets), job.lora
        named = [(canonical_name(n), p) for m in job.trained for n, p in m.named_parameters()]
        record = {"frozen_with_grad": [], "trainable_without_grad": [], "grads_bytes": 0}

        def check_then(step_fn, part):
            # after backward (and any reduction), before the update of this part's parameters (a pipeline rank's
            # parts step one after another, each clearing its gradients)
            own = [(canonical_name(n), p) for n, p in part.named_parameters()]

            def run(*args, **kwargs):
                record["frozen_with_grad"] += [n for n, p in own if not p.requires_grad and p.grad is not None]
                record["trainable_without_grad"] += [n for n, p in own if p.requires_grad and p.grad is None]
                record["grads_bytes"] = max(record["grads_bytes"], grad_bytes(job.trained))
                return step_fn(*args, **kwargs)
            return run

        for o, part in zip(job.optimizers, job.trained):
            o.step = check_then(o.step, part)
        record["losses"] = [train_step(job, step, dump_grads=f"{out_dir}/{name}.grads" if step == STEPS - 1 else None)
                            for step in range(STEPS)]
        record["frozen_with_grad"] += [n for n, p in named if not p.requires_grad and p.grad is not None]
        states = [s for o in job.optimizers for s in getattr(o, "optim", o).state.values()]
        record.update(
            params_bytes=param_bytes(job.trained),
            moments_bytes=storage_bytes(s[k] for s in states for k in ("exp_avg", "exp_avg_sq")),
            step_counters_bytes=storage_bytes(s["step"] for s in states),
            trainable_local_bytes=storage_bytes(p for n, p in named if p.requires_grad),
            optimizer_params=sum(len(getattr(o, "optim", o).state) for o in job.optimizers),
            layouts={n: [repr(pl) for pl in p.placements] for n, p in named
                     if n.startswith("layers.0.") and n.endswith(("lora_A", "lora_B", "proj.weight"))
                     and hasattr(p, "placements")})
        if name.startswith("tp2-all"):      # the adapters add no collective to the forward
            plain = Job(plan, RunOptions(steps=STEPS), torch.device("cpu"))
            record["forward_collectives"] = {"lora": _forward_collectives(job), "plain": _forward_collectives(plain)}
        record["seconds"] = time.perf_counter() - start_s
        Path(f"{out_dir}/{name}.rank{rank}.json").write_text(json.dumps(record))


def _load_grads(prefix: str, world: int) -> dict[str, torch.Tensor]:
    merged = {}
    for r in range(world):
        for name, g in torch.load(f"{prefix}.rank{r}.pt", weights_only=True).items():
            merged.setdefault(name, g)
    return merged


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    by_world: dict[int, list] = {}
    for layout, targets in CASES:
        (world, knobs), names = LAYOUTS[layout], TARGET_SETS[targets]
        path = write_plan(tmp, TINY_LLAMA, gpus=world, name=f"{layout}-{targets}", finetune="lora",
                          lora_rank=RANK, lora_targets=",".join(names), **knobs)
        if layout in STAGES:
            plan = json.loads(Path(path).read_text())
            plan["stages"] = STAGES[layout]
            Path(path).write_text(json.dumps(plan))
        by_world.setdefault(world, []).append((f"{layout}-{targets}", path, names))
    for world, jobs in sorted(by_world.items()):
        spawn(_train, world, jobs, str(tmp))
    out = {}
    for layout, targets in CASES:
        world, name = LAYOUTS[layout][0], f"{layout}-{targets}"
        ranks = [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(world)]
        out[layout, targets] = ranks, _load_grads(str(tmp / f"{name}.grads"), world)
    return out


@pytest.fixture(scope="module")
def references():
    return {targets: lora_reference(TINY_LLAMA, names) for targets, names in TARGET_SETS.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("layout,targets", CASES)
def test_lora_equals_single_process(results, references, layout, targets):
    ranks, grads = results[layout, targets]
    ref_losses, ref_grads = references[targets]
    for r, record in enumerate(ranks):
        assert_losses(record["losses"], ref_losses, against="single-process LoRA")
        assert record["frozen_with_grad"] == [], f"rank {r}: frozen parameters with a gradient"
        assert record["trainable_without_grad"] == [], f"rank {r}: adapters without a gradient"
    assert set(grads) == set(ref_grads)         # only the adapters were written: nothing else is trainable
    assert all(name.endswith(("lora_A", "lora_B")) for name in grads)
    floor = 1e-5 * max(g.abs().max().item() for g in ref_grads.values())
    for name, want in ref_grads.items():
        assert want.abs().max() > 0, name       # the last step's A and B gradients are both non-zero
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=floor, msg=lambda m: f"{name}: {m}")


# -- bytes per rank against a hand computation ------------------------------------------------------------------

FP32_BYTES = 4       # CPU runs keep fp32 parameters (executor/parallelize.py mixed_precision: none on CPU)


def adapter_numel(spec, targets: tuple[str, ...], rank: int) -> int:
    """r (in + out) per adapted linear, over every block (Hu et al. 2021, Sec 4.1)."""
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn_hidden
    shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, f), "up": (h, f), "down": (f, h)}
    return spec.num_layers * sum(rank * sum(shapes[t]) for t in targets)


def hand_bytes(layout: str, targets: str) -> dict[str, int]:
    """Bytes per rank by category for the data-parallel layouts: the base (frozen) and adapter parameters,
    gradients of the adapters only, and AdamW's two moments of the adapters only. ZeRO-3 shards all three
    over dp (FSDP2: every dimension 0 here is even, so no padding); ZeRO-1 keeps whole parameters and
    gradients and shards the moments; ZeRO-0 (DDP) shards nothing."""
    base, adapters = TINY_LLAMA.num_params(), adapter_numel(TINY_LLAMA, TARGET_SETS[targets], RANK)
    dp = LAYOUTS[layout][1]["dp"]
    params_split, grads_split, moments_split = {"dp2-zero3": (dp, dp, dp), "dp2-zero3-full-recompute": (dp, dp, dp),
                                                "dp2-zero1": (1, 1, dp), "dp2-zero0": (1, 1, 1)}[layout]
    return {"params_bytes": (base + adapters) * FP32_BYTES // params_split,
            "grads_bytes": adapters * FP32_BYTES // grads_split,
            "moments_bytes": 2 * adapters * FP32_BYTES // moments_split}


def test_hand_counts_of_the_tiny_llama():
    """The numbers hand_bytes uses, spelt out: tiny Llama (h 64, 4 heads of 16, 2 kv heads, f 160, V 128,
    4 layers, untied head) has 188,992 parameters; rank-4 adapters on q (64 -> 64) and v (64 -> 32) add
    4 x 4 x (128 + 96) = 3,584, on all seven projections 4 x 4 x (128 + 96 + 96 + 128 + 3 x 224) = 17,920."""
    assert TINY_LLAMA.num_params() == 128 * 64 + 4 * (2 * 64 + 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 160) + 64 + 128 * 64
    assert TINY_LLAMA.num_params() == 188_992
    assert adapter_numel(TINY_LLAMA, TARGET_SETS["qv"], RANK) == 3_584
    assert adapter_numel(TINY_LLAMA, TARGET_SETS["all"], RANK) == 17_920
    assert hand_bytes("dp2-zero3", "qv") == {"params_bytes": 385_152, "grads_bytes": 7_168, "moments_bytes": 14_336}


@pytest.mark.distributed
@pytest.mark.parametrize("layout,targets", CASES)
def test_bytes_per_rank(results, layout, targets):
    """Each rank's bytes (printed for the cost model's later comparison); the data-parallel layouts equal the
    hand computation, and under TP the gradients and moments are those of the local adapter shards only."""
    ranks, _ = results[layout, targets]
    for r, record in enumerate(ranks):
        print(f"{layout} {targets} rank {r}: params {record['params_bytes']} B, grads {record['grads_bytes']} B, "
              f"AdamW moments {record['moments_bytes']} B (+ step counters {record['step_counters_bytes']} B); "
              f"built and trained in {record['seconds']:.2f} s")
        trainable = record["trainable_local_bytes"]
        if not layout.startswith(("tp2", "dp2-tp2", "pp2")):
            want = hand_bytes(layout, targets)
            assert {k: record[k] for k in want} == want, f"rank {r}"
        else:
            assert record["grads_bytes"] == trainable and record["moments_bytes"] == 2 * trainable, f"rank {r}"
    # AdamW sees the adapters and nothing else: all of them on every rank, or under a pipeline each stage's on the
    # ranks holding it
    adapters = 2 * len(TARGET_SETS[targets]) * TINY_LLAMA.num_layers
    world, knobs = LAYOUTS[layout]
    assert sum(r["optimizer_params"] for r in ranks) == adapters * world // knobs.get("pp", 1)
    if "pp" not in knobs:
        assert all(r["optimizer_params"] == adapters for r in ranks)


@pytest.mark.distributed
def test_adapters_take_the_layout_of_their_base(results):
    """Column-parallel base (Shard(0)): A replicated, B Shard(0); row-parallel base (Shard(1)): A Shard(1), B
    replicated (adapter_placements); under FSDP2 the dp mesh's Shard(0) comes first."""
    ranks, _ = results["tp2", "all"]
    layouts = ranks[0]["layouts"]
    for linear in ("attn.q_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        base = f"layers.0.{linear}"
        assert layouts[f"{base}.weight"] == ["Shard(dim=0)"]
        assert layouts[f"{base}.lora_A"] == ["Replicate()"] and layouts[f"{base}.lora_B"] == ["Shard(dim=0)"]
    for linear in ("attn.o_proj", "mlp.down_proj"):
        base = f"layers.0.{linear}"
        assert layouts[f"{base}.weight"] == ["Shard(dim=1)"]
        assert layouts[f"{base}.lora_A"] == ["Shard(dim=1)"] and layouts[f"{base}.lora_B"] == ["Replicate()"]
    fsdp = results["dp2-tp2-zero3", "all"][0][0]["layouts"]
    assert fsdp["layers.0.attn.o_proj.lora_A"] == ["Shard(dim=0)", "Shard(dim=1)"]


@pytest.mark.distributed
def test_adapters_add_no_collective_to_the_tensor_parallel_forward(results):
    """A row-parallel linear's adapter output is a partial sum reduced by the base's own all-reduce: a
    forward with adapters on all seven projections runs the collectives of one without them."""
    counts = results["tp2", "all"][0][0]["forward_collectives"]
    print(f"tp2 forward collectives with adapters on all seven projections: {counts['lora']}, without: "
          f"{counts['plain']}")
    assert counts["lora"] == counts["plain"], counts
    assert counts["plain"]        # the TP forward does reduce something


# -- pure: initialisation, targets, refusals -----------------------------------------------------------------------

def test_adapters_start_at_the_base_model_and_only_they_train():
    from executor.models import build_model, full_init
    model = build_model(TINY_LLAMA, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_init(name, p.shape, TINY_LLAMA, 0))
    ids = torch.randint(0, TINY_LLAMA.vocab_size, (2, SEQ))
    before = model(ids)
    adapted = apply_lora(model, rank=RANK, alpha=ALPHA, targets=("q", "down"))
    assert adapted == [f"layers.{i}.{p}" for i in range(4) for p in ("attn.q_proj", "mlp.down_proj")]
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)      # B = 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{path}.{leaf}" for path in adapted for leaf in ("lora_A", "lora_B")}
    q = model.layers["0"].attn.q_proj
    assert isinstance(q, torch.nn.Linear) and q.scaling == ALPHA / RANK
    assert q.lora_A.shape == (RANK, 64) and q.lora_B.shape == (64, RANK)


def test_adapter_init_is_nn_linear_default_and_depends_only_on_name_and_seed():
    """A: Kaiming-uniform with a = sqrt(5), bound 1/sqrt(in) (nn.Linear's and PEFT's); B: zeros."""
    from executor.models import full_init
    a = adapter_init("layers.1.attn.q_proj.lora_A", (RANK, 64), 0)
    assert a.abs().max() <= 1 / 64 ** 0.5 and a.std() > 0.5 / 64 ** 0.5 / 3 ** 0.5
    torch.testing.assert_close(a, full_init("layers.1.attn.q_proj.lora_A", (RANK, 64), TINY_LLAMA, 0))
    assert not torch.equal(a, adapter_init("layers.2.attn.q_proj.lora_A", (RANK, 64), 0))
    assert not torch.equal(a, adapter_init("layers.1.attn.q_proj.lora_A", (RANK, 64), 1))
    assert torch.count_nonzero(adapter_init("layers.1.attn.q_proj.lora_B", (64, RANK), 0)) == 0


def test_targets_are_named_and_unknown_ones_refused():
    from executor.models import build_model
    from planner.errors import UserError
    assert target_paths(("q", "v_proj", "down")) == ("attn.q_proj", "attn.v_proj", "mlp.down_proj")
    with pytest.raises(UserError, match=r"lora\.targets: unknown LoRA target 'qkv'; allowed: q \(attn\.q_proj\)"):
        LoraConfig(rank=4, alpha=8, targets=("qkv",))
    with pytest.raises(UserError, match=r"layers\.0\.mlp\.gate_proj: no such linear.*q, k, v, o, fc1, fc2"):
        apply_lora(build_model(TINY_GPT), rank=4, alpha=8, targets=("gate",))
    with pytest.raises(UserError, match="lora.rank"):
        LoraConfig(rank=0, alpha=8)


def test_plain_weights_get_plain_adapters():
    assert adapter_placements(torch.zeros(4, 4)) is None


@pytest.mark.distributed
def test_a_stage_with_nothing_to_train_still_steps(results):
    """The embedding-only stage of the ZB-V run (rank 0 holds it and the last stage): its optimizer has an
    empty group, and the rank's optimizers see only the last stage's adapters."""
    ranks, _ = results["pp2-zbv", "all"]
    assert ranks[0]["optimizer_params"] == 2 * len(TARGET_SETS["all"])         # layers.3's adapters
    assert ranks[1]["optimizer_params"] == 2 * len(TARGET_SETS["all"]) * 3     # layers.0, 1 and 2's


@pytest.mark.distributed
@pytest.mark.parametrize("layout", QV_LAYOUTS + ("pp2",))
def test_bytes_per_rank_match_the_cost_model(results, tmp_path, layout):
    """The planner's memory of the same plan (`meshplan plan --finetune lora`: frozen base, adapters with their
    gradients and AdamW moments) against what every rank holds, each within 5%; under a pipeline each rank
    against its stage's."""
    from executor.plan_file import load_plan
    from planner import api
    world, knobs = LAYOUTS[layout]
    targets = "all" if layout.startswith("pp") else "qv"
    path = write_plan(tmp_path, TINY_LLAMA, gpus=world, name=layout, finetune="lora", lora_rank=RANK,
                      lora_targets=",".join(TARGET_SETS[targets]), **knobs)
    plan = load_plan(path)
    stages = api.estimate(api.load_job(str(tmp_path / "tiny-llama.json"), cluster="cpu-gloo", gpus=world,
                                       global_batch=plan.workload.global_batch, seq_len=plan.workload.seq_len,
                                       precision="fp32", finetune="lora", lora_rank=RANK,
                                       lora_targets=TARGET_SETS[targets]),
                          plan.config).estimate.memory_per_stage
    ranks, _ = results[layout, targets]
    for rank, r in enumerate(ranks):
        memory = stages[rank if layout.startswith("pp") else 0]
        assert r["params_bytes"] == pytest.approx(memory.params, rel=0.05), (r["params_bytes"], memory.params)
        assert r["grads_bytes"] == pytest.approx(memory.grads, rel=0.05), (r["grads_bytes"], memory.grads)
        assert r["moments_bytes"] == pytest.approx(memory.optimizer, rel=0.05), (r["moments_bytes"], memory.optimizer)
