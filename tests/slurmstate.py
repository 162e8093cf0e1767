"""What a test Slurm cluster (tests/slurmcluster.py) makes, recorded before it makes it, so
that the next cluster sweeps what one whose process died unstopped (SIGKILL, a crash, a CI
runner gone) left: its processes, loop devices, bridge, user and directories.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

STATE = "cluster-state.json"  # in the cluster's base directory, /var/tmp/shmstage-slurm-*
ROOT = Path("/var/tmp")


def _identity(pid: int) -> list[float] | None:
    """(pid, start time): a PID the kernel gave to another process since is not ours."""
    try:
        return [pid, psutil.Process(pid).create_time()]
    except psutil.Error:
        return None


def _same(ident: list[float]) -> bool:
    now = _identity(int(ident[0]))
    return now is not None and now[1] == ident[1]


class Record:
    """The state file of one cluster: every ``add`` is written (atomically) at once."""

    def __init__(self, base: Path, image: Path) -> None:
        self.path = base / STATE
        self.data: dict = {"owner": _identity(os.getpid()), "base": str(base),
                           "image": str(image), "pids": [], "bridge": None, "user": None,
                           "dirs": []}  # fmt: skip
        self._save()

    def add(self, key: str, value) -> None:
        """Set ``key`` (bridge, user) or append to it (pids: a PID; dirs: a path)."""
        if key == "pids":
            ident = _identity(value)
            if ident is not None:
                self.data["pids"].append(ident)
        elif key == "dirs":
            self.data["dirs"].append(str(value))
        else:
            self.data[key] = value
        self._save()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def sweep(root: Path = ROOT) -> list[str]:
    """Remove what clusters whose owner process is dead left under ``root``; say what."""
    swept = []
    for state in sorted(root.glob(f"shmstage-slurm-*/{STATE}")):
        try:
            data = json.loads(state.read_text())
        except (OSError, ValueError):
            continue  # being written, or being removed by its live owner
        if data.get("owner") is None or _same(data["owner"]):
            continue  # its owner runs: the cluster is in use
        swept += _remove(data)
    return swept


def _remove(data: dict) -> list[str]:
    gone = []
    pids = [p for p in data["pids"] if _same(p)]
    for ident in pids:  # nodes' PID 1 first (recorded so): the kernel kills their rest
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(ident[0]), signal.SIGKILL)
        gone.append(f"pid {int(ident[0])}")
    deadline = time.monotonic() + 20
    while any(_same(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    bridge = data.get("bridge")  # its veths went with the nodes' network namespaces
    if bridge and _ok(["ip", "link", "del", bridge]):
        gone.append(f"bridge {bridge}")
    out = subprocess.run(["losetup", "-j", data["image"]], capture_output=True, text=True)
    for line in out.stdout.splitlines():  # "/dev/loop3: []: (/var/tmp/.../nfs.ext4)"
        dev = line.split(":", 1)[0]
        subprocess.run(["losetup", "-d", dev], capture_output=True)
        gone.append(f"loop device {dev}")
    user = data.get("user")
    if user and user.startswith("shmslurm") and _ok(["userdel", user]):
        gone.append(f"user {user}")
    for d in (*data["dirs"], data["base"]):
        if os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(f"directory {d}")
    return gone


def _ok(argv: list[str]) -> bool:
    return subprocess.run(argv, capture_output=True).returncode == 0
