"""Where a Hugging Face ``transformers`` decoder is cut into pipeline stages, by module paths.

torch.fx cannot follow a ``transformers`` decoder's forward: building the attention mask branches on
the sequence's length (``masking_utils``). torch.export can, but its cut sends the forward's prologue
(position ids, rotary tables) from the first stage to every later one, which torch's schedules refuse
(they pass tensors between adjacent stages only). So these models are cut as torchtitan cuts its own
(``torchtitan/distributed/pipeline_parallel.py``: each stage the model's modules it runs, under their
own paths): a stage holds the embedding (first stage), its decoder layers, the final norm and head
(last stage) of the ``transformers`` model as the original module objects under the user module's
paths, and runs them as the model's forward does (executor/hf_stages.py builds and runs the stages; this module
says where the cut goes and whether it can, for the trace).

The user's module may wrap the model: its forward is traced by torch.fx with the model as one call;
the code before the call (making ``input_ids``) runs in the first stage and the code after it (reading
``.logits`` or ``[0]``) in the last.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from ..errors import UserError

# model_type -> where the pieces are, below the causal LM: the decoder, its embeddings (run in order
# on the input ids), its layer list, its final norm; and how a layer is called
LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
FAMILIES = {**{t: ("model", ("embed_tokens",), "layers", "norm", "rotary") for t in LLAMA_LIKE},
            "gpt2": ("transformer", ("wte", "wpe", "drop"), "h", "ln_f", "gpt2")}


def find_decoder(module) -> tuple[str, object] | None:
    """(path, module) of the one ``transformers`` causal LM of a supported family inside ``module``."""
    found = []
    for path, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if hasattr(sub, "lm_head") and getattr(config, "model_type", None) in FAMILIES and \
                hasattr(sub, FAMILIES[config.model_type][0]):
            found.append((path, sub))
    return found[0] if len(found) == 1 else None


def _wrapper_parts(module, lm_path: str, source: str):
    """(pre, post): GraphModules of the user's forward before the causal LM's call (the user's inputs ->
    input_ids) and after it (logits -> the output). The model itself is the module: no wrapper."""
    import torch.fx as fx

    if lm_path == "":
        raise UserError("the module is the transformers model itself, whose output is a ModelOutput; a pipeline "
                        "runs a module returning tensors (wrap it: forward(ids) -> model(input_ids=ids).logits)",
                        source=source, field="stages")

    class ModelAsLeaf(fx.Tracer):
        def is_leaf_module(self, m, qualname: str) -> bool:
            return qualname == lm_path or super().is_leaf_module(m, qualname)

    try:
        graph = ModelAsLeaf().trace(module)
    except Exception as e:
        raise UserError(f"torch.fx cannot trace the module's forward around {lm_path!r}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}", source=source, field="stages") from None
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == lm_path]
    if len(calls) != 1:
        raise UserError(f"the module's forward calls {lm_path!r} {len(calls)} times; a pipeline cuts one call",
                        source=source, field="stages")
    call = calls[0]
    other = {k: v for k, v in call.kwargs.items() if k != "input_ids" and v is not None}
    ids = call.kwargs.get("input_ids", call.args[0] if call.args else None)
    if other or len(call.args) > (0 if "input_ids" in call.kwargs else 1) or ids is None:
        raise UserError(f"the module calls {lm_path!r} with {', '.join(other) or 'positional arguments'}; a "
                        "pipeline's stages rebuild the mask and positions themselves and take input_ids only",
                        source=source, field="stages")
    getters = [u for u in call.users if u.op == "call_function" and (
        (u.target is getattr and u.args[1] == "logits") or (u.target is operator.getitem and u.args[1] == 0))]
    if len(getters) != len(call.users):
        raise UserError(f"the module uses {lm_path!r}'s output other than its logits (.logits or [0]); a "
                        "pipeline's last stage returns the logits", source=source, field="stages")
    order = list(graph.nodes)
    at = order.index(call)
    pre, env = fx.Graph(), {}
    for node in order[:at]:
        env[node] = pre.node_copy(node, lambda n: env[n])
    if not isinstance(ids, fx.Node):
        raise UserError("the module passes a constant as input_ids", source=source, field="stages")
    pre.output(env[ids])
    post, env = fx.Graph(), {}
    logits = post.placeholder("logits")
    for node in order[at + 1:]:
        if node in getters:
            env[node] = logits
            continue
        outside = [n for n in node.all_input_nodes if n not in env]
        if outside:
            raise UserError(f"the module's forward uses {outside[0].name} (computed before {lm_path!r}) after it; a "
                            "pipeline's last stage sees the logits only", source=source, field="stages")
        if node.op == "output":
            post.output(fx.graph.map_arg(node.args[0], lambda n: env[n]))
        else:
            env[node] = post.node_copy(node, lambda n: env[n])
    return fx.GraphModule(module, pre), fx.GraphModule(module, post)


def pieces_of(lm_path: str, lm, stages, source: str) -> list[list[tuple[str, str, str]]]:
    """Each stage's pieces (role, path, name) in the model's order; UserError where a stage holds a module
    that is not one of the model's pieces, or the pieces are out of the model's order."""
    base, embeds, layers, norm, _ = FAMILIES[lm.config.model_type]
    prefix = f"{lm_path}." if lm_path else ""
    order = [("embed", f"{prefix}{base}.{e}", e) for e in embeds if hasattr(lm.get_submodule(base), e)]
    order += [("layer", f"{prefix}{base}.{layers}.{i}", str(i)) for i in range(len(lm.get_submodule(f"{base}.{layers}")))]
    order += [("norm", f"{prefix}{base}.{norm}", norm), ("head", f"{prefix}lm_head", "lm_head")]
    rank = {path: k for k, (_, path, _) in enumerate(order)}
    rotary = f"{prefix}{base}.rotary_emb"
    out, last = [], -1
    for j, stage in enumerate(stages):
        held = [path for path in stage if path != rotary]
        unknown = [path for path in held if path not in rank]
        if unknown:
            raise UserError(f"stage {j} holds {unknown[0]!r}, which is not one of the {lm.config.model_type} model's "
                            "embeddings, layers, final norm or head", source=source, field="stages")
        ranks = [rank[path] for path in held]
        if ranks != sorted(ranks) or (ranks and ranks[0] < last):
            raise UserError(f"stage {j}'s modules are out of the model's order", source=source, field="stages")
        last = ranks[-1] if ranks else last
        out.append([order[k] for k in ranks])
    held = {path for stage in out for _, path, _ in stage}
    if held != set(rank):
        missing = [path for path in rank if path not in held]
        raise UserError(f"no stage runs {missing[0]!r}", source=source, field="stages")
    return out


@dataclass(frozen=True)
class DecoderLayout:
    """Where a ``transformers`` decoder inside a user's module is cut: the causal LM's path and module, each
    stage's pieces (role, path, name) in the model's order, and the user's code before the model's call
    (its inputs -> input_ids, run by the first stage) and after it (logits -> output, run by the last)."""

    lm_path: str
    lm: object
    pieces: list
    pre: object
    post: object


def decoder_layout(module, stages, source: str = "plan") -> DecoderLayout:
    """How ``module`` that wraps a ``transformers`` decoder is cut into ``stages`` by module paths (the
    executor builds the stages: executor/hf_stages.py); UserError where it cannot be."""
    found = find_decoder(module)
    if found is None:
        raise UserError(f"the module holds no transformers causal LM of a family a pipeline cuts by paths "
                        f"({', '.join(sorted(FAMILIES))})", source=source, field="stages")
    lm_path, lm = found
    pieces = pieces_of(lm_path, lm, stages, source)
    pre, post = _wrapper_parts(module, lm_path, source)
    return DecoderLayout(lm_path=lm_path, lm=lm, pieces=pieces, pre=pre, post=post)
