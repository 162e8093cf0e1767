"""The served-bytes counters (stage/store/served.py) against other users: a planted FIFO,
forged, non-UTF-8 and unknown names, a counter held locked, a store on a tmpfs of its own;
and that every reading process of a user adds to one file (NOTE [served])."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shmstage import metrics
from shmstage.stage import engine, resident
from shmstage.stage.store import Store, served

VICTIM, ATTACKER = 2301, 2302  # numeric users: no passwd entry needed


def as_user(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


# Reads every file through ``n`` DatasetFiles of the dataset, one after the other (a job
# that rebuilds its dataset each epoch), and prints the bytes read.
READ_ALL = """
import sys
from shmstage.datasetfiles import DatasetFiles
total = 0
for _ in range(int(sys.argv[2])):
    f = DatasetFiles(sys.argv[1])
    total += sum(len(f.read(n)) for n in f.names)
print(total)
"""

PLANT = """
import os, sys
where = sys.argv[1]
os.mkfifo(os.path.join(where, "ds@0"), 0o666)  # root's counter name: a job would hang on it
os.chmod(os.path.join(where, "ds@0"), 0o666)
for name, text in ((b"ds@2303", b"9" * 20 + b" " + b"9" * 20 + b"\\n"),  # another uid's
                   (b"ghost@2302", b"0" * 19 + b"1 " + b"0" * 19 + b"1\\n"),  # no such dataset
                   (b"\\xff@2302", b"0" * 19 + b"1 " + b"0" * 19 + b"1\\n"),  # not UTF-8
                   (b"ds@02302", b"0" * 19 + b"1 " + b"0" * 19 + b"1\\n")):  # not canonical
    with open(os.path.join(os.fsencode(where), name), "wb") as f:
        f.write(text)
"""

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def read_all(path: Path, uid: int | None, n: int = 1) -> int:
    r = subprocess.run(
        [*(as_user(uid) if uid is not None else []), sys.executable, "-c", READ_ALL, str(path),
         str(n)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return int(r.stdout)


@pytest.mark.root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_counters_add_up_per_user_and_nothing_planted_hangs_forges_or_breaks_metrics(
    open_tmp_path, open_tmpfs, shmstage_bin
):
    """DEST in a 1777 directory, served/ sticky and world-writable.  Another user plants a
    FIFO under root's counter name, a forged file under a third user's name, names of no
    dataset, not UTF-8 or not canonical: root's job neither hangs nor writes through them;
    the victim's jobs (two processes, two DatasetFiles each) add up in one file; a counter held
    locked by the attacker delays nothing and loses only that flush; metrics shows only the
    victim's real counts, in UTF-8; gc removes the planted names, and the counter with its
    dataset."""
    dest = open_tmpfs("1M") / "store"  # the tmpfs is 1777, like /dev/shm
    data = {f"c/{i}.bin": os.urandom(200_000) for i in range(6)}
    for rel, b in data.items():
        (open_tmp_path / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (open_tmp_path / "src" / rel).write_bytes(b)
    open_tmp_path.joinpath("src").chmod(0o755)
    ds = resident.stage(open_tmp_path / "src", name="ds", dest=dest, reserve="100K")
    assert 0 < ds.resident < 1
    where = Path(served.served_dir(Store(dest).book))
    assert oct(where.stat().st_mode & 0o7777) == "0o1777"
    r = subprocess.run([*as_user(ATTACKER), sys.executable, "-c", PLANT, str(where)],
                       capture_output=True, text=True, timeout=30)  # fmt: skip
    assert r.returncode == 0, r.stderr
    total, ram = ds.total_bytes, ds.bytes

    assert read_all(dest / "ds", None) == total  # root's job: the FIFO is skipped, not opened
    assert (where / "ds@0").is_fifo()
    assert read_all(dest / "ds", VICTIM, 2) == 2 * total
    assert read_all(dest / "ds", VICTIM, 2) == 2 * total
    mine = where / f"ds@{VICTIM}"
    assert mine.stat().st_uid == VICTIM
    with subprocess.Popen(
        [*as_user(ATTACKER), sys.executable, "-c", HOLD, str(mine)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as holder:  # fmt: skip
        try:
            assert holder.stdout.readline() == "held\n"
            assert read_all(dest / "ds", VICTIM) == total  # done, its counts given up
        finally:
            holder.stdin.close()
            holder.wait(timeout=30)

    rows = list(served.files(Store(dest).book, {"ds"}))
    assert [(x.name, x.uid) for x in rows] == [("ds", VICTIM)]
    assert (rows[0].ram, rows[0].source) == (4 * ram, 4 * (total - ram))
    text = metrics.render(metrics.collect(dest))
    text.encode("utf-8")
    got = sorted(line for line in text.splitlines() if line.startswith("shmstage_served_"))
    assert got == [
        f'shmstage_served_bytes_total{{tier="{dest}",dataset="ds",from="ram"}} {4 * ram}',
        f'shmstage_served_bytes_total{{tier="{dest}",dataset="ds",from="source"}} '
        f"{4 * (total - ram)}",
    ]
    r = subprocess.run([*shmstage_bin, "metrics", "--no-service", "--dest", str(dest)],
                       capture_output=True, timeout=60)  # fmt: skip
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    r.stdout.decode("utf-8")

    gone = {os.path.basename(x.path) for x in engine.gc(dest).removed}
    assert {"ds@0", "ds@2303", "ghost@2302", "ds@02302"} <= gone
    assert sorted(os.listdir(where)) == [f"ds@{VICTIM}"]
    assert engine.evict("ds", dest=dest) == ["ds"]
    engine.gc(dest)
    assert os.listdir(where) == []


@pytest.mark.root
def test_served_is_world_writable_only_on_the_parents_file_system(tmpfs):
    """A store on a tmpfs of its own under a 1777 directory gets a 0755 served/ (no user may
    fill the store's RAM through it), and one made 1777 before is taken back to 0755; a store
    that is a plain directory of the 1777 file system gets a 1777 one."""
    shm = tmpfs("2M", name="shm", mode="1777")
    own = tmpfs("2M", name="shm/own", mode="0755")
    plain = shm / "plain"
    plain.mkdir()
    for dest in (own, plain):
        Store(dest).open()
    mode = {d: oct(Path(served.served_dir(Store(d).book)).stat().st_mode & 0o7777)
            for d in (own, plain)}  # fmt: skip
    assert mode == {own: "0o755", plain: "0o1777"}
    os.chmod(served.served_dir(Store(own).book), 0o1777)  # made by an older shmstage
    Store(own).open()
    assert oct(Path(served.served_dir(Store(own).book)).stat().st_mode & 0o7777) == "0o755"
