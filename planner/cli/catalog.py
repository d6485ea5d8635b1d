"""`meshplan models` and `meshplan clusters`: what --model and --cluster can name."""
from __future__ import annotations

import json
import sys

from ..cluster import GiB, builtin_profiles, load_cluster
from ..model import ALIASES, SUPPORTED_MODEL_TYPES, ZOO
from .common import add_debug


def add_parser(sub) -> None:
    m = sub.add_parser("models", help="list the model zoo with parameter counts")
    m.add_argument("--json", action="store_true", help="print one JSON array instead of the table")
    add_debug(m)
    c = sub.add_parser("clusters", help="list the built-in cluster profiles")
    c.add_argument("--json", action="store_true", help="print one JSON array instead of the table")
    add_debug(c)


def run(args) -> int:
    return _models(args) if args.command == "models" else _clusters(args)


def _models(args) -> int:
    rows = [(name, spec.num_params(), spec) for name, spec in ZOO.items()]
    if args.json:
        json.dump([{"name": n, "params": p, "layers": s.num_layers, "hidden": s.hidden, "heads": s.num_heads,
                    "kv_heads": s.num_kv_heads, "ffn_hidden": s.ffn_hidden, "vocab": s.vocab_size,
                    "seq_len": s.seq_len, "experts": s.num_experts, "active_params": s.active_params(),
                    "source": s.source} for n, p, s in rows],
                  sys.stdout)
        sys.stdout.write("\n")
        return 0
    aliases = {}
    for alias, target in ALIASES.items():
        aliases.setdefault(target, []).append(alias)
    print(f"{'name':<15} {'params':>9} {'layers':>6} {'hidden':>6} {'heads':>9} {'ffn':>6} {'vocab':>7} {'seq':>6}")
    for name, params, s in rows:
        heads = f"{s.num_heads}/{s.num_kv_heads}" if s.num_kv_heads != s.num_heads else str(s.num_heads)
        extra = _moe_text(s)
        also = f"  (also: {', '.join(aliases[name])})" if name in aliases else ""
        print(f"{name:<15} {params / 1e9:>8.2f}B {s.num_layers:>6} {s.hidden:>6} {heads:>9} {s.ffn_hidden:>6} "
              f"{s.vocab_size:>7} {s.seq_len:>6}{extra}{also}")
    print(f"\nor --model path/to/config.json (Hugging Face model_type {', '.join(SUPPORTED_MODEL_TYPES)})")
    return 0


def _moe_text(s) -> str:
    """What a row's columns leave out: the experts (their width where it is not the ffn column's, the shared ones,
    the dense first blocks, the parameters a token goes through) and latent attention."""
    if not s.is_moe:
        return ""
    width = f" of {s.expert_ffn}" if s.expert_ffn != s.ffn_hidden else ""
    shared = f" + {s.shared_experts} shared" if s.shared_experts else ""
    dense = f", first {s.dense_layers} dense" if s.dense_layers else ""
    mla = ", MLA" if s.is_mla else ""
    return f"  MoE {s.num_experts}x{width} top-{s.experts_per_token}{shared}{dense}{mla}, " \
           f"{s.active_params() / 1e9:.1f}B active"


def _clusters(args) -> int:
    rows = []
    for name in sorted(builtin_profiles()):
        c = load_cluster(name)
        rows.append(c)
    if args.json:
        json.dump([{"name": c.name, "description": c.description, "gpus_per_node": c.gpus_per_node,
                    "device": c.device.name, "memory_bytes": c.device.memory_bytes,
                    "peak_tflops": {**{d: f / 1e12 for d, f in c.device.peak_flops},
                                    **({"fp8": c.device.fp8_peak_flops / 1e12} if c.device.fp8_peak_flops else {})},
                    "intra_node_GBps": c.intra.bytes_per_s / 1e9, "nics_per_node": c.nics_per_node,
                    "nic_Gbps": c.nic.bytes_per_s * 8 / 1e9} for c in rows], sys.stdout)
        sys.stdout.write("\n")
        return 0
    # columns as wide as their longest entry (profile names like gb200-nvl72, GPU names like B200 (GB200, 1,200 W))
    wn, wg = max([4] + [len(c.name) for c in rows]), max([3] + [len(c.device.name) for c in rows])
    print(f"{'name':<{wn}} {'GPU':<{wg}} {'mem GiB':>7} {'TFLOPS':>7} {'per node':>8} {'intra GB/s':>10} {'network':>14}")
    for c in rows:
        peak = max(f for _, f in c.device.peak_flops) / 1e12
        net = f"{c.nics_per_node}x{c.nic.bytes_per_s * 8 / 1e9:.0f} Gb/s" if c.nics_per_node else "-"
        print(f"{c.name:<{wn}} {c.device.name:<{wg}} {c.device.memory_bytes / GiB:>7.1f} {peak:>7.1f} "
              f"{c.gpus_per_node:>8} {c.intra.bytes_per_s / 1e9:>6.0f} {c.fabric:<3.3} {net:>14}")
    print("\nor --cluster path/to/profile.toml (see profiles/*.toml for the format)")
    return 0
