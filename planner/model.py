"""What is trained: the architecture of a transformer language model.

``ModelSpec`` is a plain value read from the zoo below or from a Hugging Face
``config.json``. ``layers.build_layer_graph`` turns it into the layer graph the
cost model and the search consume; a traced ``nn.Module`` produces the same
layer graph type (see ``planner.trace``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from .errors import UserError, one_of


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, as its config states it."""

    name: str
    num_layers: int                 # transformer blocks
    hidden: int                     # model width h
    num_heads: int                  # query heads a
    num_kv_heads: int               # key/value heads g (grouped-query attention when g < a)
    head_dim: int                   # d; a * d is usually h
    ffn_hidden: int                 # MLP inner width f
    vocab_size: int                 # V (as trained: padded where the source pads)
    seq_len: int                    # default training sequence length
    max_positions: int              # rows of the learned position table (0 with RoPE)
    mlp: Literal["gelu", "swiglu"]  # GELU: two linears; SwiGLU: gate, up, down
    norm: Literal["layernorm", "rmsnorm"]
    linear_bias: bool               # biases on every linear (GPT-2 / Megatron GPT)
    qkv_bias: bool                  # biases on q, k, v only (Qwen2)
    tied_embeddings: bool           # LM head shares the input embedding matrix
    dropout: bool                   # dropout layers active in training (Megatron GPT: 0.1)
    num_experts: int = 0            # 0: dense MLP; else experts per MoE layer
    experts_per_token: int = 0      # top-k routing
    sliding_window: int = 0         # 0: full causal attention
    fused_qkv: bool = False         # q, k and v are one parameter tensor (GPT-2's c_attn, Megatron GPT's
                                    # query_key_value): one module for runtimes that work per module
    source: str = ""                # where these numbers come from

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        h, f = self.hidden, self.ffn_hidden
        norm = (2 * h if self.norm == "layernorm" else h) * 2
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.linear_bias:
            attn += self.q_dim + 2 * self.kv_dim + h
        elif self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.mlp == "gelu":
            expert = 2 * h * f + ((f + h) if self.linear_bias else 0)
        else:
            expert = 3 * h * f
        if self.is_moe:
            mlp = self.num_experts * expert + h * self.num_experts  # experts + router
        else:
            mlp = expert
        return norm + attn + mlp

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden + self.max_positions * self.hidden

    def final_norm_params(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def head_params(self) -> int:
        """Parameters the LM head owns (0 when tied to the embedding)."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden

    def num_params(self) -> int:
        return (self.embedding_params() + self.num_layers * self.block_params()
                + self.final_norm_params() + self.head_params())

    def validate(self, source: str) -> "ModelSpec":
        """Check the shape is one a transformer can have; raise UserError naming the field."""
        for field in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                      "ffn_hidden", "vocab_size", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"must be a positive integer, got {value!r}", source=source, field=field)
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"{self.num_heads} query heads are not a multiple of "
                            f"{self.num_kv_heads} key/value heads", source=source, field="num_kv_heads")
        if self.is_moe and not 0 < self.experts_per_token <= self.num_experts:
            raise UserError(f"experts per token must be 1..{self.num_experts}, got {self.experts_per_token}",
                            source=source, field="experts_per_token")
        return self


def _gpt(name: str, layers: int, hidden: int, heads: int, *, seq: int = 2048, vocab: int = 51200,
         source: str) -> ModelSpec:
    """A Megatron GPT: GELU MLP of 4h, learned positions, LayerNorm, biases, tied embeddings."""
    return ModelSpec(name=name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=heads,
                     head_dim=hidden // heads, ffn_hidden=4 * hidden, vocab_size=vocab, seq_len=seq,
                     max_positions=seq, mlp="gelu", norm="layernorm", linear_bias=True, qkv_bias=False,
                     tied_embeddings=True, dropout=True, fused_qkv=True, source=source)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           seq: int, *, source: str, experts: int = 0, top_k: int = 0) -> ModelSpec:
    """A Llama-family model: SwiGLU, RoPE, RMSNorm, no biases, untied embeddings."""
    return ModelSpec(name=name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=hidden // heads, ffn_hidden=ffn, vocab_size=vocab, seq_len=seq,
                     max_positions=0, mlp="swiglu", norm="rmsnorm", linear_bias=False, qkv_bias=False,
                     tied_embeddings=False, dropout=False, num_experts=experts, experts_per_token=top_k,
                     source=source)


_NAR21 = "Narayanan et al., SC'21 (arXiv:2104.04473), Table 1; seq 2048, vocab 51200"
_GPT3 = "Brown et al. 2020 (arXiv:2005.14165), Table 2.1 (GPT-3 175B); Narayanan et al. SC'21, Sec 5.2"
_L2 = "Touvron et al. 2023 (arXiv:2307.09288) / Hugging Face meta-llama/Llama-2-*-hf config.json"
_L3 = "Llama Team 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783), Table 3 / HF config.json"
_MIX = "Jiang et al. 2024 (arXiv:2401.04088) / HF mistralai/Mixtral-8x7B-v0.1 config.json"

ZOO: dict[str, ModelSpec] = {m.name: m for m in (
    _gpt("gpt-1.7b", 24, 2304, 24, source=_NAR21),
    _gpt("gpt-3.6b", 30, 3072, 32, source=_NAR21),
    _gpt("gpt-7.5b", 36, 4096, 32, source=_NAR21),
    _gpt("gpt-18.4b", 40, 6144, 48, source=_NAR21),
    _gpt("gpt-39.1b", 48, 8192, 64, source=_NAR21),
    _gpt("gpt-76.1b", 60, 10240, 80, source=_NAR21),
    _gpt("gpt-145.6b", 80, 12288, 96, source=_NAR21),
    _gpt("gpt-310.1b", 96, 16384, 128, source=_NAR21),
    _gpt("gpt-529.6b", 105, 20480, 128, source=_NAR21),
    _gpt("gpt-1t", 128, 25600, 160, source=_NAR21),
    _gpt("gpt3-175b", 96, 12288, 96, source=_GPT3),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, source=_L2),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, source=_L2),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, source=_L2),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, source=_L3),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, source=_L3),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, source=_L3),
    _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, source=_MIX, experts=8, top_k=2),
)}

# Other names people use for the same models. Narayanan's Table 1 has no 175B
# row (its GPT-3-sized row is 145.6B); GPT-3 175B is the model of its Sec 5.2.
ALIASES = {"gpt-175b": "gpt3-175b", "gpt-1008b": "gpt-1t", "gpt3": "gpt3-175b"}

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "mixtral")

# What transformers assumes for each field a config.json leaves out: the defaults of its config classes
# (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, MixtralConfig of transformers 5.23; checked against
# the installed transformers by tests/test_model.py). Only the fields meshplan reads.
HF_DEFAULTS = {
    "gpt2": {"n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "n_inner": None, "vocab_size": 50257,
             "resid_pdrop": 0.1, "attn_pdrop": 0.1, "embd_pdrop": 0.1, "tie_word_embeddings": True},
    "llama": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": None,
              "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 2048, "head_dim": None,
              "attention_bias": False, "tie_word_embeddings": False},
    "mistral": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 131072, "head_dim": None,
                "sliding_window": 4096, "tie_word_embeddings": False},
    "qwen2": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
              "intermediate_size": 22016, "vocab_size": 151936, "max_position_embeddings": 32768,
              "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False},
    "mixtral": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 131072, "head_dim": None,
                "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
                "tie_word_embeddings": False},
}
GPT2_ATTRIBUTE_MAP = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                      "max_position_embeddings": "n_positions"}


def zoo_names() -> list[str]:
    return list(ZOO)


def load_model(source: str, *, seq_len: int | None = None) -> ModelSpec:
    """A zoo name or a path to a Hugging Face config.json (or a folder holding one)."""
    name = ALIASES.get(source.lower(), source.lower())
    if name in ZOO:
        spec = ZOO[name]
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            if source.endswith(".json") or "/" in source:
                raise UserError("no such file", source=source)
            raise UserError(f"unknown model {source!r}; known: {one_of(zoo_names())}, "
                            "or a path to a Hugging Face config.json", field="--model")
        spec = load_hf_config(path)
    if seq_len is not None:
        spec = replace(spec, seq_len=seq_len)
    return spec


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; a missing file, bad JSON or another top-level value is a UserError
    that names the file (and the line and column)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"cannot read: {e.strerror}", source=str(path)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}",
                        source=str(path)) from None
    if not isinstance(data, dict):
        raise UserError(f"expected a JSON object, got {type(data).__name__}", source=str(path))
    return data


class _Fields:
    """Typed access to a config.json's fields, with errors that name the file and field."""

    def __init__(self, data: dict, source: str):
        self.data, self.source = data, source

    def int(self, *keys: str, default: int | None = None) -> int:
        for key in keys:
            if key in self.data and self.data[key] is not None:
                value = self.data[key]
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise UserError(f"must be a positive integer, got {value!r}", source=self.source, field=key)
                return value
        if default is None:
            raise UserError("missing (required)", source=self.source, field=" or ".join(keys))
        return default

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise UserError(f"must be true or false, got {value!r}", source=self.source, field=key)
        return value


def load_hf_config(path: Path) -> ModelSpec:
    """Read a Hugging Face config.json of a supported model_type into a ModelSpec."""
    source = str(path)
    data = read_json(path)
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"unsupported value {model_type!r}; supported: {one_of(SUPPORTED_MODEL_TYPES)}",
                        source=source, field="model_type")
    if model_type == "gpt2":        # GPT2Config.attribute_map: the common names stand for GPT-2's own
        data = {**{own: data[common] for common, own in GPT2_ATTRIBUTE_MAP.items() if common in data}, **data}
    defaulted = sorted(k for k in HF_DEFAULTS[model_type] if k not in data)
    data = {**HF_DEFAULTS[model_type], **data}      # what transformers assumes for what the file leaves out
    f = _Fields(data, source)
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    said = f"{source} (model_type {model_type}" + (f"; transformers' defaults for {', '.join(defaulted)}"
                                                    if defaulted else "") + ")"
    if model_type == "gpt2":
        hidden = f.int("n_embd", "hidden_size")
        heads = f.int("n_head", "num_attention_heads")
        if hidden % heads:
            raise UserError(f"n_embd {hidden} is not a multiple of n_head {heads}", source=source, field="n_embd")
        positions = f.int("n_positions", "max_position_embeddings", default=1024)
        dropout = any(float(data.get(k) or 0) > 0 for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
        spec = ModelSpec(
            name=name, num_layers=f.int("n_layer", "num_hidden_layers"), hidden=hidden, num_heads=heads,
            num_kv_heads=heads, head_dim=hidden // heads, ffn_hidden=f.int("n_inner", default=4 * hidden),
            vocab_size=f.int("vocab_size"), seq_len=positions, max_positions=positions, mlp="gelu",
            norm="layernorm", linear_bias=True, qkv_bias=False,
            tied_embeddings=f.bool("tie_word_embeddings", True), dropout=dropout, fused_qkv=True, source=said)
    else:
        hidden = f.int("hidden_size")
        heads = f.int("num_attention_heads")
        if data.get("head_dim") is not None:
            head_dim = f.int("head_dim")
        else:
            if hidden % heads:
                raise UserError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                                "and no head_dim is given", source=source, field="hidden_size")
            head_dim = hidden // heads
        experts = f.int("num_local_experts", default=8) if model_type == "mixtral" else 0
        top_k = f.int("num_experts_per_tok", default=2) if model_type == "mixtral" else 0
        window = data.get("sliding_window") if data.get("use_sliding_window", True) else None
        spec = ModelSpec(
            name=name, num_layers=f.int("num_hidden_layers"), hidden=hidden, num_heads=heads,
            num_kv_heads=f.int("num_key_value_heads", default=heads), head_dim=head_dim,
            ffn_hidden=f.int("intermediate_size"), vocab_size=f.int("vocab_size"),
            seq_len=f.int("max_position_embeddings", default=4096), max_positions=0, mlp="swiglu",
            norm="rmsnorm", linear_bias=False,
            qkv_bias=True if model_type == "qwen2" else f.bool("attention_bias", False),
            tied_embeddings=f.bool("tie_word_embeddings", False), dropout=False,
            num_experts=experts, experts_per_token=top_k,
            sliding_window=window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0,
            source=said)
    return spec.validate(source)
