"""``auto_parallelize`` in a 4-process torchrun job on a module the test defines: the losses equal
a single-process run of the same module on the whole batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 8
STEPS = 3

MODULE = '''
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
'''

SCRIPT = MODULE + '''
import json, os, sys
import torch.distributed as dist
from executor import auto_parallelize

out, cluster = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
rank = int(os.environ["RANK"])
torch.manual_seed(0 if rank == 0 else 1000 + rank)       # every rank its own init: rank 0's must win
net = Net()
train = auto_parallelize(net, (torch.randn(2, 16),), global_batch=8, cluster=cluster)
world = dist.get_world_size()
share = 8 // world
losses = []
for step in range(3):
    x, y = batch(step)
    losses.append(train.step(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]))
if rank == 0:
    plan = train.plan
    json.dump({"losses": losses, "dp": plan.dp, "zero": plan.zero, "layers": list(plan.layers),
               "source": plan.source}, open(out, "w"))
dist.barrier()                  # gloo: no rank closes its connections while another still uses them
dist.destroy_process_group()
'''


def _reference() -> list[float]:
    scope: dict = {}
    exec(MODULE, scope)
    torch.manual_seed(0)
    net = scope["Net"]()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
    losses = []
    for step in range(STEPS):
        x, y = scope["batch"](step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _small_profile(tmp_path: Path) -> str:
    """cpu-gloo with room for about 21 kB of model states per process: DDP's 16 B per parameter
    (2,788 parameters: 44.6 kB) and ZeRO-2's 8 B (22.3 kB) do not fit, ZeRO-3's 4 B does."""
    text = (ROOT / "profiles" / "cpu-gloo.toml").read_text()
    text = text.replace('name = "cpu-gloo"', 'name = "tiny-cpu"').replace("memory_GiB = 2.0", "memory_GiB = 0.30002")
    path = tmp_path / "tiny-cpu.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("profile,zero", [(None, 0), ("small", 3)])
def test_auto_parallelize_in_torchrun_matches_single_process(tmp_path, profile, zero):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    args = [str(out)] + ([_small_profile(tmp_path)] if profile else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script), *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dp"] == 4 and result["zero"] == zero
    if zero:
        assert result["layers"] == ["inp", "body", "out"]
    for got, want in zip(result["losses"], _reference(), strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (result["losses"], want)


def test_choose_zero_takes_the_lowest_stage_that_fits(tmp_path):
    from executor.auto import choose_zero
    profile = _small_profile(tmp_path)
    assert choose_zero(1000, world=4, cluster=profile)[0] == 0     # 16 kB fits in ~21 kB
    assert choose_zero(2000, world=4, cluster=profile)[0] == 2     # 32 kB does not; ZeRO-2's 16 kB does
    assert choose_zero(2788, world=4, cluster=profile)[0] == 3
    from planner.errors import UserError
    with pytest.raises(UserError, match="even with ZeRO-3 over 4 ranks"):
        choose_zero(10_000, world=4, cluster=profile)
