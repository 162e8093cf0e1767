"""A job for tests/test_overlap.py: reads every file of a dataset through the live-view protocol
(docs/staging.md "Views"), written here from the contract alone, not from shmstage's reader.

    overlap_job.py DEST NAME OUT.json [--first REL] [--go FILE] [--seed N]

Reads each file once, in a shuffled order (``--first`` first; after ``--go`` exists), and
writes {rel: sha256}, how each was read (root, final, source) and the landed order it saw.
Exit 3: the stager refused a file; 4: a source file differs from the listing; 5: no view.
"""

import hashlib
import json
import os
import random
import socket
import struct
import sys
import time


def view_of(dest, name):
    path = os.path.join(dest, ".shmstage", "views", name)
    try:
        with open(os.path.join(path, "view.json")) as f:
            view = json.load(f)
        with open(os.path.join(path, "files"), "rb") as f:
            raw = f.read().decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        return None, None, path
    files = []
    for line in raw.split("\n"):
        if line:
            rel, size, mtime, res = line.split("\t")
            rel = rel.replace("%09", "\t").replace("%0A", "\n").replace("%25", "%")
            files.append((rel, int(size), int(mtime), res == "1"))
    return view, files, path


def read(path):
    with open(path, "rb") as f:
        return f.read()


def read_root(path, size, mtime):
    """A landed file under root; None when root is no longer this copy (after the publish's
    exchange it may hold the old version: its size or mtime then differ from the listing)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size != size or st.st_mtime_ns != mtime:
                return None
            return f.read()
    except FileNotFoundError:  # published meanwhile
        return None


def main():
    dest, name, out = sys.argv[1:4]
    opts = dict(zip(sys.argv[4::2], sys.argv[5::2]))
    view, files, vpath = view_of(dest, name)
    if view is None:
        print("no view", file=sys.stderr)
        return 5
    if "--go" in opts:
        while not os.path.exists(opts["--go"]):
            time.sleep(0.01)
    landed = set(i for i, f in enumerate(files) if f[3])
    order = []  # landed indices in the order seen
    offset = 0
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(view["socket"])
    except OSError:
        sock = None
    names = list(range(len(files)))
    random.Random(int(opts.get("--seed", 1))).shuffle(names)
    if "--first" in opts:
        first = [i for i, f in enumerate(files) if f[0] == opts["--first"]][0]
        names.remove(first)
        names.insert(0, first)
    how = {"root": 0, "final": 0, "source": 0, "demanded": 0}
    sums = {}
    position = before = None
    for i in names:
        rel, size, mtime, _ = files[i]
        try:
            with open(os.path.join(vpath, "landed"), "rb") as f:
                f.seek(offset)
                raw = f.read()
            whole = len(raw) - len(raw) % 4
            new = [x for (x,) in struct.iter_unpack("<I", raw[:whole])]
            offset += whole
            order += new
            landed.update(new)
        except FileNotFoundError:
            pass
        data = None
        if i not in landed and sock is not None:
            how["demanded"] += 1
            if before is None:
                before = len(order)  # landed when the first demand went out
            answer = b""
            try:
                sock.sendall(struct.pack("<I", i))
                while len(answer) < 8:
                    chunk = sock.recv(8 - len(answer))
                    if not chunk:
                        break
                    answer += chunk
            except OSError:  # EPIPE, ECONNRESET: the stager is gone (or published and left)
                pass
            if len(answer) < 8:
                sock = None  # the stager is gone
            else:
                index, status = struct.unpack("<Ii", answer)
                assert index == i
                if status < 0:
                    print(f"refused {rel}: {status}", file=sys.stderr)
                    return 3
                if status == 0:
                    landed.add(i)
                    if position is None:  # where the first demanded file landed
                        with open(os.path.join(vpath, "landed"), "rb") as f:
                            raw = f.read()
                        seen = [x for (x,) in struct.iter_unpack("<I", raw[: len(raw) // 4 * 4])]
                        position = seen.index(i)
                else:
                    data = read(os.path.join(view["final"], rel))
                    how["final"] += 1
        if data is None and i in landed:
            data = read_root(os.path.join(view["root"], rel), size, mtime)
            if data is not None:
                how["root"] += 1
            else:
                data = read(os.path.join(view["final"], rel))
                how["final"] += 1
        if data is None:
            if not os.path.exists(os.path.join(vpath, "view.json")) and os.path.isdir(
                view["final"]
            ):
                data = read(os.path.join(view["final"], rel))
                how["final"] += 1
            else:
                path = os.path.join(view["source"], rel)
                st = os.stat(path)
                data = read(path)
                if st.st_size != size or st.st_mtime_ns != mtime or len(data) != size:
                    print(f"source file changed: {rel}", file=sys.stderr)
                    return 4
                how["source"] += 1
        sums[rel] = hashlib.sha256(data).hexdigest()
    with open(out, "w") as f:
        json.dump(
            {"sums": sums, "how": how, "position": position, "before": before, "total": len(files)},
            f,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
