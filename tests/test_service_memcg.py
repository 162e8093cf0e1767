"""Issue 22: the tmpfs pages of a dataset staged through the service are charged to the
service's memory cgroup, not to the job that asked: a job whose memory limit is below the
dataset's size stages it through the service, and its cgroup stays small.

tmpfs pages are charged to the cgroup of the process that wrote them and stay charged after it
exits; the control case (the same stage in-process, in the job's cgroup) shows the measure sees
that charge, so the main assertion can fail.  Real cgroups (v1 memory controller, or v2), a
real `shmstage serve`, the client as an ordinary user.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

MiB = 1 << 20
USER = 4322
V2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
MEMCG_ROOT = Path("/sys/fs/cgroup") if V2 else Path("/sys/fs/cgroup/memory")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (MEMCG_ROOT / ("memory.current" if V2 else "memory.usage_in_bytes")).parent.is_dir(),
    reason="needs root and a memory cgroup controller",
)


class Memcg:
    """A memory cgroup of this test's: ``enter`` is a preexec_fn that moves the child in."""

    def __init__(self, name: str, limit: int | None = None) -> None:
        self.path = MEMCG_ROOT / f"shmstage-test-{name}-{os.getpid()}"
        self.path.mkdir()
        if V2:
            (MEMCG_ROOT / "cgroup.subtree_control").write_text("+memory")
        if limit is not None:
            (self.path / ("memory.max" if V2 else "memory.limit_in_bytes")).write_text(str(limit))

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> int:
        return int((self.path / ("memory.current" if V2 else "memory.usage_in_bytes")).read_text())

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # a child still exiting


@pytest.fixture
def memcgs() -> Iterator[list[Memcg]]:
    made: list[Memcg] = []
    yield made
    for cg in made:
        cg.remove()


def _serve(procs, shmstage_bin, config: Path, sock: Path, cgroup: Memcg) -> None:
    state = config.parent / "state"  # the lease keeper's, not the node's /var/lib/shmstage
    p = procs.start(
        [*shmstage_bin, "serve", "--socket", str(sock), "--config", str(config)],
        env={**os.environ, "SHMSTAGE_STATE_DIR": str(state)},
        preexec_fn=cgroup.enter,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert p.poll() is None, p.stderr.read().decode()
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(sock))
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail("shmstage serve did not answer within 30 s")


def _source(root: Path, files: int, size: int) -> Path:
    src = root / "src"
    src.mkdir()
    for i in range(files):
        (src / f"f{i:03d}.bin").write_bytes(os.urandom(size))
    os.chown(src, USER, USER)
    for f in src.iterdir():
        os.chown(f, USER, USER)
    return src


def test_pages_staged_through_the_service_are_charged_to_the_service_not_the_job(
    procs, shmstage_bin, open_tmpfs, open_tmp_path, memcgs
) -> None:
    store = open_tmpfs("512M")
    dataset = 160 * MiB
    src = _source(open_tmp_path, 40, dataset // 40)
    config = open_tmp_path / "node.yaml"
    config.write_text(f"dest: {store}/shmstage\nreserve: 0\n")
    sock = open_tmp_path / "run" / "shmstage.sock"
    sock.parent.mkdir()
    service = Memcg("service")
    job = Memcg("job", limit=96 * MiB)  # below the dataset: charged, the job could not hold it
    memcgs += [service, job]
    _serve(procs, shmstage_bin, config, sock, service)
    before = service.usage()

    env = {**os.environ, "SHMSTAGE_SOCKET": str(sock), "SHMSTAGE_CONFIG": str(config)}
    user = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "--"]
    r = subprocess.run(
        [*user, *shmstage_bin, "stage", str(src), "--json"],
        env=env, preexec_fn=job.enter, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    staged = Path(store) / "shmstage" / "src"
    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in src.iterdir())
    assert (staged / "f007.bin").read_bytes() == (src / "f007.bin").read_bytes()
    # The job's cgroup holds its own interpreter at most, not the dataset's pages ...
    assert job.usage() < dataset // 2, (job.usage(), dataset)
    # ... and the service's holds them (tmpfs pages stay charged after the writer exits).
    assert service.usage() - before >= dataset * 9 // 10, (service.usage() - before, dataset)


def test_control_the_same_stage_in_process_charges_the_job(
    shmstage_bin, open_tmpfs, open_tmp_path, memcgs
) -> None:
    """Without the service, the job that stages pays for the pages: what the test above
    measures is there to be seen."""
    store = open_tmpfs("512M")
    dataset = 64 * MiB
    src = _source(open_tmp_path, 16, dataset // 16)
    dest = Path(store) / "mine"
    dest.mkdir()
    os.chown(dest, USER, USER)
    job = Memcg("job-inproc", limit=512 * MiB)
    memcgs.append(job)
    user = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "--"]
    r = subprocess.run(
        [*user, *shmstage_bin, "stage", str(src), "--dest", str(dest), "--no-service"],
        preexec_fn=job.enter, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert job.usage() >= dataset * 9 // 10, (job.usage(), dataset)
