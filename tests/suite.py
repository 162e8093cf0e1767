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

Signals, with or without ARGS: a SIGTERM sent to this process is passed to each pytest as
SIGINT, so each stops as on Ctrl-C, its fixtures torn down (a Slurm cluster, mounts, users),
and this exits 143 once they have.  Ctrl-C at a terminal reaches every pytest directly (one
process group), so it is not sent again (a second SIGINT would cut pytest's teardown short);
this waits for them and exits 130.  A SIGTERM sent to the whole group (GNU `timeout`) reaches
each pytest itself and kills it as it would a bare pytest, without teardown: a Slurm cluster
left so is swept by the next one's start (tests/slurmcluster.py).
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


def main(argv: list[str]) -> int:
    stopped: list[int] = []
    running: list[subprocess.Popen] = []

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)
        if signum == signal.SIGINT:  # the terminal's: every pytest has it already
            return
        for p in running:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)

    # before any pytest starts: a signal never finds this gone and a pytest without a parent
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def pytest(*args: str, **kw) -> subprocess.Popen:  # noqa: ANN003
        p = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=REPO, **kw)
        running.append(p)
        if stopped and stopped[0] != signal.SIGINT:  # a SIGTERM came while it started
            p.send_signal(signal.SIGINT)
        return p

    with tempfile.TemporaryFile("w+", prefix="shmstage-slurm-tests-") as log:
        if argv:
            rc = pytest(*argv).wait()
        else:
            # a cache of its own: two sessions writing one lastfailed would keep only the last
            beside = pytest("-o", "cache_dir=.pytest_cache/slurm", BESIDE, stdout=log, stderr=log)
            rc = pytest(f"--ignore={BESIDE}").wait() or beside.wait()
            beside.wait()
            log.seek(0)
            print(f"\n==== {BESIDE} (run beside the rest) ====", flush=True)
            sys.stdout.write(log.read())
            sys.stdout.flush()
    return 128 + stopped[0] if stopped else rc


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
