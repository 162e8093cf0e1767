"""Overlap the source walk with the first data reads.

The capacity check needs the whole walk before a byte is written, and on a cold
or throttled source the disk idles meanwhile.  ``Readahead`` asks the kernel to
start reading the first files in copy order (``POSIX_FADV_WILLNEED``, a bounded
budget) while the walk runs; nothing is written.  The copier drops each file's
pages as it copies it, so only a copy that did not complete needs ``stop(drop=True)``.
"""

from __future__ import annotations

import os
import signal
import stat
import threading

BUDGET = 64 << 20  # about 0.3 s of a 200 MB/s disk: the length of a cold 20k-file walk


class Readahead:
    """A daemon thread that advises WILLNEED on files in the walk's (and copier's) order.

    Lifecycle: started in ``__init__``; ends on its own at the budget or the last file;
    ``stop()`` is idempotent: it sets the stop event, joins briefly and, with ``drop``,
    advises DONTNEED on every file it touched.  Errors are ignored: it is only advice.
    """

    def __init__(self, root: str, budget: int = BUDGET) -> None:
        self.root = root
        self.budget = budget
        self.advised: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmstage-readahead", daemon=True)
        self._thread.start()

    def _advise(self, path: str, advice: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _run(self) -> None:
        # Stop signals belong to the main thread: one the kernel hands to this thread would
        # still run the main thread's Python handler at its next bytecode, possibly inside
        # fork()'s at-fork hooks while the copier starts its workers with them blocked.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        left = self.budget
        pending = [self.root]
        while pending and left > 0 and not self._stop.is_set():
            here = pending.pop()
            try:
                with os.scandir(here) as it:
                    items = sorted(it, key=lambda e: e.name)
            except OSError:
                continue
            subdirs = []
            for item in items:
                if self._stop.is_set() or left <= 0:
                    return
                try:
                    st = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    self.advised.append(item.path)
                    self._advise(item.path, os.POSIX_FADV_WILLNEED)
                    left -= st.st_size
                elif stat.S_ISDIR(st.st_mode):
                    subdirs.append(item.path)
            pending.extend(reversed(subdirs))  # depth-first by name, as plan.walk orders entries

    def stop(self, drop: bool) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if drop:
            advised, self.advised = self.advised, []
            for path in advised:
                self._advise(path, os.POSIX_FADV_DONTNEED)
