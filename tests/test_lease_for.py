"""`stage --lease-for PID` (issue 22 item 4): a lease held until PID exits, from a detached
holder, so `DATA=$(shmstage stage SRC --lease-for $$ -q)` protects a batch script.

Real processes throughout: a real bash running the recipe, real users through setpriv, real
SIGKILL; waits are polls with a deadline."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest

from shmstage.errors import RefusedError
from shmstage.stage import engine, find, holders, lease_until, stage
from shmstage.stage.store import leasefor, leases
from shmstage.stage.store.gc import gc
from shmstage.stage.store.layout import Store
from shmstage.stage.store.leases import command_of
from shmstage.stage.store.locks import start_time
from tests.test_stage_lease import LOADER_JOB, cli, kill, make_src, wait_for

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")


def read_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The first line ``proc`` writes, failing (not hanging) if it does not come in time."""
    ready = select.select([proc.stdout], [], [], timeout)[0]
    assert ready, "no line in time: the $(...) did not return"
    return proc.stdout.readline().decode().strip()


def sleeper(procs, *prefix: str) -> subprocess.Popen:
    return procs.start([*prefix, "sleep", "300"])


def test_recipe_protects_a_batch_script_until_it_exits(shmstage_bin, tmp_path, procs):
    """bash -c 'D=$(shmstage stage SRC --lease-for $$ -q); ...': the $(...) returns at once,
    evict refuses naming the bash's pid (and the holder) while the bash lives, and works
    once it is killed; the holder keeps none of the script's pipes open."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    script = (
        f"D=$({' '.join(shmstage_bin)} stage {src} --dest {dest} --lease-for $$ -q) || exit 9; "
        'echo "$D"; read -r _; echo never'  # read: a builtin, so the bash is all there is
    )
    bash = procs.start(
        ["bash", "-c", script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert read_line(bash) == str(dest / "ds")
    r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"Error: ds is in use by pid {bash.pid} (bash -c D=$(")
    held = holders("ds", dest)
    assert [h.pid for h in held] == [bash.pid] and held[0].via not in (0, bash.pid)
    assert f") held for it by shmstage (pid {held[0].via}); wait for" in r.stderr
    # the holder is a small process of its own, not a copy of the stager (its memory)
    assert command_of(held[0].via).startswith(f"leasewait.py --for-pid {bash.pid} --start ")
    listed = json.loads(cli(shmstage_bin, "list", "--dest", str(dest), "--json").stdout)
    assert listed[0]["leased_by"] == [bash.pid]
    assert bash.poll() is None
    os.kill(bash.pid, signal.SIGKILL)
    out, err = bash.communicate(timeout=30)  # hangs if the holder kept stdout/stderr open
    assert out == b"" and err == b""
    wait_for(lambda: holders("ds", dest) == (), "the holder to let go")
    r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
    assert r.returncode == 0 and r.stdout == "evicted: ds\n", r.stderr
    assert os.listdir(dest / ".shmstage" / "leases") == []  # no mark left behind


@needs_setpriv
@pytest.mark.root
def test_a_user_leases_for_their_own_process(shmstage_bin, open_tmp_path, procs):
    """nobody stages into their own store with --lease-for a process of theirs: the stage
    returns (its stdout closed), the lease is held for that process by a holder of theirs,
    their evict refuses naming it, and works once it is gone."""
    home = open_tmp_path / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    src, dest = make_src(open_tmp_path / "ds"), home / "dest"
    j = sleeper(procs, *NOBODY)
    wait_for(lambda: os.stat(f"/proc/{j.pid}").st_uid == 65534, "setpriv to drop")
    r = subprocess.run(
        [*NOBODY, *shmstage_bin, "stage", str(src), "--dest", str(dest), "-q",
         "--lease-for", str(j.pid)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{dest / 'ds'}\n", "")
    held = holders("ds", dest)
    assert [h.pid for h in held] == [j.pid] and held[0].via
    assert os.stat(f"/proc/{held[0].via}").st_uid == 65534  # the holder is theirs too
    r = subprocess.run(
        [*NOBODY, *shmstage_bin, "evict", "ds", "--dest", str(dest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith(f"Error: ds is in use by pid {j.pid} (")
    kill(j)
    wait_for(lambda: holders("ds", dest) == (), "the holder to let go")
    r = subprocess.run(
        [*NOBODY, *shmstage_bin, "evict", "ds", "--dest", str(dest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (r.returncode, r.stdout) == (0, "evicted: ds\n"), r.stderr


def test_lease_for_a_dead_pid_is_refused_before_staging(shmstage_bin, tmp_path, procs):
    """--lease-for a pid that is not running: one line, exit 2, nothing staged or held (a dry
    run says the same)."""
    gone = procs.start(["true"])
    gone.wait(timeout=30)
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    for dry in ([], ["--dry-run"]):
        argv = ["stage", str(src), "--dest", str(dest), "--lease-for", str(gone.pid), *dry]
        r = cli(shmstage_bin, *argv)
        assert (r.returncode, r.stdout) == (2, "")
        assert r.stderr == f"Error: cannot lease for pid {gone.pid}: no such process\n"
        assert find("ds", dest=dest) is None


@needs_setpriv
@pytest.mark.root
def test_lease_for_another_users_pid_is_refused(shmstage_bin, open_tmp_path, procs):
    """nobody may not lease for root's process: one line, exit 2, nothing staged; root may
    lease for nobody's (a process of any user)."""
    src, dest = make_src(open_tmp_path / "ds"), open_tmp_path / "dest"
    roots = sleeper(procs)
    r = subprocess.run(
        [*NOBODY, *shmstage_bin, "stage", str(src), "--dest", str(dest), "-q",
         "--lease-for", str(roots.pid)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        f"Error: cannot lease for pid {roots.pid}: it is another user's process (uid 0); "
        "lease for a process of your own\n"
    )
    assert find("ds", dest=dest) is None
    nobodys = sleeper(procs, *NOBODY)
    wait_for(lambda: start_time(nobodys.pid) and os.stat(f"/proc/{nobodys.pid}").st_uid != 0,
             "the setpriv'd sleep")  # fmt: skip
    ds = stage(src, dest=dest)
    lease_until(ds.path, dest, nobodys.pid)
    assert [h.pid for h in holders("ds", dest)] == [nobodys.pid]
    kill(nobodys)
    wait_for(lambda: holders("ds", dest) == (), "the holder to let go")


def test_holder_lets_go_at_once_when_the_pid_was_reused(tmp_path, procs):
    """The holder compares the pid's start time read before it forked: a mismatch (the pid
    now names another process) refuses, and nothing stays held."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    other = sleeper(procs)
    start = wait_for(lambda: start_time(other.pid), "the sleep's start time")
    held = engine.lease_for("ds", dest)
    try:
        with pytest.raises(RefusedError, match=f"^cannot lease for pid {other.pid}: it exited$"):
            leasefor.hold_until(held, other.pid, start - 1)
    finally:
        held.release()
    assert holders("ds", dest) == ()
    assert leases.marks(Store(dest)) == []


def test_without_pidfd_the_holder_polls_pid_and_start_time(tmp_path, procs, monkeypatch):
    """Where the kernel has no pidfd_open, the holder watches /proc/PID's start time: the
    lease holds while the process lives and goes when it exits (a zombie counts as gone)."""
    monkeypatch.delattr(os, "pidfd_open")  # the forked holder inherits this
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    ds = stage(src, dest=dest)
    job = sleeper(procs)
    assert lease_until(ds.path, dest, job.pid).name == "ds"
    held = holders("ds", dest)
    assert [h.pid for h in held] == [job.pid] and held[0].via
    os.kill(job.pid, signal.SIGKILL)  # not reaped yet: a zombie
    wait_for(lambda: holders("ds", dest) == (), "the polling holder to let go")
    job.wait(timeout=30)


def test_a_killed_holders_mark_holds_until_its_job_exits(tmp_path, procs):
    """A holder killed by SIGKILL leaves its "held for" mark: while the job runs, the mark is
    the lease (evict refuses naming the job, gc keeps it); once the job is gone, it names
    nobody and gc removes it."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    ds = stage(src, dest=dest)
    job = sleeper(procs)
    lease_until(ds.path, dest, job.pid)
    holder = holders("ds", dest)[0].via
    os.kill(holder, signal.SIGKILL)
    wait_for(lambda: not leases.holders_of(*_dev_ino(dest)), "the killed holder's flock to go")
    [mark] = leases.marks(Store(dest), "ds")
    assert mark.holder[0] == holder and mark.owner[0] == job.pid
    assert [(h.pid, h.via) for h in holders("ds", dest)] == [(job.pid, holder)]
    with pytest.raises(leases.InUse, match=f"^ds is in use by pid {job.pid} "):
        engine.evict_report("ds", dest=dest)
    assert not gc(dest).removed and leases.marks(Store(dest)) == [mark]
    job.kill()
    job.wait(timeout=30)
    assert holders("ds", dest) == ()
    report = gc(dest)
    assert [(x.path, x.what) for x in report.removed] == [(mark.path, "lease mark")]
    assert leases.marks(Store(dest)) == []


def _dev_ino(dest) -> tuple[int, int]:
    st = os.lstat(leases.lease_path(Store(dest), "ds"))
    return st.st_dev, st.st_ino


def test_describe_names_the_process_a_lease_is_held_for():
    """One holder for another reads "pid N (cmd) held for it by shmstage (pid H)"."""
    got = leases.describe((leases.Holder(12, "bash job.sh", via=34), leases.Holder(56, "")))
    assert got == "pid 12 (bash job.sh) held for it by shmstage (pid 34), pid 56"


def test_lease_for_is_in_stage_help(shmstage_bin):
    r = cli(shmstage_bin, "stage", "--help")
    assert r.returncode == 0 and "--lease-for PID" in r.stdout


def test_every_use_moves_last_used(shmstage_bin, tmp_path, procs):
    """Each use refreshes the LRU time (the record's or the stamp's): a no-op stage, a restage of a
    changed source, find, a lease (taken, and let go), a lease for a process, run --stage."""
    import shmstage

    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    stamp = dest / ".shmstage" / "meta" / ".ds.used"
    old = time.time() - 3600

    def used() -> float:
        return Store(dest).read_record("ds").last_used  # the record's, or the stamp's if later

    def make_old() -> None:
        store = Store(dest)
        store.write_record(dataclasses.replace(store.read_record("ds"), last_used=old))
        os.utime(stamp, (old, old), follow_symlinks=False)
        assert used() == old

    def moved(use) -> bool:
        make_old()
        use()
        return used() > old + 1800  # file times lag time.time() by a tick

    def change() -> None:
        (src / "a" / "0.bin").write_bytes(b"changed")
        assert stage(src, dest=dest).changed

    def leased() -> None:
        with shmstage.lease("ds", dest=dest):
            assert used() > old + 1800  # taken
            make_old()

    def run() -> None:
        r = cli(shmstage_bin, "run", "--stage", str(src), "--dest", str(dest), "--", "true")
        assert r.returncode == 0, r.stderr

    j = sleeper(procs)
    uses = {
        "stage": lambda: stage(src, dest=dest),
        "restage": change,
        "find": lambda: find(str(src), dest=dest),
        "lease": leased,
        "lease_until": lambda: lease_until("ds", dest, j.pid),
        "run --stage": run,
    }
    assert {what: moved(use) for what, use in uses.items()} == dict.fromkeys(uses, True)


@needs_setpriv
@pytest.mark.root
def test_a_loader_jobs_own_lease_is_named_on_a_root_store(shmstage_bin, open_tmp_path, procs):
    """A job of another user (nobody) calling staged_path() on a store root manages holds the
    lease in its own process (no holder, no service needed): root's list and evict (what the
    service runs) name the job itself; its exit ends the lease."""
    src, dest = make_src(open_tmp_path / "ds"), open_tmp_path / "dest"
    stage(src, dest=dest)
    job = procs.start(
        [*NOBODY, sys.executable, "-c", LOADER_JOB, "staged_path", str(src)],
        stdout=subprocess.PIPE, env={**os.environ, "SHMSTAGE_DEST": str(dest)},
    )  # fmt: skip
    assert read_line(job) == "ready"
    assert [(h.pid, h.via) for h in holders("ds", dest)] == [(job.pid, 0)]
    listed = json.loads(cli(shmstage_bin, "list", "--dest", str(dest), "--json").stdout)
    assert listed[0]["leased_by"] == [job.pid]
    r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
    assert r.returncode == 2 and r.stderr.startswith(f"Error: ds is in use by pid {job.pid} (")
    kill(job)
    r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
    assert r.returncode == 0 and r.stdout == "evicted: ds\n", r.stderr


def test_a_lease_is_let_go_by_its_taker_only(tmp_path):
    """release() in the process that took a lease lets go though a forked child still has the
    fd; the child's release() (its copy: a DataLoader worker's, a request's) lets go of
    nothing."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    held = engine.lease_for("ds", dest)
    r, w = os.pipe()
    with warnings.catch_warnings():  # Python 3.12: fork() beside threads (the keeper's)
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            held.release()  # its copy only
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        os.close(w)
        assert os.read(r, 1) == b"x"
        assert [h.pid for h in holders("ds", dest)] == [os.getpid()]
        held.release()
        assert holders("ds", dest) == ()  # the child's copy of the fd does not keep it
    finally:
        os.close(r)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
