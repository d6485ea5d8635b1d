import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `meshplan ARGS` as a user would, in a fresh interpreter started in ``cwd``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def write_json(tmp_path):
    def write(data, name="config.json") -> str:
        path = tmp_path / name
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        return str(path)
    return write


# The files whose tests run longest (minutes each on the 2-core CI machine: the executor's plan grid, its
# split-backward schedules, elastic restarts, the full-scale dry runs, LoRA, the ILP-against-enumeration checks,
# expert parallelism), collected first. pytest-xdist's --dist loadfile hands whole files to the workers in the
# order they were collected, so one of these collected late would leave a worker running it alone at the end.
LONGEST_FIRST = ("test_executor_plans.py", "test_executor_zb.py", "test_executor_elastic.py", "test_dry_run.py",
                 "test_executor_lora.py", "test_ilp.py", "test_executor_moe.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))       # stable: the rest keep their order
