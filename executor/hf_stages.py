"""Pipeline stages of a Hugging Face ``transformers`` decoder, cut by module paths (planner/trace/hf_cut.py
says where): each stage holds the model's modules it runs under the user module's paths and runs them as
the model's forward does (``LlamaModel.forward`` and its kin, ``GPT2Model.forward`` in transformers 5.x),
rebuilding the position ids, rotary tables and causal masks from the hidden states' shape in every stage
(they hold no parameters)."""
from __future__ import annotations

import torch
from torch import nn

from planner.trace.hf_cut import FAMILIES, DecoderLayout


class DecoderStage(nn.Module):
    """One pipeline stage of a ``transformers`` decoder: the modules the plan gives it, under the
    user module's paths, run as the model's forward runs them."""

    def __init__(self, module, lm_path: str, lm, pieces: list[tuple[str, str, str]], first: bool, last: bool,
                 pre, post):
        super().__init__()
        self._pieces = pieces          # (role, path, name) in the model's order
        for _, path, _ in pieces:
            _attach(self, path, module.get_submodule(path))
        base, _, _, _, kind = FAMILIES[lm.config.model_type]
        decoder = lm.get_submodule(base)
        # not registered: no parameters, and every stage needs them
        object.__setattr__(self, "_rotary", getattr(decoder, "rotary_emb", None))
        object.__setattr__(self, "_pre", pre if first else None)
        object.__setattr__(self, "_post", post if last else None)
        self._config, self._kind, self._first, self._last = lm.config, kind, first, last

    def forward(self, *args):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        if self._first:
            hidden = self._pre(*args)              # the input ids
        else:
            hidden = args[0]
        position_ids = masks = embeddings = None
        for role, path, name in self._pieces:
            module = self.get_submodule(path)
            if role == "embed":
                if name == "wpe":              # GPT-2's learned positions, added to the token embeddings
                    hidden = hidden + module(_positions(hidden))
                else:
                    hidden = module(hidden)
                continue
            if role == "layer":
                if position_ids is None:
                    position_ids = _positions(hidden)
                    kwargs = dict(config=self._config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
                    masks = {"full_attention": create_causal_mask(**kwargs)}
                    if getattr(self._config, "sliding_window", None) is not None:
                        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
                    if self._rotary is not None:
                        embeddings = self._rotary(hidden, position_ids=position_ids)
                index = int(name)
                if self._kind == "gpt2":
                    hidden = module(hidden, None, masks["full_attention"], None, use_cache=False,
                                    position_ids=position_ids)
                else:
                    hidden = module(hidden, attention_mask=masks[_mask_type(self._config, index)],
                                    position_embeddings=embeddings, position_ids=position_ids,
                                    past_key_values=None, use_cache=False)
                continue
            hidden = module(hidden)            # the final norm, the head
        return self._post(hidden) if self._last else hidden


def _positions(hidden):
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _mask_type(config, index: int) -> str:
    """The mask a layer takes: its ``layer_types`` entry (Qwen2/3), else sliding-window attention
    where the config has a window (Mistral, Mixtral), else causal (as their forwards choose)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _attach(root, path: str, module) -> None:
    """Register ``module`` under ``path`` in ``root``, making plain containers on the way."""
    *parents, name = path.split(".")
    for part in parents:
        if part not in root._modules:
            root.add_module(part, nn.Module())
        root = root._modules[part]
    root.add_module(name, module)


def decoder_stages(module, layout: DecoderLayout, indices: list[int]) -> list[DecoderStage]:
    """The stages ``indices`` of ``module`` cut as ``layout`` says (planner/trace/hf_cut.py ``decoder_layout``)."""
    last = len(layout.pieces) - 1
    return [DecoderStage(module, layout.lm_path, layout.lm, layout.pieces[j], j == 0, j == last, layout.pre,
                         layout.post) for j in indices]
