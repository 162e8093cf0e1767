"""The whole test suite as `make test` runs it: tests/test_slurm.py in a second pytest beside
the rest.

    .venv/bin/python -m tests.suite           # the whole suite (what `make test` and CI run)
    .venv/bin/python -m tests.suite ARGS...   # exactly `pytest ARGS...` (one pytest, nothing beside)

test_slurm.py runs a real 4-node Slurm: about 6 of the suite's 26 minutes when run in line,
most of them spent waiting on Slurm's own clocks (slurmctld's 30 s time-limit check, KillWait,
job start and end) while the 2 CPUs idle, and it shares nothing with the other test files (its
nodes have their own namespaces, addresses, loop devices, user and cgroups).  So it runs
beside them.  Its output is kept in a file and printed once the rest has ended, so the two
never interleave; the suite fails when either pytest fails (the rest's exit status first).
SIGTERM (a CI timeout) reaches both as SIGINT: each stops as on Ctrl-C, its fixtures torn down
(a Slurm cluster, mounts, users), and this exits 143.  Ctrl-C at a terminal reaches both
directly (one process group), so it is not sent again (a second SIGINT would cut pytest's
teardown short); this waits for them and exits 130.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BESIDE = "tests/test_slurm.py"


def pytest(*args: str, **kw) -> subprocess.Popen:  # noqa: ANN003
    return subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=REPO, **kw)


def main(argv: list[str]) -> int:
    if argv:
        return pytest(*argv).wait()
    stopped: list[int] = []
    with tempfile.TemporaryFile("w+", prefix="shmstage-slurm-tests-") as log:
        # a cache of its own: two sessions writing one lastfailed would keep only the last
        beside = pytest("-o", "cache_dir=.pytest_cache/slurm", BESIDE, stdout=log, stderr=log)
        rest = pytest(f"--ignore={BESIDE}")

        def stop(signum: int, _frame: object) -> None:
            stopped.append(signum)
            if signum == signal.SIGINT:  # the terminal's: both pytests have it already
                return
            for p in (rest, beside):
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        rc_rest = rest.wait()
        rc_beside = beside.wait()
        log.seek(0)
        print(f"\n==== {BESIDE} (run beside the rest) ====", flush=True)
        sys.stdout.write(log.read())
        sys.stdout.flush()
    if stopped:
        return 128 + stopped[0]
    return rc_rest or rc_beside


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
