"""Waiting for a gloo send or receive without losing signals: ``wait_work`` joins a helper
thread in short slices, and raises ``LinkLost`` (naming the peer) when the operation fails.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

POLL = 0.2  # seconds between two looks at a stop flag or a signal (the ring's loops too)
WATCH_SLICES = 5  # a wait_work's watch runs every 5 POLLs


_LEFT: list[threading.Thread] = []  # helpers whose wait was abandoned (a signal, a watch)


def left_behind() -> bool:
    """A gloo wait was abandoned and still runs (in C++): a normal interpreter exit would
    destroy gloo's threads under it (std::terminate, SIGABRT), so the process must leave
    with ``os._exit`` once it has said why (shmstage.cli.main)."""
    return any(t.is_alive() for t in _LEFT)


class LinkLost(Exception):
    """A gloo send/recv failed or timed out; ``peer`` is the node it was with."""

    def __init__(self, error: BaseException, peer: int | None) -> None:
        super().__init__(str(error))
        self.error, self.peer = error, peer


def wait_work(
    work: Any, timeout: timedelta, peer: int | None, watch: Callable[[], None] | None = None
) -> None:
    """Wait for a gloo operation, up to ``timeout``; ``LinkLost`` if it fails or times out.

    The wait runs in a helper thread and this one joins it in short slices: a signal
    (SIGTERM) is acted on at once, not after the peer answers or ``timeout`` (a gloo wait
    holds the thread in C++, and one cut short by its own timeout closes the link).  On a
    signal the helper is left behind, as a daemon; the exit closes its links.  ``watch``
    runs about once a second meanwhile and may raise (the rendezvous's: a node that said it
    stopped, or whose connection closed): a wait held up by another node (a send to a
    frozen one) then ends naming the node that is gone, not after ``timeout``."""
    box: list[BaseException] = []

    def wait() -> None:
        try:
            work.wait(timeout)
        except BaseException as e:  # handed to the caller as a value
            box.append(e)

    helper = threading.Thread(target=wait, name="shmstage-gloo-wait", daemon=True)
    helper.start()
    slices = 0
    try:
        while helper.is_alive():
            helper.join(POLL)
            slices += 1
            if watch is not None and slices % WATCH_SLICES == 0 and helper.is_alive():
                watch()
    except BaseException:
        _LEFT.append(helper)
        raise
    if box:
        raise LinkLost(box[0], peer)


def first_line(e: BaseException) -> str:
    """The first line of an error, without gloo's source location (``[.../pair.cc:553] ``)
    and sign-off (``GLHF!``): one line a user reads, not C++ internals."""
    text = str(e).strip().splitlines()
    line = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text[0]) if text else ""
    return line.split(" GLHF")[0].strip().rstrip(":") or type(e).__name__
