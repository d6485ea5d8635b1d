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
