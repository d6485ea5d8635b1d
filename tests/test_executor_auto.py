"""``auto_parallelize`` in 4-process torchrun jobs on modules the test defines: rank 0 traces and
plans the module (the planner's full search: dp, tp, pp, ZeRO, micro-batches), every rank applies
the broadcast plan, and the losses equal a single-process run of the same module on the whole batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from executor_support import assert_losses

pytestmark = pytest.mark.distributed      # auto_parallelize inside torchrun jobs

STEPS = 3

MLP = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.out = nn.Linear(32, 4)

    def forward(self, x):                                 # (B, 16) -> (B, 4)
        return self.out(torch.relu(self.body(torch.relu(self.inp(x)))))

def batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)

EXAMPLE = (torch.randn(2, 16),)
loss_fn = None                                            # auto_parallelize's default: mean squared error
'''

LM_HEADER = '''
import torch
import torch.nn.functional as F
from torch import nn
'''

# the language model around the blocks, and its data and loss (the block is defined before it)
LM = '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, ids):                               # (B, S) -> (B, S, 64)
        h = self.embed(ids) * 0.5
        for block in self.blocks:
            h = block(h)
        return self.head(torch.relu(h))

def batch(step):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 64, (8, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]

EXAMPLE = (torch.randint(0, 64, (2, 16)),)

def loss_fn(logits, targets):                             # (B, S, V), (B, S)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
'''

# a small language model: vocabulary-parallel embedding, residual blocks whose MLPs TP splits
# column then row, a head, and code between the layers (the pipeline must carry it over)
TOKENS = LM_HEADER + '''
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):                                 # (B, S, 32) -> (B, S, 32)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))
''' + LM

# causal self-attention written out (QK^T, softmax, by V) in residual blocks: what selective
# recompute finds and recomputes in a module it did not build (executor/selective.py)
ATTENTION = LM_HEADER + '''
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(32)
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.proj = nn.Linear(32, 32)
        self.fc = nn.Linear(32, 32)

    def forward(self, x):                                 # (B, S, 32) -> (B, S, 32)
        b, s, _ = x.shape
        n = self.norm(x)
        q, k, v = (f(n).view(b, s, -1, 8).transpose(1, 2) for f in (self.q, self.k, self.v))  # (B, nh, S, 8)
        scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1),
                                                                   float("-inf"))           # (B, nh, S, S)
        x = x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))
        return x + self.fc(F.gelu(x))
''' + LM

SCRIPT = '''
import json, os, sys
import torch.distributed as dist
from executor import auto_parallelize
from executor.train import exit_now
from planner.api import Knobs

out, cluster, knobs = sys.argv[1], sys.argv[2] or None, json.loads(sys.argv[3])
rank = int(os.environ["RANK"])
torch.manual_seed(0 if rank == 0 else 1000 + rank)       # every rank its own init: rank 0's must win
net = Net()
train = auto_parallelize(net, EXAMPLE, global_batch=8, cluster=cluster, knobs=Knobs(**knobs) if knobs else None,
                         loss_fn=loss_fn)
losses = []
for step in range(3):
    x, y = batch(step)
    losses.append(train.step(train.shard(x), train.shard(y)))
if rank == 0:
    p = train.plan
    json.dump({"losses": losses, "dp": p.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "layers": list(p.layers),
               "tp_plan": p.tp_plan, "stages": [list(s) for s in p.stages], "notes": list(p.notes),
               "planned": p.doc["config"]}, open(out, "w"))
dist.barrier()                  # gloo: no rank closes its connections while another still uses them
dist.destroy_process_group()
exit_now(0)     # no interpreter finalization: gloo's threads releasing tensors in it can abort a finished rank
'''


def _reference(module_code: str) -> list[float]:
    """One process, the whole batch, AdamW lr 1e-3: the training every plan must reproduce."""
    scope: dict = {}
    exec(module_code, scope)
    torch.manual_seed(0)
    net = scope["Net"]()
    loss_fn = scope["loss_fn"] or torch.nn.functional.mse_loss
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
    losses = []
    for step in range(STEPS):
        x, y = scope["batch"](step)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _small_profile(tmp_path: Path) -> str:
    """cpu-gloo with room for about 22 kB of model states per process once the default 18% memory headroom
    is kept (25.9 kB beyond the 0.3 GiB runtime reserve, over 1.18): the MLP's 2,788 parameters
    need 44.6 kB as plain data parallelism (16 B per parameter), so every plan that fits splits
    the model states (ZeRO, tensor or pipeline parallelism)."""
    text = (ROOT / "profiles" / "cpu-gloo.toml").read_text()
    text = text.replace('name = "cpu-gloo"', 'name = "tiny-cpu"').replace("memory_GiB = 2.0", "memory_GiB = 0.3000242")
    path = tmp_path / "tiny-cpu.toml"
    path.write_text(text)
    return str(path)


def _torchrun(tmp_path: Path, module_code: str, cluster: str = "", knobs: dict | None = None) -> dict:
    script = tmp_path / "train.py"
    script.write_text(module_code + SCRIPT)
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script), str(out), cluster, json.dumps(knobs or {})], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("profile", [None, "small"])
def test_auto_parallelize_in_torchrun_matches_single_process(tmp_path, profile):
    cluster = _small_profile(tmp_path) if profile else ""
    result = _torchrun(tmp_path, MLP, cluster)
    assert result["dp"] * result["tp"] * result["pp"] == 4
    if profile:      # plain data parallelism does not fit the small profile
        assert result["zero"] >= 1 or result["tp"] > 1 or result["pp"] > 1, result
    assert_losses(result["losses"], _reference(MLP), against="single process")


def test_auto_parallelize_runs_a_tensor_and_pipeline_parallel_plan(tmp_path):
    """Knobs(tp=2) fixes tensor parallelism; the planner chooses the rest (pp 2 on 4 processes for
    this module, as its cost model prefers a pipeline to data parallelism here; the test accepts
    either). Each rank holds half of every split linear and of the vocabulary."""
    result = _torchrun(tmp_path, TOKENS, knobs={"tp": 2})
    assert result["tp"] == 2 and result["planned"]["tp"] == 2
    assert result["tp_plan"] == {"embed": "vocab", "blocks.0.fc1": "colwise", "blocks.0.fc2": "rowwise",
                                 "blocks.1.fc1": "colwise", "blocks.1.fc2": "rowwise", "head": "colwise_loss"}
    if result["pp"] > 1:
        assert [p for s in result["stages"] for p in s] == ["embed", "blocks.0", "blocks.1", "head"]
    assert_losses(result["losses"], _reference(TOKENS), against="single process")


def test_auto_parallelize_runs_selective_recompute_with_tp_and_fsdp(tmp_path):
    """Knobs(recompute="selective", dp=2, tp=2, zero=3): every block runs under torch's selective
    checkpointing (the attention core and pointwise ops recomputed, the linears kept) on DTensor
    shards inside FSDP2's units, and trains as one process does; the run notes where it differs
    from the plan."""
    result = _torchrun(tmp_path, ATTENTION, knobs={"recompute": "selective", "dp": 2, "tp": 2, "zero": 3})
    assert result["planned"]["recompute"] == "selective" and (result["dp"], result["tp"], result["zero"]) == (2, 2, 3)
    assert result["tp_plan"]["blocks.0.q"] == "colwise" and result["tp_plan"]["blocks.0.proj"] == "rowwise"
    assert [n.split(":")[0] for n in result["notes"] if "selective" in n] == ["blocks.0", "blocks.1"]
    assert_losses(result["losses"], _reference(ATTENTION), against="single process")
