"""``run --no-wait``: each directory is staged by a stager forked from ``run`` that writes a
live view and goes on copying while the job runs (stage/build/ondemand.py); the job starts
once every view is written, and the job's lease is taken when its copy is published.

    run ── fork ──▶ stager: engine.stage(live=...) ─▶ "view" ─▶ copy ─▶ publish ─▶ "published"
     │                                                                  (lock held) waits ack
     ├─ reads "view" (or "published": nothing to copy; "failed": refused, no job started)
     ├─ starts the job; a thread reads on: "published" -> lease, ack; "failed" -> one line
     └─ the job exits: wait for the copy (a stopping signal or --cleanup: stop it), reap
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from shmstage.errors import RefusedError, ShmstageError
from shmstage.livestager import live_stager
from shmstage.nowaitjoin import Join, LiveDataset, joinable, quiet_thread

STOP_GRACE = 10.0  # seconds a stager told to stop (SIGCONT + SIGTERM) has before a SIGKILL


def why_not(source: str, *, cluster: Any, service_answers: bool) -> str | None:
    """Why ``--no-wait`` stages ``source`` first instead (one line), or None: it overlaps."""
    from shmstage.stage.sources import kinds

    if cluster is not None:
        return "with --nodes every node's share is exchanged before any is complete"
    if service_answers:
        return "the node's shmstage service stages it (a live copy is made by run itself: add --no-service and a --dest of your own)"
    try:
        kind, _ = kinds.resolve(source)
    except ShmstageError:
        return None  # staging says what is wrong with it, in its own words
    if kind != "dir":
        return f"it is a {'tar archive' if kind == 'tar' else kind + ' prefix'}, and only a directory is read while it is copied"
    return None


class Stager:
    """One forked stager and what ``run`` hears from it (the module's diagram)."""

    def __init__(self, pid: int, events: int, ack: int, name: str | None) -> None:
        self.pid, self.events, self.ack = pid, events, ack
        self.name = name
        self.buf = b""
        self.status: int | None = None  # the stager's exit status, once reaped
        self.failure: ShmstageError | None = None
        self.done: dict[str, Any] | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False  # run stops the copy: its end is no news to the user
        self.root: tuple[int, int] | None = None  # the in-flight tree's (dev, ino): see _gone
        self.dest: str | None = None
        self.leased = False  # the lease taken at its "published"

    @classmethod
    def fork(cls, source: str, name: str | None, dest: str | None, room: dict[str, Any]) -> Stager:
        ev_r, ev_w = os.pipe()
        ack_r, ack_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the stager
            os.close(ev_r)
            os.close(ack_w)
            live_stager(source, name, dest, room, ev_w, ack_r)
        os.close(ev_w)
        os.close(ack_r)
        return cls(pid, ev_r, ack_w, name)

    def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The stager's next event; {"event": "gone"} at EOF; None when ``timeout`` passed."""
        while b"\n" not in self.buf:
            if timeout is not None and not select.select([self.events], [], [], timeout)[0]:
                return None
            chunk = os.read(self.events, 65536)
            if not chunk:
                return {"event": "gone"}
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def first(self, lease: Callable[[str, str], Any]) -> tuple[Any, Any]:
        """Wait for the view (a LiveDataset, no lease yet) or, with nothing to copy, for the
        published copy (its dataset and lease).  Raises what the stager failed with."""
        event = self.next_event()
        assert event is not None
        if event["event"] == "view":
            if event.get("root"):
                self.root = (int(event["root"][0]), int(event["root"][1]))
            self.dest = os.path.dirname(event["path"])
            return LiveDataset(event["name"], event["path"], event["source"]), None
        if event["event"] == "published":
            held = self.published(event, lease)
            done = self.next_event()
            assert done is not None
            if done["event"] != "done":
                self._failed(done)
            self.reap()
            return replace(held.dataset, changed=bool(done["changed"])), held
        self._failed(event)
        raise AssertionError("unreachable")

    def published(self, event: dict[str, Any], lease: Callable[[str, str], Any]) -> Any:
        """Take the lease while the stager still holds its lock, then let it go on."""
        try:
            got = lease(event["name"], os.path.dirname(event["path"]))
            self.leased = True
            return got
        finally:
            with contextlib.suppress(OSError):
                os.write(self.ack, b"k")

    def watch(
        self, lease: Callable[[str, str], Any], held: list[Any], log: Callable[[str], None] | None
    ) -> None:
        """After the job started: a thread takes the lease at the publish and says a failure."""

        def follow() -> None:
            while True:
                event = self.next_event()
                assert event is not None
                kind = event["event"]
                if kind == "published":
                    try:
                        held.append(self.published(event, lease))
                    except ShmstageError as e:
                        self.failure = e
                elif kind == "done":
                    self.done = event
                    if log is not None and event.get("summary"):
                        log(str(event["summary"]))
                elif kind == "gone" and self._published_anyway(lease, held):
                    return  # killed after its publish: the copy is there and current
                elif kind in ("failed", "gone"):
                    self.failure = _failure(event)
                    if log is not None and not self.stopping:
                        log(
                            f"{self.failure} (the job goes on reading what is not copied from the source)"
                        )
                    return
                if kind == "done":
                    return

        self.thread = quiet_thread(follow, "shmstage-nowait")

    def finish(self, stop: bool, poll: Callable[[], int | None]) -> None:
        """After the job: stop the copy (``stop``), or wait for it while ``poll()`` sees no
        stopping signal; then reap the stager."""
        if not stop:
            while self.thread is not None and self.thread.is_alive():
                self.thread.join(0.2)
                if poll() is not None:
                    stop = True
                    break
        copying = self.thread is None or self.thread.is_alive()
        if stop and self.status is None and copying:
            self.stopping = True
            with contextlib.suppress(ProcessLookupError):  # a stopped stager takes it too
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
        self.reap(STOP_GRACE)
        if self.thread is not None:
            self.thread.join(5)

    def reap(self, grace: float | None = None) -> None:
        """Wait for the stager to exit; past ``grace`` seconds (a stager stopped or stuck:
        run must end), SIGCONT + SIGTERM, then SIGKILL after as long again."""
        if self.status is None:
            status = self._wait(grace)
            if status is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGCONT)
                    os.kill(self.pid, signal.SIGTERM)
                self.stopping = True
                status = self._wait(grace)
            if status is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                status = self._wait(None)
            assert status is not None
            self.status = os.waitstatus_to_exitcode(status)
            for fd in (self.events, self.ack):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _wait(self, grace: float | None) -> int | None:
        """waitpid: blocking (``grace`` None), or None if still running after ``grace`` s."""
        if grace is None:
            return os.waitpid(self.pid, 0)[1]
        deadline = time.monotonic() + grace
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return status
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _published_anyway(self, lease: Callable[[str, str], Any], held: list[Any]) -> bool:
        """The stager died without a word after its publish (killed between the rename and
        the view's removal): the published copy is this stager's tree (its root's inode) and
        so current.  Take the lease if not taken yet, remove the dead view, and say done."""
        from shmstage.stage.store.layout import Store
        from shmstage.stage.store.views import read_view, remove_view

        if self.root is None or self.dest is None or self.name is None:
            return False
        store = Store(self.dest)
        record = store.published(self.name)
        if record is None or (record.root_dev, record.root_ino) != self.root:
            return False
        if not self.leased:
            with contextlib.suppress(ShmstageError):
                held.append(lease(self.name, self.dest))
        view = read_view(self.dest, self.name)
        if view is not None and view.pid == self.pid:
            with contextlib.suppress(OSError):
                remove_view(store, self.name)
        self.done = {"event": "done", "changed": True}
        return True

    def _failed(self, event: dict[str, Any]) -> None:
        self.reap()
        raise _failure(event)


def _failure(event: dict[str, Any]) -> ShmstageError:
    if event["event"] == "gone":
        return ShmstageError("the stager of --no-wait exited before the copy was published")
    cls = RefusedError if event.get("code") == RefusedError.exit_code else ShmstageError
    error = cls(event.get("message") or "the copy failed")
    error.exit_code = int(event.get("code") or 1)
    return error


def start(
    source: str,
    name: str | None,
    dest: str | None,
    *,
    cluster: Any,
    service_answers: bool,
    room: dict[str, Any],
    held: list[Any],
    log: Callable[[str], None] | None,
    lease: Callable[[str, str], Any],
    tiers: list[str],
) -> tuple[Any, Stager | None, LiveDataset | None] | None:
    """``--no-wait`` for one ``--stage``: (the dataset the job gets, the stager forked for
    it, a view of another stager joined); None when it is staged first (said in one line)."""
    why = why_not(source, cluster=cluster, service_answers=service_answers)
    if why is not None:
        if log is not None:
            log(f"--no-wait: staging {source} before the job starts: {why}")
        return None
    joined = joinable(source, name, tiers)
    if joined is not None:
        if log is not None:
            log(
                f"--no-wait: {joined.name} is being copied by another shmstage: the job starts on its copy now"
            )
        return joined, None, Join(joined)
    from shmstage.stage.signals import signals_raise

    stager = Stager.fork(source, name, dest, room)
    with signals_raise():  # SIGTERM while it lists: run's cleanup stops it, then we die of it
        ds, got = stager.first(lease)
    if got is not None:
        held.append(got)
        return ds, None, None
    stager.name = ds.name
    if log is not None:
        log(f"--no-wait: the job starts now; {source} is copied to {ds.path} while it runs")
    return ds, stager, None


def start_live(
    source: str,
    name: str | None,
    dest: str | None,
    log: Callable[[str], None] | None,
    cluster: Any,
    service: bool,
    held: list[Any],
    no_wait: bool,
    **room: Any,
) -> tuple[Any, Any, Any] | None:
    """``--no-wait`` for one ``--stage`` (:func:`start`); None: stage it first."""
    if not no_wait:
        return None
    from shmstage.service import api
    from shmstage.stage.cache.tiers import split
    from shmstage.stage.store.leases import acquire

    return start(
        source,
        name,
        dest,
        cluster=cluster,
        service_answers=api.service_for(dest, service) is not None,
        room=room,
        held=held,
        log=log,
        lease=acquire,
        tiers=split(dest),
    )


def follow_live(stagers: list[Any], joins: list[Any], held: list[Any], log: Any) -> None:
    """Once every stager forked: threads take each live copy's lease when it is published."""
    if not stagers and not joins:
        return
    from shmstage.stage.store.leases import acquire

    for stager in stagers:
        stager.watch(acquire, held, log)
    for joined in joins:
        joined.follow(acquire, held, log)


def finish_live(
    stagers: list[Any], returncode: int, stop: bool, hold: Any, log: Any, joins: list[Any] = ()
) -> int:
    """The job exited: wait for each copy (or stop it: a signal, ``--cleanup``); the job's
    status, or the first copy's failure (its own or a joined one's) when the job succeeded."""
    for stager in stagers:
        if not stop and stager.status is None and stager.done is None and log is not None:
            log(
                f"the job exited; finishing the copy of {stager.name or 'the dataset'} (^C stops it)"
            )
        stager.finish(stop, hold.poll)
    for joined in joins:
        joined.finish()
    failures = [s.failure for s in stagers if s.failure is not None and not s.stopping]
    failures += [j.failure for j in joins if j.failure is not None]
    if returncode == 0 and failures:
        return failures[0].exit_code
    return returncode


def unpublished(staged: list[Any], stagers: list[Any]) -> list[Any]:
    """``staged`` with the live copies that were never published marked unchanged (so
    ``--cleanup`` does not try to evict what is not there)."""
    gone = {s.name for s in stagers if s.done is None}
    return [
        replace(ds, changed=False) if isinstance(ds, LiveDataset) and ds.name in gone else ds
        for ds in staged
    ]
