"""Hostile review B, 4: no user may hang the stages of a store root owns by flocking a lock its
stagers wait on; a lease file opens only for who may read its copy, and a lease never waits
for ever on someone's exclusive hold.  A real `shmstage serve`, real users through setpriv."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shmstage.errors import RefusedError
from shmstage.stage.store import leases
from tests.nodeservice import ALICE, BOB, as_user, make_ds

pytestmark = pytest.mark.root

# Opens each path given (a directory too) read-only and holds LOCK_EX on it; says which it could.
HOG = textwrap.dedent(
    """
    import fcntl, os, sys, time
    for p in sys.argv[1:]:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            print("locked", p, flush=True)
        except OSError as e:
            print("refused", p, e.errno, flush=True)
    print("done", flush=True)
    time.sleep(600)
    """
)


def hog(procs, uid: int, paths: list[Path]) -> dict[str, str]:
    """Start the hog as ``uid`` on ``paths`` (it keeps what it locked); {path: locked|refused}."""
    proc = procs.start(
        [*as_user(uid), "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", HOG,
         *map(str, paths)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    said = {}
    for line in proc.stdout:
        if line.startswith("done"):
            break
        what, path = line.split()[:2]
        said[path] = what
    return said


def test_a_user_cannot_flock_what_the_services_stagers_wait_on(service, procs):
    """Bob opens every lock under root's store that a stage waits on (the store-wide counters'
    and fit check's, the dataset and placing locks, and their directories, which were the locks
    of earlier versions) and holds LOCK_EX on what he could: he could open none, and Alice's
    stages through the service, of a new dataset and a current one, complete."""
    world = service.world
    ds = make_ds(world / "data" / "ds", uid=ALICE)
    ds2 = make_ds(world / "data" / "ds2", uid=ALICE)
    r = service.run("stage", str(ds), "-q", uid=ALICE)
    assert r.returncode == 0, r.stderr
    book = service.store / ".shmstage"
    waited_on = [
        book / "locks",
        book / "locks" / "ds.lock",
        book / "locks" / ".counters",
        book / "reservations",
        book / "reservations" / ".fitting",
    ]
    if (book / "placing").exists():
        waited_on += [book / "placing", *(book / "placing").iterdir()]
    waited_on = [p for p in waited_on if p.exists()]
    assert book / "locks" / "ds.lock" in waited_on and book / "reservations" in waited_on
    said = hog(procs, BOB, [book, *waited_on])
    for src, name in ((ds2, "ds2"), (ds, "ds")):
        r = service.run("stage", str(src), uid=ALICE, timeout=60)  # a hang fails here
        assert r.returncode == 0, r.stderr
        assert r.stdout == f"{service.store}/{name}\n"
    assert {p: said[str(p)] for p in waited_on} == {p: "refused" for p in waited_on}
    assert said[str(book)] == "locked"  # no stage waits on DEST/.shmstage itself any more


def test_a_lease_file_opens_only_for_who_may_read_its_copy(service, procs):
    """Alice's private dataset's lease file is hers (and root's) alone: Bob cannot open it to
    hold it; a dataset everyone may read keeps a lease file everyone may open."""
    world = service.world
    private = make_ds(world / "data" / "mine", uid=ALICE)
    private.chmod(0o700)
    shared = make_ds(world / "data" / "ours", uid=ALICE)
    for src in (private, shared):
        r = service.run("stage", str(src), "-q", uid=ALICE)
        assert r.returncode == 0, r.stderr
    lease_dir = service.store / ".shmstage" / "leases"
    said = hog(procs, BOB, [lease_dir / "mine.lease", lease_dir / "ours.lease"])
    assert said == {
        str(lease_dir / "mine.lease"): "refused",
        str(lease_dir / "ours.lease"): "locked",
    }
    r = service.run("evict", "ours")  # Bob's hold is a lease: evict says so
    assert r.returncode != 0 and "in use by" in r.stderr


def test_a_lease_does_not_wait_for_ever_on_an_exclusive_hold(tmp_path, procs, monkeypatch):
    """Someone holds the lease file exclusively past LEASE_WAIT: the lease is refused in one
    line naming the holder, instead of waiting for as long as they like."""
    from shmstage.stage import stage

    src = make_ds(tmp_path / "src")
    dest = tmp_path / "dest"
    stage(str(src), dest=str(dest), name="ds")
    path = dest / ".shmstage" / "leases" / "ds.lease"
    holder = procs.start(
        [sys.executable, "-c",
         "import fcntl,os,sys,time;fd=os.open(sys.argv[1],os.O_RDONLY);"
         "fcntl.flock(fd,fcntl.LOCK_EX);print('held',flush=True);time.sleep(600)", str(path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline() == "held\n"
    monkeypatch.setattr(leases, "LEASE_WAIT", 0.5, raising=False)

    def hung(*_: object) -> None:
        raise AssertionError("the lease waited on the exclusive hold")

    signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        with pytest.raises(RefusedError) as e:
            leases.acquire("ds", str(dest))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    assert f"pid {holder.pid}" in str(e.value) and "ds" in str(e.value)
    fd = os.open(path, os.O_RDONLY)
    try:  # still held: the refusal took nothing from the holder
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        os.close(fd)
