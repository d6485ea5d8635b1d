"""The hardware profiler: measure this machine and write the cluster profile TOML that --cluster reads.

    from executor.profile import profile_machine, rederive
    result = profile_machine(device="cpu", nproc=2, threads=1, quick=True, out="here.toml")
    result.path, result.kernels_path, result.device, result.collectives

Every number is timed here with torch and torch.distributed (which the planner never
imports); the planner reads only the TOML this writes. `meshplan profile` is the
command line over ``profile_machine`` and ``rederive`` (planner/cli/profile.py).
Importing this package does not import torch; measuring does.

Modules:
  machine.py      profile_machine / rederive: measure, write NAME.toml, NAME.kernels.json, NAME.ops.json
  device.py       one device: GEMM and attention rates, copy bandwidth, Adam, the kernel detail
  kernels.py      the kernel sweeps behind the cost model's mechanisms, and time_per_call
  collectives.py  collectives over local processes (python -m executor.profile.collectives)
  ops.py          each traced operator replayed and timed here (--ops)
  fit.py          GPU kernel-model parameters fitted to the sweeps (pure Python)
  toml.py         the profile TOML from the measurements (pure Python)

Nothing else in executor/ imports this package (tests/test_imports.py).
"""
from __future__ import annotations

from .machine import MachineProfile, profile_machine, rederive

__all__ = ["MachineProfile", "profile_machine", "rederive"]
