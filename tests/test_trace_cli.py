"""`meshplan trace` and `meshplan plan --model file.py:factory` from the command line."""
import json

import networkx as nx
import pytest

from planner.cli import main

MODELS = "tests/trace_models.py"


def test_trace_prints_layers_with_repeated_blocks_collapsed(capsys):
    assert main(["trace", f"{MODELS}:tiny_transformer"]) == 0
    out = capsys.readouterr().out
    assert "TinyTransformer: 164.416K parameters, 64 tokens" in out
    assert "blocks.0 .. 2" in out and "3 blocks, 4 distinct layers costed" in out


def test_trace_json_and_operator_graph(tmp_path, capsys):
    path = tmp_path / "ops.json"
    assert main(["trace", f"{MODELS}:mlp", "--json", "--op-graph", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["params"] == 64 * 256 + 256 + 256 * 64 + 64 + 64 * 10 + 10
    assert doc["fwd_flops"] == 2 * 8 * (64 * 256 + 256 * 64 + 64 * 10)
    assert [layer["name"] for layer in doc["graph"]["layers"]] == ["fc1", "act", "fc2", "head"]
    g = nx.node_link_graph(json.loads(path.read_text()), edges="edges")
    assert g.number_of_nodes() == doc["operators"]


def test_trace_a_zoo_model_against_its_analytical_graph(capsys):
    assert main(["trace", "gpt-1.7b", "--seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "analytical graph: 1.652B parameters; traced/analytical model FLOPs 1.0000" in out


def test_trace_says_whether_the_executor_splits_the_experts(capsys):
    """transformers' grouped experts split over expert-parallel ranks; a stacked weight called another way stays
    whole on every rank, the reason named; --json carries both."""
    pytest.importorskip("transformers")
    assert main(["trace", f"{MODELS}:tiny_mixtral"]) == 0
    assert ("mixture of experts: 4 routed experts a layer, 2 a token; meshplan's executor splits them over "
            "expert-parallel ranks (ep)") in capsys.readouterr().out
    assert main(["trace", f"{MODELS}:stacked_experts"]) == 0
    out = capsys.readouterr().out
    assert ("mixture of experts: 4 routed experts a layer, 1 a token; meshplan's executor keeps them whole on every "
            "rank (ep 1): the experts of '0.experts' are not in a transformers grouped-experts module") in out
    assert main(["trace", f"{MODELS}:stacked_experts", "--json"]) == 0
    experts = json.loads(capsys.readouterr().out)["experts"]
    assert (experts["routed"], experts["splits"], experts["per_token"]) == (4, False, 1)


def test_plan_a_module_with_an_untraceable_part(capsys):
    rc = main(["plan", "--model", f"{MODELS}:untraceable", "--cluster", "cpu-gloo", "--gpus", "2",
               "--global-batch", "8", "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "meshplan: warning: blocks.0.gate: cannot be traced on fake tensors" in captured.err
    plan = json.loads(captured.out)
    assert plan["model"]["source"] == f"{MODELS}:untraceable" and "spec" not in plan["model"]
    assert plan["stages"][0][0] == "tok"


def test_a_module_path_factory(capsys):
    """package.module:factory imports that module (tests/ is on the path under pytest) and nothing else."""
    assert main(["trace", "trace_models:cnn", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == 224 + 16 + 1168 + 32 + 170


def test_example_input_flag_gives_a_bare_module_its_inputs(capsys):
    assert main(["plan", "--model", f"{MODELS}:tiny_transformer_module_only", "--example-input", "1x32:int64",
                 "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["seq_len"] == 32


@pytest.mark.parametrize("args, message", [
    (["--model", f"{MODELS}:tiny_transformer_module_only"], "give their shapes, e.g. --example-input 1x512:int64"),
    (["--model", f"{MODELS}:mlp", "--example-input", "8x64"], "--example-input: '8x64' is not SHAPE:DTYPE"),
    (["--model", f"{MODELS}:mlp", "--example-input", "8x64:complex"], "unknown dtype 'complex'"),
    (["--model", f"{MODELS}:nope"], "has no callable 'nope'"),
    (["--model", f"{MODELS}:not_a_module"], "the factory returned int"),
    (["--model", "tests/missing.py:build"], "tests/missing.py: no such file"),
    (["--model", "no_such_package.models:build"], "cannot import module 'no_such_package.models'"),
])
def test_bad_traced_models_are_one_line_errors(capsys, args, message):
    assert main(["plan", *args, "--cluster", "cpu-gloo", "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
