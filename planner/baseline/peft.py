"""A PEFT ``adapter_config.json`` beside a baseline: the job fine-tunes with LoRA adapters.

Hugging Face's PEFT writes the file with ``LoraConfig.save_pretrained`` (peft/config.py ``to_dict``); the keys read
here are LoraConfig's (peft/tuners/lora/config.py):

- ``peft_type``: ``"LORA"`` is modelled (LoRA, Hu et al. 2021); another method (IA3, AdaLoRA, prefix tuning...) is
  refused, naming the file and the key.
- ``r``: the adapters' rank (``Workload.lora_rank``).
- ``target_modules``: a list of module names, each matched by its last component (``q_proj`` and
  ``model.layers.0.self_attn.q_proj`` alike, as PEFT's ``check_target_module_exists`` does), or one string: PEFT's
  ``"all-linear"`` (every linear but the output layer) or a regular expression matched against each module's full
  name (``re.fullmatch``, as PEFT does for a string), here the Hugging Face Llama names
  (``model.layers.0.self_attn.q_proj`` ... ``model.layers.0.mlp.down_proj``).
- ``modules_to_save``, ``bias`` other than ``"none"``, ``use_dora``, ``rank_pattern``, ``alpha_pattern``,
  ``layers_to_transform``: listed as read and not modelled (the plan prices LoRA on every block as the keys above
  give it).

The file says nothing of the base's storage: a QLoRA run's 4-bit base is in its BitsAndBytesConfig (the model's
``quantization_config``), not here, so the job is read as LoRA over a 16-bit base, and a note says so.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import UserError, one_of
from ..finetune import TARGETS

FILE = "adapter_config.json"
# meshplan's LoRA targets (planner/finetune.py TARGETS) by their module names in Hugging Face's Llama family
HF_NAMES = {"q": "model.layers.0.self_attn.q_proj", "k": "model.layers.0.self_attn.k_proj",
            "v": "model.layers.0.self_attn.v_proj", "o": "model.layers.0.self_attn.o_proj",
            "gate": "model.layers.0.mlp.gate_proj", "up": "model.layers.0.mlp.up_proj",
            "down": "model.layers.0.mlp.down_proj"}


def beside(baseline: str) -> Path | None:
    """The ``adapter_config.json`` in the baseline file's directory, if there is one."""
    path = Path(baseline).resolve().parent / FILE
    return path if path.is_file() else None


def read(path: Path) -> dict:
    """The Baseline fields the file gives: ``finetune``, ``lora_rank``, ``lora_targets``, and what was read
    (``flags``), not modelled (``ignored``) and approximated (``notes``)."""
    source = str(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read: {getattr(e, 'strerror', None) or e}", source=source) from None
    except json.JSONDecodeError as e:
        raise UserError(f"not JSON: {e.msg} (line {e.lineno})", source=source) from None
    if not isinstance(doc, dict):
        raise UserError("not a PEFT adapter config: the file holds no JSON object", source=source)
    kind = doc.get("peft_type")
    if kind != "LORA":
        raise UserError(f"{kind!r} is not modelled; allowed: 'LORA' (LoRA adapters)", source=source,
                        field="peft_type")
    rank = doc.get("r", 8)          # LoraConfig's default
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise UserError(f"{rank!r} is not a LoRA rank; allowed: a positive integer", source=source, field="r")
    targets, ignored = _targets(doc.get("target_modules"), source)
    for key, default in (("modules_to_save", None), ("bias", "none"), ("use_dora", False), ("rank_pattern", {}),
                         ("alpha_pattern", {}), ("layers_to_transform", None)):
        value = doc.get(key, default)
        if value not in (default, None, [], {}, False):
            ignored.append(f"{key}={json.dumps(value)} ({FILE})")
    notes = (f"{FILE}: LoRA, rank {rank}, on {', '.join(targets)}; a QLoRA run's 4-bit base is not in this file "
             "(its BitsAndBytesConfig is the model's): priced as LoRA over a 16-bit base",)
    return {"finetune": "lora", "lora_rank": rank, "lora_targets": targets,
            "flags": {"finetune": f"{FILE} peft_type", "lora-rank": f"{FILE} r",
                      "lora-targets": f"{FILE} target_modules"},
            "ignored": tuple(ignored), "notes": notes}


def _targets(value, source: str) -> tuple[tuple[str, ...], list[str]]:
    """(meshplan's targets, the modules named that it does not model) of ``target_modules``."""
    if value is None:       # PEFT then takes the model type's defaults: q_proj and v_proj for Llama
        return ("q", "v"), []
    if isinstance(value, str):
        if value.lower() == "all-linear":
            return TARGETS, []
        try:
            pattern = re.compile(value)
        except re.error as e:
            raise UserError(f"{value!r} is not a regular expression ({e})", source=source,
                            field="target_modules") from None
        found = tuple(t for t in TARGETS if pattern.fullmatch(HF_NAMES[t]))
        if not found:
            raise UserError(f"{value!r} matches none of the projections meshplan adapts "
                            f"({', '.join(HF_NAMES.values())})", source=source, field="target_modules")
        return found, []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{value!r}: expected a list of module names or one string",
                        source=source, field="target_modules")
    by_name = {HF_NAMES[t].rsplit(".", 1)[1]: t for t in TARGETS}
    found, ignored = set(), []
    for name in value:
        target = by_name.get(name.rsplit(".", 1)[-1])
        if target is None:
            ignored.append(f"target_modules {name!r} ({FILE}: meshplan adapts {one_of(sorted(by_name))})")
        else:
            found.add(target)
    if not found:
        raise UserError(f"{value!r} names none of the projections meshplan adapts; allowed: "
                        f"{one_of(sorted(by_name))}", source=source, field="target_modules")
    return tuple(t for t in TARGETS if t in found), ignored
