"""The view format (views.py): written, read back, landed read incrementally, dead views."""

from __future__ import annotations

import os
import subprocess
import sys

from shmstage.stage.store import Store
from shmstage.stage.store.views import (
    LIVE,
    PARTIAL,
    LandedLog,
    decode_rel,
    encode_rel,
    read_view,
    remove_dead_view,
    view_names,
    write_view,
)

ODD = ["a%b", "tab\there", "new\nline", "plain/x.jpg", "%09", "caf\u00e9", "bad\udcff"]


def test_rel_encoding_round_trips_tab_newline_and_percent():
    for rel in ODD:
        field = encode_rel(rel)
        assert "\t" not in field and "\n" not in field
        assert decode_rel(field) == rel
    assert encode_rel("%09") == "%2509"


def _view(tmp_path, kind=LIVE):
    store = Store(tmp_path / "dest").open()
    files = [(rel, i * 10, 1_000_000_000 + i, i % 2 == 0) for i, rel in enumerate(ODD)]
    top = store.dest
    return (
        store,
        files,
        write_view(
            store,
            "ds",
            kind=kind,
            source="/src/ds",
            root="/r",
            socket="/s.sock",
            files=files,
            top=top,
        ),
    )


def test_write_then_read_round_trips_every_field(tmp_path):
    store, files, view = _view(tmp_path)
    again = read_view(store.dest, "ds")
    assert again == view
    assert (view.kind, view.source, view.root, view.socket) == (LIVE, "/src/ds", "/r", "/s.sock")
    assert view.final == os.path.join(store.dest, "ds")
    assert view.pid == os.getpid() and view.pid_start is not None and view.alive()
    listed = view.files()
    want = sorted(files)
    assert list(listed.names) == [f[0] for f in want]
    assert list(listed.sizes) == [f[1] for f in want]
    assert list(listed.mtimes) == [f[2] for f in want]
    assert list(listed.resident) == [f[3] for f in want]
    with open(os.path.join(view.path, "files"), "rb") as f:
        raw = f.read()
    assert raw.count(b"\n") == len(files)  # one line each, whatever the names hold


def test_landed_is_read_incrementally_and_a_torn_record_waits(tmp_path):
    store, _files, view = _view(tmp_path)
    log = LandedLog(view)
    log.append([3, 1])
    got, off = view.landed_since(0)
    assert (got, off) == ([3, 1], 8)
    with open(os.path.join(view.path, "landed"), "ab") as f:
        f.write(b"\x05\x00")  # half a record: not yet an index
    assert view.landed_since(off) == ([], off)
    with open(os.path.join(view.path, "landed"), "ab") as f:
        f.write(b"\x00\x00")
    assert view.landed_since(off) == ([5], 12)
    log.close()


def test_a_partial_view_has_no_stager_and_is_never_dead(tmp_path):
    store, _files, view = _view(tmp_path, PARTIAL)
    assert view.pid_start is None and view.alive()
    assert not os.path.exists(os.path.join(view.path, "landed"))
    assert not remove_dead_view(store, "ds")


def test_a_dead_stagers_view_is_detected_and_removed(tmp_path):
    store = Store(tmp_path / "dest").open()
    code = (
        "import sys; from shmstage.stage.store import Store; "
        "from shmstage.stage.store.views import write_view, LIVE; "
        f"write_view(Store({str(store.dest)!r}), 'ds', kind=LIVE, source='/s', root='/r', "
        f"socket=None, files=[('a', 1, 2, False)], top={str(store.dest)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    view = read_view(store.dest, "ds")
    assert view is not None and not view.alive()
    assert view_names(store) == ["ds"]
    assert remove_dead_view(store, "ds")
    assert read_view(store.dest, "ds") is None and view_names(store) == []


def test_rewriting_a_view_replaces_it_whole(tmp_path):
    store, _files, _view1 = _view(tmp_path)
    write_view(
        store, "ds", kind=LIVE, source="/s2", root="/r", socket=None, files=[], top=store.dest
    )
    view = read_view(store.dest, "ds")
    assert view.source == "/s2" and len(view.files()) == 0 and view.landed_since() == ([], 0)
    assert sorted(os.listdir(store.views_dir)) == ["ds"]


def test_gc_removes_a_dead_stagers_view_and_socket_but_not_a_live_one(tmp_path):
    from shmstage.stage.store.gc import gc

    store = Store(tmp_path / "dest").open()
    code = (
        "import socket; from shmstage.stage.store import Store; "
        "from shmstage.stage.store.views import write_view, LIVE; "
        f"s = Store({str(store.dest)!r}); "
        "p = s.views_dir + '/.' + __import__('shmstage.stage.store.locks').stage.store.locks.me() + '.sock'; "
        "import os; os.makedirs(s.views_dir, exist_ok=True); socket.socket(socket.AF_UNIX).bind(p); "
        "write_view(s, 'ds', kind=LIVE, source='/s', root='/r', socket=p, files=[], top=s.dest)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    dead = read_view(store.dest, "ds")
    assert os.path.exists(dead.socket)
    write_view(
        store, "mine", kind=LIVE, source="/s", root="/r", socket=None, files=[], top=store.dest
    )
    report = gc(store.dest)
    assert {x.what for x in report.removed} >= {"live view"}
    assert read_view(store.dest, "ds") is None and not os.path.exists(dead.socket)
    assert read_view(store.dest, "mine") is not None  # its stager (this process) lives
