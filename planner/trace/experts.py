"""Which routed experts of a traced module meshplan's executor can split over expert-parallel ranks.

Hugging Face ``transformers`` (v5) holds a mixture of experts' routed experts in one module per layer whose class
its ``use_experts_implementation`` decorator wraps (``transformers/integrations/moe.py``: Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3, GPT-OSS and the rest): every parameter is a stack of the experts' tensors along dim 0
(``gate_up_proj`` (E, 2F, H), ``down_proj`` (E, H, F), GPT-OSS's biases (E, ...)), ``num_experts`` is E, and the
block calls it as ``experts(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``. That
interface is enough to split the experts: a rank holds E / ep of each stack and runs the module's own forward on
the tokens routed to them (executor/moe.py ``apply_ep``). The experts of any other module (a user's own loop over
``nn.ModuleList`` experts, say) stay whole on every rank.
"""
from __future__ import annotations

from torch import nn


def is_grouped_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers grouped-experts module (the decorator's ``_is_expert_parallel`` flag,
    an integer ``num_experts`` and at least one parameter of its own, each a stack of ``num_experts`` tensors of two
    or more dimensions)."""
    count = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return (hasattr(module, "_is_expert_parallel") and isinstance(count, int) and not isinstance(count, bool)
            and count > 0 and bool(params) and all(p.ndim >= 2 and p.shape[0] == count for p in params))


def grouped_experts(module: nn.Module) -> dict[str, nn.Module]:
    """{path: module} of the grouped-experts modules ``module`` holds (``is_grouped_experts``)."""
    return {path: m for path, m in module.named_modules() if is_grouped_experts(m)}


def expert_split(module: nn.Module, expert_weights: list[str]) -> tuple[bool, str]:
    """(whether the executor can split the routed experts whose weights are the parameter paths ``expert_weights``
    over ep ranks, why not): it can where each lives in a grouped-experts module and every such module holds the
    same number of experts (ep must divide it)."""
    if not expert_weights:
        return True, ""
    holders = grouped_experts(module)
    # a weight is named by its parameter path where its module holds several, else by the module's
    alien = sorted(w for w in expert_weights if w not in holders and w.rsplit(".", 1)[0] not in holders)
    if alien:
        return False, (f"the experts of {alien[0]!r} are not in a transformers grouped-experts module (one parameter "
                       "per projection stacking every expert, called with the top-k ids and weights), which is what "
                       "meshplan's executor splits over expert-parallel ranks")
    counts = sorted({m.num_experts for m in holders.values()})
    if len(counts) > 1:
        return False, f"its layers hold different numbers of routed experts ({', '.join(map(str, counts))})"
    return True, ""
