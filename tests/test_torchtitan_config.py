"""torchtitan's two config forms: the Python config module of current torchtitan (a function returning
Trainer.Config; batch sizes in tokens) and the TOML of v0.2.2 and earlier. meshplan writes both and reads
both back as the plan they came from; every key it writes is a field of torchtitan's dataclasses at a pinned
commit (tests/data/torchtitan_fields.json, read from its source by tests/data/torchtitan_fields.py)."""
from __future__ import annotations

import ast
import json
import textwrap

import pytest

from conftest import ROOT
from planner import api
from planner.baseline import Context, read_baseline
from planner.errors import UserError
from planner.exports import torchtitan, torchtitan_python

FIELDS = json.loads((ROOT / "tests" / "data" / "torchtitan_fields.json").read_text())
KNOBS = ("dp", "tp", "pp", "cp", "zero", "micro_batch", "num_microbatches", "vpp", "schedule", "sequence_parallel",
         "optimizer_offload", "stage_layers")
# plans torchtitan expresses (it has no ZeRO-1: its data parallelism is DDP, HSDP or FSDP; and with context
# parallelism it shards the states over the context-parallel ranks too)
CASES = [dict(pp=2, tp=2, cp=1, zero=0, schedule="interleaved-1f1b"), dict(pp=1, tp=1, cp=1, zero=3, recompute="full"),
         dict(pp=1, tp=8, cp=1, zero=0, recompute="none"),
         dict(pp=4, tp=1, cp=1, zero=0, schedule="1f1b", recompute="full"),
         dict(pp=1, tp=2, cp=1, zero=2, recompute="op", micro_batch=1, sequence_parallel=True)]


def _plan(**knobs):
    return api.plan(api.load_job("llama3-8b", "h100-80g", gpus=16, global_batch=64, framework="torchtitan"),
                    api.Knobs(**knobs))


def _policies(config, graph) -> tuple:
    from planner.placement import layer_policies
    return tuple(layer_policies(graph, config))


@pytest.mark.parametrize("knobs", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_both_forms_read_back_as_the_plan_they_came_from(tmp_path, knobs):
    plan = _plan(**knobs)
    for export, name in ((torchtitan_python, "config.py"), (torchtitan, "config.toml")):
        path = tmp_path / name
        path.write_text(export(plan).text)
        baseline, spec, graph = read_baseline(str(path), Context(gpus=16))
        assert spec.name == "llama3-8b" and baseline.global_batch == 64 and baseline.seq_len == 8192
        for knob in KNOBS:
            assert getattr(baseline.config, knob) == getattr(plan.config, knob), (name, knob)
        assert _policies(baseline.config, graph) == _policies(plan.config, plan.graph), name
        assert baseline.runtime == "torchtitan"


def test_the_python_form_says_sequence_parallelism_off_where_the_toml_could_not(tmp_path):
    plan = _plan(pp=1, tp=2, cp=1, zero=2, sequence_parallel=False)
    path = tmp_path / "config.py"
    path.write_text(torchtitan_python(plan).text)
    assert read_baseline(str(path), Context(gpus=16))[0].config.sequence_parallel is False
    assert any("always shards norms along the sequence" in n for n in torchtitan(plan).notes)


def _calls(text: str) -> dict[str, list[str]]:
    """The keyword names of each call in the exported module, by the called name."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            out.setdefault(name, []).extend(k.arg for k in node.keywords)
    return out


@pytest.mark.parametrize("knobs", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_every_key_of_the_python_export_is_a_field_of_torchtitans_dataclasses(knobs):
    text = torchtitan_python(_plan(**knobs)).text
    compile(text, "torchtitan_config.py", "exec")           # valid Python
    calls = _calls(text)
    classes = FIELDS["classes"]
    for call, fields in (("Trainer.Config", "Trainer.Config"), ("TrainingConfig", "TrainingConfig"),
                         ("ParallelismConfig", "ParallelismConfig")):
        assert calls[call], call
        assert set(calls[call]) <= set(classes[fields]), (call, set(calls[call]) - set(classes[fields]))
    for name in calls:
        if name.endswith("AC.Config"):
            assert name.removesuffix(".Config") in FIELDS["activation_checkpoint_classes"], name
    assert len(FIELDS["commit"]) == 40


# In the shape of torchtitan's own Llama 3 70B config (its config function: model_registry("70B"),
# TrainingConfig in tokens, ParallelismConfig with tensor_parallel_degree 8, FullAC), written here.
LLAMA3_70B = '''
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.optimizer import default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer


def llama3_70b() -> Trainer.Config:
    model_spec = model_registry("70B")
    return Trainer.Config(
        hf_assets_path="./assets/hf/Llama-3.1-70B",
        model_spec=model_spec,
        optimizer=default_adamw(lr=1.5e-4),
        training=TrainingConfig(
            num_tokens_per_microbatch_per_dp_rank=8 * 8192,
            max_context_length=8192,
            steps=1000,
        ),
        parallelism=ParallelismConfig(
            tensor_parallel_degree=8,
        ),
        checkpoint=CheckpointManager.Config(interval=500),
        activation_checkpoint=FullAC.Config(),
    )
'''


def test_torchtitans_llama3_70b_python_config_plans_through_compare(cli, tmp_path):
    path = tmp_path / "llama3_70b.py"
    path.write_text(LLAMA3_70B)
    out = cli("compare", "--cluster", "h100-80g", "--gpus", "256", "--baseline", str(path), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    base = doc["baseline"]
    assert base["format"] == "torchtitan-python" and doc["workload"]["framework"] == "torchtitan"
    assert doc["model"]["name"] == "llama3-70b" and doc["workload"]["seq_len"] == 8192
    c = base["config"]
    # FSDP over the 32 data-parallel ranks left by tp 8 (data_parallel_shard_degree -1), 8 sequences each
    assert (c["tp"], c["pp"], c["dp"], c["zero"], c["micro_batch"]) == (8, 1, 32, 3, 8)
    assert c["recompute"] == "full" and doc["workload"]["global_batch"] == 256
    text = cli("compare", "--cluster", "h100-80g", "--gpus", "256", "--baseline", str(path)).stdout
    assert "torchtitan Python config" in text


REGISTRY = '''
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.trainer import Trainer
from . import model_registry


def llama3_8b() -> Trainer.Config:
    return Trainer.Config(
        model_spec=model_registry("8B"),
        training=TrainingConfig(num_tokens_per_microbatch_per_dp_rank=2 * 8192, max_context_length=8192),
        parallelism=ParallelismConfig(pipeline_parallel_degree=2, num_pp_microbatches=4,
                                      pipeline_parallel_schedule="1F1B"),
        activation_checkpoint=None,
    )


def llama3_8b_tp2() -> Trainer.Config:
    config = llama3_8b()
    config.parallelism.tensor_parallel_degree = 2
    config.training.num_tokens_per_train_step = 64 * 8192
    return config
'''


def test_a_config_registry_picks_its_function_and_follows_derived_configs(tmp_path):
    folder = tmp_path / "llama3"                 # `from . import model_registry`: the model is the folder's
    folder.mkdir()
    path = folder / "config_registry.py"
    path.write_text(textwrap.dedent(REGISTRY))
    with pytest.raises(UserError, match="2 config functions.*llama3_8b or llama3_8b_tp2"):
        read_baseline(str(path), Context(gpus=16))
    base, spec, _ = read_baseline(f"{path}:llama3_8b", Context(gpus=16))
    # 2 sequences per micro-batch x 4 pipeline micro-batches per replica, dp 8: 64 sequences
    assert spec.name == "llama3-8b" and base.global_batch == 64
    assert (base.config.pp, base.config.dp, base.config.micro_batch, base.config.num_microbatches) == (2, 8, 2, 4)
    derived, _, _ = read_baseline(f"{path}:llama3_8b_tp2", Context(gpus=16))
    assert (derived.config.tp, derived.config.pp, derived.config.dp) == (2, 2, 4)
    assert derived.global_batch == 64 and derived.config.num_microbatches == 8
    with pytest.raises(UserError, match="'nope' is not a config function"):
        read_baseline(f"{path}:nope", Context(gpus=16))


def test_the_toml_form_reads_the_token_based_batch_keys(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nnum_tokens_per_microbatch_per_dp_rank = '
                    '16384\nnum_tokens_per_train_step = 1048576\nmax_context_length = 8192\n[parallelism]\n'
                    'tensor_parallel_degree = 2\n')
    base, _, _ = read_baseline(str(path), Context(gpus=16))
    assert base.global_batch == 128 and base.seq_len == 8192
    assert (base.config.dp, base.config.micro_batch, base.config.num_microbatches) == (8, 2, 8)
    path.write_text('[training]\nlocal_batch_size = 2\nnum_tokens_per_train_step = 1048576\n')
    with pytest.raises(UserError, match="local_batch_size beside the token-based batch keys"):
        read_baseline(str(path), Context(gpus=16), model="llama3-8b")


def test_a_py_baseline_that_is_not_a_torchtitan_config_is_refused(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    with pytest.raises(UserError, match="read as a torchtitan Python config"):
        read_baseline(str(path), Context(gpus=8), model="llama3-8b")
