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
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from shmstage import __version__
from shmstage.config import configured, node_reserve
from shmstage.errors import RefusedError, ShmstageError
from shmstage.libc import load_libc
from shmstage.service import ops
from shmstage.service.ops import Caller, adopt_groups
from shmstage.service.protocol import (
    ERROR,
    PROGRESS,
    RESULT,
    Hello,
    Peer,
    ProtocolError,
    ServiceLost,
    frame,
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
#                                                  │ connection: a client gone -> SIGTERM
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
SEND_TIMEOUT = 60.0  # a client that stops reading for this long loses its progress frames
_PR_SET_PDEATHSIG = 1
EXIT_SENT = 0  # the child's exit status once its last frame is written
EXIT_UNSENT = 3  # the child finished but could not write its last frame


class Service:
    """The service's state: its socket, tiers and config, and the children it runs."""

    def __init__(self, path: str | None = None, config_path: str | None = None) -> None:
        self.path = socket_path(path)
        self.config_path = config_path
        dest, self.policies = configured(None, config_path)
        self.tiers = split(dest)
        self.reserve = node_reserve(config_path)
        self.stopping = threading.Event()
        self.children: dict[int, int] = {}  # pid -> pidfd, of running requests
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.listener: socket.socket | None = None
        self.held: int | None = None  # the flock that says this service owns the socket
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.keeper = ops.make_keeper(self)

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
        """Accept until SIGTERM/SIGINT; then stop the running requests and return."""
        assert self.listener is not None
        ops.warm_up()  # imported before any fork: a child never waits on an import lock
        old = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        threading.stack_size(512 * 1024)  # a thread per connection, thousands at once
        workers: list[threading.Thread] = []
        log(f"serving {','.join(self.tiers)} on {self.path} (shmstage {__version__})")
        try:
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
                t = threading.Thread(target=self._connection, args=(conn, log), daemon=True)
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
            for w in workers:
                w.join(timeout=10)
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

    def _connection(self, conn: socket.socket, log: Callable[[str], None]) -> None:
        try:
            who = peer(conn)
            try:
                request = parse_request(read_request(conn))
            except ProtocolError as e:
                _send(conn, ERROR, remote_error(e))
                return
            except OSError:
                return
            if request.op == "hello":
                _send(conn, RESULT, Hello(__version__, 1, self.tiers, self.path))
                return
            if request.op in ops.IN_SERVICE:  # quick, and their state lives here
                caller = Caller(who.uid, who.gid, who.groups, who.pid)
                try:
                    result = ops.run(self, caller, request.op, request.args, lambda _: None)
                except ShmstageError as e:
                    _send(conn, ERROR, remote_error(e))
                else:
                    _send(conn, RESULT, result)
                return
            self._in_child(conn, who, request.op, request.args, log)
        except Exception:  # a bug in one request never takes the service down
            log("error in a request:\n" + traceback.format_exc())
        finally:
            conn.close()
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
                _send(conn, ERROR, remote_error(ServiceLost(_stopped_line(self.path))))
                return
            done_r, done_w = os.pipe2(os.O_CLOEXEC)
            pid = os.fork()
            if pid == 0:
                os.close(done_r)
                _child(self, conn, caller, op, args, ppid, done_w)  # never returns
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
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) in (EXIT_SENT, EXIT_UNSENT):
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
        _send(conn, ERROR, remote_error(ServiceLost(line)))

    def _wait(self, pid: int, pidfd: int, conn: socket.socket, done: int) -> int:
        """The child's wait status; a client that hangs up before the child has its answer
        gets its request stopped (SIGTERM to the child's group: the engine cleans up as on
        ^C).  ``done`` turns readable (or hangs up) once the child is writing its answer."""
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(conn.fileno(), select.POLLIN | select.POLLHUP)
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
                        os.killpg(pid, signal.SIGTERM)


def _stopped_line(path: str) -> str:
    return (
        f"the shmstage service on {path} stopped mid-request: run the command again "
        "(once it is back); a partial copy resumes"
    )


def _send(conn: socket.socket, kind: str, value: Any) -> bool:
    try:
        conn.sendall(frame(kind, value))
    except OSError:
        return False
    return True


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


def _child(
    service: Service,
    conn: socket.socket,
    caller: Caller,
    op: str,
    args: dict[str, Any],
    ppid: int,
    done: int,
) -> None:
    """The forked child: run ``op`` for ``caller``, write its frames, exit.  Never returns."""
    code = EXIT_UNSENT
    try:
        load_libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != ppid:  # the service died before the line above
            os._exit(code)
        os.setpgid(0, 0)  # its own group: stopping the request stops its copier too
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        if service.listener is not None:
            service.listener.close()
        os.close(service.wake_r)
        os.close(service.wake_w)
        conn.settimeout(SEND_TIMEOUT)
        adopt_groups(caller)
        live = [True]

        def progress(event: Any) -> None:
            if live[0] and not _send(conn, PROGRESS, event):
                live[0] = False  # the client stopped reading: go on without telling it

        def answering() -> None:
            os.write(done, b"1")  # from here a client hanging up stops nothing

        try:
            result = ops.run(service, caller, op, args, progress)
            answering()
        except ShmstageError as e:
            answering()
            sent = _send(conn, ERROR, remote_error(e))
        except KeyboardInterrupt:
            answering()
            sent = _send(conn, ERROR, remote_error(ServiceLost("interrupted")))
        except Exception:
            answering()
            traceback.print_exc(file=sys.stderr)
            why = ServiceLost(
                f"the shmstage service failed on {op} (a bug; its log has the traceback)"
            )
            sent = _send(conn, ERROR, remote_error(why))
        else:
            sent = _send(conn, RESULT, result)
        code = EXIT_SENT if sent else EXIT_UNSENT
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)
