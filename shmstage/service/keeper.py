"""The node service's lease keeper: leases the service holds for its clients' processes, each
until that process exits (a pidfd per lease, watched by one thread), written to a state
directory so a restarted service takes again those whose process still runs.

Imports only the staging engine, the store and identity: the server calls it, never the
other way round.  See NOTE [keeper] for the lifecycle.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import select
import shutil
import stat
import subprocess
import threading
import weakref
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shmstage.errors import RefusedError, ShmstageError
from shmstage.stage import engine
from shmstage.stage.store import leasefor, leases
from shmstage.stage.store.layout import Store
from shmstage.stage.store.locks import running, start_time

if TYPE_CHECKING:
    from shmstage.identity import Caller

POLL_SECONDS = 0.5  # without pidfds (kernels before 5.3): how often /proc is looked at
# Each lease takes two of the service's fds: one user must not use up what all share.
MAX_PER_USER = 256
_STATE_FILE = re.compile(r"^([0-9a-f]{32})\.json(\.\d+\.tmp)?\Z")  # <token>.json[.<pid>.tmp]

# NOTE [keeper]
#
#   hold(name, dest, pid, caller)            watcher thread               release(token, caller)
#     pidfd_open(pid)   (first: the facts      poll(wake pipe, pidfds)       (the loader's
#     /proc/pid: owner, start  below are         a pidfd readable: the        `with` exit)
#     flock LOCK_SH (engine.lease_for, as root)  process exited -> drop  -->  drop
#     mark "held for pid" beside the lease                                     |
#     state_dir/<token>.json                                                   v
#                                                 drop: unflock (touches last_used), unmark,
#                                                 close the pidfd, remove the state file
#
# close() stops the thread and lets go of every flock but keeps the state files and the
# marks: the next Keeper(state_dir) takes again each lease whose process is still the same
# (pid and start time) and forgets the others.  Meanwhile (the service stopped, or killed:
# its flocks are gone) a mark of a dead holder naming a live job is a lease by itself
# (leases.orphaned), so evict, make-room, run --cleanup and prepare still spare the data.  A child forked by the service (a request's process)
# closes its copies of the keeper's fds at once (os.register_at_fork): a flock lives as
# long as any fd of its open file, so a long request must not keep a released lease held.


@dataclass
class _Held:
    token: str
    pid: int
    start: int
    uid: int
    pidfd: int | None
    lease: leases.Lease
    mark: str | None = None

    @property
    def state(self) -> dict[str, Any]:
        return {
            "name": self.lease.name,
            "dest": self.lease.store.dest,
            "pid": self.pid,
            "start": self.start,
            "uid": self.uid,
            "mark": self.mark,
            "boot": _boot_id(),
        }


class Keeper:
    """Leases held by the service for processes of its callers (see NOTE [keeper])."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        st = os.lstat(state_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            # what is in it is held as leases and unmarked in stores: it must be ours alone
            raise ShmstageError(
                f"lease state directory {state_dir} must be a directory of uid {os.geteuid()} "
                "that no one else may write"
            )
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._closed = False
        self._me = (os.getpid(), start_time(os.getpid()) or 0)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.register_at_fork(after_in_child=functools.partial(_after_fork, weakref.ref(self)))
        self._restore()
        self._thread = threading.Thread(target=self._watch, name="shmstage-lease-keeper")
        self._thread.daemon = True
        self._thread.start()

    # --- the server's calls ---------------------------------------------------------------

    def hold(self, name: str, dest: str, pid: int, caller: Caller) -> str:
        """Lease ``name`` (a name, a staged path or a source, as ``engine.lease``) in ``dest``
        until process ``pid`` exits; a token for :meth:`release`.  Refused (RefusedError) when
        ``pid`` is not running or is not the caller's (root may lease for any), and, in one
        line for both, when ``name`` is not staged or the caller may not read the copy."""
        _same_pid_namespace(pid, caller)
        self._check_count(caller)
        try:
            pidfd = leasefor.pidfd_of(pid)  # first: what /proc says next is about this process
        except OSError:
            raise RefusedError(f"cannot lease for pid {pid}: no such process") from None
        try:
            start = leasefor.target(pid, caller.uid, pidfd)
            held = _lease_readable(name, dest, caller)
        except BaseException:
            if pidfd is not None:
                os.close(pidfd)
            raise
        h = _Held(secrets.token_hex(16), pid, start, caller.uid, pidfd, held)
        h.mark = leases.mark(held.store, held.name, self._me, (pid, start))
        try:
            self._save(h)
        except OSError as e:
            self._let_go(h)
            raise ShmstageError(
                f"cannot record the lease in {self.state_dir}: {e.strerror}"
            ) from None
        with self._lock:
            closed = self._closed
            if not closed:
                self._held[h.token] = h
        if closed:
            self._let_go(h)
            raise ShmstageError("the service is shutting down; lease again")
        try:
            self._check_count(caller, more=0)  # concurrent holds: the count after ours
        except RefusedError:
            self._drop(h)
            raise
        self._wake()
        return h.token

    def _check_count(self, caller: Caller, more: int = 1) -> None:
        if caller.is_root:
            return
        with self._lock:
            count = sum(1 for h in self._held.values() if h.uid == caller.uid)
        if count + more > MAX_PER_USER:
            raise RefusedError(
                f"you hold {MAX_PER_USER} leases through the service already; each ends when "
                "its process exits (or release one)"
            )

    def check(self, pid: int, caller: Caller) -> None:
        """Refuse (RefusedError), before anything is staged, what :meth:`hold` would: ``pid``
        not running, or not the caller's (``stage --lease-for`` asks this first)."""
        _same_pid_namespace(pid, caller)
        leasefor.target(pid, caller.uid)

    def release(self, token: str, caller: Caller) -> None:
        """Let go of the lease ``token`` (its holder's user, or root)."""
        with self._lock:
            h = self._held.get(token)
            if h is None or not (caller.is_root or caller.uid == h.uid):
                h = None
            else:
                del self._held[token]
        if h is None:  # one answer for unknown and foreign tokens: nothing to probe
            raise RefusedError("no such lease (it ended with its process, or was released)")
        self._let_go(h)
        self._wake()

    def close(self) -> None:
        """Stop watching and let go of every flock; the state files stay for the next
        Keeper (a restarted service).  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held, self._held = list(self._held.values()), {}
        self._wake()
        self._thread.join(timeout=5)
        for h in held:
            self._let_go(h, forget=False)
        for fd in (self._wake_r, self._wake_w):
            with suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def held(self) -> list[tuple[str, str, int]]:
        """(dataset name, DEST, pid) of every lease held now."""
        with self._lock:
            return [(h.lease.name, h.lease.store.dest, h.pid) for h in self._held.values()]

    # --- the watcher ----------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                items = list(self._held.values())
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            by_fd = {h.pidfd: h for h in items if h.pidfd is not None}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            polling = len(by_fd) < len(items)
            for fd, _ in poller.poll(POLL_SECONDS * 1000 if polling else None):
                if fd == self._wake_r:
                    with suppress(OSError):
                        while os.read(fd, 512):
                            pass
                elif fd in by_fd:
                    self._drop(by_fd[fd])  # the process exited (or the fd was closed meanwhile)
            for h in items:
                if h.pidfd is None and not running(h.pid, h.start):
                    self._drop(h)

    def _drop(self, h: _Held) -> None:
        with self._lock:
            if self._held.get(h.token) is not h:
                return  # released meanwhile
            del self._held[h.token]
        self._let_go(h)

    def _let_go(self, h: _Held, *, forget: bool = True) -> None:
        h.lease.release()  # the end of a job is a use too: it touches last_used
        if h.pidfd is not None:
            with suppress(OSError):
                os.close(h.pidfd)
        if forget:
            leases.unmark(h.mark)
            with suppress(FileNotFoundError):
                os.unlink(self._path(h.token))
        # else (close: the service stops): the mark stays with the state file, and keeps the
        # lease once this process is gone until a restarted service holds it again.

    def _wake(self) -> None:
        with suppress(OSError):  # full (the thread will look anyway) or closed
            os.write(self._wake_w, b"x")

    def _forget_in_child(self) -> None:
        """After a fork, in the child: close its copies of the keeper's fds (NOTE [keeper]).
        No lock is taken: another thread of the parent may have held it at the fork.
        Once only: a child's own children (the copier's workers) run this hook again, and
        by then these fd numbers may be the copier's pipes."""
        if self._wake_r < 0:
            return
        self._lock = threading.Lock()
        self._closed = True
        held, self._held = list(self._held.values()), {}
        for h in held:
            h.lease.close_copy()
            if h.pidfd is not None:
                with suppress(OSError):
                    os.close(h.pidfd)
        for fd in (self._wake_r, self._wake_w):
            with suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # --- the state directory ----------------------------------------------------------------

    def _path(self, token: str) -> str:
        return os.path.join(self.state_dir, token + ".json")

    def _save(self, h: _Held) -> None:
        path = self._path(h.token)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            os.write(fd, json.dumps(h.state).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _restore(self) -> None:
        """Take again the leases of a previous service whose processes still run."""
        for entry in sorted(os.listdir(self.state_dir)):
            path = os.path.join(self.state_dir, entry)
            found = _STATE_FILE.match(entry)
            if found is None:
                continue  # not ours: the state directory may hold the service's other files
            if found.group(2):
                with suppress(OSError):
                    os.unlink(path)  # half written by a killed service
                continue
            h = self._restored(found.group(1), path)
            if h is None:
                with suppress(OSError):
                    os.unlink(path)
                continue
            self._held[h.token] = h

    def _restored(self, token: str, path: str) -> _Held | None:
        try:
            with open(path) as f:
                data = json.load(f)
            name, dest = str(data["name"]), str(data["dest"])
            pid, start, uid = int(data["pid"]), int(data["start"]), int(data["uid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if data.get("boot") != _boot_id():
            return None  # held before a reboot: a pid and start time may name another now
        old = data.get("mark")
        mine = isinstance(old, str) and os.path.dirname(old) == Store(dest).lease_dir
        if not (mine and os.path.basename(old).startswith(f".{name}@")):
            old = None
        # The previous service's mark kept the lease while no service ran (leases.orphaned);
        # it goes once this keeper holds the flock and its own mark, or the job is gone.
        try:
            pidfd = leasefor.pidfd_of(pid)
        except OSError:
            leases.unmark(old)
            return None  # exited
        same = start_time(pid) == start and (
            not leasefor.exited(pidfd) if pidfd is not None else running(pid, start)
        )
        try:
            if not same:
                raise ShmstageError("another process")
            held = leases.acquire(name, dest)
        except (ShmstageError, OSError):  # its process is gone, or the dataset is
            if pidfd is not None:
                os.close(pidfd)
            leases.unmark(old)
            return None
        h = _Held(token, pid, start, uid, pidfd, held)
        h.mark = leases.mark(held.store, held.name, self._me, (pid, start))
        if old != h.mark:
            leases.unmark(old)
        with suppress(OSError):
            self._save(h)
        return h


def _lease_readable(name: str, dest: str, caller: Caller) -> leases.Lease:
    """The lease on ``name`` (taken as root: last_used moves for any caller), when the caller
    may read the copy.  A copy the caller may not read is not theirs to pin (evict and
    make-room would have to skip it for them), and "not staged" must not differ from "not
    yours", or the answer says what another user has staged: one line for both."""
    refused = RefusedError(
        f"cannot lease {name}: it is not staged in {dest}, or you may not read it"
    )
    try:
        held = engine.lease_for(name, dest)
    except ShmstageError:
        raise refused from None
    if not _may_read(held.store.path(held.name), caller):
        held.close_copy()  # not a use: last_used stays as it was
        raise refused
    return held


def _may_read(top: str, caller: Caller) -> bool:
    """Whether ``caller`` may reach ``top`` and list it (root always).  Asked of the kernel by
    a process with the caller's uid, gid and groups (access(2): every ancestor's search right,
    ACLs): the service's own thread could take the caller's fsuid, not their groups."""
    if caller.is_root:
        return True
    if caller.uid == os.geteuid():  # a service run by a user for themselves: no switch needed
        return os.access(top, os.R_OK | os.X_OK)
    test = shutil.which("test") or "/usr/bin/test"
    try:
        done = subprocess.run(
            [test, "-r", top, "-a", "-x", top],
            user=caller.uid, group=caller.gid, extra_groups=list(caller.groups), env={},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _after_fork(ref: weakref.ref[Keeper]) -> None:
    keeper = ref()
    if keeper is not None:
        keeper._forget_in_child()


@functools.cache
def _boot_id() -> str:
    """This boot's id: a state file of another boot names processes that are gone."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _same_pid_namespace(pid: int, caller: Caller) -> None:
    """Refuse a PID given from another pid namespace (a container): there it names another
    process than here.  The caller's own pid (SO_PEERCRED) is translated by the kernel, the
    number in the request is not."""
    if not caller.pid:
        return  # no peer pid known: the caller is this process (tests, in-process use)
    try:
        theirs = os.stat(f"/proc/{caller.pid}/ns/pid").st_ino
        ours = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return  # gone already, or /proc says nothing: the owner check still applies
    if theirs != ours:
        raise RefusedError(
            f"cannot lease for pid {pid}: you run in another pid namespace (a container), "
            "where pids are not the service's; lease from the host's pid namespace, or "
            "hold the lease in the job itself (shmstage.lease, run --stage)"
        )
