"""The forked child that runs one request of the service: it takes the caller's groups, runs
the op (the engine reading as the caller), writes its progress and its answer to the client's
connection itself, and dies with the service.  See server.py NOTE [a request's life].
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from shmstage.errors import Interrupted, ShmstageError
from shmstage.identity import Caller, adopt_groups
from shmstage.libc import load_libc
from shmstage.service import ops
from shmstage.service.protocol import ERROR, PROGRESS, RESULT, ServiceLost, frame, remote_error

SEND_TIMEOUT = 60.0  # a client that stops reading for this long loses its progress frames
PROGRESS_EVERY = 0.1  # seconds between "copying" frames (a terminal redraws no faster)
EXIT_SENT = 0  # the child's exit status once its last frame is written
EXIT_UNSENT = 3  # the child finished but could not write its last frame
_PR_SET_PDEATHSIG = 1


def send(conn: socket.socket, kind: str, value: Any) -> bool:
    try:
        conn.sendall(frame(kind, value))
    except OSError:
        return False
    return True


def die_with(ppid: int) -> None:
    """Kill this process group (the request and its copier) when the service dies.

    PR_SET_PDEATHSIG alone is not enough: the kernel clears it whenever the process's
    effective or file-system ids change, and reading as the caller is such a change
    (setfsuid).  A thread waits on the service's pidfd instead, for the child's life."""
    try:
        pidfd = os.pidfd_open(ppid)
    except OSError:
        os.killpg(0, signal.SIGKILL)  # gone already
        raise

    def watch() -> None:
        select.select([pidfd], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="service-watch", daemon=True).start()


def run(
    service: Any,
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
        die_with(ppid)
        # SIGHUP stops the request (the engine cleans up, as on ^C): the service sends it
        # when the client hangs up.  SIGTERM and SIGINT are the service's to act on (systemd
        # may send them to the whole cgroup): it then SIGKILLs this group, so the partial
        # copy stays to be resumed.
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Fds of the service stay open here (a fork copies them all), harmless because
        # none is waited on for EOF: clients end on their last frame, the keeper releases
        # a lease with LOCK_UN (one open file: every copy lets go).  Only the listener goes,
        # so a stopped service's socket is never held open by a long stage.
        if service.listener is not None:
            service.listener.close()
        os.close(service.wake_r)
        os.close(service.wake_w)
        conn.settimeout(SEND_TIMEOUT)
        adopt_groups(caller)
        live, last = [True], [0.0]

        def progress(event: Any) -> None:
            now = time.monotonic()
            if (
                getattr(event, "phase", None) == "copying"
                and now - last[0] < PROGRESS_EVERY
                and event.bytes_done < event.bytes_total
            ):
                return  # the terminal would not draw it: spare the pickling
            last[0] = now
            if live[0] and not send(conn, PROGRESS, event):
                live[0] = False  # the client stopped reading: go on without telling it

        def answering() -> None:
            os.write(done, b"1")  # from here a client hanging up stops nothing

        try:
            result = ops.run(service, caller, op, args, progress)
            answering()
        except Interrupted as e:  # the service's signal, not the client's: no "die of it"
            answering()
            sent = send(conn, ERROR, remote_error(ServiceLost(f"the shmstage service: {e}")))
        except ShmstageError as e:
            answering()
            sent = send(conn, ERROR, remote_error(e))
        except KeyboardInterrupt:
            answering()
            sent = send(conn, ERROR, remote_error(ServiceLost("interrupted")))
        except Exception:
            answering()
            traceback.print_exc(file=sys.stderr)
            why = ServiceLost(
                f"the shmstage service failed on {op} (a bug; its log has the traceback)"
            )
            sent = send(conn, ERROR, remote_error(why))
        else:
            sent = send(conn, RESULT, result)
        code = EXIT_SENT if sent else EXIT_UNSENT
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)
