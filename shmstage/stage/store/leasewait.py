"""The waiting half of a ``stage --lease-for`` holder (leasefor.py), run as a script: it keeps
the lease's fd it was handed open until process PID exits, then removes its mark.

Standard library only, started as ``python -I -S leasewait.py``: the holder lives as long as
the job, so it must not keep the stager's memory (hundreds of MB after a large copy) or load
the package.  Usage: leasewait.py --for-pid PID --start TICKS --pidfd FD|-1 --mark PATH|-
"""

from __future__ import annotations

import os
import select
import sys
import time
from contextlib import suppress

POLL_SECONDS = 0.5


def running(pid: int, start: int) -> bool:
    """A copy of shmstage.stage.store.locks.running (this script imports nothing of the
    package): the process ``pid`` that started at ``start`` has not exited."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2 :].split()
        return int(fields[19]) == start and fields[0] not in (b"Z", b"X", b"x")
    except (OSError, ValueError, IndexError):
        return False


def main(argv: list[str]) -> int:
    opts = dict(zip(argv[0::2], argv[1::2]))
    pid, start, pidfd = int(opts["--for-pid"]), int(opts["--start"]), int(opts["--pidfd"])
    mark = opts["--mark"]
    try:
        if pidfd >= 0:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while not poller.poll():
                pass
        else:  # no pidfd on this kernel: pid and start time, twice a second
            while running(pid, start):
                time.sleep(POLL_SECONDS)
    finally:
        if mark != "-":
            with suppress(OSError):
                os.unlink(mark)
    return 0  # exiting closes the lease's fd: the kernel drops the flock


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
