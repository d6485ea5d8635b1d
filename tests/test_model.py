"""Model zoo and Hugging Face config loading, against published parameter counts."""
import pytest

from planner.errors import UserError
from planner.model import ZOO, load_model

# Parameter counts as published on the Hugging Face model cards / safetensors metadata
# (meta-llama/*, mistralai/Mixtral-8x7B-v0.1).
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name,params", PUBLISHED_PARAMS.items())
def test_llama_family_parameter_counts_match_published(name, params):
    assert ZOO[name].num_params() == params


# Narayanan et al. SC'21, Sec 3.1 (Eq. 2): P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)),
# and Table 1's rounded sizes in billions.
NARAYANAN_TABLE1 = {"gpt-1.7b": 1.7, "gpt-3.6b": 3.6, "gpt-7.5b": 7.5, "gpt-18.4b": 18.4, "gpt-39.1b": 39.1,
                    "gpt-76.1b": 76.1, "gpt-145.6b": 145.6, "gpt-310.1b": 310.1, "gpt-529.6b": 529.6,
                    "gpt-1t": 1008.0}


@pytest.mark.parametrize("name,billions", NARAYANAN_TABLE1.items())
def test_gpt_zoo_matches_narayanan_formula_and_table(name, billions):
    spec = ZOO[name]
    l, h, V, s = spec.num_layers, spec.hidden, spec.vocab_size, spec.seq_len
    formula = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    # the formula leaves out the final LayerNorm (2h)
    assert spec.num_params() == pytest.approx(formula + 2 * h, rel=1e-9)
    assert spec.num_params() / 1e9 == pytest.approx(billions, abs=0.06)


def test_aliases_and_gpt3():
    assert load_model("gpt3-175b").num_params() == pytest.approx(174.6e9, rel=1e-3)   # Brown et al. 2020
    assert load_model("GPT-175B") == load_model("gpt3-175b")


GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
        "n_positions": 1024}
LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
         "max_position_embeddings": 8192, "tie_word_embeddings": False}


def test_gpt2_config_gives_gpt2_small(write_json):
    spec = load_model(write_json(GPT2))
    assert spec.num_params() == 124_439_808          # GPT-2 small, tied embeddings (HF model card)
    assert spec.ffn_hidden == 4 * 768 and spec.mlp == "gelu" and spec.tied_embeddings


def test_llama_config_gives_llama3_8b(write_json):
    spec = load_model(write_json(LLAMA))
    assert spec.num_params() == 8_030_261_248
    assert spec.num_kv_heads == 8 and spec.seq_len == 8192


def test_qwen2_has_qkv_bias_and_tied_embeddings(write_json):
    # Qwen2-0.5B: published 494,032,768 parameters (HF model card, Qwen/Qwen2-0.5B)
    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
           "max_position_embeddings": 32768, "tie_word_embeddings": True}
    spec = load_model(write_json(cfg))
    assert spec.qkv_bias and spec.tied_embeddings
    assert spec.num_params() == 494_032_768


def test_mistral_config_with_sliding_window(write_json):
    cfg = dict(LLAMA, model_type="mistral", vocab_size=32000, sliding_window=4096, max_position_embeddings=32768)
    spec = load_model(write_json(cfg))
    assert spec.sliding_window == 4096
    assert spec.num_params() == 7_241_732_096        # Mistral-7B-v0.1 (HF model card)


@pytest.mark.parametrize("data,field", [
    ({"model_type": "bert"}, "model_type"),
    ({**LLAMA, "hidden_size": "big"}, "hidden_size"),
    ({**LLAMA, "num_hidden_layers": 0}, "num_hidden_layers"),
    ({**LLAMA, "num_key_value_heads": 5}, "num_kv_heads"),
    ({**GPT2, "n_head": 7}, "n_embd"),
    ({**LLAMA, "tie_word_embeddings": "yes"}, "tie_word_embeddings"),
])
def test_bad_configs_name_file_and_field(write_json, data, field):
    path = write_json(data)
    with pytest.raises(UserError) as err:
        load_model(path)
    assert path in str(err.value) and field in str(err.value)


def test_unknown_model_type_lists_supported(write_json):
    with pytest.raises(UserError, match="gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v3 or gpt_oss"):
        load_model(write_json({"model_type": "t5"}))


def test_invalid_json_names_line(write_json):
    with pytest.raises(UserError, match="line 1"):
        load_model(write_json("{not json"))


# -- what transformers assumes for the fields a config.json leaves out ------------------------------

CONFIG_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                  "qwen3": "Qwen3Config", "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
                  "deepseek_v3": "DeepseekV3Config", "gpt_oss": "GptOssConfig"}


@pytest.mark.parametrize("model_type", list(CONFIG_CLASSES))
def test_a_config_leaving_fields_out_gets_transformers_defaults(write_json, model_type):
    """{"model_type": T} alone is the model transformers builds from T's config class with no arguments:
    every field meshplan reads is that class's default (transformers is installed with meshplan[hf])."""
    import transformers
    from planner.model import HF_DEFAULTS
    hf = getattr(transformers, CONFIG_CLASSES[model_type])()
    spec = load_model(write_json({"model_type": model_type}))
    derived = {"head_dim": "hidden_size // num_attention_heads", "num_key_value_heads": "num_attention_heads"}
    for key, value in HF_DEFAULTS[model_type].items():
        if value is None and key in derived:    # the config class fills it in from the others (None here)
            assert getattr(hf, key) in (None, eval(derived[key], {}, vars(hf))), (model_type, key)
        else:
            assert value == getattr(hf, key, None), (model_type, key)
    assert spec.head_dim == getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if model_type == "gpt2":
        assert (spec.hidden, spec.num_heads, spec.num_layers, spec.vocab_size, spec.seq_len) == (
            hf.n_embd, hf.n_head, hf.n_layer, hf.vocab_size, hf.n_positions)
        assert spec.ffn_hidden == 4 * hf.n_embd and spec.dropout is (hf.resid_pdrop > 0) and spec.tied_embeddings
    else:
        assert (spec.hidden, spec.num_heads, spec.num_layers, spec.ffn_hidden, spec.vocab_size, spec.seq_len) == (
            hf.hidden_size, hf.num_attention_heads, hf.num_hidden_layers, hf.intermediate_size, hf.vocab_size,
            hf.max_position_embeddings)
        assert spec.num_kv_heads == (hf.num_key_value_heads or hf.num_attention_heads)
        window = vars(hf).get("sliding_window") if vars(hf).get("use_sliding_window", True) else None
        assert spec.sliding_window == (window or 0) and spec.tied_embeddings == hf.tie_word_embeddings
    assert "transformers' defaults for" in spec.source


def test_a_gpt2_config_without_dropout_fields_has_transformers_dropout(write_json):
    """GPT2Config's resid_pdrop, attn_pdrop and embd_pdrop default to 0.1: a file that leaves them out trains
    with dropout (planned from such a file before, Narayanan's 1.7B case came out 16% fast); one that sets
    them to 0 does not."""
    base = {"model_type": "gpt2", "n_embd": 2304, "n_head": 24, "n_layer": 24, "vocab_size": 51200}
    assert load_model(write_json(base)).dropout is True
    assert load_model(write_json({**base, "resid_pdrop": 0.0, "attn_pdrop": 0.0, "embd_pdrop": 0.0})).dropout is False
    # the common names stand for GPT-2's own (GPT2Config.attribute_map), and win over the defaults
    common = {"model_type": "gpt2", "hidden_size": 1600, "num_attention_heads": 25, "num_hidden_layers": 48,
              "max_position_embeddings": 2048}
    spec = load_model(write_json(common))
    assert (spec.hidden, spec.num_heads, spec.num_layers, spec.seq_len) == (1600, 25, 48, 2048)
