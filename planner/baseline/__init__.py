"""Reading a training job's own configuration (a baseline) into meshplan's knobs.

    baseline, spec, graph = read_baseline("megatron_args.txt", Context(gpus=1024), model=None)

One reader per format, each in its own module with ``parse`` (text -> document),
``model_of`` (what the file says about the model) and ``read`` (document and model ->
Baseline): megatron.py (Megatron-LM arguments or launch script), deepspeed.py (a
DeepSpeed config JSON), torchtitan.py (a job config TOML), planjson.py (meshplan's
plan.json), torchtitan_py.py (a torchtitan Python config module, its current form).
The file tells its format: .py is a torchtitan Python config (``file.py:function`` picks
one of its config functions), .toml a torchtitan TOML, .json with a schema_version and a
config a plan.json, any other .json a DeepSpeed config, anything else Megatron-LM arguments.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import UserError
from ..layers import LayerGraph, build_layer_graph
from ..model import ModelSpec, load_model
from ..search.space import Knobs, Space
from . import deepspeed, megatron, peft, planjson, torchtitan, torchtitan_py
from .values import Baseline, Context, FileModel

READERS = {"megatron": megatron, "deepspeed": deepspeed, "torchtitan": torchtitan, "torchtitan-python": torchtitan_py,
           "plan.json": planjson}
FORMAT_NAMES = {"megatron": "Megatron-LM arguments", "deepspeed": "DeepSpeed config", "torchtitan": "torchtitan TOML",
                "torchtitan-python": "torchtitan Python config", "plan.json": "meshplan plan.json"}
SHAPE_FIELDS = ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden")   # what must agree with --model

__all__ = ["Baseline", "Context", "FORMAT_NAMES", "check_baseline", "detect", "read_baseline"]


def detect(path: str, text: str) -> str:
    suffix = Path(file_of(path)).suffix.lower()
    if suffix == ".py":
        if not torchtitan_py.is_python_config(text):
            raise UserError("a .py baseline is read as a torchtitan Python config, and this file neither imports "
                            "torchtitan nor returns a Trainer.Config; allowed: a torchtitan config module, Megatron-LM "
                            "arguments, a DeepSpeed JSON, a torchtitan TOML or a plan.json", source=path)
        return "torchtitan-python"
    if suffix == ".toml":
        return "torchtitan"
    if suffix == ".json":
        return "plan.json" if '"schema_version"' in text and '"config"' in text else "deepspeed"
    return "megatron"


# the formats a PEFT adapter_config.json is read beside (planner/baseline/peft.py): the runtimes whose jobs wrap a
# Hugging Face model in PEFT; Megatron-LM's and meshplan's plan.json say their training mode themselves
ADAPTER_FORMATS = ("deepspeed", "torchtitan", "torchtitan-python")


def read_baseline(path: str, ctx: Context, model: str | None = None,
                  adapter: str | None = None) -> tuple[Baseline, ModelSpec, LayerGraph]:
    """The baseline in ``path``, the model it trains (``model``, else the one the file
    describes) and its layer graph. ``adapter``: a PEFT adapter_config.json the job trains with (else
    the one beside ``path``, if any, for the formats of ``ADAPTER_FORMATS``)."""
    try:
        text = Path(file_of(path)).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read: {getattr(e, 'strerror', None) or e}", source=file_of(path)) from None
    fmt = detect(path, text)
    if (ctx.tp or ctx.pp) and fmt != "deepspeed":
        raise UserError(f"only for a DeepSpeed config (Megatron-DeepSpeed's degrees); {path} is "
                        f"{FORMAT_NAMES[fmt]}, which sets its own degrees", field="--tp/--pp")
    reader = READERS[fmt]
    doc = reader.parse(text, path)
    told = reader.model_of(doc, path)
    spec = _model(told, model, path)
    spec = replace(spec, seq_len=_seq_len(told, ctx, path, spec))
    graph = build_layer_graph(spec)
    baseline = reader.read(doc, path, ctx, graph)
    from_file = told.notes if model is None and told.spec is not None else ()    # how the file's model was read
    baseline = replace(baseline, notes=from_file + baseline.notes)
    if adapter is not None and fmt not in ADAPTER_FORMATS:
        raise UserError(f"a PEFT adapter config is read beside a DeepSpeed or torchtitan config; {path} is "
                        f"{FORMAT_NAMES[fmt]}, which says its training mode itself", field="--adapter-config")
    found = Path(adapter) if adapter is not None else peft.beside(file_of(path)) if fmt in ADAPTER_FORMATS else None
    if found is not None:
        lora = peft.read(found)
        baseline = replace(baseline, finetune=lora["finetune"], lora_rank=lora["lora_rank"],
                           lora_targets=lora["lora_targets"], flags={**baseline.flags, **lora["flags"]},
                           ignored=baseline.ignored + lora["ignored"], notes=baseline.notes + lora["notes"])
    return baseline, spec, graph


def file_of(path: str) -> str:
    """The file of a baseline path: ``config.py:function`` names a function of a torchtitan Python config."""
    head, sep, _ = path.partition(".py:")
    return head + ".py" if sep else path


def _model(told: FileModel, model: str | None, source: str) -> ModelSpec:
    if model is None:
        if told.spec is not None:
            return told.spec
        if told.name is not None:
            return load_model(told.name)
        raise UserError(f"{told.missing or 'the file names no model'}; allowed: --model (a zoo name or a "
                        "config.json)", source=source, field="--model")
    spec = load_model(model)
    named = told.spec or (load_model(told.name) if told.name else None)
    shape = dict(told.shape)
    if named is not None:
        shape.update({f: (told.name_flag, getattr(named, f)) for f in SHAPE_FIELDS if f not in shape})
    for field, (flag, value) in shape.items():
        if getattr(spec, field) != value:
            raise UserError(f"{value} but --model {model} has {field} {getattr(spec, field)}; allowed: the file's "
                            "model, or leave out --model", source=source, field=flag)
    return spec


def _seq_len(told: FileModel, ctx: Context, source: str, spec: ModelSpec) -> int:
    """The file's sequence length, else --seq-len, else the runtime's default, else the model's."""
    if told.seq_len is not None:
        flag, value = told.seq_len
        if ctx.seq_len is not None and ctx.seq_len != value:
            raise UserError(f"{value} but --seq-len is {ctx.seq_len}; allowed: one of them, or the same",
                            source=source, field=flag)
        return value
    return ctx.seq_len or told.seq_len_default or spec.seq_len


def check_baseline(baseline: Baseline, graph: LayerGraph, cluster) -> None:
    """Every rule meshplan applies to a fixed plan (config.check_config), on the file's terms:
    an error names the file and the file's flag instead of meshplan's."""
    if baseline.precision not in cluster.device.dtypes:
        raise UserError(f"{baseline.precision}, but {cluster.name}'s {cluster.device.name} has no {baseline.precision} "
                        f"peak; allowed: {', '.join(cluster.device.dtypes)}", source=baseline.source,
                        field=baseline.flags.get("--precision", "precision"))
    try:
        Space(graph, cluster.num_gpus, baseline.workload(), Knobs(), cluster.device.dtypes).check(baseline.config)
    except UserError as e:
        raise UserError(e.detail, source=baseline.source, field=baseline.flags.get(e.field, e.field)) from None
