"""Selective recompute of a user's module (executor/parallelize.py ``apply_ac`` with no attention core
known, executor/selective.py):
a module written here and a Hugging Face Llama train exactly as without recompute, the attention
core is recomputed (its scores are not held after forward), and what a layer holds for backward
lies between full recompute and none.

What a layer holds is measured as the bytes of the storages made during its forward that are still
alive when the forward has returned (torch's own weak storage references), not through saved-tensor
hooks: selective checkpointing keeps the tensors it saves in its own cache, which those hooks do not
see (they see only the checkpoint's input).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from executor.parallelize import apply_ac
from executor_support import adamw_steps
from planner.errors import UserError

BATCH, SEQ, HIDDEN, HEADS = 2, 32, 64, 4     # (B, nh, S, S) and (B, S, h) differ in size


class Block(nn.Module):
    """Pre-norm transformer block: RMSNorm (torch's, which adds its epsilon in place on CPU), unfused
    causal attention with dropout on the probabilities, a GELU MLP, dropout on the attention's output."""

    def __init__(self, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.p = dropout

    def forward(self, x):                                                       # (B, S, h)
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)  # (B, nh, S, hd)
        scores = q @ k.transpose(-1, -2) / (h // HEADS) ** 0.5                    # (B, nh, S, S)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        y = F.dropout(scores.softmax(-1), self.p, self.training) @ v             # (B, nh, S, hd)
        x = x + F.dropout(self.out(y.transpose(1, 2).reshape(b, s, h)), self.p, self.training)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(32, HIDDEN)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(2))
        self.head = nn.Linear(HIDDEN, 32)

    def forward(self, ids):                                                     # (B, S) -> (B, S, V)
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 32, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _train(net: nn.Module, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of ``steps`` AdamW steps (dropout drawing from the same seed every step) and the first
    step's gradients."""
    def loss_of(step: int) -> torch.Tensor:
        ids, targets = _batch(step)
        torch.manual_seed(100 + step)
        return F.cross_entropy(net(ids).flatten(0, 1), targets.flatten())

    return adamw_steps(net, loss_of, steps=steps)


def _assert_same_training(got, want) -> None:
    (losses, grads), (ref_losses, ref_grads) = got, want
    assert len(set(round(x, 6) for x in ref_losses)) == len(ref_losses), "the losses must move"
    for step, (g, w) in enumerate(zip(losses, ref_losses)):
        assert abs(g - w) <= 1e-4 * abs(w), f"step {step}: {g} against {w} without recompute"
    for name, w in ref_grads.items():
        torch.testing.assert_close(grads[name], w, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_selective_recompute_trains_as_no_recompute_with_dropout():
    torch.manual_seed(0)
    plain = Net()
    selective = copy.deepcopy(plain)
    notes = apply_ac(selective, {"blocks.0": "selective", "blocks.1": "selective"})
    assert len(notes) == 2                       # the run says where it differs from the plan
    _assert_same_training(_train(selective), _train(plain))


def test_selective_recompute_of_hugging_face_llama_layers_trains_as_no_recompute():
    """Hugging Face's Llama decoder layers (eager attention: matmul, softmax, dropout, matmul; their
    own RMSNorm and rotary embedding), called with keyword arguments."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=HIDDEN, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
                                      max_position_embeddings=SEQ, attention_dropout=0.1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).train()
    selective = copy.deepcopy(plain)
    apply_ac(selective, {"model.layers.0": "selective", "model.layers.1": "selective"})

    class Logits(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids).logits

    _assert_same_training(_train(Logits(selective)), _train(Logits(plain)))


class _LiveBytes(TorchDispatchMode):
    """Every storage the ops under it make, by weak reference: ``alive()`` is the bytes of those still
    held (by autograd or by the selective checkpoint's cache)."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude, self.refs = exclude, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.exclude:
                    self.refs[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive(self) -> list[int]:
        return [n for ref, n in self.refs.values() if not ref.expired()]


def _held_after_forward(policy: str) -> list[int]:
    """Bytes of each storage one block's forward leaves alive for backward (its output's included)."""
    torch.manual_seed(0)
    block = Block(dropout=0.1)
    if policy != "none":
        apply_ac(nn.ModuleDict({"b": block}), {"b": policy})
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    exclude = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
    live = _LiveBytes(exclude)
    with live:
        y = block(x)
    held = live.alive()
    y.sum().backward()          # the graph those storages were kept for runs
    return held


def test_selective_holds_less_than_none_more_than_full_and_no_attention_scores():
    none, selective, full = (_held_after_forward(p) for p in ("none", "selective", "full"))
    assert sum(full) < sum(selective) < sum(none), (sum(full), sum(selective), sum(none))
    # the attention scores, probabilities, dropout mask and dropped probabilities are (B, nh, S, S):
    # 2 x 4 x 32 x 32 elements, 32,768 bytes in fp32. Without recompute autograd holds three: softmax's
    # output (its backward's), the dropout mask (the dropout product's) and the dropped probabilities
    # (the product by V's); selectively none
    scores_bytes = BATCH * HEADS * SEQ * SEQ * 4
    assert none.count(scores_bytes) == 3 and scores_bytes not in selective
    # full recompute holds the block's input only (excluded) and its output (B, S, h) in fp32
    assert sum(full) == BATCH * SEQ * HIDDEN * 4


def test_the_policy_recomputes_the_attention_core_and_pointwise_ops_and_keeps_linears():
    """The decision for each op of the block's forward, written here by op: the two activation
    products and the softmax recomputed, the weight products kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    import executor.selective as selective
    decisions: dict[str, set] = {}
    original = selective.AttentionCorePolicy.__call__

    def spy(self, ctx, op, *args, **kwargs):
        decision = original(self, ctx, op, *args, **kwargs)
        decisions.setdefault(str(op), set()).add(decision)
        return decision

    selective.AttentionCorePolicy.__call__ = spy
    try:
        _held_after_forward("selective")
    finally:
        selective.AttentionCorePolicy.__call__ = original
    save, recompute = {CheckpointPolicy.MUST_SAVE}, {CheckpointPolicy.MUST_RECOMPUTE}
    assert decisions["aten.bmm.default"] == recompute            # QK^T and the probabilities by V
    assert decisions["aten._softmax.default"] == recompute
    assert decisions["aten.bernoulli_.float"] == recompute       # both dropouts' draws
    assert decisions["aten.mm.default"] == save                  # qkv and out: linears without bias
    assert decisions["aten.addmm.default"] == save               # fc1, fc2
    assert decisions["aten.gelu.default"] == recompute           # pointwise
    assert decisions["aten.mean.dim"] == save                    # RMSNorm's mean, then its in-place epsilon
    assert decisions["aten.add_.Scalar"] == save


def test_a_layer_changing_its_input_in_place_is_refused_naming_the_op():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            x.mul_(2.0)
            return self.fc(x)

    wrapper = nn.ModuleDict({"layer": Scale()})
    apply_ac(wrapper, {"layer": "selective"})
    x = torch.randn(BATCH, HIDDEN)          # not a leaf that requires grad: autograd allows the change
    with pytest.raises(UserError, match=r"layer: aten\.mul_\.Tensor changes in place a tensor that selective "
                                        r"recompute cannot replay .*plan this layer with recompute none or full"):
        wrapper["layer"](x.clone().requires_grad_(False) + torch.zeros(1, requires_grad=True))
