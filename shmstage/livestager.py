"""The stager ``run --no-wait`` forks (nowait.py): it stages one directory with a live view
and says each step (view, published, done or failed) to ``run`` as JSON lines on a pipe."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
from typing import Any

from shmstage.errors import ShmstageError
from shmstage.libc import load_libc

ACK_WAIT = 60.0  # seconds a stager holding its lock waits for run to take its lease
_PR_SET_PDEATHSIG = 1


def live_stager(
    source: str, name: str | None, dest: str | None, room: dict[str, Any], ev_w: int, ack_r: int
) -> None:  # pragma: no cover - runs in the forked stager
    """The stager's whole life: stage with a live view, say each step on ``ev_w``, exit."""
    code = 1
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        with contextlib.suppress(OSError, AttributeError):
            load_libc().prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # run died: stop
        code = _stage_live(source, name, dest, room, ev_w, ack_r)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _stage_live(
    source: str, name: str | None, dest: str | None, room: dict[str, Any], ev_w: int, ack_r: int
) -> int:  # pragma: no cover - runs in the forked stager
    from shmstage.service import api
    from shmstage.stage.build.ondemand import Live

    def send(**event: Any) -> None:
        os.write(ev_w, json.dumps(event).encode() + b"\n")

    said = []

    def on_view(view: Any) -> None:
        said.append(True)
        st = os.lstat(view.root)  # the tree published later: same inode (Stager._published_anyway)
        root = [st.st_dev, st.st_ino]
        send(event="view", name=view.name, path=view.final, source=view.source, root=root)

    def on_published(path: str) -> None:
        send(event="published", name=os.path.basename(path), path=path)
        select.select([ack_r], [], [], ACK_WAIT)  # run leases it before our lock goes

    try:
        ds = api.stage(
            source, name=name, dest=dest, service=False, live=Live(on_view, on_published), **room
        )
    except ShmstageError as e:
        send(event="failed", message=str(e), code=e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        send(event="failed", message="the copy was stopped", code=130)
        return 130
    if not said:  # nothing to copy: published already (no view, no lock held now)
        send(event="published", name=ds.name, path=str(ds.path))
        select.select([ack_r], [], [], ACK_WAIT)
    from shmstage.stage.engine import summary

    send(event="done", changed=ds.changed, summary=f"{summary(ds)} -> {ds.path}")
    return 0
