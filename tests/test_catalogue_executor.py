"""The executor's bad inputs, one case each: what is given, exit code 2, and one line on stderr
naming the source (file or flag), the field and what is allowed.

Every case goes through `meshplan run` (planner.cli.main, in this process) and must be refused
before anything is launched; the plans are written by the planner's own CLI, then broken the way
each case says. The expected text is written here by hand, never taken from the executor.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from executor_support import TINY_GPT, TINY_LLAMA, write_plan
from planner.errors import UserError
from planner.model import ModelSpec


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("catalogue")
    paths = {"gpt": write_plan(tmp, TINY_GPT, gpus=2, name="gpt", dp=2, zero=3),
             "llama": write_plan(tmp, TINY_LLAMA, gpus=2, name="llama", dp=2),
             # planned for DeepSpeed's runtime, then broken to ask for offload without ZeRO
             "offload": write_plan(tmp, TINY_LLAMA, gpus=2, name="offload", dp=2, zero=1, optimizer_offload=True,
                                   framework="deepspeed")}
    docs = {name: json.loads(Path(p).read_text()) for name, p in paths.items()}
    for name, losses in (("done", [4.8, 4.8, 4.8, 4.8]), ("broken", [1.0])):
        (tmp / name / "step-00000004").mkdir(parents=True)
        (tmp / name / "step-00000004" / "COMPLETE.json").write_text(json.dumps(
            {"step": 4, "seed": 0, "losses": losses, "world_size": 2}))
    return tmp, docs


def _set(path: str, value):
    """A change that sets doc[a][b]... = value ('a.b' path; value DELETE removes the key)."""
    def change(doc, docs):
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value(docs) if callable(value) else value
    return change


DELETE = object()

# id: (base plan, change to plan.json, --model, extra flags, expected pieces of the one line)
CASES = {
    "schema version unknown": ("gpt", _set("schema_version", 9), "gpt", [],
                               ["plan.json: schema_version: unsupported schema version 9", "reads 1"]),
    "schema version missing": ("gpt", _set("schema_version", DELETE), "gpt", [],
                               ["plan.json: schema_version: unsupported schema version None", "reads 1"]),
    "meshplan version not a string": ("gpt", _set("meshplan_version", 1), "gpt", [],
                                      ["plan.json: meshplan_version: must be a string, got 1"]),
    "model missing": ("gpt", _set("model", DELETE), "gpt", [], ["plan.json: model: missing (required)"]),
    "model spec not an object": ("gpt", _set("model.spec", [1]), "gpt", [],
                                 ["plan.json: model.spec: must be a JSON object, got [1]"]),
    "model spec unknown field": ("gpt", _set("model.spec.wings", 2), "gpt", [],
                                 ["plan.json: model.spec: unknown field(s) wings; allowed: attention_sinks, dense_layers, dropout,"]),
    "fingerprints missing": ("gpt", _set("fingerprints", DELETE), "gpt", [],
                             ["plan.json: fingerprints: missing (required)"]),
    "model fingerprint not hex": ("gpt", _set("fingerprints.model", "xyz"), "gpt", [],
                                  ["plan.json: fingerprints.model: 'xyz' is not 16 lowercase hex digits"]),
    "world size zero": ("gpt", _set("fingerprints.world_size", 0), "gpt", [],
                        ["plan.json: fingerprints.world_size: must be a positive integer, got 0"]),
    "world size not the config's": ("gpt", _set("fingerprints.world_size", 4), "gpt", [],
                                    ["plan.json: config: dp x tp x pp x cp = 2 x 1 x 1 x 1 = 2 but "
                                     "fingerprints.world_size is 4"]),
    # the plan's spec says GPT but its fingerprint is the Llama plan's: made for another model
    "another model (fingerprint)": ("gpt", _set("fingerprints.model", lambda d: d["llama"]["fingerprints"]["model"]),
                                    "gpt", [], ["plan.json: fingerprints.model: --model", "has model fingerprint",
                                                "the plan was made for", "another model", "re-plan"]),
    "another model (spec)": ("gpt", None, "llama", [],
                             ["plan.json: model.spec: --model", "is not the model this plan was made for",
                              "mlp 'swiglu' != 'gelu'"]),
    "workload batch not an integer": ("gpt", _set("workload.global_batch", "8"), "gpt", [],
                                      ["plan.json: workload.global_batch: must be a JSON integer, got '8'"]),
    "workload precision": ("gpt", _set("workload.precision", "fp8"), "gpt", [],
                           ["plan.json: workload.precision: 'fp8' is not allowed; allowed: bf16, fp16 or fp32"]),
    "workload unknown field": ("gpt", _set("workload.speed", 1), "gpt", [],
                               ["plan.json: workload: unknown field(s) speed; allowed:"]),
    "config degree not an integer": ("gpt", _set("config.tp", "two"), "gpt", [],
                                     ["plan.json: config.tp: must be a positive integer, got 'two'"]),
    "config zero stage": ("gpt", _set("config.zero", 7), "gpt", [],
                          ["plan.json: config.zero: 7 is not a ZeRO stage; allowed: 0, 1, 2 or 3"]),
    "config micro-batches": ("gpt", _set("config.num_microbatches", 3), "gpt", [],
                             ["plan.json: config.num_microbatches: dp x micro_batch x num_microbatches = 2 x 4 x 3 = "
                              "24 but workload.global_batch is 8; allowed: equal"]),
    "config offload without ZeRO": ("offload", _set("config.zero", 0), "llama", [],
                                    ["plan.json: config.optimizer_offload: optimizer offload with ZeRO-0 does not run on the "
                                     "torch runtime on cpu; allowed with ZeRO 1, 2 or 3"]),
    "stages not a list": ("gpt", _set("stages", "all"), "gpt", [],
                          ["plan.json: stages: must be a JSON array, got 'all'"]),
    "stages not paths": ("gpt", _set("stages", [[1, 2]]), "gpt", [],
                         ["plan.json: stages: must be a list of lists of module paths (strings)"]),
    "stages count": ("gpt", _set("stages", [["embed"], ["lm_head"]]), "gpt", [],
                     ["plan.json: stages: 2 stages but pp x vpp = 1 x 1"]),
    "stages unknown layer": ("gpt", _set("stages", [["embed", "layers.0", "layers.1", "layers.9", "layers.3",
                                                     "norm", "lm_head"]]), "gpt", [],
                             ["plan.json: stages: the stages must list embed, layers.0 ... lm_head once each"]),
    "tp plan not an object": ("gpt", _set("tp_plan", ["colwise"]), "gpt", [],
                              ["plan.json: tp_plan: must be a JSON object {module path: colwise, rowwise,"]),
    "tp style": ("gpt", _set("tp_plan", {"layers.0.attn.q_proj": "diagonal"}), "gpt", [],
                 ["plan.json: tp_plan: 'diagonal' for 'layers.0.attn.q_proj'; allowed: colwise, rowwise, vocab,"]),
    "recompute policy": ("gpt", _set("recompute_per_layer", {"layers.0": "some"}), "gpt", [],
                         ["plan.json: recompute_per_layer: 'some' for 'layers.0'; allowed: none, selective, discard, op, full or activation-offload"]),
    "estimate step time": ("gpt", _set("estimate.step_time_s", "fast"), "gpt", [],
                           ["plan.json: estimate.step_time_s: must be a number, got 'fast'"]),
    "estimate memory per stage": ("gpt", _set("estimate.memory_per_stage_bytes", 5), "gpt", [],
                                  ["plan.json: estimate.memory_per_stage_bytes: must be a non-empty list of objects"]),
    "traced module plan": ("gpt", _set("model.spec", DELETE), "gpt", [],
                           ["plan.json: model.spec: the plan is for a traced module", "auto_parallelize"]),
    # run flags
    "process count": ("gpt", None, "gpt", ["--nproc", "3"],
                      ["--nproc: 1 node(s) x 3 processes = 3, but the plan needs 2"]),
    "checkpoint every without dir": ("gpt", None, "gpt", ["--checkpoint-every", "4"],
                                     ["--checkpoint-every: needs --checkpoint-dir DIR"]),
    "checkpoint every zero": ("gpt", None, "gpt", ["--checkpoint-dir", "ck", "--checkpoint-every", "0"],
                              ["argument --checkpoint-every: expected a positive integer, got '0'"]),
    "max restarts negative": ("gpt", None, "gpt", ["--max-restarts", "-1"],
                              ["argument --max-restarts: expected a non-negative integer, got '-1'"]),
    "timeout zero": ("gpt", None, "gpt", ["--timeout", "0"],
                     ["argument --timeout: expected a number of seconds > 0, got '0'"]),
    "timeout not a number": ("gpt", None, "gpt", ["--timeout", "soon"],
                             ["argument --timeout: expected a number of seconds > 0, got 'soon'"]),
    "checkpoint dir and load": ("gpt", None, "gpt", ["--checkpoint-dir", "ck", "--load", "old"],
                                ["--load: --load and --checkpoint-dir both say where checkpoints are; allowed: one"]),
    "checkpoint dir is a file": ("gpt", None, "gpt", ["--checkpoint-dir", "{tmp}/gpt.json"],
                                 ["gpt.json: --checkpoint-dir: exists and is not a folder; allowed: a folder"]),
    # a complete checkpoint after 4 steps of seed 0 in {tmp}/done (the fixture writes its marker)
    "fewer steps than the checkpoint": ("gpt", None, "gpt", ["--checkpoint-dir", "{tmp}/done", "--steps", "3"],
                                        ["done: --steps: holds a checkpoint after step 4, beyond --steps 3; "
                                         "allowed: --steps >= 4, or another --checkpoint-dir"]),
    "another seed than the checkpoint": ("gpt", None, "gpt", ["--checkpoint-dir", "{tmp}/done", "--seed", "1"],
                                         ["done: --seed: its checkpoint was written with --seed 0, this run has "
                                          "--seed 1; allowed: the same seed"]),
    "checkpoint marker losses": ("gpt", None, "gpt", ["--checkpoint-dir", "{tmp}/broken"],
                                 ["broken/step-00000004/COMPLETE.json: losses: must be the 4 losses of the steps "
                                  "done, got [1.0]"]),
    # elastic runs
    "elastic not a range": ("gpt", None, "gpt", ["--elastic", "2:1"],
                            ["argument --elastic: expected MIN:MAX nodes with 1 <= MIN <= MAX (e.g. 1:4), got '2:1'"]),
    "elastic without checkpoint dir": ("gpt", None, "gpt", ["--elastic", "1:2", "--rdzv-endpoint", "h:1"],
                                       ["--elastic: needs --checkpoint-dir DIR, on a file system every node sees"]),
    "elastic without endpoint": ("gpt", None, "gpt", ["--elastic", "1:2", "--checkpoint-dir", "{tmp}/done"],
                                 ["--elastic: needs --rdzv-endpoint HOST:PORT, where the nodes' agents meet"]),
    "elastic and nnodes": ("gpt", None, "gpt", ["--elastic", "1:2", "--nnodes", "2", "--checkpoint-dir", "{tmp}/done",
                                                "--rdzv-endpoint", "h:1"],
                           ["--nnodes: --elastic MIN:MAX says how many nodes, and the rendezvous numbers them; "
                            "allowed: --elastic without --nnodes"]),
    "rdzv conf key": ("gpt", None, "gpt", ["--rdzv-conf", "last_call=2"],
                      ["argument --rdzv-conf: 'last_call=2' is not KEY=VALUE with KEY one of join_timeout, "
                       "last_call_timeout"]),
    "rdzv conf value": ("gpt", None, "gpt", ["--rdzv-conf", "join_timeout=soon"],
                        ["argument --rdzv-conf: join_timeout='soon': expected a positive integer"]),
    "fixed knobs not an object": ("gpt", _set("knobs", [1]), "gpt", [],
                                  ["plan.json: knobs: must be a JSON object {knob: integer, string or boolean}"]),
}


def _meshplan_run(argv: list[str], capsys) -> tuple[int, str]:
    from planner.cli import main
    try:
        code = main(argv)
    except SystemExit as e:         # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_naming_source_field_and_allowed(case, plans, tmp_path, capsys):
    base, change, model, flags, expected = CASES[case]
    tmp, docs = plans
    doc = copy.deepcopy(docs[base])
    if change is not None:
        change(doc, docs)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    model_path = str(tmp / ("tiny-gpt.json" if model == "gpt" else "tiny-llama.json"))
    argv = ["run", "--plan", str(plan), "--model", model_path, "--steps", "6", "--out", str(tmp_path / "m.json"),
            *[f.format(tmp=tmp) for f in flags]]
    code, err = _meshplan_run(argv, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("meshplan run: error: ")
    for piece in expected:
        assert piece in lines[0].replace(str(plan), "plan.json"), (piece, lines[0])
    assert not (tmp_path / "m.json").exists()       # nothing ran


@pytest.mark.parametrize("text,expected", [
    ("", "cannot read: No such file or directory"), ("{", "not valid JSON at line 1"), ("[1, 2]", "expected a JSON object, got list")])
def test_a_plan_file_that_is_not_a_plan_is_one_line(text, expected, tmp_path, plans, capsys):
    tmp, _ = plans
    plan = tmp_path / "plan.json"
    if text:
        plan.write_text(text)
    code, err = _meshplan_run(["run", "--plan", str(plan), "--model", str(tmp / "tiny-gpt.json"), "--steps", "1"],
                              capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{plan}: " in err and expected in err, err


def test_a_malformed_fault_injection_variable_is_one_line(plans, tmp_path, capsys, monkeypatch):
    tmp, docs = plans
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(docs["gpt"]))
    monkeypatch.setenv("MESHPLAN_FAULT", "explode:1:2")
    code, err = _meshplan_run(["run", "--plan", str(plan), "--model", str(tmp / "tiny-gpt.json"), "--steps", "1"],
                              capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "MESHPLAN_FAULT: 'explode:1:2' is not KIND:RANK:STEP with KIND kill, hang or kill-in-checkpoint" in err


def test_a_plan_written_by_another_meshplan_version_is_a_one_line_warning(plans, capsys):
    from importlib.metadata import version

    from executor.plan_file import warn_if_other_version
    from planner.plan import Plan
    _, docs = plans
    doc = {**docs["gpt"], "meshplan_version": "0.0.1"}
    warn_if_other_version(Plan.from_json(doc, "p.json"))
    err = capsys.readouterr().err
    assert err.splitlines() == [f"meshplan run: warning: p.json: meshplan_version: written by meshplan 0.0.1, "
                                f"this is meshplan {version('meshplan')}; its estimate may differ from what this "
                                "version predicts (re-plan to compare)"]
    warn_if_other_version(Plan.from_json(docs["gpt"], "p.json"))       # the planner wrote it: same version
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("knobs,expected", [
    ({"cp": 2}, "knobs.cp: 2: auto_parallelize runs cp 1 only"),
    ({"sequence_parallel": True}, "knobs.sequence_parallel: True: auto_parallelize runs sequence_parallel False"),
    ({"optimizer_offload": True}, "knobs.optimizer_offload: True: auto_parallelize runs optimizer_offload False only"),
])
def test_auto_parallelize_refuses_knobs_it_cannot_run(knobs, expected):
    from executor.auto import executable_knobs
    from planner.api import Knobs
    with pytest.raises(UserError) as caught:
        executable_knobs(Knobs(**knobs))
    assert caught.value.exit_code == 2 and expected in str(caught.value) and "allowed:" in str(caught.value)


def test_the_spec_models_are_the_planners(plans):
    """The catalogue's GPT and Llama plans carry the specs the tests wrote (so 'another model' cases
    really compare two models)."""
    _, docs = plans
    for name, spec in (("gpt", TINY_GPT), ("llama", TINY_LLAMA)):
        written = ModelSpec(**docs[name]["model"]["spec"])      # plan.json leaves out the fields at their default
        assert {k: v for k, v in asdict(written).items() if k not in ("name", "source")} == \
            {k: v for k, v in asdict(spec).items() if k not in ("name", "source")}
    assert docs["gpt"]["fingerprints"]["model"] != docs["llama"]["fingerprints"]["model"]
