"""``shmstage serve``: the node service that owns the store.  It accepts one request per
connection on a Unix socket, knows the caller from the kernel (SO_PEERCRED, SO_PEERGROUPS),
and runs each request in a forked child with the caller's groups, the engine reading as the
caller (see NOTE [a request's life]); what each op may do and for whom is in ops.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import socket
import stat
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from shmstage import __version__
from shmstage.config import configured, node_reserve, node_shares
from shmstage.errors import RefusedError, ShmstageError
from shmstage.identity import Caller
from shmstage.service import ops, worker
from shmstage.service.protocol import (
    ERROR,
    RESULT,
    Hello,
    Peer,
    ProtocolError,
    ServiceLost,
    parse_request,
    peer,
    read_request,
    remote_error,
    socket_path,
)
from shmstage.stage.cache.tiers import split

# NOTE [a request's life]
#
#   client ──connect──▶ accept (main thread) ──▶ thread per connection
#                                                  │ peer(): SO_PEERCRED + SO_PEERGROUPS
#                                                  │ read_request(): one line, 1 MiB, 5 s
#                                                  │ hello: answered here
#                                                  ▼
#                                                fork ──▶ child (own process group,
#                                                  │        PDEATHSIG=SIGKILL on this thread)
#                                                  │        setgroups(caller's), engine op
#                                                  │        reading as the caller; writes its
#                                                  │        progress/result/error frames itself
#                                                  │ waits on the child's pidfd and on the
#                                                  │ connection: a client gone -> SIGHUP
#                                                  │ (the engine cleans up, as on ^C)
#                                                  ▼
#                                                child dead without its last frame -> an
#                                                error frame from here; then close
#
# The child stays in the service's cgroup, so the pages it stages are charged to the
# service, not to the job that asked.  A SIGKILLed service takes its children with it
# (PDEATHSIG, and the copier's workers have theirs): the client sees EOF, the partial
# copy stays and the next stage resumes it.  SIGTERM/SIGINT to the service: it stops
# accepting, kills its children's process groups (SIGKILL, so every partial copy is left
# to resume rather than thrown away), tells their clients in one line, removes the socket
# and exits 0.

MAX_CONNECTIONS = 4096  # beyond this a connection is closed at once: the service stays up
MAX_PER_USER = 64  # a user's connections at once (root: no limit): one cannot crowd out all


class Service:
    """The service's state: its socket, tiers and config, and the children it runs."""

    def __init__(self, path: str | None = None, config_path: str | None = None) -> None:
        self.path = socket_path(path, config_path, strict=True)
        self.config_path = config_path
        dest, self.policies = configured(None, config_path)
        self.tiers = split(dest)
        self.reserve = node_reserve(config_path)
        self.shares = node_shares(config_path)  # who else may read an object-store copy
        self.stopping = threading.Event()
        self.children: dict[int, int] = {}  # pid -> pidfd, of running requests
        self.per_user: dict[int, int] = {}  # uid -> its connections now
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.listener: socket.socket | None = None
        self.held: int | None = None  # the flock that says this service owns the socket
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.keeper: Any = None  # made once the socket is ours (bind): it takes over leases

    # --- the socket ---------------------------------------------------------------------

    def bind(self) -> None:
        """Own the socket: its directory (0755 root), a lock beside it held for the service's
        life, and the socket itself (0666: anyone may connect, the kernel says who they are).
        A socket file left by a dead service is replaced; a live one refuses."""
        parent = os.path.dirname(self.path) or "."
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o755, exist_ok=True)
            os.chmod(parent, 0o755)
        st = os.lstat(parent)
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise RefusedError(
                f"{parent} is writable by others (or not root's): anyone could replace the "
                f"service's socket there; use a root-owned 0755 directory for --socket"
            )
        lock = os.open(
            os.path.join(parent, f".{os.path.basename(self.path)}.lock"),
            os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
            0o600,
        )
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise RefusedError(f"another shmstage service is running on {self.path}") from None
        if _answers(self.path):
            os.close(lock)
            raise RefusedError(f"another shmstage service is running on {self.path}")
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # stale: nothing answers on it, and we hold the lock
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(self.path)
        except OSError as e:
            listener.close()
            os.close(lock)
            raise RefusedError(f"cannot listen on {self.path}: {e.strerror}") from None
        os.chmod(self.path, 0o666)
        listener.listen(socket.SOMAXCONN)
        self.listener, self.held = listener, lock
        if self.keeper is None:  # a refused second service never touches the live one's leases
            self.keeper = ops.make_keeper(self)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if self.held is not None:
            os.close(self.held)
            self.held = None
        if self.keeper is not None:
            self.keeper.close()

    # --- the loop -----------------------------------------------------------------------

    def serve(self, log: Callable[[str], None]) -> None:
        """:meth:`bind` (unless bound), accept until SIGTERM/SIGINT; then stop the running
        requests and return.  The signals are ours before the socket answers: a SIGTERM
        sent as soon as it does stops the service cleanly (exit 0, the socket removed)."""
        ops.warm_up()  # imported before any fork: a child never waits on an import lock
        old = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        threading.stack_size(512 * 1024)  # a thread per connection, thousands at once
        workers: list[threading.Thread] = []
        try:
            if self.listener is None:
                self.bind()
            assert self.listener is not None
            log(f"serving {','.join(self.tiers)} on {self.path} (shmstage {__version__})")
            while not self.stopping.is_set():
                ready = select.select([self.listener, self.wake_r], [], [])[0]
                if self.listener not in ready:
                    continue
                try:
                    conn, _ = self.listener.accept()
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        log(f"cannot accept a connection: {e.strerror}")
                        self.stopping.wait(0.05)  # out of descriptors: let others finish
                    continue
                if not self.slots.acquire(blocking=False):
                    conn.close()  # too many at once: this one is turned away, the rest go on
                    continue
                try:
                    who = peer(conn)
                except OSError:  # gone already
                    conn.close()
                    self.slots.release()
                    continue
                with self.lock:  # counted here, in the order they came
                    mine = self.per_user[who.uid] = self.per_user.get(who.uid, 0) + 1
                t = threading.Thread(
                    target=self._connection, args=(conn, who, mine, log), daemon=True
                )
                t.start()
                workers = [w for w in workers if w.is_alive()] + [t]
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if self.listener is not None:  # no new connection from here on
                self.listener.close()
                self.listener = None
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            self._kill_children()
            end = time.monotonic() + 10  # for all of them: a reply to write, then gone
            for w in workers:
                w.join(timeout=max(0.0, end - time.monotonic()))
            self.close()

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping.set()
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"x")

    def _kill_children(self) -> None:
        with self.lock:
            running = list(self.children)
        for pid in running:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # its group: the copier's workers too

    # --- one connection -----------------------------------------------------------------

    def _connection(
        self, conn: socket.socket, who: Peer, mine: int, log: Callable[[str], None]
    ) -> None:
        """One connection of ``who``, their ``mine``-th open now: read, check, answer."""
        conn.settimeout(worker.SEND_TIMEOUT)  # a reply to a client that never reads cannot hang us
        try:
            if who.uid != 0 and mine > MAX_PER_USER:
                busy = ShmstageError(
                    f"uid {who.uid} already has {MAX_PER_USER} requests open with the "
                    "shmstage service: wait for some to finish"
                )
                worker.send(conn, ERROR, remote_error(busy))
                return
            try:
                request = parse_request(read_request(conn))
            except ProtocolError as e:
                worker.send(conn, ERROR, remote_error(e))
                return
            except OSError:
                return
            if request.op == "hello":
                worker.send(conn, RESULT, Hello(__version__, 1, self.tiers, self.path))
                return
            if request.op in ops.IN_SERVICE:  # quick, and their state lives here
                caller = Caller(who.uid, who.gid, who.groups, who.pid)
                try:
                    result = ops.run(self, caller, request.op, request.args, lambda _: None)
                except ShmstageError as e:
                    worker.send(conn, ERROR, remote_error(e))
                else:
                    worker.send(conn, RESULT, result)
                return
            self._in_child(conn, who, request.op, request.args, log)
        except Exception:  # a bug in one request never takes the service down
            log("error in a request:\n" + traceback.format_exc())
        finally:
            conn.close()
            with self.lock:
                self.per_user[who.uid] -= 1
                if not self.per_user[who.uid]:
                    del self.per_user[who.uid]
            self.slots.release()

    def _in_child(
        self,
        conn: socket.socket,
        who: Peer,
        op: str,
        args: dict[str, Any],
        log: Callable[[str], None],
    ) -> None:
        caller = Caller(who.uid, who.gid, who.groups, who.pid)
        ppid = os.getpid()
        with self.lock:  # no fork while stopping: _kill_children must see every child
            if self.stopping.is_set():
                worker.send(conn, ERROR, remote_error(ServiceLost(_stopped_line(self.path))))
                return
            done_r, done_w = os.pipe2(os.O_CLOEXEC)
            pid = os.fork()
            if pid == 0:
                os.close(done_r)
                worker.run(self, conn, caller, op, args, ppid, done_w)  # never returns
            os.close(done_w)
            pidfd = os.pidfd_open(pid)
            self.children[pid] = pidfd
        try:
            status = self._wait(pid, pidfd, conn, done_r)
        finally:
            with self.lock:
                del self.children[pid]
            os.close(pidfd)
            os.close(done_r)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) in (
            worker.EXIT_SENT,
            worker.EXIT_UNSENT,
        ):
            return
        if self.stopping.is_set():
            line = _stopped_line(self.path)
        else:
            how = (
                f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
                if os.WIFSIGNALED(status)
                else f"exited with status {os.WEXITSTATUS(status)}"
            )
            line = (
                f"the shmstage service's worker for this request {how}: run the command "
                "again; a partial copy resumes"
            )
            log(f"{op} for uid {caller.uid} (pid {caller.pid}): worker {how}")
        worker.send(conn, ERROR, remote_error(ServiceLost(line)))

    def _wait(self, pid: int, pidfd: int, conn: socket.socket, done: int) -> int:
        """The child's wait status; a client that hangs up before the child has its answer
        gets its request stopped (SIGHUP to the child's group: the engine cleans up as on
        ^C).  ``done`` turns readable (or hangs up) once the child is writing its answer."""
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        # Hang-up only (POLLHUP is always reported): a client that merely shuts down its
        # sending side, or sends more, still gets its answer.
        poller.register(conn.fileno(), 0)
        poller.register(done, select.POLLIN)
        watching = True
        while True:
            for fd, _ in poller.poll():
                if fd == pidfd:
                    return os.waitpid(pid, 0)[1]
                if not watching:
                    continue
                watching = False  # answered, or the client gone: nothing more to watch
                poller.unregister(conn.fileno())
                poller.unregister(done)
                if fd == conn.fileno():  # the client closed (a request sends nothing more)
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGHUP)


def _stopped_line(path: str) -> str:
    return (
        f"the shmstage service on {path} stopped mid-request: run the command again "
        "(once it is back); a partial copy resumes"
    )


def _answers(path: str) -> bool:
    """True when something accepts connections on ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(2)
        s.connect(path)
    except OSError:
        return False
    finally:
        s.close()
    return True
