"""The distributed test harness (tests/executor_support.spawn) fails a run whose ranks did not all
finish, and only tolerates a rank killed by a signal after the final barrier (gloo's teardown abort); a rank that
crashes mid-run with no Python error is run again, and fails the run when the crash repeats."""
import os

import pytest
import torch.distributed as dist

from tests.executor_support import spawn

pytestmark = pytest.mark.distributed      # the harness that spawns gloo ranks


def _write_rank(path: str) -> None:
    with open(path, "a") as f:
        f.write(f"{dist.get_rank()}\n")


def _abort_before_barrier(path: str) -> None:
    if dist.get_rank() == 1:
        os.abort()
    _write_rank(path)


def _abort_at_teardown(path: str) -> None:
    _write_rank(path)
    if dist.get_rank() == 1:
        dist.destroy_process_group = os.abort      # this rank aborts in teardown, as gloo did


def _raise_on_rank_0(path: str) -> None:
    if dist.get_rank() == 0:
        raise ValueError("rank 0 broke")


def test_rank_killed_before_finishing_fails_the_run(tmp_path):
    with pytest.raises(AssertionError, match="SIGABRT"):
        spawn(_abort_before_barrier, 2, str(tmp_path / "ranks"))


def _abort_on_the_first_run(path: str) -> None:
    crashed = path + ".crashed"
    if dist.get_rank() == 1 and not os.path.exists(crashed):
        open(crashed, "w").close()
        os.abort()                                  # as glibc aborted a rank on a corrupted heap in a CI run
    _write_rank(path)


def test_rank_crashing_once_mid_run_is_run_again(tmp_path):
    with pytest.warns(UserWarning, match="crashed"):
        spawn(_abort_on_the_first_run, 2, str(tmp_path / "ranks"))
    assert sorted((tmp_path / "ranks").read_text().split())[-2:] == ["0", "1"]
    assert (tmp_path / "ranks.crashed").exists()


def test_rank_aborting_in_teardown_after_the_barrier_is_tolerated(tmp_path):
    spawn(_abort_at_teardown, 2, str(tmp_path / "ranks"))
    assert sorted((tmp_path / "ranks").read_text().split()) == ["0", "1"]


def test_error_in_a_rank_is_reported_with_its_traceback(tmp_path):
    with pytest.raises(AssertionError, match="rank 0 broke"):
        spawn(_raise_on_rank_0, 2, str(tmp_path / "ranks"))


def test_a_rendezvous_port_taken_while_the_ranks_start_is_chosen_again(tmp_path, monkeypatch):
    """A port that another process binds between its choice and the store's bind (EADDRINUSE in
    init_process_group) is chosen again rather than failing the run; the port is chosen below the
    kernel's ephemeral range, where no outgoing connection is handed it."""
    import socket
    import tests.executor_support as support
    from executor.launch import _ephemeral_ports, free_port
    low = _ephemeral_ports()[0]
    assert 20000 <= free_port() < low if low > 21000 else free_port() > 0    # a kernel with no room below: its choice
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = iter([held.getsockname()[1]])
    monkeypatch.setattr(support, "free_port", lambda: next(ports, None) or free_port())
    path = tmp_path / "ranks"
    try:
        spawn(_write_rank, 2, str(path))
    finally:
        held.close()
    assert sorted(path.read_text().split()) == ["0", "1"]


def _write_env(path: str) -> None:
    with open(path, "a") as f:
        f.write(f"{os.environ.get('MESHPLAN_TEST_MARK', '-')}\n")


def test_ranks_see_the_environment_of_the_test_at_the_spawn(tmp_path, monkeypatch):
    """The ranks fork from a server started at the first spawn: they still take the environment the test
    process has when it spawns them, as spawned interpreters do."""
    spawn(_write_rank, 1, str(tmp_path / "first"))       # the fork server is running from here on
    monkeypatch.setenv("MESHPLAN_TEST_MARK", "set-after-the-server-started")
    spawn(_write_env, 2, str(tmp_path / "env"))
    assert (tmp_path / "env").read_text().split() == ["set-after-the-server-started"] * 2
