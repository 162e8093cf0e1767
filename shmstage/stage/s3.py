"""s3:// sources through obstore (the optional ``shmstage[s3]`` extra), see docs/s3.md.

One LIST, then GETs without a HEAD: whole objects up to ``PART`` bytes, bigger ones as
ranged GETs of ``PART`` written in place with ``pwrite``; ``WORKERS`` requests in flight
from a thread pool calling obstore's sync API (its async streams aborted the interpreter at
exit in some runs; the sync calls release the GIL).  Every GET carries ``If-Match`` and the
response's ETag is compared too (some servers ignore If-Match).  Credentials and the
endpoint come from the AWS_* environment or a ~/.aws profile, never from the command line.
gs:// (gcs.py) and az:// (azure.py) subclass ``S3Source``: the same LIST and fetch.
"""

from __future__ import annotations

import configparser
import hashlib
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from shmstage.errors import (
    AccessDenied,
    EmptySource,
    EndpointUnreachable,
    NoCredentials,
    NoSuchBucket,
    RefusedError,
    ShmstageError,
    SourceChanged,
    SourceError,
    SourceLost,
    UnknownAccessKey,
)
from shmstage.stage.sources import Listing, Source, Tick, Want

PART = 32 << 20  # objects above this are fetched as ranged GETs of this size
STREAM_CHUNK = 1 << 20  # a ranged part is written as it arrives, in chunks of about this
WORKERS = 32  # requests in flight (measured: 32-64 saturate a local server; docs/s3.md)
FILE_MODE, DIR_MODE = 0o644, 0o755
_NAME_MAX = 255
_CODE = re.compile(r"<Code>([^<]+)</Code>")
_CONNECT = ("error sending request", "connection refused", "tcp connect", "dns error",
            "connection reset", "connection closed", "broken pipe", "timed out",
            "operation timed out", "incomplete message", "unexpected eof")  # fmt: skip


@dataclass(frozen=True)
class S3Url:
    """An object-store prefix (gcs.py and azure.py use it with their schemes)."""

    bucket: str
    prefix: str  # "" or ending in "/"
    scheme: str = "s3"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix.rstrip('/')}".rstrip("/")

    def of(self, key: str) -> str:
        """The URL of one object (in messages)."""
        return f"{self.scheme}://{self.bucket}/{key}"


def parse(
    raw: str,
    scheme: str = "s3",
    pattern: str = r"[a-z0-9][a-z0-9.\-_]{1,254}",
    noun: str = "bucket",
) -> S3Url:
    """``s3://bucket[/prefix]``; the prefix is a "directory": ``train`` lists ``train/...``."""
    rest = raw.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    if not bucket or not re.fullmatch(pattern, bucket):
        raise RefusedError(f"invalid {noun} name in {raw}: write {scheme}://{noun.upper()}/PREFIX")
    prefix = prefix.strip("/")
    return S3Url(bucket, prefix + "/" if prefix else "", scheme)


def _import(kind: str = "s3", extra: str = "s3") -> Any:
    try:
        import obstore
    except ImportError:
        raise RefusedError(
            f"{kind}:// sources need the {extra} extra: pip install 'shmstage[{extra}]'"
        ) from None
    return obstore


# Every store's requests: bounded retries (docs/s3.md "How it reads"), short connect timeout.
RETRY = {"max_retries": 4, "retry_timeout": timedelta(seconds=30),
         "backoff": {"init_backoff": timedelta(milliseconds=100),
                     "max_backoff": timedelta(seconds=4), "base": 2}}  # fmt: skip


def client_options(endpoint: str | None) -> dict[str, Any]:
    return {"allow_http": bool(endpoint and endpoint.startswith("http://")),
            "connect_timeout": timedelta(seconds=5), "timeout": timedelta(seconds=120),
            "pool_max_idle_per_host": "64"}  # fmt: skip


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _profile_config() -> dict[str, str]:
    """Static keys and region of the ~/.aws profile (AWS_PROFILE, else default) when the
    environment has no keys: obstore reads only the environment and instance metadata."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return {}
    name = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    home = os.path.expanduser("~")
    out: dict[str, str] = {}
    creds = configparser.ConfigParser(interpolation=None)
    creds.read(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or f"{home}/.aws/credentials")
    if creds.has_section(name):
        sec = creds[name]
        for ours, theirs in (("access_key_id", "aws_access_key_id"),
                             ("secret_access_key", "aws_secret_access_key"),
                             ("session_token", "aws_session_token")):  # fmt: skip
            if sec.get(theirs):
                out[ours] = sec[theirs]
    conf = configparser.ConfigParser(interpolation=None)
    conf.read(os.environ.get("AWS_CONFIG_FILE") or f"{home}/.aws/config")
    section = name if name == "default" else f"profile {name}"
    no_region = not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"))
    if no_region and conf.has_section(section) and conf[section].get("region"):
        out["region"] = conf[section]["region"]
    return out


def _has_credentials(config: dict[str, str]) -> bool:
    env = os.environ
    return bool(
        config.get("access_key_id")
        or env.get("AWS_ACCESS_KEY_ID")
        or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
        or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        or env.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true"  # instance metadata
    )


class S3Source(Source):
    """A prefix of a bucket as a listed source (see stage/sources.py).

    The LIST and fetch machinery of every object store: gcs.py and azure.py subclass it and
    override only the hooks (``parse``, ``endpoint_name``, ``open_store``, ``coded_error``
    and the two hints)."""

    kind = "s3"
    extra = "s3"  # the pip extra that brings obstore
    parse = staticmethod(parse)
    credentials_hint = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    endpoint_hint = "AWS_ENDPOINT_URL"

    def __init__(self, location: str) -> None:
        self.obs = _import(self.kind, self.extra)
        self.where = self.parse(location)
        self.location = self.where.url
        self.endpoint = self.endpoint_name()
        self.started = False  # a response came back: later connection errors are "lost"
        self.checksum = False  # fetch: compare single-part objects' bytes with their MD5 ETag
        try:
            self.store = self.open_store()
        except ShmstageError:
            raise
        except Exception as e:  # obstore refused the configuration (e.g. a malformed key)
            raise self.error(e) from None

    # --- the store (hooks) ---------------------------------------------------------

    def endpoint_name(self) -> str:
        """Where requests go, as messages name it (no credentials in it)."""
        return _endpoint() or "AWS"

    def open_store(self) -> Any:
        """The obstore store, configured from the environment only."""
        from obstore.store import S3Store

        config = _profile_config()
        if not _has_credentials(config):
            raise NoCredentials(
                f"no credentials for {self.location}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where instance metadata answers"
            )
        endpoint = _endpoint()
        if not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
            config.setdefault("region", "us-east-1")
        return S3Store(
            self.where.bucket,
            config=config,
            client_options=client_options(endpoint),
            retry_config=RETRY,
        )

    def coded_error(self, msg: str, code: str, name: str, obj: str) -> ShmstageError | None:
        """The store's own error codes (S3's ``<Code>``); None: the common mapping applies."""
        what = f"{self.location} ({self.endpoint})"
        if code == "NoSuchBucket":
            return NoSuchBucket(
                f"no bucket {self.where.bucket!r} at {self.endpoint}: check the URL, "
                "AWS_ENDPOINT_URL and AWS_REGION"
            )
        if code == "InvalidAccessKeyId":
            return UnknownAccessKey(
                f"{self.endpoint} does not know the access key in AWS_ACCESS_KEY_ID "
                f"(or the profile) reading {what}: check the credentials"
            )
        if code in ("SignatureDoesNotMatch", "AccessDenied", "AllAccessDisabled",
                    "InvalidToken", "ExpiredToken", "TokenRefreshRequired") or name in (
            "PermissionDeniedError", "UnauthenticatedError"):  # fmt: skip
            why = (
                "the secret key does not match"
                if code == "SignatureDoesNotMatch"
                else "access denied"
            )
            return AccessDenied(
                f"cannot read {obj}: {why} ({code or name}); check the credentials and the bucket policy"
            )
        return None

    # --- errors ------------------------------------------------------------------

    def error(self, e: BaseException, key: str | None = None) -> ShmstageError:
        """One line for an obstore failure (the store's code is in the message, see docs/s3.md)."""
        msg = str(e)
        code = m.group(1) if (m := _CODE.search(msg)) else ""
        low = msg.lower()
        obj = self.where.of(key) if key else self.location
        name = type(e).__name__
        coded = self.coded_error(msg, code, name, obj)
        if coded is not None:
            return coded
        if code == "PreconditionFailed" or name == "PreconditionError":
            return SourceChanged(
                f"{obj} changed while it was being staged; re-run when it is stable"
            )
        if name in ("NotFoundError", "FileNotFoundError") or code == "NoSuchKey":
            return SourceChanged(
                f"{obj} was deleted while it was being staged; re-run when the prefix is stable"
            )
        if name == "InvalidPathError" or "parsing path" in low or "empty path segment" in low:
            bad = m.group(1) if (m := re.search(r'Path "([^"]*)"', msg)) else "a key"
            return RefusedError(
                f"cannot stage {self.location}: key {bad!r} is not a safe file path (an empty, . or .. "
                "segment); rename it or stage a prefix without it"
            )
        if "credential" in low or "169.254.169.254" in low or "metadata" in low:
            return NoCredentials(f"no credentials for {self.location}: {self.credentials_hint}")
        if any(s in low for s in _CONNECT):
            if self.started:
                return SourceLost(
                    f"lost the connection to {self.endpoint} while staging {self.location} "
                    "(after retries); nothing was published: re-run when it answers"
                )
            return EndpointUnreachable(
                f"cannot reach {self.endpoint} for {self.location}: check {self.endpoint_hint} "
                "and the network"
            )
        status = re.search(r"status code: (\d{3}) ([A-Za-z ]+)", msg)
        if status:
            tries = (
                m.group(0) if (m := re.search(r"after \d+ retries", msg)) else "without retrying"
            )
            return SourceError(
                f"{self.endpoint} answered {status.group(1)} {status.group(2).strip()}"
                f"{f' ({code})' if code else ''} for {obj}, {tries}; nothing was published: re-run later"
            )
        first = msg.splitlines()[0] if msg else name
        first = re.sub(r"<\?xml.*|<Error>.*", "", first)[:300]
        return SourceError(f"cannot read {obj}: {first}")

    # --- listing -----------------------------------------------------------------

    def listing(self) -> Listing:
        """One LIST of the prefix: the tree's entries and each object's change key."""
        prefix = self.where.prefix
        files: dict[str, tuple[int, int, list[Any]]] = {}
        try:
            for chunk in self.obs.list(self.store, prefix or None, chunk_size=1000):
                self.started = True
                for meta in chunk:
                    rel = meta["path"][len(prefix) :]
                    if rel.endswith("/") or not rel:
                        continue  # a console "folder" marker: the directory exists anyway
                    etag = (meta.get("e_tag") or "").strip('"')
                    key = [etag, meta["size"], meta.get("version")]
                    files[rel] = (meta["size"], _ns(meta["last_modified"]), key)
        except ShmstageError:
            raise
        except Exception as e:  # obstore's errors: mapped by kind and S3 code
            raise self.error(e) from None
        if not files:
            raise EmptySource(
                f"no objects under {self.location}/: check the prefix (an object store lists an "
                "empty or missing prefix without an error)"
            )
        return _tree(self.location, files)

    # --- fetch -------------------------------------------------------------------

    def fetch(
        self,
        wants: Sequence[Want],
        root: str,
        tick: Tick,
        workers: int | None,
        checksum: bool,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """GET every wanted object into ``root`` (see the module docstring); tick() runs
        in this thread only.  ``meanwhile`` runs once the first requests are out."""
        nworkers = workers or WORKERS
        self.checksum = checksum
        pending: dict[Future[tuple[int, int]], None] = {}
        parts: dict[str, int] = {}  # path -> ranged parts still to land
        failed: BaseException | None = None

        def tasks() -> Any:
            for w in wants:
                if w.size <= PART:
                    yield (self._whole, w)
                    continue
                path = os.path.join(root, w.path)
                fd = os.open(
                    path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                )
                try:
                    os.ftruncate(fd, w.size)
                finally:
                    os.close(fd)
                parts[w.path] = -(-w.size // PART)
                for start in range(0, w.size, PART):
                    yield (self._range, w, path, start, min(w.size, start + PART))

        with ThreadPoolExecutor(nworkers, thread_name_prefix="shmstage-s3") as pool:
            try:
                for task in tasks():
                    if meanwhile is not None and len(pending) == nworkers:
                        meanwhile()  # the pool is busy: the manifest is written meanwhile
                        meanwhile = None
                    while len(pending) >= 2 * nworkers:
                        self._reap(pending, tick, wait_for=FIRST_COMPLETED)
                    pending[pool.submit(task[0], root, *task[1:])] = None
                if meanwhile is not None:
                    meanwhile()
                while pending:
                    self._reap(pending, tick, wait_for=FIRST_COMPLETED)
            except BaseException as e:
                failed = e
                for f in pending:
                    f.cancel()
                wait(pending)
        if failed is not None:
            raise failed
        for w in wants:
            if w.size > PART:
                path = os.path.join(root, w.path)
                if checksum:
                    _check_md5(path, w)
                _finish(path, w)

    def _reap(self, pending: dict, tick: Tick, wait_for: str) -> None:
        done, _ = wait(pending, return_when=wait_for)
        for f in done:
            del pending[f]
            b, n = f.result()  # raises the worker's error here, in the caller's thread
            tick(b, n)

    def _get(self, key: str, w: Want, rng: tuple[int, int] | None, collect: bool = True) -> Any:
        opts: dict[str, Any] = {"if_match": f'"{w.key[0]}"'} if w.key[0] else {}
        if rng is not None:
            opts["range"] = rng
        if w.key[2]:
            opts["version"] = w.key[2]
        try:
            res = self.obs.get(self.store, key, options=opts)
            data = res.bytes() if collect else None
        except Exception as e:
            raise self.error(e, key) from None
        self.started = True
        etag = (res.meta.get("e_tag") or "").strip('"')
        if w.key[0] and etag and etag != w.key[0]:  # a server that ignores If-Match
            raise SourceChanged(
                f"{self.where.of(key)} changed while it was being staged; re-run when it is stable"
            )
        return res, data

    def _whole(self, root: str, w: Want) -> tuple[int, int]:
        key = self.where.prefix + w.path
        data = self._get(key, w, None)[1] if w.size else b""  # nothing to fetch for 0 bytes
        if len(data) != w.size:
            raise SourceChanged(
                f"{self.where.of(key)} changed size while it was being staged; re-run"
            )
        path = os.path.join(root, w.path)
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        if self.checksum and _is_md5(w.key[0]) and hashlib.md5(data).hexdigest() != w.key[0]:
            raise SourceChanged(f"{self.where.of(key)}: bytes do not match its ETag (MD5)")
        _finish(path, w)
        return w.size, 1

    def _range(self, root: str, w: Want, path: str, start: int, end: int) -> tuple[int, int]:
        key = self.where.prefix + w.path
        res, _ = self._get(key, w, (start, end), collect=False)
        got = tuple(res.range)
        if got != (start, end):
            raise SourceError(
                f"{self.where.of(key)}: asked for bytes {start}-{end}, got {got[0]}-{got[1]}"
            )
        # Streamed in small chunks: malloc reuses them, where a fresh 32 MiB buffer per part
        # costs its page faults (measured: a third more system time than s5cmd).
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        off = start
        try:
            for chunk in res.stream(min_chunk_size=STREAM_CHUNK):
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(fd, view, off)
                    view, off = view[n:], off + n
        except OSError:
            raise
        except Exception as e:  # the body broke off mid-part
            raise self.error(e, key) from None
        finally:
            os.close(fd)
        if off != end:
            raise SourceError(f"{self.where.of(key)}: bytes {start}-{end} ended at {off}")
        return end - start, 1 if end == w.size else 0


def _finish(path: str, w: Want) -> None:
    """The last byte is in: the mode and mtime that make the file count as copied."""
    os.chmod(path, w.mode)
    os.utime(path, ns=(w.mtime_ns, w.mtime_ns))


def _is_md5(etag: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-f]{32}", etag))


def _check_md5(path: str, w: Want) -> None:
    if not _is_md5(w.key[0]):
        return  # multipart (md5-of-parts-N) or encrypted: no whole-object digest to compare
    h = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    if h.hexdigest() != w.key[0]:
        raise SourceChanged(f"{w.path}: bytes do not match its ETag (MD5); re-run")


def compare(manifest: dict[str, Any], root: str) -> list[str]:
    """Files of a staged copy whose bytes differ from their object's MD5 ETag (``verify
    --checksum``); multipart objects' ETags are no whole-file digest and are skipped."""
    bad = []
    for rel, key in manifest.get("objects", {}).items():
        want = Want(rel, 0, 0, 0, key)
        try:
            _check_md5(os.path.join(root, rel), want)
        except SourceChanged:
            bad.append(rel)
        except OSError:
            continue  # missing: verify reports it already
    return bad


def _ns(dt: Any) -> int:
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


def _tree(location: str, files: dict[str, tuple[int, int, list[Any]]]) -> Listing:
    """The tree the objects stage to: directories from the keys' ``/``, refusing keys that
    cannot be file paths and a key that is also a "directory" of other keys."""
    dirs: set[str] = set()
    for rel in files:
        parts = rel.split("/")
        for p in parts:
            if p in ("", ".", "..") or len(p.encode()) > _NAME_MAX or "\0" in p:
                raise RefusedError(
                    f"cannot stage {location}: key {rel!r} is not a safe file path "
                    "(an empty, . or .. segment, or a name over 255 bytes); rename it or stage "
                    "a prefix without it"
                )
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
    for d in dirs & files.keys():
        if files[d][0] == 0:  # a console "folder/" marker (obstore drops the "/"): the directory
            del files[d]
    both = sorted(dirs & files.keys())
    if both:
        raise RefusedError(
            f"cannot stage {location}: {both[0]!r} is both an object and a prefix of other "
            "objects (a file cannot also be a directory); rename one of them"
        )
    entries: list[tuple] = [(".", "d", 0, 0, DIR_MODE, None)]
    entries += [(d, "d", 0, 0, DIR_MODE, None) for d in sorted(dirs)]
    keys: dict[str, list[Any]] = {}
    total = 0
    for rel in sorted(files):
        size, mtime, key = files[rel]
        entries.append((rel, "f", size, mtime, FILE_MODE, None))
        keys[rel] = key
        total += size
    return Listing(location, entries, keys, total, len(files))
