"""Property-based fuzzing of every planner loader: random and mutated documents end in
a clean UserError (or load), never in another exception."""
import json
import tomllib

from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ROOT
from planner.cluster import parse_cluster
from planner.config import ParallelConfig
from planner.errors import UserError
from planner.model import load_hf_config

LLAMA = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "intermediate_size": 2816, "vocab_size": 32000, "max_position_embeddings": 2048,
         "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
PROFILE = tomllib.loads((ROOT / "profiles" / "h100-80g.toml").read_text())

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8)


def mutate(node: dict, draw_key: int, value) -> None:
    """In place: delete (``value`` is ...) or set the key ``draw_key`` picks among ``node``'s."""
    keys = list(node)
    key = keys[draw_key % len(keys)]
    if value is ...:
        del node[key]
    else:
        node[key] = value


FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _load_config(tmp_path, text: str):
    path = tmp_path / "config.json"
    path.write_text(text)
    try:
        load_hf_config(path)
    except UserError as e:
        assert str(path) in str(e)


@FUZZ
@given(base=st.sampled_from([LLAMA, GPT2]), key=st.integers(0, 50), value=json_values | st.just(...))
def test_mutated_model_configs(tmp_path_factory, base, key, value):
    doc = json.loads(json.dumps(base))
    mutate(doc, key, value)
    _load_config(tmp_path_factory.mktemp("c"), json.dumps(doc))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=json_values)
def test_random_json_documents_as_model_configs(tmp_path_factory, doc):
    _load_config(tmp_path_factory.mktemp("c"), json.dumps(doc))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=200))
def test_random_text_as_model_configs(tmp_path_factory, text):
    _load_config(tmp_path_factory.mktemp("c"), text)


def _tables(doc: dict, prefix=()):
    yield prefix, doc
    for k, v in doc.items():
        if isinstance(v, dict):
            yield from _tables(v, prefix + (k,))


TABLES = list(_tables(PROFILE))


@FUZZ
@given(table=st.integers(0, len(TABLES) - 1), key=st.integers(0, 50), value=json_values | st.just(...))
def test_mutated_cluster_profiles(table, key, value):
    doc = json.loads(json.dumps(PROFILE))
    node = doc
    for k in TABLES[table][0]:
        node = node[k]
    mutate(node, key, value)
    try:
        parse_cluster(doc, "fuzz.toml")
    except UserError as e:
        assert "fuzz.toml" in str(e)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.dictionaries(st.sampled_from(["dp", "tp", "pp", "cp", "zero", "micro_batch", "num_microbatches",
                                              "vpp", "schedule", "recompute", "sequence_parallel", "offload",
                                              "optimizer_offload",
                                              "stage_layers", "recompute_layers", "bogus"]), json_values,
                           max_size=12))
def test_random_plan_configs(doc):
    try:
        ParallelConfig.from_json(doc, "plan.json")
    except UserError as e:
        assert "plan.json" in str(e)


@settings(max_examples=2000, deadline=None)
@given(text=st.text(max_size=40) | st.from_regex(r"[0-9x]{0,12}:[a-z0-9]{0,8}(,[0-9x]{0,8}:[a-z]{0,6}){0,2}",
                                                  fullmatch=True))
def test_example_input_specs(text):
    from planner.trace.load import parse_example_input
    try:
        specs = parse_example_input(text)
    except UserError as e:
        assert "--example-input" in str(e)
    else:
        assert specs and all(all(s > 0 for s in shape) for shape, _ in specs)
