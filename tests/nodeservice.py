"""A real `shmstage serve` for tests (the ``service`` fixture in conftest.py): the service as
root on a socket in a tmpfs every user can reach, and the test users who are its clients."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

ALICE, BOB = 4551, 4552


def as_user(uid: int, gid: int | None = None) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid if gid is None else gid}", "--clear-groups"]


def own(path: Path, uid: int, gid: int | None = None) -> None:
    for p in [path, *path.rglob("*")]:
        os.lchown(p, uid, uid if gid is None else gid)


def make_ds(path: Path, files: int = 4, size: int = 64 * 1024, uid: int | None = None) -> Path:
    path.mkdir(parents=True)
    for i in range(files):
        (path / f"f{i}").write_bytes(os.urandom(size))
    if uid is not None:
        own(path, uid)
    return path


class Service:
    """A `shmstage serve` on ``world/run/shmstage.sock`` owning ``world/store``."""

    def __init__(self, world: Path, shmstage_bin: list[str], procs, config: str = "") -> None:
        self.world, self.bin, self.procs = world, shmstage_bin, procs
        self.store = world / "store"
        self.socket = world / "run" / "shmstage.sock"
        self.config = world / "shmstage.yaml"
        self.config.write_text(config or f"version: 1\ndest: {self.store}\n")
        self.config.chmod(0o644)
        self.env = {
            **os.environ,
            "SHMSTAGE_SOCKET": str(self.socket),
            "SHMSTAGE_CONFIG": str(self.config),
            "SHMSTAGE_STATE_DIR": str(world / "state"),  # the lease keeper's, not the node's
        }
        self.env.pop("SHMSTAGE_DEST", None)
        self.proc: subprocess.Popen | None = None
        self.log = world / "serve.log"

    def start(self, **env: str) -> subprocess.Popen:
        out = open(self.log, "ab")  # noqa: SIM115 - the service keeps it open
        self.proc = self.procs.start(
            [*self.bin, "serve"], env={**self.env, **env}, stdout=out, stderr=out
        )
        out.close()
        deadline = time.monotonic() + 60
        while not self.answers():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        return self.proc

    def stop(self) -> None:
        """SIGTERM the service if it still runs, and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def answers(self) -> bool:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(self.socket))
        except OSError:
            return False
        finally:
            s.close()
        return True

    def run(self, *args: str, uid: int | None = None, **kw) -> subprocess.CompletedProcess:
        who = as_user(uid) if uid is not None else []
        return subprocess.run(
            [*who, *self.bin, *args], env={**self.env, **kw.pop("env", {})},
            capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw,
        )  # fmt: skip
