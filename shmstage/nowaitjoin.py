"""``run --no-wait`` joining another run's live copy (nowait.py): whether it may (its own walk
of the source agrees with the view) and, once joined, leasing the copy at its publish or
saying in one line that it was never published."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shmstage.errors import ShmstageError


@dataclass(frozen=True)
class LiveDataset:
    """A dataset the job reads while it is copied: ``path`` is where it is published (what
    ``{staged}`` gives; shmstage.loader.DatasetFiles finds the view from it)."""

    name: str
    path: str
    source: str
    changed: bool = True
    skipped: tuple[Any, ...] = ()
    evicted: tuple[Any, ...] = ()


def joinable(source: str, name: str | None, tiers: list[str]) -> LiveDataset | None:
    """A live stager already copying ``source`` as ``name`` (another ``run --no-wait``): the job
    may start on its view at once, without waiting for its lock."""
    from shmstage.stage.sources import kinds
    from shmstage.stage.store import name_for
    from shmstage.stage.store.views import LIVE, read_view

    try:
        kind, real = kinds.resolve(source)
    except ShmstageError:
        return None
    name = name or name_for(real)
    for tier in tiers:
        view = read_view(tier, name)
        if view is not None and view.kind == LIVE and view.source == real and view.alive():
            if not _agrees(real, view):  # changed since it was listed: wait, then restage
                return None
            return LiveDataset(view.name, view.final, real, changed=False)
    return None


def _agrees(source: str, view: Any) -> bool:
    """Whether our own walk of ``source`` finds exactly the view's files, each with the
    size and mtime_ns it was listed with (a file changed since, even one already copied,
    means the live copy is not of the source as it is now)."""
    from shmstage.stage.sources.walk import walk

    files = view.files()
    if files is None:
        return False
    try:
        tree = walk(source, check_links=False, hardlinks=False)
    except (OSError, ShmstageError):
        return False  # staging says what is wrong, in its own words
    found = sorted((e[0], e[2], e[3]) for e in tree.entries if e[1] == "f")
    return found == sorted(zip(files.names, files.sizes, files.mtimes, strict=True))


class Join:
    """A job started on another stager's view: lease the copy once that stager published
    it; ``failure``: it stopped before publishing (said in one line when it is seen)."""

    def __init__(self, live: LiveDataset) -> None:
        self.live = live
        self.failure: ShmstageError | None = None
        self.thread: threading.Thread | None = None

    def follow(
        self, lease: Callable[[str, str], Any], held: list[Any], log: Callable[[str], None] | None
    ) -> None:
        from shmstage.stage.store.views import read_view

        live = self.live

        def follow() -> None:
            dest = os.path.dirname(live.path)
            while True:
                view = read_view(dest, live.name)
                if view is None or not view.alive():
                    break
                time.sleep(0.5)
            try:
                held.append(lease(live.name, dest))
            except ShmstageError:
                self.failure = ShmstageError(
                    f"the shmstage copying {live.source} to {live.path} stopped before the copy "
                    "was published"
                )
                if log is not None:
                    log(
                        f"{self.failure} (the job goes on reading what is not copied from the source)"
                    )

        self.thread = quiet_thread(follow, "shmstage-nowait-join")

    def finish(self) -> None:
        """The job exited: a stager that died is seen within a poll (0.5 s); one still
        copying is the run that started it to wait for."""
        if self.thread is not None:
            self.thread.join(2.0)


def quiet_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread that never takes a signal: it inherits a mask blocking them all, so
    a SIGTERM to run reaches the main thread (the supervisor forwards it to the job) and
    never the default action in this thread (run dying with its stager left running)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return thread
