"""executor/launch.py launch_env: what the launched ranks' environment holds, and why."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from executor.launch import HUGE_PAGES, launch_env

CLONES = textwrap.dedent("""
    import resource
    import torch
    src = torch.ones(16 * 2**20)                 # 64 MiB: above glibc's largest mmap threshold (32 MiB)
    src.clone()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        y = src.clone()
        del y
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 4)
""")


def _faults_per_clone(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", CLONES], capture_output=True, text=True, check=True, env=env)
    return int(out.stdout)


def _thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise or never (Linux)."""
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return re.search(r"\[(\w+)\]", text).group(1)


def test_large_cpu_tensors_are_not_faulted_in_page_by_page():
    # a fresh 64 MiB tensor is 16,384 pages of 4 KiB, each faulted in on first touch; on 2 MiB huge
    # pages it is 32 faults (plus the ones of the small allocations around it)
    plain = {k: v for k, v in os.environ.items() if k != HUGE_PAGES[0]}
    assert _faults_per_clone(plain) >= 16_384
    huge = _faults_per_clone({**launch_env(), "PYTHONSAFEPATH": "0"})
    if _thp_mode() == "never":          # the kernel gives no huge pages: the setting changes nothing
        assert huge >= 16_384
    else:
        assert huge < 2_000


def test_the_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = launch_env()
    assert env["THP_MEM_ALLOC_ENABLE"] == "0" and env["OMP_NUM_THREADS"] == "2"
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    monkeypatch.delenv("OMP_NUM_THREADS")
    env = launch_env()
    assert env["THP_MEM_ALLOC_ENABLE"] == "1" and env["OMP_NUM_THREADS"] == "1"
