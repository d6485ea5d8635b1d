"""`meshplan compare` reads a PEFT adapter_config.json beside a DeepSpeed or torchtitan config (or named by
--adapter-config): LoRA's rank and target projections from the keys LoraConfig saves (planner/baseline/peft.py)."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from planner.baseline import peft
from planner.errors import UserError

DS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
      "zero_optimization": {"stage": 3}}


def _adapter(tmp_path, **keys):
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", **keys}))
    return path


@pytest.mark.parametrize("targets, expected", [
    (["q_proj", "v_proj"], ("q", "v")),
    (["model.layers.0.self_attn.o_proj", "down_proj", "up_proj", "gate_proj"], ("o", "gate", "up", "down")),
    ("all-linear", ("q", "k", "v", "o", "gate", "up", "down")),
    (r".*\.(k_proj|up_proj)", ("k", "up")),
    (None, ("q", "v")),             # PEFT's Llama default
])
def test_rank_and_targets_come_from_the_keys_lora_config_saves(tmp_path, targets, expected):
    got = peft.read(_adapter(tmp_path, r=32, target_modules=targets))
    assert (got["finetune"], got["lora_rank"], got["lora_targets"]) == ("lora", 32, expected)
    assert got["ignored"] == ()


def test_what_it_does_not_model_is_listed_not_dropped(tmp_path):
    got = peft.read(_adapter(tmp_path, r=8, target_modules=["q_proj", "lm_head"], modules_to_save=["embed_tokens"],
                             use_dora=True, bias="none"))
    assert got["lora_targets"] == ("q",)
    assert len(got["ignored"]) == 3
    assert any("'lm_head'" in i for i in got["ignored"]) and any("modules_to_save" in i for i in got["ignored"])
    assert any("use_dora" in i for i in got["ignored"])
    assert "16-bit base" in got["notes"][0]


@pytest.mark.parametrize("keys, field", [
    ({"peft_type": "IA3"}, "peft_type"),
    ({"r": 0}, "r"),
    ({"target_modules": ["lm_head"]}, "target_modules"),
    ({"target_modules": "(unclosed"}, "target_modules"),
    ({"target_modules": r".*\.c_attn"}, "target_modules"),
])
def test_bad_keys_name_the_file_and_the_key(tmp_path, keys, field):
    with pytest.raises(UserError) as err:
        peft.read(_adapter(tmp_path, **keys))
    assert err.value.field == field and err.value.source.endswith("adapter_config.json")


def test_compare_reads_the_adapter_config_beside_a_deepspeed_config(tmp_path):
    (tmp_path / "ds_config.json").write_text(json.dumps(DS))
    args = ("compare", "--model", "llama3-8b", "--cluster", "a100-80g", "--gpus", "8", "--seq-len", "4096",
            "--baseline", str(tmp_path / "ds_config.json"), "--json")
    alone = json.loads(run_cli(*args).stdout)
    _adapter(tmp_path, r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    lora = json.loads(proc.stdout)
    assert alone["workload"]["finetune"] == "full"
    assert (lora["workload"]["finetune"], lora["workload"]["lora_rank"], lora["workload"]["lora_targets"]) == \
        ("lora", 16, ["q", "k", "v", "o"])
    # frozen weights: no gradients or optimizer states but the adapters'
    mine, before = lora["baseline"]["estimate"]["memory_per_gpu_bytes"], alone["baseline"]["estimate"]["memory_per_gpu_bytes"]
    assert mine["optimizer"] < before["optimizer"] / 50


def test_an_adapter_config_beside_megatron_arguments_is_refused_by_name(tmp_path):
    args = tmp_path / "args.txt"
    args.write_text("--tensor-model-parallel-size 1 --micro-batch-size 1 --global-batch-size 8 --seq-length 2048 --bf16\n")
    proc = run_cli("compare", "--model", "llama3-8b", "--cluster", "a100-80g", "--gpus", "8", "--baseline", str(args),
                   "--adapter-config", str(_adapter(tmp_path, r=8)))
    assert proc.returncode == 2 and "--adapter-config" in proc.stderr and "Traceback" not in proc.stderr
