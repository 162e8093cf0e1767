"""A directory that does not fit: the one refusal line of `stage` and `run --stage` also says
that --partial keeps the part that fits, where --partial would (a directory, no --no-wait, no
--nodes, room beyond the reserve), and taking that advice keeps a part."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.test_stage_partial import make_src, sh

pytestmark = pytest.mark.root

OFFER = "(or keep the part that fits in RAM with --partial; jobs read the rest from the source)"
READ_ALL = """
import sys
from shmstage.datasetfiles import DatasetFiles
f = DatasetFiles(sys.argv[1])
print(len(f.names), sum(len(f.read(n)) for n in f.names))
"""


def refusal(r: subprocess.CompletedProcess) -> str:
    """The one line a refused command printed on stderr (it must be one line, exit 2)."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("Error: dataset does not fit: "), r.stderr
    assert "shmstage remount" in r.stderr, r.stderr  # the remount hint stays
    return r.stderr


def test_stage_and_run_offer_partial_and_taking_the_offer_keeps_a_part(tmpfs, tmp_path):
    """stage, stage --dry-run and run --stage of a directory 1.5x the tmpfs are refused in one
    line naming --partial; the same commands with --partial keep a part, and the job reads
    every file."""
    shm = tmpfs("8M")
    src = tmp_path / "src"
    data = make_src(src)
    where = ("--dest", str(shm), "--reserve", "1M")
    stage = ("stage", str(src), *where)
    run = ("run", "--stage", str(src), *where)
    job = ("--", sys.executable, "-c", READ_ALL, "{staged}")
    for args in (stage, (*stage, "--dry-run"), (*run, *job)):
        line = refusal(sh(*args))
        assert line.endswith(f" {OFFER}\n"), line
    assert not (shm / "src").exists()
    r = sh(*run, "--partial", *job)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(len(data)), str(sum(map(len, data.values())))]
    r = sh(*stage, "--partial", "--json")
    assert r.returncode == 0, r.stderr
    assert 0 < json.loads(r.stdout)["resident"] < 1


def test_no_offer_for_an_archive_no_wait_or_no_room(tmpfs, tmp_path):
    """Where --partial would not keep a part, the line does not name it: a tar archive
    (--partial stages directories), run --no-wait (they do not combine), a reserve that
    leaves no room; nor a stage --partial that itself cannot keep a part."""
    shm = tmpfs("8M")
    make_src(tmp_path / "src")
    subprocess.run(["tar", "-cf", str(tmp_path / "a.tar"), "-C", str(tmp_path), "src"], check=True)
    where = ("--dest", str(shm), "--reserve", "1M")
    cases = [
        ("stage", str(tmp_path / "a.tar"), *where),
        ("run", "--stage", str(tmp_path / "src"), *where, "--no-wait", "--", "true"),
        ("stage", str(tmp_path / "src"), "--dest", str(shm), "--reserve", "8M"),
        ("stage", str(tmp_path / "src"), "--dest", str(shm), "--reserve", "8M", "--partial"),
    ]
    for args in cases:
        line = refusal(sh(*args))
        assert "--partial" not in line, (args, line)
    assert not (shm / "src").exists()


def test_no_offer_with_nodes(tmp_path, procs):
    """stage --nodes 2 (each node its own 8M tmpfs at DEST): --partial stages on one node, so
    neither node's refusal names it."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a tmpfs in each node's mount namespace)")
    pytest.importorskip("torch.distributed", reason="cluster staging needs torch")
    src, dest = tmp_path / "src", tmp_path / "shm"
    make_src(src)
    dest.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "shmstage")
    nodes = []
    for rank in range(2):
        stage = (
            f"{exe} stage {src} --dest {dest} --reserve 1M --nodes 2 --node-rank {rank} "
            f"--rendezvous 127.0.0.1:{port} --timeout 60"
        )
        script = f"mount -t tmpfs -o size=8M shmstage-test {dest} || exit 91; exec {stage}"
        nodes.append(
            procs.start(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        )  # fmt: skip
    for node in nodes:
        _, err = node.communicate(timeout=120)
        line = refusal(subprocess.CompletedProcess([], node.returncode, "", err))
        assert "--partial" not in line, line
