"""The hardware profiler: measure this machine and write the cluster profile TOML that --cluster reads.

Every number is timed here with torch and torch.distributed (which the planner never
imports); the planner reads only the TOML this writes. Importing this package does
not import torch; measuring does.

Modules:
  machine.py      meshplan profile: measure, write NAME.toml, NAME.kernels.json, NAME.ops.json
  device.py       one device: GEMM and attention rates, copy bandwidth, Adam, the kernel detail
  kernels.py      the kernel sweeps behind the cost model's mechanisms, and time_per_call
  collectives.py  collectives over local processes (python -m executor.profile.collectives)
  ops.py          each traced operator replayed and timed here (--ops)
  fit.py          GPU kernel-model parameters fitted to the sweeps (pure Python)
  toml.py         the profile TOML from the measurements (pure Python)
"""
