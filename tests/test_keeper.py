"""The service's lease keeper (issue 22 item 4): leases held in the service process for its
callers' processes, released when a process exits (pidfd), kept across a restart.

Real processes: the jobs leased for are real sleeps, a crashed service is a real process
killed by SIGKILL, another user is nobody through setpriv."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from shmstage.errors import RefusedError, ShmstageError
from shmstage.identity import Caller
from shmstage.service.keeper import Keeper
from shmstage.stage import find, holders, stage
from shmstage.stage.store import leases
from shmstage.stage.store.layout import Store
from shmstage.stage.store.locks import start_time
from tests.test_stage_lease import kill, make_src, wait_for

ROOT = Caller(0, 0, ())
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def keeper(tmp_path):
    made: list[Keeper] = []

    def make() -> Keeper:
        made.append(Keeper(str(tmp_path / "state")))
        return made[-1]

    yield make
    for k in made:
        k.close()


def job(procs, *prefix: str) -> subprocess.Popen:
    p = procs.start([*prefix, "sleep", "300"])
    wait_for(lambda: start_time(p.pid), "the job to start")
    return p


def uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))


def test_hold_until_the_process_exits(tmp_path, keeper, procs):
    """hold() takes the lease in the service (evict names the job, held for it by the
    service); the job's exit releases it, its mark and its state file."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    k = keeper()
    j = job(procs)
    token = k.hold("ds", str(dest), j.pid, ROOT)
    held = holders("ds", dest)
    assert [(h.pid, h.via) for h in held] == [(j.pid, os.getpid())]
    assert os.listdir(tmp_path / "state") == [token + ".json"]
    state = json.loads((tmp_path / "state" / (token + ".json")).read_text())
    assert (state["name"], state["pid"], state["uid"]) == ("ds", j.pid, 0)
    assert state["start"] == start_time(j.pid) and state["dest"] == str(dest)
    kill(j)
    wait_for(lambda: holders("ds", dest) == (), "the keeper to let go")
    wait_for(lambda: os.listdir(tmp_path / "state") == [], "the state file to go")
    assert leases.marks(Store(dest)) == [] and k.held() == []


def test_release_by_its_user_only(tmp_path, keeper, procs):
    """release(token) lets go at once; another user's release is refused with the same line
    as an unknown token's, and keeps the lease."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    k = keeper()
    j = job(procs)
    token = k.hold(str(dest / "ds"), str(dest), j.pid, ROOT)
    refusal = "^no such lease \\(it ended with its process, or was released\\)$"
    with pytest.raises(RefusedError, match=refusal):
        k.release(token, Caller(4321, 4321, ()))
    with pytest.raises(RefusedError, match=refusal):
        k.release("0" * 32, ROOT)
    assert [h.pid for h in holders("ds", dest)] == [j.pid]
    k.release(token, ROOT)
    assert holders("ds", dest) == () and os.listdir(tmp_path / "state") == []
    assert j.poll() is None  # the job itself is not touched


@needs_setpriv
@pytest.mark.root
def test_hold_refuses_another_users_process_and_a_dead_one(tmp_path, open_tmp_path, keeper, procs):
    """A caller may lease for a process of their own only (root for any); a pid that is not
    running is refused; nothing is held either way.  (A store every user may read.)"""
    src, dest = make_src(open_tmp_path / "ds"), open_tmp_path / "dest"
    stage(src, dest=dest)
    k = keeper()
    nobody_job = job(procs, *NOBODY)
    wait_for(lambda: uid_of(nobody_job.pid) != 0, "setpriv to drop")
    nobody = Caller(uid_of(nobody_job.pid), 65534, ())
    roots = job(procs)
    for ask in (
        lambda: k.check(roots.pid, nobody),
        lambda: k.hold("ds", str(dest), roots.pid, nobody),
    ):
        with pytest.raises(RefusedError, match=f"^cannot lease for pid {roots.pid}: it is another"):
            ask()
    k.check(roots.pid, ROOT)
    gone = procs.start(["true"])
    gone.wait(timeout=30)
    with pytest.raises(RefusedError, match=f"^cannot lease for pid {gone.pid}: no such process$"):
        k.hold("ds", str(dest), gone.pid, ROOT)
    assert holders("ds", dest) == () and os.listdir(tmp_path / "state") == []
    k.hold("ds", str(dest), nobody_job.pid, nobody)  # their own
    k.hold("ds", str(dest), nobody_job.pid, ROOT)  # root: anyone's
    assert [h.pid for h in holders("ds", dest)] == [nobody_job.pid]
    assert len(k.held()) == 2


SERVICE = textwrap.dedent(
    """
    import sys, time
    from shmstage.identity import Caller
    from shmstage.service.keeper import Keeper
    k = Keeper(sys.argv[1])
    for pid in sys.argv[3:]:
        k.hold("ds", sys.argv[2], int(pid), Caller(0, 0, ()))
    print("held", flush=True)
    time.sleep(300)
    """
)


def test_a_restarted_keeper_takes_again_live_leases_and_drops_dead_ones(tmp_path, procs):
    """A service killed by SIGKILL leaves its state and marks: while it is down, the job still
    running keeps its lease through the mark; the next Keeper(state_dir) holds it again
    (evict names it, held by the new service) and forgets the lease of the job that exited
    meanwhile; the old service's marks go."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    state = tmp_path / "state"
    live, dead = job(procs), job(procs)
    service = procs.start(
        [sys.executable, "-c", SERVICE, str(state), str(dest), str(live.pid), str(dead.pid)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert service.stdout.readline() == "held\n"
    assert sorted(h.pid for h in holders("ds", dest)) == sorted([live.pid, dead.pid])
    assert len(os.listdir(state)) == 2
    kill(service)  # SIGKILL: no close(), the flocks go with the process
    kill(dead)
    assert [(h.pid, h.via) for h in holders("ds", dest)] == [(live.pid, service.pid)]
    (state / "service.conf").write_text("not the keeper's\n")
    entries = [
        json.loads((state / e).read_text()) for e in os.listdir(state) if e.endswith(".json")
    ]
    [before_reboot] = [e for e in entries if e["pid"] == live.pid]
    (state / ("f" * 32 + ".json")).write_text(json.dumps({**before_reboot, "boot": "another"}))
    k = Keeper(str(state))
    try:
        assert [(h.pid, h.via) for h in holders("ds", dest)] == [(live.pid, os.getpid())]
        assert len(k.held()) == 1  # the entry of another boot is not taken
        assert [m.holder[0] for m in leases.marks(Store(dest))] == [os.getpid()]
        left = sorted(os.listdir(state))
        assert len(left) == 2 and left[1] == "service.conf"  # others' files are left alone
        assert json.loads((state / left[0]).read_text())["pid"] == live.pid
        kill(live)
        wait_for(lambda: holders("ds", dest) == (), "the restarted keeper to let go")
    finally:
        k.close()


def test_a_forked_child_keeps_no_lease_of_the_keeper(tmp_path, keeper, procs):
    """A request's process forked by the service closes its copies of the keeper's fds: when
    the job exits, the lease goes though the child still runs."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    k = keeper()
    j = job(procs)
    k.hold("ds", str(dest), j.pid, ROOT)
    with warnings.catch_warnings():  # Python 3.12: fork() beside threads (the keeper's)
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        kill(j)
        wait_for(lambda: holders("ds", dest) == (), "the lease to go with the child alive")
        assert os.waitpid(child, os.WNOHANG) == (0, 0)  # still running
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


@needs_setpriv
@pytest.mark.root
def test_use_by_another_user_moves_last_used_through_the_service(open_tmp_path, keeper, procs):
    """Where the LRU stamp of a root store is a regular file (root could not make a device),
    another user's find cannot move last_used and says nothing; the same use through the
    service (as root, for that user: find, or a lease by the keeper) moves it."""
    no_mknod = ["setpriv", "--inh-caps=-mknod", "--bounding-set=-mknod"]
    src, dest = make_src(open_tmp_path / "ds"), open_tmp_path / "dest"
    stager = f"from shmstage.stage import stage; stage({str(src)!r}, dest={str(dest)!r})"
    r = subprocess.run(
        [*no_mknod, sys.executable, "-c", stager], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    stamp = dest / ".shmstage" / "meta" / ".ds.used"
    assert stamp.is_file() and stamp.stat().st_uid == 0 and stamp.stat().st_mode & 0o777 == 0o644
    old = time.time() - 3600
    os.utime(stamp, (old, old))
    probe = f"from shmstage.stage import find; print(find('ds', dest={str(dest)!r}).name)"
    r = subprocess.run(
        [*NOBODY, sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, "ds\n", "")
    assert stamp.stat().st_mtime == old  # nobody may not touch it: skipped, silently
    recent = old + 1800  # file times lag time.time() by a tick: compare with the hour moved
    assert find("ds", dest=dest).last_used > recent  # the service's find: as root
    assert stamp.stat().st_mtime > recent
    os.utime(stamp, (old, old))
    j = job(procs, *NOBODY)
    wait_for(lambda: uid_of(j.pid) != 0, "setpriv to drop")
    keeper().hold("ds", str(dest), j.pid, Caller(uid_of(j.pid), 65534, ()))
    assert stamp.stat().st_mtime > recent


@pytest.mark.root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_pid_from_another_pid_namespace_is_refused(tmp_path, keeper, procs):
    """A caller in a container (its own pid namespace) names pids the service cannot read:
    refused in one line, nothing held; the same pid from the service's namespace is leased."""
    import psutil

    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    k = keeper()
    box = procs.start(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "300"])
    inside = wait_for(lambda: psutil.Process(box.pid).children(), "the contained sleep")[0]
    wait_for(lambda: os.stat(f"/proc/{inside.pid}/ns/pid").st_ino
             != os.stat("/proc/self/ns/pid").st_ino, "unshare to enter its namespace")  # fmt: skip
    j = job(procs)
    contained = Caller(0, 0, (), inside.pid)
    for ask in (
        lambda: k.check(j.pid, contained),
        lambda: k.hold("ds", str(dest), j.pid, contained),
    ):
        with pytest.raises(
            RefusedError, match=f"^cannot lease for pid {j.pid}: you run in another pid namespace"
        ):
            ask()
    assert holders("ds", dest) == ()
    k.hold("ds", str(dest), j.pid, Caller(0, 0, (), os.getpid()))
    assert [h.pid for h in holders("ds", dest)] == [j.pid]


def test_a_state_directory_others_may_write_is_refused(tmp_path):
    """What the state directory holds is taken as leases: one others may write is refused."""
    state = tmp_path / "state"
    state.mkdir(mode=0o777)
    state.chmod(0o777)
    with pytest.raises(ShmstageError, match=f"^lease state directory {state} must be a dir"):
        Keeper(str(state))


def test_one_user_holds_a_bounded_number_of_leases(open_tmp_path, keeper, procs, monkeypatch):
    """A user may not use up the service's fds with leases: past MAX_PER_USER, refused in one
    line (root is not counted); a lease that ends makes room again."""
    from shmstage.service import keeper as keeper_module

    monkeypatch.setattr(keeper_module, "MAX_PER_USER", 2)
    src, dest = make_src(open_tmp_path / "ds"), open_tmp_path / "dest"
    stage(src, dest=dest)
    k = keeper()
    j = job(procs)
    # Only the count is under test: the job (root's) passes for the user's.
    monkeypatch.setattr(keeper_module.leasefor, "target", lambda pid, uid, pidfd=None: 0)
    user = Caller(4321, 4321, ())
    tokens = [k.hold("ds", str(dest), j.pid, user) for _ in range(2)]
    with pytest.raises(RefusedError, match="^you hold 2 leases through the service already"):
        k.hold("ds", str(dest), j.pid, user)
    k.hold("ds", str(dest), j.pid, ROOT)  # root: not counted
    k.release(tokens[0], user)
    k.hold("ds", str(dest), j.pid, user)
    assert len(k.held()) == 3


@needs_setpriv
@pytest.mark.root
def test_a_copy_the_caller_may_not_read_is_not_theirs_to_lease(open_tmp_path, keeper, procs):
    """A user may not pin a copy they cannot read (by its name, staged path or source): the
    refusal is the same line as for a dataset that is not staged, so it says nothing of what
    others staged, and nothing is held.  Readable through a supplementary group: leased."""
    src, dest = make_src(open_tmp_path / "private"), open_tmp_path / "dest"
    stage(src, dest=dest)
    top = find("private", dest=dest).path
    os.chown(top, 0, 4480)
    os.chmod(top, 0o750)
    k = keeper()
    j = job(procs, *NOBODY)
    wait_for(lambda: uid_of(j.pid) != 0, "setpriv to drop")
    nobody = Caller(uid_of(j.pid), 65534, (65534,))
    for key in ("private", top, str(src), "nope", str(open_tmp_path / "nope")):
        with pytest.raises(RefusedError) as e:
            k.hold(key, str(dest), j.pid, nobody)
        assert (
            str(e.value)
            == f"cannot lease {key}: it is not staged in {dest}, or you may not read it"
        )
    assert holders("private", dest) == () and k.held() == []
    assert os.listdir(k.state_dir) == [] and leases.marks(Store(dest)) == []
    in_group = Caller(nobody.uid, 65534, (65534, 4480))
    k.hold("private", str(dest), j.pid, in_group)
    assert [h.pid for h in holders("private", dest)] == [j.pid]


def test_a_killed_services_leases_hold_until_their_jobs_exit(tmp_path, procs):
    """Between a SIGKILLed service and its restart, its marks are the leases: evict (no
    --force) refuses naming the job, gc keeps the mark; when the job exits, gc removes the
    mark and evict goes ahead.  A mark another user wrote for root's job pins nothing."""
    from shmstage.stage import engine

    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    live = job(procs)
    service = procs.start(
        [sys.executable, "-c", SERVICE, str(tmp_path / "state"), str(dest), str(live.pid)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert service.stdout.readline() == "held\n"
    kill(service)
    with pytest.raises(leases.InUse, match=f"^ds is in use by pid {live.pid} \\(sleep 300\\)"):
        engine.evict_report("ds", dest=dest)
    engine.gc(dest)
    assert [m.owner[0] for m in leases.marks(Store(dest))] == [live.pid]
    assert find("ds", dest=dest) is not None
    kill(live)
    assert holders("ds", dest) == ()
    engine.gc(dest)
    assert leases.marks(Store(dest)) == []
    engine.evict_report("ds", dest=dest)
    assert find("ds", dest=dest) is None

    stage(src, dest=dest)
    roots = job(procs)
    gone = procs.start(["true"])
    gone.wait(timeout=30)
    forged = leases.mark(Store(dest), "ds", (gone.pid, 1), (roots.pid, start_time(roots.pid)))
    os.chown(forged, 65534, 65534)
    assert holders("ds", dest) == ()
    engine.evict_report("ds", dest=dest)
