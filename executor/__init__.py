"""meshplan's executor: applies a plan.json to a model with torch.distributed, runs it, measures it.

    meshplan run --plan plan.json --model MODEL --steps N       # torchrun, see executor/launch.py
    meshplan run ... --checkpoint-dir DIR --checkpoint-every K --max-restarts N --timeout S
                                                                 # survives a rank that dies (checkpoint.py)
    from executor import auto_parallelize                        # inside your own torchrun script: plans
                                                                 # dp/tp/pp/ZeRO for your module (auto.py)

Importing this package does not import torch (``meshplan run`` checks its arguments first);
``auto_parallelize`` is loaded on first use.
"""
from __future__ import annotations

__all__ = ["auto_parallelize"]


def __getattr__(name: str):
    if name == "auto_parallelize":
        from .auto import auto_parallelize
        return auto_parallelize
    raise AttributeError(f"module 'executor' has no attribute {name!r}")
