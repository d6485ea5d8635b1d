"""Cutting a user's module into pipeline stages, and whether its forward allows it.

A stage is a piece of the module's forward between two layers, holding the original module objects
under their original paths (so tensor parallelism's styles, FSDP units and recompute apply by the
plan's paths, and shapes stay as the module's code computes them). Two ways cut it:

- ``torch.fx`` (``fx_cut``): the forward traced symbolically with the layers kept as leaves, the
  graph cut before each stage's first layer (``torch.fx.passes.split_module``). It fails where the
  forward outside the layers branches on tensor values or shapes.
- by module paths (``hf_cut.decoder_layout`` says where, executor/hf_stages.py builds the stages) for
  the ``transformers`` decoders the planner reads, whose forwards fx cannot follow (their mask building
  branches on the sequence length).

torch.export (``torch.distributed.pipelining.pipeline``) follows such forwards too, but its cut of a
``transformers`` decoder sends the prologue's values (position ids, rotary tables) from the first
stage to every later stage, which torch's schedules refuse (adjacent stages only), and its stages
keep the traced micro-batch's shapes (no tensor parallelism): it is not used.

``pipeline_cuts`` says whether a module can be cut (by cutting it in two at the middle block), so
that the search offers a pipeline only where the executor runs it.
"""
from __future__ import annotations

from ..errors import UserError


def _check_paths(module, stages, source: str) -> list[str]:
    layers = [path for stage in stages for path in stage]
    named = dict(module.named_modules())
    missing = [path for path in layers if path not in named or not path]
    if missing:
        raise UserError(f"layer(s) {', '.join(map(repr, missing))} are not submodules of the module; a pipeline "
                        "cuts the module between submodules", source=source, field="stages")
    return layers


def fx_cut(module, stages: tuple[tuple[str, ...], ...], indices: list[int], source: str = "plan") -> list:
    """The virtual stages ``indices`` of ``module`` as GraphModules holding the original layer modules
    under their original paths (so TP styles and FSDP units apply by the plan's paths). Raises
    UserError where torch.fx cannot follow the forward or the forward runs the layers out of order."""
    import torch.fx as fx
    from torch.fx.passes.split_module import split_module

    layers = _check_paths(module, stages, source)
    leaves = set(layers)

    class LayerTracer(fx.Tracer):
        def is_leaf_module(self, m, qualname: str) -> bool:
            return qualname in leaves or super().is_leaf_module(m, qualname)

    try:
        graph = LayerTracer().trace(module)
    except Exception as e:          # torch.fx cannot follow data-dependent Python control flow
        raise UserError(f"torch.fx cannot trace the module's forward outside its layers: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}", source=source, field="stages") from None
    traced = fx.GraphModule(module, graph)
    stage_of = {path: j for j, stage in enumerate(stages) for path in stage}
    current = [0]

    def which_stage(node) -> int:
        if node.op == "call_module" and node.target in stage_of:
            current[0] = stage_of[node.target]
        return current[0]       # code between layers runs with the layer before it

    pieces = dict(split_module(traced, module, which_stage, keep_original_order=True).named_children())
    if sorted(pieces) != sorted(f"submod_{j}" for j in range(len(stages))):
        raise UserError(f"the module's forward does not run the stages' layers in the plan's order "
                        f"({len(pieces)} pieces for {len(stages)} stages)", source=source, field="stages")
    targets = [n.target for n in traced.graph.nodes if n.op in ("call_module", "get_attr")]
    original = {t.replace(".", "_"): t for t in targets}   # split_module flattens dotted paths
    if len(original) != len(set(targets)):
        raise UserError("two submodule paths differ only in '.' against '_'; rename one to pipeline the module",
                        source=source, field="stages")
    parts = []
    for j in indices:
        piece_graph = pieces[f"submod_{j}"].graph
        for node in piece_graph.nodes:
            if node.op in ("call_module", "get_attr"):
                node.target = original[node.target]
        parts.append(fx.GraphModule(module, piece_graph))     # references module's own submodules
    return parts


def how_to_cut(module, stages, source: str = "plan") -> tuple[str, object]:
    """("fx", None) where ``fx_cut`` cuts ``module`` into ``stages``, else ("paths", its
    ``hf_cut.DecoderLayout``); UserError naming both reasons where neither does (the executor builds
    the stages: executor/pipeline.py ``split_pipeline``)."""
    from .hf_cut import decoder_layout
    try:
        fx_cut(module, stages, [], source)
        return "fx", None
    except UserError as fx_error:
        try:
            return "paths", decoder_layout(module, stages, source)
        except UserError as path_error:
            raise UserError(f"{fx_error.detail}; {path_error.detail}; plan with knobs pp=1", source=source,
                            field="stages") from None


def halves(layers: list[str], blocks: list[bool]) -> tuple[tuple[str, ...], ...] | None:
    """The layers in two stages cut before the middle block (None with fewer than two blocks)."""
    at = [i for i, is_block in enumerate(blocks) if is_block]
    if len(at) < 2:
        return None
    middle = at[len(at) // 2]
    return tuple(layers[:middle]), tuple(layers[middle:])


def pipeline_cuts(module, layers: list[str], blocks: list[bool]) -> tuple[bool, str]:
    """(whether ``module`` can be cut into pipeline stages, why not) for ``module`` whose layers are
    ``layers`` (module paths, in order; ``blocks`` marks the repeated ones), found by cutting it in two
    at the middle block."""
    stages = halves(layers, blocks)
    if stages is None:
        return False, "fewer than two blocks to cut between"
    if not all(layers):
        return False, "a layer is not one submodule (the trace grouped operators outside any module)"
    try:
        how_to_cut(module, stages, source="trace")
        return True, ""
    except UserError as e:
        return False, e.detail
