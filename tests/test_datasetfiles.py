"""DatasetFiles, the job's side of a copy: a plain copy, a partial one (the rest from the
source, checked), a live one (demands to a stager; a dead stager: the source, checked),
DataLoader workers, another user, and the served-bytes counters."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shmstage import viewfollow
from shmstage.datasetfiles import DatasetFiles
from shmstage.errors import ShmstageError
from shmstage.stage import engine
from shmstage.stage.store import Store, served


def make_tree(root: Path, classes: int = 3, per: int = 4) -> dict[str, bytes]:
    out = {}
    for c in range(classes):
        for i in range(per):
            rel = f"class{c}/img{i:02d}.bin"
            data = os.urandom(1000 + 37 * i + c)
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
            out[rel] = data
    (root / "README").write_bytes(b"top-level file\n")
    out["README"] = b"top-level file\n"
    return out


def write_view(dest: Path, name: str, src: Path, kind: str, root: Path, resident, **meta) -> Path:
    """A view as issue 23's format 1 says (what the stager writes), for the job to read."""
    d = Store(dest).book
    vdir = Path(d) / "views" / name
    vdir.mkdir(parents=True)
    lines = []
    for rel in sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()):
        st = os.stat(src / rel)
        lines.append(f"{rel}\t{st.st_size}\t{st.st_mtime_ns}\t{1 if rel in resident else 0}\n")
    (vdir / "files").write_text("".join(lines))
    head = {"format": 1, "kind": kind, "name": name, "source": str(src), "root": str(root)}
    head |= {"final": str(dest / name), "socket": None, "pid": 0, "pid_start": None, **meta}
    if kind == "partial":  # it names the tree it describes (a view over another is none)
        head["tree"] = os.lstat(dest / name).st_ino
    (vdir / "view.json").write_text(json.dumps(head))
    return vdir


def test_plain_copy_lists_every_file_and_reads_it_from_ram(tmp_path):
    """A published copy: names complete and sorted, bytes equal, all counted as RAM, and the
    counters written to served/ for `metrics`."""
    data = make_tree(tmp_path / "src")
    ds = engine.stage(tmp_path / "src", dest=tmp_path / "dest", reserve=0)
    files = DatasetFiles(ds.path)
    assert files.names == tuple(sorted(data)) and files.kind == "copy"
    assert all(files.read(n) == data[n] for n in files.names)
    assert files.size("README") == len(data["README"])
    assert files.served == (sum(map(len, data.values())), 0)
    files.flush()
    assert served.totals(Store(tmp_path / "dest").book) == {"src": files.served}
    with pytest.raises(ShmstageError, match="'nope' is not a file of"):
        files.open("nope")


def test_a_plain_directory_is_read_as_is(tmp_path):
    data = make_tree(tmp_path / "plain")
    files = DatasetFiles(tmp_path / "plain")
    assert (
        files.names == tuple(sorted(data))
        and files.read("class1/img02.bin") == data["class1/img02.bin"]
    )
    with pytest.raises(ShmstageError, match="is not a directory"):
        DatasetFiles(tmp_path / "missing")


def partial_copy(
    tmp_path: Path, dest: Path | None = None
) -> tuple[Path, dict[str, bytes], set[str]]:
    """A partial copy made by hand: class0 in RAM, the view listing every file."""
    src = tmp_path / "src"
    dest = dest or tmp_path / "dest"
    data = make_tree(src)
    resident = {n for n in data if n.startswith("class0/")}
    final = dest / "ds"
    for rel in resident:
        (final / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, final / rel)
    Store(dest).open()
    write_view(dest, "ds", src, "partial", final, resident)
    return src, data, resident


def test_partial_reads_the_rest_from_the_source_and_counts_both(tmp_path):
    src, data, resident = partial_copy(tmp_path)
    files = DatasetFiles(tmp_path / "dest" / "ds")
    assert files.kind == "partial" and files.names == tuple(sorted(data))
    # Read from RAM? Marked bytes, same size and mtime as listed: RAM's are served.
    ram0 = tmp_path / "dest" / "ds" / "class0" / "img00.bin"
    st = ram0.stat()
    ram0.write_bytes(b"R" * st.st_size)
    os.utime(ram0, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert files.read("class0/img00.bin") == b"R" * st.st_size
    assert all(files.read(n) == data[n] for n in files.names if n != "class0/img00.bin")
    ram = sum(len(data[n]) for n in resident)
    assert files.served == (ram, sum(len(data[n]) for n in data if n not in resident))
    # Another version in RAM (size or mtime not as listed): never served, the source is.
    ram0.write_bytes(b"RAM")
    assert files.read("class0/img00.bin") == data["class0/img00.bin"]


def test_a_source_file_changed_since_the_listing_is_one_clear_error(tmp_path):
    src, data, _ = partial_copy(tmp_path)
    files = DatasetFiles(tmp_path / "dest" / "ds")
    (src / "class1" / "img00.bin").write_bytes(b"x" * len(data["class1/img00.bin"]))
    os.utime(src / "class1" / "img00.bin", ns=(1, 1))
    with pytest.raises(ShmstageError) as e:
        files.read("class1/img00.bin")
    assert "class1/img00.bin changed at its source" in str(e.value) and "\n" not in str(e.value)
    os.unlink(src / "class2" / "img00.bin")
    with pytest.raises(ShmstageError, match="class2/img00.bin was removed at its source"):
        files.read("class2/img00.bin")


def test_a_subdirectory_or_a_symlink_of_a_partial_copy_lists_every_file_below_it(tmp_path):
    """{staged}/train, or a link to {staged}: the copy's view is found by walking up from the
    resolved path, and its names are scoped to the subdirectory: never only what is in RAM."""
    from shmstage.loader import FolderDataset

    src, data, _ = partial_copy(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "dest" / "ds")
    via_link = DatasetFiles(tmp_path / "link")
    assert via_link.kind == "partial" and via_link.names == tuple(sorted(data))
    assert len(FolderDataset(tmp_path / "link")) == len(data) - 1  # README is no sample
    for sub in ("class0", "class1"):  # in RAM; not in RAM at all (no such directory there)
        files = DatasetFiles(tmp_path / "link" / sub)
        below = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith(sub + "/")}
        assert files.kind == "partial" and files.names == tuple(sorted(below))
        assert all(files.read(n) == below[n] for n in files.names)
    with pytest.raises(ShmstageError, match="no file below nope"):
        DatasetFiles(tmp_path / "dest" / "ds" / "nope")


def source_file(tmp_path: Path, size: int) -> tuple[DatasetFiles, Path, bytes]:
    """A partial copy with one big file not in RAM (class1/big.bin)."""
    src, _, resident = partial_copy(tmp_path)
    big = os.urandom(size)
    (src / "class1" / "big.bin").write_bytes(big)
    shutil.rmtree(Path(Store(tmp_path / "dest").book) / "views" / "ds")
    write_view(tmp_path / "dest", "ds", src, "partial", tmp_path / "dest" / "ds", resident)
    return DatasetFiles(tmp_path / "dest" / "ds"), src / "class1" / "big.bin", big


def test_a_file_not_in_ram_is_streamed_not_read_whole_when_opened(tmp_path):
    files, _, big = source_file(tmp_path, 8 << 20)
    with files.open("class1/big.bin") as f:
        assert f.read(4096) == big[:4096]
        assert files.served[1] <= 1 << 20  # one buffer read, not the whole 8 MiB
        assert f.read() == big[4096:]
    assert files.served[1] == len(big) and files.read("class1/big.bin") == big


def test_a_file_rewritten_in_place_with_its_mtime_put_back_while_read_is_an_error(tmp_path):
    """`cp -p` onto the file while the job reads it: same size and mtime, new bytes (ctime
    tells): one clear error, never the old start followed by the new end."""
    files, path, big = source_file(tmp_path, 4 << 20)
    st = os.stat(path)
    with files.open("class1/big.bin") as f:
        assert f.read(4096) == big[:4096]
        with open(path, "r+b") as w:
            w.write(os.urandom(len(big)))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        with pytest.raises(ShmstageError) as e:
            f.read()
    assert "class1/big.bin changed while it was read" in str(e.value) and "\n" not in str(e.value)


def test_instances_are_collected_with_their_counter_fds(tmp_path):
    """A job that builds its DatasetFiles again and again (each epoch, each shard) keeps no
    fd (counter file, socket) per instance: the at-exit flush holds no instance."""
    import gc

    data = make_tree(tmp_path / "src")
    ds = engine.stage(tmp_path / "src", dest=tmp_path / "dest", reserve=0)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    DatasetFiles(ds.path).read("README")
    gc.collect()
    before = fds()
    for _ in range(1000):
        assert DatasetFiles(ds.path).read("README") == data["README"]
    gc.collect()
    assert fds() <= before + 2
    assert served.totals(Store(tmp_path / "dest").book)["src"][0] >= len(data["README"])


def test_make_loader_warns_about_a_walking_dataset_on_a_partial_copy(tmp_path):
    import warnings

    from shmstage.errors import ShmstageWarning
    from shmstage.loader import FolderDataset, make_loader

    partial_copy(tmp_path)

    class Walking:  # ImageFolder-like: it lists and opens DEST/NAME itself
        root = str(tmp_path / "dest" / "ds" / "class0")

        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> int:
            return i

    with pytest.warns(ShmstageWarning, match="holds only part of .*DatasetFiles"):
        make_loader(Walking(), lease=False, num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShmstageWarning)
        make_loader(FolderDataset(tmp_path / "dest" / "ds"), lease=False, num_workers=0)


def test_symlinks_are_not_followed_and_that_is_said(tmp_path):
    """Names are regular files only, as the stager lists a copy (whole, partial or live all
    give the same names); the symlinks skipped, which ImageFolder would follow, are warned of."""
    from shmstage.errors import ShmstageWarning

    data = make_tree(tmp_path / "src")
    (tmp_path / "src" / "class9").symlink_to("class0")
    (tmp_path / "src" / "class1" / "link.bin").symlink_to("img00.bin")
    with pytest.warns(ShmstageWarning, match="2 symlink.s. not followed"):
        files = DatasetFiles(tmp_path / "src")
    assert files.names == tuple(sorted(data))


def dead_pid() -> tuple[int, int]:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid, 1


def test_a_dead_stagers_view_is_read_from_the_source_checked(tmp_path):
    """A live view whose stager is gone: what landed from RAM, the rest from the source;
    a file changed at the source is refused, never mixed."""
    src = tmp_path / "src"
    data = make_tree(src)
    root = tmp_path / "dest" / ".shmstage" / "partial" / "ds"
    (root / "class0").mkdir(parents=True)
    shutil.copy2(src / "class0/img00.bin", root / "class0/img00.bin")
    pid, start = dead_pid()
    Store(tmp_path / "dest").open()
    write_view(tmp_path / "dest", "ds", src, "live", root, {"class0/img00.bin"}, pid=pid,
               pid_start=start, socket=str(tmp_path / "gone.sock"))  # fmt: skip
    files = DatasetFiles(tmp_path / "dest" / "ds")
    assert files.kind == "live"
    assert all(files.read(n) == data[n] for n in files.names)
    assert files.served == (len(data["class0/img00.bin"]), sum(map(len, data.values())) - 1000)
    (src / "class2" / "img01.bin").write_bytes(b"changed")
    with pytest.raises(ShmstageError, match="class2/img01.bin changed at its source"):
        DatasetFiles(tmp_path / "dest" / "ds").read("class2/img01.bin")


class FakeStager:
    """The stager's side of the demand protocol: lands a demanded file in root (copy, then
    the landed log), answers, and publishes (rename root -> final, remove the view) on
    ``publish()``."""

    def __init__(self, tmp_path: Path, src: Path, sock: str = "demand.sock") -> None:
        self.src, self.dest = src, tmp_path / "dest"
        self.root = self.dest / ".shmstage" / "partial" / "ds"
        self.root.mkdir(parents=True)
        self.sock_path = str(tmp_path / sock)
        stat = Path(f"/proc/{os.getpid()}/stat").read_text().rpartition(")")[2].split()
        Store(self.dest).open()
        self.view = write_view(self.dest, "ds", src, "live", self.root, set(), pid=os.getpid(),
                               pid_start=int(stat[19]), socket=self.sock_path)  # fmt: skip
        self.names = (self.view / "files").read_text().splitlines()
        self.asked: list[int] = []
        self.refuse: set[int] = set()
        self.hold = threading.Event()  # cleared: requests are taken, answers held back
        self.hold.set()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.sock_path)
        self.server.listen(8)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def die(self) -> None:
        """As a killed stager: no more connections, the open ones cut."""
        self.server.close()
        os.unlink(self.sock_path)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # a job that went away (or was collected)
            while (req := conn.recv(4)) and len(req) == 4:
                (i,) = struct.unpack("<I", req)
                self.asked.append(i)
                self.hold.wait()
                if i in self.refuse:
                    conn.sendall(struct.pack("<Ii", i, -116))  # ESTALE: the source changed
                    continue
                rel = self.names[i].split("\t")[0]
                (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.src / rel, self.root / rel)
                with open(self.view / "landed", "ab") as f:
                    f.write(struct.pack("<I", i))
                conn.sendall(struct.pack("<Ii", i, 0))

    def publish(self) -> None:
        for line in self.names:
            rel = line.split("\t")[0]
            if not (self.root / rel).exists():
                (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.src / rel, self.root / rel)
        os.rename(self.root, self.dest / "ds")
        shutil.rmtree(self.view)
        self.server.close()


def test_a_live_copy_demands_each_missing_file_once_then_reads_ram(tmp_path):
    """Names at once; each file not yet landed is asked for once (threads sharing one
    connection), its bytes read from RAM; after publish the reads go to <final>."""
    data = make_tree(tmp_path / "src")
    stager = FakeStager(tmp_path, tmp_path / "src")
    files = DatasetFiles(tmp_path / "dest" / "ds")
    assert files.names == tuple(sorted(data)) and files.kind == "live"
    got: dict[str, bytes] = {}
    threads = [
        threading.Thread(target=lambda ns: got.update({n: files.read(n) for n in ns}),
                         args=(files.names[k::4],))
        for k in range(4)
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == data
    assert sorted(stager.asked) == list(range(len(data)))  # each once, never twice
    assert files.served == (sum(map(len, data.values())), 0)
    stager.publish()
    assert files.read("README") == data["README"]  # from <final>, no demand
    assert len(stager.asked) == len(data)


def test_want_sends_its_requests_at_once_each_once_and_waits_for_none(tmp_path):
    """``want`` pipelines the requests (it returns while the stager answers none), asks for
    each file once per process however often it is named, and the reads that follow find
    the files landed without asking again."""
    data = make_tree(tmp_path / "src")
    stager = FakeStager(tmp_path, tmp_path / "src")
    files = DatasetFiles(tmp_path / "dest" / "ds")
    stager.hold.clear()
    names = list(files.names[:8])
    files.want(names + names[:3])  # returns: it waits for no answer
    files.want(names[2:5])
    _until(lambda: len(stager.asked) >= 1)
    stager.hold.set()
    _until(lambda: len(stager.asked) == 8)
    assert {n: files.read(n) for n in names} == {n: data[n] for n in names}
    files.want(names)  # landed: nothing to ask
    assert sorted(stager.asked) == list(range(8))
    files.read(files.names[8])  # a file not hinted is demanded as before
    assert sorted(stager.asked) == list(range(9))


def test_want_is_a_no_op_on_a_copy_in_ram_and_on_a_dead_stager(tmp_path):
    data = make_tree(tmp_path / "src")
    plain = DatasetFiles(tmp_path / "src")
    plain.want(plain.names)
    assert plain.read("README") == data["README"]
    with pytest.raises(ShmstageError, match="is not a file of"):
        plain.want(["nope"])
    pid, start = dead_pid()
    root = tmp_path / "dest" / ".shmstage" / "partial" / "ds"
    root.mkdir(parents=True)
    write_view(tmp_path / "dest", "ds", tmp_path / "src", "live", root, set(), pid=pid,
               pid_start=start, socket=str(tmp_path / "gone.sock"))  # fmt: skip
    dead = DatasetFiles(tmp_path / "dest" / "ds")
    dead.want(dead.names)  # no stager to ask: nothing happens, reads go to the source
    assert dead.read("README") == data["README"]


def test_a_landed_file_swapped_for_its_old_version_by_a_publish_is_never_read(tmp_path):
    """A restage's publish exchanges the old copy into root for an instant: a file there that
    is not the listed one (size, mtime) is put back, the view read again, and once the view
    is gone the new copy is read from <final>."""
    data = make_tree(tmp_path / "src")
    stager = FakeStager(tmp_path, tmp_path / "src")
    files = DatasetFiles(tmp_path / "dest" / "ds")
    rel = "class1/img02.bin"
    assert files.read(rel) == data[rel]  # landed in root
    shutil.copytree(tmp_path / "src", tmp_path / "dest" / "ds")  # the new copy, published
    (stager.root / rel).write_bytes(b"the old version")  # and the old one swapped into root
    threading.Timer(0.3, lambda: shutil.rmtree(stager.view)).start()
    assert files.read(rel) == data[rel]
    assert files.read("README") == data["README"]  # from <final> now


def test_a_new_stagers_view_is_followed_with_its_own_numbering(tmp_path):
    """Stager A dies, stager B lists the source again (a file added: every index after it
    moves) and writes its own view: the job asks B for B's index of the file and reads
    the file it named, never A's numbering against B's list or landed log."""
    data = make_tree(tmp_path / "src")
    a = FakeStager(tmp_path, tmp_path / "src")
    files = DatasetFiles(tmp_path / "dest" / "ds")
    assert files.read("README") == data["README"]  # through A
    a.die()
    shutil.rmtree(a.view)
    shutil.rmtree(a.root)
    (tmp_path / "src" / "class0" / "aaa.bin").write_bytes(b"added before every other file")
    b = FakeStager(tmp_path, tmp_path / "src", sock="b.sock")
    rel = "class1/img01.bin"
    assert files.read(rel) == data[rel]
    b_names = [line.split("\t")[0] for line in b.names]
    assert b.asked == [b_names.index(rel)] and b_names.index(rel) == files.names.index(rel) + 1
    assert "class0/aaa.bin" not in files.names  # the job's own list stays as it was


def dead_view_with_landed(tmp_path: Path, landed: list[str]) -> tuple[Path, Path]:
    """A dead stager's live view whose ``landed`` log names ``landed`` (copied under root)."""
    src = tmp_path / "src"
    root = tmp_path / "dest" / ".shmstage" / "partial" / "ds"
    for rel in landed:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, root / rel)
    pid, start = dead_pid()
    Store(tmp_path / "dest").open()
    vdir = write_view(tmp_path / "dest", "ds", src, "live", root, set(), pid=pid,
                      pid_start=start, socket=str(tmp_path / "gone.sock"))  # fmt: skip
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    (vdir / "landed").write_bytes(b"".join(struct.pack("<I", names.index(r)) for r in landed))
    return src, root


def test_a_landed_file_rewritten_or_swapped_under_a_dead_stagers_root_is_never_read(tmp_path):
    """Under a dead stager's root, a file it logged as landed but that a restage is
    rewriting (full size, zeros, new mtime) or that an exchange put back in its old
    version (old mtime) is not the file listed: the source's bytes are served, not
    RAM's; an intact one still comes from RAM."""
    data = make_tree(tmp_path / "src")
    landed = ["class0/img00.bin", "class1/img01.bin", "class2/img02.bin"]
    src, root = dead_view_with_landed(tmp_path, landed)
    half = root / "class0/img00.bin"
    half.write_bytes(bytes(half.stat().st_size))  # a restage's in-place rewrite under way
    old = root / "class1/img01.bin"
    old.write_bytes(os.urandom(old.stat().st_size))  # the old version, its own mtime
    os.utime(old, ns=(10**18, 10**18))
    files = DatasetFiles(tmp_path / "dest" / "ds")
    assert all(files.read(n) == data[n] for n in landed)
    assert files.served == (len(data["class2/img02.bin"]),
                            len(data["class0/img00.bin"]) + len(data["class1/img01.bin"]))  # fmt: skip


def test_a_dead_stagers_published_copy_is_read_not_the_source(tmp_path):
    """A stager killed after its publish leaves its live view: the published copy is read
    (each file checked against the list: one that is not the listed one comes from the
    source), not the whole dataset again from the source."""
    data = make_tree(tmp_path / "src")
    src, _ = dead_view_with_landed(tmp_path, [])
    shutil.copytree(src, tmp_path / "dest" / "ds")  # published (copy2 keeps the mtimes)
    other = tmp_path / "dest" / "ds" / "README"
    other.write_bytes(b"another version")
    files = DatasetFiles(tmp_path / "dest" / "ds")
    assert all(files.read(n) == data[n] for n in files.names)
    total = sum(map(len, data.values()))
    assert files.served == (total - len(data["README"]), len(data["README"]))


def _silent_stager(tmp_path: Path, procs) -> tuple[subprocess.Popen, socket.socket]:
    """A live view whose stager runs (a real process) and takes demands but never answers."""
    src = tmp_path / "src"
    root = tmp_path / "dest" / ".shmstage" / "partial" / "ds"
    root.mkdir(parents=True)
    proc = procs.start(["sleep", "600"])
    stat_ = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp_path / "silent.sock"))
    server.listen(8)
    Store(tmp_path / "dest").open()
    write_view(tmp_path / "dest", "ds", src, "live", root, set(), pid=proc.pid,
               pid_start=int(stat_[19]), socket=str(tmp_path / "silent.sock"))  # fmt: skip
    return proc, server


def _read_in_thread(files: DatasetFiles, name: str) -> bytes | None:
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(files.read(name)), daemon=True)
    t.start()
    t.join(120)  # a hang, not a time measured: the read must end at all
    return got[0] if got else None


def test_a_stopped_stager_does_not_hang_the_job(tmp_path, procs):
    """A stager stopped with SIGSTOP (/proc state T) answers nothing but is alive: the job
    does without it and reads the source, checked."""
    data = make_tree(tmp_path / "src")
    proc, server = _silent_stager(tmp_path, procs)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        files = DatasetFiles(tmp_path / "dest" / "ds")
        assert _read_in_thread(files, "README") == data["README"]
        assert files.served == (0, len(data["README"]))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        server.close()


def test_a_stager_making_no_progress_at_all_does_not_hang_the_job(tmp_path, procs, monkeypatch):
    """A stager that runs but shows no progress at all (no answer, nothing landed, no CPU
    time) for the stall limit is done without: the source, checked."""
    monkeypatch.setattr(viewfollow, "STALL", 1.5)
    data = make_tree(tmp_path / "src")
    _proc, server = _silent_stager(tmp_path, procs)
    try:
        files = DatasetFiles(tmp_path / "dest" / "ds")
        assert _read_in_thread(files, "README") == data["README"]
        assert files.served == (0, len(data["README"]))
    finally:
        server.close()


def test_ask_ahead_hints_each_index_once_before_it_is_yielded():
    from shmstage.askahead import AskAhead

    hinted: list[list[int]] = []
    seen = []
    for x in AskAhead(range(10), hinted.append, ahead=4, step=2):
        seen.append((x, sum(map(len, hinted))))
    assert [x for x, _ in seen] == list(range(10))
    assert [i for h in hinted for i in h] == list(range(10))  # in order, each once
    assert all(n >= min(10, x + 1 + 4 - 2) for x, n in seen)  # always ahead of the reads
    assert len(AskAhead(range(10), hinted.append, ahead=4)) == 10


def test_make_loader_asks_ahead_on_a_live_copy_only(tmp_path):
    from shmstage.askahead import AskAhead
    from shmstage.loader import FolderDataset, make_loader

    data = make_tree(tmp_path / "src")
    stager = FakeStager(tmp_path, tmp_path / "src")
    ds = FolderDataset(tmp_path / "dest" / "ds")
    loader = make_loader(ds, batch_size=2, num_workers=0, lease=False, shuffle=True)
    assert isinstance(loader.sampler, AskAhead)
    batches = iter(loader)
    read = [bytes(s) for s in next(batches)[0]]
    # one batch read, the files of the next ones asked for (2 batches x 2 workers' worth)
    _until(lambda: len(stager.asked) >= 8, timeout=10)
    read += [bytes(s) for batch in batches for s in batch[0]]
    assert sorted(read) == sorted(v for k, v in data.items() if "/" in k)
    assert sorted(stager.asked) == sorted({*stager.asked})  # each file asked for once
    plain = make_loader(FolderDataset(tmp_path / "src"), batch_size=2, num_workers=0, lease=False)
    assert not isinstance(plain.sampler, AskAhead)


def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_file_the_stager_refuses_is_one_clear_error(tmp_path):
    make_tree(tmp_path / "src")
    stager = FakeStager(tmp_path, tmp_path / "src")
    files = DatasetFiles(tmp_path / "dest" / "ds")
    stager.refuse.add(files.names.index("README"))
    with pytest.raises(ShmstageError, match="README: the stager of ds cannot serve it"):
        files.read("README")


def test_pickled_for_spawn_it_opens_its_own_connection(tmp_path):
    data = make_tree(tmp_path / "src")
    FakeStager(tmp_path, tmp_path / "src")
    files = DatasetFiles(tmp_path / "dest" / "ds")
    files.read("README")
    copy = pickle.loads(pickle.dumps(files))
    assert copy._local is None and copy.read("class1/img01.bin") == data["class1/img01.bin"]


LOADER = """
import os, sys, torch
from shmstage.loader import FolderDataset, DatasetFiles
ds = FolderDataset(sys.argv[1])
ctx = sys.argv[2]
dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=ctx)
seen = {ds.samples[i][0]: s for i, (s, t) in zip(range(len(ds)), dl)}
import hashlib
print(ds.classes, len(seen), hashlib.sha256(b"".join(seen[n] for n in sorted(seen))).hexdigest())
"""


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_folder_dataset_in_dataloader_workers_counts_per_process(tmp_path, ctx):
    """FolderDataset (class per top-level directory) through DataLoader workers: every
    sample's bytes, and each worker's reads in its own served/ file, flushed at exit."""
    src, data, resident = partial_copy(tmp_path)
    r = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "dest" / "ds"), ctx],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    import hashlib

    samples = sorted(n for n in data if "/" in n)
    digest = hashlib.sha256(b"".join(data[n] for n in samples)).hexdigest()
    assert r.stdout.split() == ["['class0',", "'class1',", "'class2']", str(len(samples)), digest]
    rows = list(served.files(Store(tmp_path / "dest").book))
    assert len(rows) == 1  # one file per user, every worker adding to it
    ram = sum(len(data[n]) for n in resident)
    assert (sum(x.ram for x in rows), sum(x.source for x in rows)) == (
        ram,
        sum(len(data[n]) for n in samples) - ram,
    )


NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.mark.root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("shared", [True, False])
def test_another_user_reads_roots_partial_copy_and_counts_where_allowed(open_tmp_path, shared):
    """A job running as nobody on root's store reads every file (the rest from the source, as
    nobody).  DEST in a directory every user writes (like /dev/shm): its counters go in a file
    of its own in the sticky served/.  Elsewhere served/ is root's alone (no user can fill the
    store's file system through it): nothing is counted on disk, nothing fails."""
    parent = open_tmp_path / "shm"
    parent.mkdir()
    parent.chmod(0o1777 if shared else 0o755)
    src, data, resident = partial_copy(open_tmp_path, parent / "store")
    code = (
        "import sys; from shmstage.datasetfiles import DatasetFiles; f = DatasetFiles(sys.argv[1]);"
        "print(sum(len(f.read(n)) for n in f.names))"
    )
    r = subprocess.run(
        [*NOBODY, sys.executable, "-c", code, str(parent / "store" / "ds")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == sum(map(len, data.values()))
    where = Path(Store(parent / "store").book) / "served"
    assert oct(where.stat().st_mode & 0o7777) == ("0o1777" if shared else "0o755")
    rows = list(served.files(Store(parent / "store").book))
    if shared:
        (row,) = rows
        assert row.uid == 65534 and os.stat(row.path).st_uid == 65534
        assert (row.ram, row.source) == (
            sum(len(data[n]) for n in resident),
            sum(len(data[n]) for n in data if n not in resident),
        )
    else:
        assert rows == []


@pytest.mark.root
def test_metrics_export_the_bytes_served_and_gc_drops_them_with_the_dataset(tmpfs, tmp_path):
    """`metrics` sums every process's counters per dataset (a real `stage --partial`); once
    the dataset is evicted and its readers are gone, gc removes their counter files."""
    from shmstage import metrics
    from shmstage.stage import resident

    dest = tmpfs("1M") / "store"
    data = {f"c/{i}.bin": os.urandom(200_000) for i in range(6)}
    for rel, b in data.items():
        (tmp_path / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / rel).write_bytes(b)
    ds = resident.stage(tmp_path / "src", name="ds", dest=dest, reserve="100K")
    assert 0 < ds.resident < 1
    code = "import sys; from shmstage.datasetfiles import DatasetFiles as D; f = D(sys.argv[1]); [f.read(n) for n in f.names]"
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code, str(dest / "ds")], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
    text = metrics.render(metrics.collect(dest))
    ram = f'shmstage_served_bytes_total{{tier="{dest}",dataset="ds",from="ram"}} {2 * ds.bytes}'
    assert ram in text
    assert f'dataset="ds",from="source"}} {2 * (ds.total_bytes - ds.bytes)}' in text
    assert len(engine.gc(dest).removed) == 0 and len(list(served.files(Store(dest).book))) == 1
    assert engine.evict("ds", dest=dest) == ["ds"]
    assert not (Path(Store(dest).book) / "views" / "ds").exists()
    gone = engine.gc(dest).removed
    assert [x.what for x in gone] == ["read counters"]
    assert list(served.files(Store(dest).book)) == []


CHECK_JOB = """
import hashlib, json, random, sys, threading
from shmstage import viewfollow
from shmstage.datasetfiles import DatasetFiles
f = DatasetFiles(sys.argv[1])
kind = f.kind
order = list(f.names)
random.Random(1).shuffle(order)
sums = {}
def read(part):
    for n in part:
        sums[n] = hashlib.sha256(f.read(n)).hexdigest()
threads = [threading.Thread(target=read, args=(order[k::3],)) for k in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({"kind": kind, "sums": sums, "served": f.served}))
"""


def _sums(root: Path) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


def run_no_wait(src: Path, dest: Path, job: str) -> subprocess.CompletedProcess:
    """`shmstage run --no-wait` of ``job`` on a fresh tree at ``src``, its copy slowed."""
    make_tree(src, classes=4, per=30)
    exe = os.path.join(os.path.dirname(sys.executable), "shmstage")
    return subprocess.run(
        [exe, "run", "--no-wait", "--no-service", "--dest", str(dest), "--stage", str(src),
         "--", sys.executable, "-c", job, "{staged}"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "SHMSTAGE_TEST_SLOW_COPY": "0.5"},  # the job starts before it ends
    )  # fmt: skip


@pytest.mark.root
def test_a_job_of_run_no_wait_reads_every_byte_from_ram_while_the_copy_runs(tmpfs, tmp_path):
    """`run --no-wait` (the real stager, slowed): the job's DatasetFiles sees a live copy,
    reads each file's source bytes in a shuffled order from three threads, and never reads
    the source itself (every byte from RAM, after a demand where it had not landed)."""
    src, dest = tmp_path / "ds", tmpfs("64M")
    r = run_no_wait(src, dest, CHECK_JOB)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["kind"] == "live" and got["sums"] == _sums(src)
    assert got["served"] == [sum(p.stat().st_size for p in src.rglob("*") if p.is_file()), 0]


@pytest.mark.root
def test_a_job_of_run_partial_reads_the_rest_from_the_source(tmpfs, tmp_path):
    """`run --stage SRC --partial` on a dataset larger than the tmpfs: the job sees a partial
    copy, leased for its life, and reads every file right (the rest from the source)."""
    src = tmp_path / "ds"
    for i in range(24):
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 3}" / f"{i}.bin").write_bytes(os.urandom(200_000))
    dest = tmpfs("4M")
    exe = os.path.join(os.path.dirname(sys.executable), "shmstage")
    r = subprocess.run(
        [exe, "run", "--partial", "--reserve", "512K", "--no-service", "--dest", str(dest),
         "--stage", str(src), "--", sys.executable, "-c", CHECK_JOB, "{staged}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["kind"] == "partial" and got["sums"] == _sums(src)
    ram, source = got["served"]
    assert ram > 0 and source > 0 and ram + source == 24 * 200_000
    assert "in RAM" in r.stderr  # the summary says what part


KILL_JOB = """
import hashlib, json, os, signal, sys, time
from shmstage.loader import DatasetFiles
from shmstage.stage.store.views import read_view
f = DatasetFiles(sys.argv[1])
sums = dict((n, hashlib.sha256(f.read(n)).hexdigest()) for n in f.names[:5])
view = read_view(os.path.dirname(sys.argv[1]), os.path.basename(sys.argv[1]))
os.kill(view.pid, signal.SIGKILL)
while view.alive():
    time.sleep(0.01)
sums.update((n, hashlib.sha256(f.read(n)).hexdigest()) for n in f.names[5:])
print(json.dumps(dict(sums=sums, served=f.served)))
"""


@pytest.mark.root
def test_a_stager_killed_mid_copy_leaves_the_job_reading_the_source(tmpfs, tmp_path):
    """The stager of `run --no-wait` SIGKILLed while the job reads: the job goes on, each
    file not landed read from the source (checked), every byte right; nothing is published."""
    src, dest = tmp_path / "ds", tmpfs("64M")
    r = run_no_wait(src, dest, KILL_JOB)
    assert r.stdout, r.stderr
    got = json.loads(r.stdout)
    assert got["sums"] == _sums(src), r.stderr
    assert got["served"][1] > 0  # the rest came from the source
    assert not (dest / "ds").exists() and "Traceback" not in r.stderr
