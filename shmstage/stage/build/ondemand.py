"""The demand-ordered copy of a directory (``run --no-wait``): once the tree's directories exist,
the live view is written (store/views.py), the copy is fed to the forked copier in small
batches so that a file a job asks for on the demand socket (demand.py) is handed to a worker
next, and each file is appended to the view's ``landed`` only once it is complete.

The rest of the stage is as without a view: fit checked and space claimed before the view is
written (build/partial.py), settle, verify and publish; the view is removed after the publish.
"""

from __future__ import annotations

import errno
import os
import select
import stat
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shmstage.stage.build import copier
from shmstage.stage.build.chown import copy_group, copy_owner
from shmstage.stage.build.copypipe import check_alive
from shmstage.stage.build.demand import DemandServer
from shmstage.stage.build.estimate import page_size
from shmstage.stage.build.fromdir import jobs_of, settle
from shmstage.stage.sources.base import Tick, Want
from shmstage.stage.sources.directory import DirSource
from shmstage.stage.store import Store
from shmstage.stage.store.checks import mkdir_checked
from shmstage.stage.store.locks import me
from shmstage.stage.store.views import LIVE, LandedLog, View, remove_view, write_view

# Bulk work is handed out small, and none while any demand waits: a demanded file (a task of
# its own) waits only for the tasks in hand and QUEUED to end, then has the source's whole
# bandwidth.  Small tasks cost the plain copy little (a record on a pipe each).
BATCH_FILES = 4
BATCH_BYTES = 1 << 20
QUEUED = 2  # tasks queued beyond one per worker: none idles while the loop answers
_SUN_PATH = 107  # sockaddr_un.sun_path, less its NUL
_FAILED_FILE = {"changed", "vanished", "replaced", "not regular"}


@dataclass
class Live:
    """What a live stage needs beyond a plain one; handed to ``staging.stage(live=...)``.

    ``on_view(view)``: the view is written (the job may start); ``on_published(path)``: the
    copy is published, the stage's lock still held (a lease taken now cannot lose a race to
    an evict).  ``restrict_top(part)``: the top's final access, set before the view is
    written (staging.py: topaccess).  The rest is the copy's state."""

    on_view: Callable[[View], None] | None = None
    on_published: Callable[[str], None] | None = None
    restrict_top: Callable[[str], None] | None = None
    view: View | None = None
    server: DemandServer | None = None
    log: LandedLog | None = None
    store: Store | None = None
    name: str = ""
    landed_order: list[int] = field(default_factory=list)

    def published(self) -> None:
        """After the publish: answer every demand "published", then remove the view."""
        if self.server is not None:
            self.server.publish()
        self._close_log()
        if self.store is not None and self.view is not None:
            remove_view(self.store, self.name)
        if self.on_published is not None and self.store is not None:
            self.on_published(self.store.path(self.name))

    def failed(self) -> None:
        """The stage failed: jobs see EOF and read from the source; the view is left for
        them to find dead once this process is gone (gc or the next stage removes it)."""
        if self.server is not None:
            self.server.close()
        self._close_log()

    def _close_log(self) -> None:
        if self.log is not None:
            self.log.close()


def socket_path(store: Store) -> str:
    """The demand socket: beside the views, named for this process (a dead stager's is
    removed with its view); an abstract name where DEST's path is too long for one."""
    mkdir_checked(store.views_dir, 0o755)
    path = os.path.join(store.views_dir, f".{me()}.sock")
    if len(os.fsencode(path)) <= _SUN_PATH:
        return path
    return f"\0shmstage-{me()}"


@dataclass(frozen=True)
class Fill:
    """What build/partial.py's step 4 copies, as :func:`fromdir.fill` takes it: the files
    ``wants`` of ``source`` into ``part`` (partial/<name>), counted by ``tick``, by
    ``workers`` copy processes (None: the default)."""

    source: DirSource
    wants: Sequence[Want]
    part: str
    tick: Tick
    workers: int | None


def fill_live(
    live: Live,
    fill: Fill,
    checksum: bool,
    meanwhile: Callable[[], None] | None,
    *,
    store: Store,
    name: str,
    entries: list[Any],
    hard: list[list[Any]],
    dirs: list[tuple[str, int, int, int]],
) -> None:
    """build/partial.py's step 4 for a live stage: view, demand socket, demand-ordered copy.
    ``hard`` (hard links inside the tree) loses the links made here as their files land."""
    source, wants, part, workers = fill.source, fill.wants, fill.part, fill.workers
    files = sorted(
        [e for e in entries if e[1] == "f"] + [_as_file(h, entries) for h in hard],
        key=lambda e: e[0],
    )
    index = {e[0]: i for i, e in enumerate(files)}
    wanted = {w.path for w in wants}
    resident = {e[0] for e in files if e[1] == "f" and e[0] not in wanted}
    linked = [h for h in hard if h[1] in resident]
    for rel, first in linked:  # their file is in the tree already
        os.link(os.path.join(part, first), os.path.join(part, rel), follow_symlinks=False)
        resident.add(rel)
    hard[:] = [h for h in hard if h[1] not in resident]
    _open_tree(store, part, dirs, source, private=any(e[5] is not None for e in entries))
    if live.restrict_top is not None:
        live.restrict_top(part)
    live.store, live.name = store, name
    sock = socket_path(store)
    live.server = DemandServer(sock, len(files))
    for rel in resident:
        live.server.landed[index[rel]] = 1
    live.view = write_view(
        store,
        name,
        kind=LIVE,
        source=source.location,
        root=part,
        socket=sock,
        files=[(e[0], e[2], e[3], e[0] in resident) for e in files],
        top=part,
    )
    live.log = LandedLog(live.view)
    if live.on_view is not None:
        live.on_view(live.view)
    links: dict[str, list[str]] = {}
    for rel, first in hard:
        links.setdefault(first, []).append(rel)
    try:
        _Copy(live, fill, index, links).run(meanwhile)
    except BaseException:
        live.failed()  # jobs see EOF now, and read what did not land from the source
        raise
    hard.clear()  # every link made as its file landed
    settle(source, jobs_of(source, wants, part), [], checksum, workers or copier.default_workers())


def _as_file(link: list[Any], entries: list[Any]) -> list[Any]:
    """A hard link inside the tree as a view line: its first name's size and mtime."""
    rel, first = link
    for e in entries:
        if e[0] == first:
            return [rel, "h", e[2], e[3], e[4], None]
    return [rel, "h", 0, 0, 0, None]


def _open_tree(
    store: Store, part: str, dirs: list[tuple[str, int, int, int]], source: DirSource, private: bool
) -> None:
    """Let who may read the copy through the in-flight tree now, not at the publish: each
    directory gets its owner and mode (and ours to write in: the copier still creates files
    there); partial/ lets them search (it stays unlistable).  A source with ACLs keeps its
    tree the stager's alone until the publish (the ACLs are written last, build/tree.py)."""
    if private:
        return
    st = os.lstat(store.partial_dir)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o711:
        os.chmod(store.partial_dir, 0o711)
    for rel, mode, _mtime, _atime in reversed(dirs):
        path = os.path.join(part, rel) if rel != "." else part
        owner = source.owner(rel)
        if owner is not None:
            copy_owner(path, owner)
        gid = source.group(rel)
        if gid is not None:
            copy_group(path, gid)
        os.chmod(path, stat.S_IMODE(mode) | stat.S_IRWXU)


def _wait(results: int, server: DemandServer) -> tuple[list[int], list[int]]:
    """poll(2), not select: a job's DataLoader workers each connect, and fds past 1023 are
    fine.  (readable, writable) after at most 0.2 s."""
    poll = select.poll()
    poll.register(results, select.POLLIN)
    for fd in server.fds():
        poll.register(fd, select.POLLIN)
    for fd in server.writers():
        poll.register(fd, select.POLLIN | select.POLLOUT)
    events = poll.poll(200)
    readable = [fd for fd, ev in events if ev & (select.POLLIN | select.POLLHUP | select.POLLERR)]
    return readable, [fd for fd, ev in events if ev & select.POLLOUT]


class _Copy:
    """The copy loop: the copier's results, the demand socket and the feeding in one select."""

    def __init__(
        self, live: Live, fill: Fill, index: dict[str, int], links: dict[str, list[str]]
    ) -> None:
        self.live, self.source, self.part = live, fill.source, fill.part
        self.tick = fill.tick
        self.workers = fill.workers or copier.default_workers()
        self.jobs = jobs_of(fill.source, fill.wants, fill.part)
        self.index = index
        self.links = links
        self.job_of = {index[job[6]]: j for j, job in enumerate(self.jobs)}
        for first, rels in links.items():  # a link is served by its file's copy
            for rel in rels:
                if first in index and index[first] in self.job_of:
                    self.job_of[index[rel]] = self.job_of[index[first]]
        self.handed = bytearray(len(self.jobs))
        self.todo = deque(range(len(self.jobs)))
        self.group_of: dict[int, int] = {}  # task number -> group
        self.next_group = 0
        self.adding = -1  # the first task number of the ``add`` under way
        self.early: set[int] = set()  # its tasks already done
        self.groups: dict[int, list[Any]] = {}  # group -> [tasks left, job indices, big files]
        self.left = len(self.jobs)

    def run(self, meanwhile: Callable[[], None] | None) -> None:
        server = self.live.server
        assert server is not None
        stream = copier.Stream(
            self.source.prefix,
            self.part + "/",
            self.workers,
            self.tick,
            page_size(self.part),
            tops={self.source.prefix: self.source.top()},
            on_task=self._task_done,
        )
        old_umask = os.umask(0)
        try:
            with stream:
                self.stream = stream
                self._feed()
                if meanwhile is not None:
                    meanwhile()  # the manifest, while the first batches copy
                while self.left:
                    for i in server.demands():
                        j = self.job_of.get(i)
                        if j is not None and not self.handed[j]:
                            self._hand([j])  # a task of its own: no bulk file ahead of it
                    self._feed()
                    ready, writable = _wait(stream.results.fd, server)
                    server.handle([fd for fd in ready if fd != stream.results.fd], writable)
                    if stream.results.fd in ready:
                        stream.results.collect(stream.sent, 0)
                    elif not ready and not writable:
                        check_alive(stream.alive)
                stream.finish()
        except copier.CopyFailed as e:
            if e.failure.kind in _FAILED_FILE:  # the job is told this file cannot be served
                rel = e.failure.path[len(self.source.prefix) :]
                if rel in self.index:
                    server.land([self.index[rel]], -errno.ESTALE)
                    server.handle([], server.writers())
            raise
        finally:
            os.umask(old_umask)

    def _feed(self) -> None:
        """Keep a task per worker and QUEUED more, in listing order, skipping what was
        demanded; none while a demand waits (every file waited for is handed out already)."""
        stream, waiting = self.stream, self.live.server.waiting  # type: ignore[union-attr]
        while (
            not waiting and self.todo and stream.sent - stream.results.done < self.workers + QUEUED
        ):
            batch: list[int] = []
            nbytes = 0
            while self.todo and len(batch) < BATCH_FILES and nbytes < BATCH_BYTES:
                j = self.todo.popleft()
                if not self.handed[j]:
                    batch.append(j)
                    nbytes += self.jobs[j][2]
            if batch:
                self._hand(batch)

    def _hand(self, batch: list[int]) -> None:
        """Hand ``batch`` (job indices) to the workers as one group: it lands when every task
        it became is done (a task may finish inside ``add``, which collects results too)."""
        stream = self.stream
        for j in batch:
            self.handed[j] = 1
        group = self.next_group
        self.next_group += 1
        first = stream.sent
        self.adding = first
        try:
            big = stream.add([self.jobs[j] for j in batch])
        finally:
            self.adding = -1
        early, self.early = self.early, set()
        tasks = range(first, stream.sent)
        self.groups[group] = [len(tasks) - len(early), batch, big]
        for t in tasks:
            if t not in early:
                self.group_of[t] = group
        if self.groups[group][0] == 0:
            self._land(group)

    def _task_done(self, seq: int) -> None:
        group = self.group_of.pop(seq, None)
        if group is None:  # done inside the very ``add`` that handed it out (see _hand)
            if self.adding >= 0 and seq >= self.adding:
                self.early.add(seq)
            return
        self.groups[group][0] -= 1
        if self.groups[group][0] == 0:
            self._land(group)

    def _land(self, group: int) -> None:
        """Every task of a batch is done: big files get their owner, mode and times, then
        the batch's files (and their hard links) are appended to ``landed``."""
        _, batch, big = self.groups.pop(group)
        if big:
            settle(self.source, [], big, False, self.workers)
        live = self.live
        assert live.server is not None and live.log is not None
        landed = []
        for j in batch:
            rel = self.jobs[j][6]
            landed.append(self.index[rel])
            for link in self.links.pop(rel, ()):
                os.link(os.path.join(self.part, rel), os.path.join(self.part, link))
                landed.append(self.index[link])
        live.log.append(landed)
        live.server.land(landed)
        live.landed_order.extend(landed)
        self.left -= len(batch)
