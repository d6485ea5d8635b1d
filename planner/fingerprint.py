"""Fingerprints that tie a plan.json to the model and cluster it was made for.

The executor recomputes them from what it is asked to run and refuses a plan made
for something else, saying which part differs. Pure functions
of plain values: the same model gives the same fingerprint in the planner and on
every rank.
"""
from __future__ import annotations

import hashlib
import json

from .cluster import Cluster
from .layers import LayerGraph


def _digest(doc) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def model_fingerprint(graph: LayerGraph) -> str:
    """Layers in order with their kind, parameters and operators' shapes."""
    doc = [[layer.name, layer.kind, layer.params,
            [[op.name, op.kind, op.params, op.in_features, op.out_features, op.heads, op.kv_heads, op.head_dim]
             for op in layer.ops]] for layer in graph.layers]
    return _digest({"layers": doc, "vocab": graph.vocab_size, "hidden": graph.hidden})


def cluster_fingerprint(cluster: Cluster) -> str:
    """What the plan depends on: world size, node size and the device."""
    return _digest({"gpus": cluster.num_gpus, "gpus_per_node": cluster.gpus_per_node,
                    "device": cluster.device.name, "memory_bytes": cluster.device.memory_bytes})
