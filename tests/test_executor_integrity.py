"""The executor refuses a plan made for another world size from inside the job, and runs
only code the user named, unpickling nothing. The refusals `meshplan run` makes before
launching are in test_catalogue_executor.py."""
from __future__ import annotations

import ast
import json

import pytest

from conftest import ROOT
from executor_support import TINY_GPT, write_plan
from planner.errors import UserError


@pytest.mark.distributed
def test_a_job_of_another_world_size_is_refused_by_every_rank(tmp_path, capfd):
    """A 2-process plan launched as a 1-process torchrun job (as a hand-written torchrun command
    would): the rank refuses before building anything, naming both sizes; exit code 2."""
    from executor.launch import Launch, launch
    plan = write_plan(tmp_path, TINY_GPT, gpus=2, dp=2)
    code = launch(Launch(nproc=1), ["--plan", plan, "--model", str(tmp_path / "tiny-gpt.json"), "--steps", "1",
                                    "--out", str(tmp_path / "m.json")])
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    assert (f"meshplan run: error: {plan}: fingerprints.world_size: the plan was made for 2 processes (dp x tp x pp "
            "x cp = 2 x 1 x 1 x 1) but this job has 1; allowed: 2 processes, or re-plan with "
            "`meshplan plan --gpus 1`") in err
    assert not (tmp_path / "m.json").exists()


DECOY = "open({marker!r}, 'w').write('imported'); raise ImportError('decoy {name} from the working directory')\n"


@pytest.mark.distributed
def test_launched_processes_import_nothing_from_the_working_directory(tmp_path, monkeypatch, capfd):
    """`executor/`, `planner/` and `torch/` packages lying in the directory `meshplan run` starts
    from are never imported by torchrun or the ranks (python -m would put the working directory
    first on sys.path): the run succeeds and no decoy wrote its marker. (A PYTHONPATH naming the
    directory, such as a relative '.', is the user naming it: the test's names only the checkout.)"""
    from executor.launch import Launch, launch
    plan = write_plan(tmp_path, TINY_GPT, gpus=1)
    work = tmp_path / "work"
    for name in ("executor", "planner", "torch"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text(DECOY.format(marker=str(tmp_path / f"{name}.imported"), name=name))
    monkeypatch.chdir(work)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    code = launch(Launch(nproc=1), ["--plan", plan, "--model", str(tmp_path / "tiny-gpt.json"), "--steps", "1",
                                    "--out", str(tmp_path / "m.json")])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert json.loads((tmp_path / "m.json").read_text())["steps"] == 1
    assert sorted(p.name for p in tmp_path.glob("*.imported")) == []


class _Payload:
    """Unpickling this calls open(path, 'w'): code run from a file, the thing weights_only forbids."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_checkpoint_rng_file_holding_objects_is_refused_unrun(tmp_path):
    import torch

    from executor.checkpoint import set_rng_state
    marker = tmp_path / "ran"
    evil = tmp_path / "rng-rank0.pt"
    torch.save({"cpu": _Payload(str(marker))}, evil)
    with pytest.raises(UserError, match=r"rng-rank0.pt: not an RNG state written by meshplan run \(refused to unpickle"):
        set_rng_state(evil)
    assert not marker.exists()
    good = tmp_path / "good.pt"                     # what save_atomic writes loads
    torch.save({"cpu": torch.get_rng_state()}, good)
    set_rng_state(good)


def test_every_torch_load_is_weights_only():
    """torch.load in the executor and the tests passes weights_only=True (tensors, no objects)."""
    calls = []
    for path in [*sorted((ROOT / "executor").glob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr == "load" \
                    and isinstance(func.value, ast.Name) and func.value.id == "torch":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                calls.append((f"{path.name}:{node.lineno}", safe))
    assert calls and all(safe for _, safe in calls), calls
