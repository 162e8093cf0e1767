"""The `procs` fixture: what a test starts is killed and reaped at teardown, even on failure."""

from __future__ import annotations

import contextlib
import subprocess

import psutil
from conftest import Procs


def test_cleanup_kills_and_reaps_the_process_and_its_group(tmp_path):
    """A still-running process and the children of its session are gone after cleanup."""
    pidfile = tmp_path / "child"
    procs = Procs()
    p = procs.start(
        ["sh", "-c", f'sleep 300 & echo $! > "{pidfile}"; wait'],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert p.poll() is None
    child = int(pidfile.read_text())
    procs.cleanup()
    assert p.returncode is not None  # reaped: no zombie left behind
    assert p.stdout is not None and p.stdout.closed
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(child).wait(timeout=10)  # the sleeper died with its group
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_cleanup_closes_the_pipes_a_left_running_grandchild_holds(tmp_path):
    """A process not leading its group (as the cluster test's `unshare sh -c` nodes) whose
    child keeps its pipes: cleanup kills the child too and closes every pipe, so no unclosed
    file is left for a later garbage collection to warn about (issue 20 item 31)."""
    pidfile = tmp_path / "child"
    procs = Procs()
    p = procs.start(
        ["sh", "-c", f'sleep 300 & echo $! > "{pidfile}"; wait'],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert p.poll() is None
    child = int(pidfile.read_text())
    procs.cleanup()
    assert p.returncode is not None
    assert p.stdout is not None and p.stdout.closed and p.stderr is not None and p.stderr.closed
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(child).wait(timeout=10)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
