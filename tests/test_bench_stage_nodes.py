"""`shmstage bench stage --nodes`: 2 "nodes" on this machine, each a process in a mount
namespace of its own with its own tmpfs at DEST (the unshare happens in a wrapper before
exec), one plain source directory shared by both (enough for the shape of the results:
the page cache is shared, so the source bytes prove nothing here)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from shmstage.cli import cli

NODES = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nodes_without_a_rank_outside_slurm_is_one_error_line(tmp_path: Path) -> None:
    """--nodes without --node-rank (and no SLURM_NODEID): exit 2, one line saying what to add."""
    env = {"SLURM_NODEID": "", "SLURM_JOB_NODELIST": ""}
    result = CliRunner().invoke(cli, ["bench", "stage", str(tmp_path), "--nodes", "2"], env=env)
    assert result.exit_code == 2
    assert result.output == (
        "Error: --nodes 2 needs this node's --node-rank (0 to 1); under Slurm it comes from "
        "SLURM_NODEID\n"
    )


@pytest.mark.root
def test_two_nodes_time_both_modes_report_on_node_0_and_remove_their_copies(
    tmp_path: Path, procs
) -> None:
    """Node 0 prints the JSON report (both modes, one run, source bytes summed over nodes),
    node 1 prints nothing; every copy was exact (a wrapper around `shmstage stage` hashes
    each one before the benchmark removes it) and no copy is left on either node."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a tmpfs per node in its own mount namespace)")
    pytest.importorskip("torch.distributed", reason="stage --nodes needs torch")
    src, dest = tmp_path / "src", tmp_path / "shm"
    for d in range(3):
        (src / f"class{d}").mkdir(parents=True)
        for i in range(20):
            (src / f"class{d}" / f"img{i}.jpg").write_bytes(os.urandom(1000 * (i + d + 1)))
    (src / "big.bin").write_bytes(os.urandom(3 << 20))
    (src / "link").symlink_to("big.bin")
    dest.mkdir()
    digest = "cd {} && find . -type f -print0 | sort -z | xargs -0 sha1sum; find . | sort"
    want = subprocess.run(
        ["sh", "-c", digest.format(src)], capture_output=True, text=True, check=True
    ).stdout
    exe = shutil.which("shmstage", path=os.path.dirname(sys.executable)) or "shmstage"
    # PATH-free wrapper: the library's own default is the venv's shmstage; this one runs it
    # and records a digest of every copy it made (rank in $RANK) before printing its JSON.
    lib = (
        "import sys; from shmstage.bench.stage_nodes import run_nodes_benchmark as r; "
        "from shmstage.cluster import resolve; import json; "
        "from shmstage.cli.output import dumps; "
        "s = resolve(2, int(sys.argv[1]), sys.argv[2]); "
        f"res = r('{src}', '{dest}', s, runs=1, shmstage_cmd=['{tmp_path}/wrap']); "
        "print(dumps(res)) if s.rank == 0 else None"
    )
    (tmp_path / "wrap").write_text(
        "#!/bin/sh\n"
        f'out=$({exe} "$@") || exit $?\n'
        f'path=$(printf %s "$out" | {sys.executable} -c "import json,sys;print(json.load(sys.stdin)[\'path\'])")\n'
        f"({digest.format('$path')}) > {tmp_path}/copy-$RANK-$(basename $path)\n"
        'printf "%s\\n" "$out"\n'
    )
    (tmp_path / "wrap").chmod(0o755)
    port, port2 = _free_port(), _free_port()
    nodes = []
    for rank in range(NODES):
        cli_json = "--json" if rank == 0 else ""
        script = (
            f"mount -t tmpfs -o size=64M node{rank} {dest} || exit 91; "
            f"export RANK={rank}; "
            f"{exe} bench stage {src} --dest {dest} --runs 1 --no-drop-caches {cli_json} "
            f"--nodes {NODES} --node-rank {rank} --rendezvous 127.0.0.1:{port} || exit 1; "
            f'echo ---; {sys.executable} -c "{lib}" {rank} 127.0.0.1:{port2} || exit 2; '
            f"echo ---; ls -A {dest}"
        )
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        nodes.append(procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [(p.communicate(timeout=300), p.returncode) for p in nodes]
    for (out, err), rc in results:
        assert rc == 0, (out, err)
    (out0, _), (out1, err1) = results[0][0], results[1][0]
    cli_out, lib_out, left = out0.split("---\n")
    for text in (cli_out, lib_out):
        report = json.loads(text)
        assert (report["nodes"], report["runs"], report["drop_caches"]) == (2, 1, False)
        assert report["bytes"] == sum(p.stat().st_size for p in src.rglob("*.*"))
        assert [m["mode"] for m in report["modes"]] == ["naive", "read-once"]
        for m in report["modes"]:
            assert len(m["times"]) == 1 and m["median_s"] > 0
            assert isinstance(m["median_source_bytes"], int) and m["median_source_bytes"] >= 0
        assert report["modes"][1]["vs_read_once"] == 1.0
    assert out1 == "---\n---\n" + left, (out1, err1)  # node 1 prints nothing of the report
    assert left == "", left  # each node's scratch store under DEST is gone
    copies = sorted(tmp_path.glob("copy-*"))
    assert [c.name.rsplit("-", 1)[1] for c in copies] == ["0", "0", "0", "0"], copies
    assert len(copies) == 2 * NODES  # naive and read-once, on each node
    for copy in copies:
        assert copy.read_text() == want, copy.name


def test_a_patient_gather_waits_for_a_live_node_and_names_a_dead_one() -> None:
    """``allgather(patient=True)`` outlasts --timeout while the missing node's heartbeat goes
    on, and fails naming the node once its heartbeat stops (real TCPStore, two ranks)."""
    pytest.importorskip("torch.distributed", reason="the rendezvous needs torch")
    import threading
    import time

    from shmstage.cluster.rendezvous import PeerLost, Rendezvous

    port = _free_port()
    node0 = Rendezvous("127.0.0.1", port, 2, 0, timeout=1.0)
    node1 = Rendezvous("127.0.0.1", port, 2, 1, timeout=1.0)
    node0.connect()
    node1.connect()

    def late() -> None:
        time.sleep(3.0)  # three timeouts, heartbeat running
        node1.allgather("done", b"1")

    thread = threading.Thread(target=late)
    thread.start()
    try:
        assert node0.allgather("done", b"0", patient=True) == [b"0", b"1"]
    finally:
        thread.join()
    node1.beating.set()  # node 1 "dies": its heartbeat stops, it never posts again
    with pytest.raises(PeerLost, match="lost node 1 of 2"):
        node0.allgather("next", b"0", patient=True)
    node1.close()
    node0.close()
