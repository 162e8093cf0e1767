"""Shared fixtures.

As root, the whole test session moves into a private mount namespace before
any test runs (``unshare(CLONE_NEWNS)`` + ``mount --make-rprivate /``), so every
tmpfs a test mounts is invisible to the machine and vanishes with the
process.  Tests never touch the real /dev/shm or /etc/fstab.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from shmstage.libc import load_libc
from tests.nodeservice import Service

CLONE_NEWNS = 0x00020000
MS_REC = 16384
MS_PRIVATE = 1 << 18

IS_ROOT = os.geteuid() == 0
PRIVATE_NS = False


def _enter_private_mount_namespace() -> bool:
    libc = load_libc()
    libc.unshare.argtypes = [ctypes.c_int]
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
    ]
    if libc.unshare(CLONE_NEWNS) != 0:
        return False
    return libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0


def _default_stop_signals() -> None:
    """Tests send SIGINT/SIGHUP to the processes they start and expect the defaults; a
    suite started in the background (``cmd &`` ignores SIGINT) or under nohup (SIGHUP)
    would hand those ignored dispositions down to every child."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def pytest_configure(config: pytest.Config) -> None:
    global PRIVATE_NS
    _default_stop_signals()
    # `prepare` locks /run/lock/shmstage-prepare.lock by default: tests use a lock of their own
    if "SHMSTAGE_PREPARE_LOCK" not in os.environ:
        lock_dir = tempfile.mkdtemp(prefix="shmstage-test-")
        atexit.register(shutil.rmtree, lock_dir, True)
        os.environ["SHMSTAGE_PREPARE_LOCK"] = os.path.join(lock_dir, "prepare.lock")
    if IS_ROOT and sys.platform == "linux" and not PRIVATE_NS:
        PRIVATE_NS = _enter_private_mount_namespace()
        if PRIVATE_NS:
            os.environ["SHMSTAGE_TEST_PRIVATE_NS"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    need_root = pytest.mark.skip(
        reason="needs root and a private mount namespace (run `make test` as root)"
    )
    need_gpu = pytest.mark.skip(reason="needs a CUDA device")
    has_cuda = _has_cuda()
    for item in items:
        if "root" in item.keywords and not (IS_ROOT and PRIVATE_NS):
            item.add_marker(need_root)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(need_gpu)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def cli():
    from shmstage.cli import cli as group

    return group


class Tmpfs:
    """Mounts tmpfs file systems under a temporary directory; unmounts them all at teardown."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.mounted: list[Path] = []

    def __call__(self, size: str = "64M", name: str = "shm", mode: str = "1777") -> Path:
        path = self.base / name
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(path)],
            check=True,
        )
        self.mounted.append(path)
        return path

    def cleanup(self) -> None:
        for path in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def tmpfs(tmp_path: Path):
    """``tmpfs("32M")`` -> path of a fresh tmpfs (root + private namespace only)."""
    if not (IS_ROOT and PRIVATE_NS):
        pytest.skip("needs root and a private mount namespace")
    t = Tmpfs(tmp_path / "mnt")
    yield t
    t.cleanup()


@pytest.fixture
def open_tmp_path():
    """A temporary directory (0755) under /tmp that every user can reach, removed at the end
    even if a test left read-only directories in it."""
    base = Path(tempfile.mkdtemp(prefix="shmstage-test-"))
    base.chmod(0o755)
    yield base
    subprocess.run(["chmod", "-R", "u+rwx", str(base)], check=False)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def open_tmpfs():
    """``open_tmpfs("16M")`` -> a tmpfs (mode 1777) every user can reach, for tests that run
    shmstage as another user (pytest's tmp_path is root's, 0700).  Root + private namespace."""
    if not (IS_ROOT and PRIVATE_NS):
        pytest.skip("needs root and a private mount namespace")
    base = Path(tempfile.mkdtemp(prefix="shmstage-test-"))
    base.chmod(0o755)
    t = Tmpfs(base)
    yield t
    t.cleanup()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def service_world(open_tmpfs) -> Path:
    """The 256M tmpfs of the ``service`` fixture, every user can reach: its store, socket, config."""
    return open_tmpfs("256M")


@pytest.fixture
def service(service_world, shmstage_bin, procs):
    """A real `shmstage serve` as root on ``service_world`` (tests/nodeservice.py), stopped at
    the end; clients run as other users through ``service.run(..., uid=ALICE)``."""
    svc = Service(service_world, shmstage_bin, procs)
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture
def shmstage_bin() -> list[str]:
    """Command prefix that runs the installed CLI in a subprocess."""
    exe = shutil.which("shmstage", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "shmstage"]


class Procs:
    """``procs.start(argv, **popen_kwargs)`` -> a Popen that is killed and reaped at teardown.

    Every test that starts a process goes through this (or a try/finally), so a failing
    assertion never leaves a stager, a job or a worker running behind the suite."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []

    def start(self, argv: list[str], **kwargs) -> subprocess.Popen:
        p = subprocess.Popen(argv, **kwargs)
        self.started.append(p)
        return p

    def cleanup(self) -> None:
        for p in self.started:
            if p.poll() is None:
                # What it started too: a grandchild left running holds the pipes open, so
                # communicate() below would time out and leave them unclosed (a ResourceWarning,
                # an error wherever a later GC finalizes them: issue 20 item 31).
                try:
                    kids = psutil.Process(p.pid).children(recursive=True)
                except psutil.Error:
                    kids = []
                try:  # its whole group when it leads one (start_new_session=True)
                    if os.getpgid(p.pid) == p.pid:
                        os.killpg(p.pid, 9)
                except OSError:
                    pass
                p.kill()
                for kid in kids:
                    with contextlib.suppress(psutil.Error):
                        kid.kill()
        for p in self.started:
            try:
                p.communicate(timeout=30)  # reap, and close its pipes
            except (subprocess.TimeoutExpired, ValueError, OSError):
                for pipe in (p.stdin, p.stdout, p.stderr):
                    if pipe is not None:
                        with contextlib.suppress(OSError):
                            pipe.close()
                p.wait()


@pytest.fixture
def procs():
    """Start processes with ``procs.start(...)``; each is SIGKILLed (with its session's process
    group when it leads one) and reaped when the test ends, passed or failed."""
    p = Procs()
    yield p
    p.cleanup()


@pytest.fixture
def rewrite_after_listing(monkeypatch):
    """``rewrite_after_listing(rewrite)``: ``rewrite()`` runs right after an object-store
    source's LIST, so an object changes between the LIST and its GET."""

    def arm(rewrite):
        from shmstage.stage.sources import s3

        real = s3.S3Source.listing

        def listing_then_rewrite(self):
            out = real(self)
            rewrite()
            return out

        monkeypatch.setattr(s3.S3Source, "listing", listing_then_rewrite)

    return arm
