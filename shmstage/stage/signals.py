"""SIGTERM and SIGHUP while staging: turned into an exception so the cleanup runs, and held
off (with ^C) until that cleanup is done."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shmstage import errors


class Interrupted(errors.Interrupted):
    """SIGTERM (or SIGHUP) arrived while staging; the partial copy was removed."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(signum, f"interrupted by {name}; the partial copy was removed")


@contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into an exception so cleanup runs (Ctrl-C already raises).

    Once one of them (or ^C) is taken, SIGINT/SIGTERM/SIGHUP are only noted until the
    cleanup is done: an impatient second signal must not unwind the cleanup half-way (the
    partial in trash, the lock, the new manifest left behind while the message says it was
    removed).  The first signal decides how we die.  A Python handler, not a blocked mask:
    the copier's threads would take a process-directed signal the main thread blocks."""
    if threading.current_thread() is threading.main_thread():
        stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        # Only where the default applies: `nohup` (SIG_IGN) and a caller's own handler win.
        ours = {
            s
            for s in stopping
            if signal.getsignal(s)
            == (signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        }
        with _stopping_held(ours):
            yield
    else:
        yield


@contextmanager
def _stopping_held(ours: set[signal.Signals]) -> Iterator[None]:
    def later(signum: int, frame: Any) -> None:
        pass  # the first signal is being acted on: this one changes nothing

    def handler(signum: int, frame: Any) -> None:
        for s in ours:
            signal.signal(s, later)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in ours}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
