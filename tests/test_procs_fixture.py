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
