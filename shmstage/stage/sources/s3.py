"""s3:// sources through obstore (the optional ``shmstage[s3]`` extra), see docs/s3.md.

One LIST, then GETs without a HEAD: objects up to ``SMALL`` bytes collected and written at
once, bigger ones streamed into the file, those above ``PART`` as ranged GETs of ``PART``
written in place with ``pwrite`` (a whole GET instead when the server ignores Range).
``WORKERS`` threads call obstore's sync API (its async streams aborted the interpreter at
exit in some runs; the sync calls release the GIL).  Every GET carries ``If-Match`` and the
response's ETag is compared too (some servers ignore If-Match).  Credentials and the
endpoint come from the AWS_* environment or a ~/.aws profile, never from the command line.
gs:// (gcs.py) and az:// (azure.py) subclass ``S3Source``: the same LIST and fetch.

NOTE [fetch lifecycle]

    caller's thread (fetch)                 worker i (thread)
    -----------------------                 -----------------
    start WORKERS workers  ---------------> loop until stop is set or no task is left:
                                              next(tasks) under a lock (made lazily)
                                              run it: GET, write, finish the file
    results.get(), drain the rest  <------- (bytes, files) per task
      -> one tick() for all of them
      an exception -> stop             <--- the task's exception, as a value
                                       <--- None: this worker has ended
    all ended, or failed (ours, SIGTERM, Ctrl-C): set stop, join every worker (each ends
    its request in flight), re-raise; the caller removes the partial tree
"""

from __future__ import annotations

import configparser
import hashlib
import os
import queue
import re
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from shmstage.stage.sources.base import Listing, Source, Tick, Want
from shmstage.stage.sources.signedget import SignedGets

PART = 64 << 20  # objects above this are fetched as ranged GETs of this size
SMALL = 256 << 10  # objects up to this are collected in memory, then written at once
STREAM_CHUNK = 256 << 10  # bigger ones are written as they arrive, in chunks of about this
WORKERS = 32  # requests in flight (measured: 32-64 saturate a local server; docs/s3.md)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_PARTIAL = "non-partial response"  # object_store's error for a 200 to a ranged GET
_SIGNED_FOR = timedelta(hours=1)  # a signed URL is used at once; this only bounds a stall
_PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")
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
    """A prefix of a bucket as a listed source (see stage/sources/base.py).

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
        self.ignores_range = False  # a ranged GET came back whole: no more ranged GETs
        self.signed: SignedGets | None = None  # fetch: big bodies over signed URLs (S3 only)
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
        seen: dict[str, list[tuple[int, int, list[Any]]]] = {}
        try:
            for chunk in self.obs.list(self.store, prefix or None, chunk_size=1000):
                self.started = True
                for meta in chunk:
                    rel = meta["path"][len(prefix) :]
                    if not rel and meta["size"]:  # `p/` (at a bucket's root `/`) with data
                        raise RefusedError(
                            f"cannot stage {self.location}: key {prefix or '/'!r} holds data but "
                            "is not a file path (a key that ends with '/'; obstore cannot read "
                            "it); rename it"
                        )
                    if not rel:
                        continue  # the prefix's own "folder" marker: the tree's root
                    etag = (meta.get("e_tag") or "").strip('"')
                    key = [etag, meta["size"], meta.get("version")]
                    seen.setdefault(rel, []).append((meta["size"], _ns(meta["last_modified"]), key))
            if not seen:
                raise EmptySource(
                    f"no objects under {self.location}/: check the prefix (an object store lists "
                    "an empty or missing prefix without an error)"
                )
            files, markers = self._one_per_path(seen)
        except ShmstageError:
            raise
        except Exception as e:  # obstore's errors: mapped by kind and S3 code
            raise self.error(e) from None
        return _tree(self.location, files, markers)

    # NOTE [keys obstore strips]: obstore drops a key's leading and trailing "/" (in LIST
    # and GET alike), so `a`, `a/` (a console "folder" marker) and, at the bucket's root,
    # `/a` are all listed as `a`, and only `a` can be read.  Where the listing is ambiguous
    # (one path listed twice, a zero-byte object that may be a marker, an object that is
    # also a directory of others) one delimited LIST of that directory tells: an object
    # listed there is exactly the key `a`; `a/...` keys show as the common prefix `a`.

    def _one_per_path(
        self, seen: dict[str, list[tuple[int, int, list[Any]]]]
    ) -> tuple[dict[str, tuple[int, int, list[Any]]], set[str]]:
        """One object per path, and the directories that only folder markers make; refuses
        two keys that stage to one path and a non-empty key that ends in "/"."""
        dirs: set[str] = set()
        for rel in seen:
            i = rel.rfind("/")
            while i > 0 and rel[:i] not in dirs:  # its parents are in already
                dirs.add(rel[:i])
                i = rel.rfind("/", 0, i)
        # A delimited LIST only where a refusal is certain and only its message is in doubt
        # (one path listed twice, a non-empty object that is also a directory): rare.  An
        # empty object is the commonest doubt (Spark's _SUCCESS, empty labels, markers): a
        # HEAD tells the key `a` from a marker `a/` whatever the directory holds (a LIST of
        # it costs a page per 1,000 entries, in sequence), see exact().
        doubtful: dict[str, list[str]] = {}
        empty: list[str] = []
        for rel, got in seen.items():
            if len(got) > 1 or (got[0][0] and rel in dirs):
                doubtful.setdefault(rel.rpartition("/")[0], []).append(rel)
            elif got[0][0] == 0:
                empty.append(rel)
        files = {rel: got[0] for rel, got in seen.items()}
        for d in sorted(doubtful):
            plain, under = self.level(d)
            for rel in sorted(doubtful[d]):
                got = seen[rel]
                real = rel in plain  # the key is exactly prefix + rel
                if len(got) > 1:
                    names = self._spellings(rel, real, len(got), under, rel in dirs)
                    raise RefusedError(
                        f"cannot stage {self.location}: keys {' and '.join(names)} "
                        f"both stage to the path {rel!r} (obstore drops a key's leading and "
                        "trailing '/'); rename or delete one of them"
                    )
                if not real:
                    raise self.slashed(rel, under)
                # else a plain object that is also a directory: _tree refuses it by name
        markers: set[str] = set()
        exact = self.exact(empty, [*seen, *dirs])
        leading: bool | None = None  # at the bucket's root: does any key begin with "/"?
        for rel in sorted(set(empty) - exact):
            del files[rel]
            if not self.where.prefix:  # `rel/`, or `/rel` or `/rel/`, which obstore lists alike
                if leading is None:
                    leading = "" in self.level("")[1]
                if leading and not self.marker(rel):
                    raise RefusedError(
                        f"cannot stage {self.location}: key {'/' + rel!r} (or {'/' + rel + '/'!r}) "
                        "begins with '/' (obstore drops it, so the key is not a file path); "
                        "rename it"
                    )
            markers.add(rel)  # an empty `rel/` "folder" marker: only the directory
        return files, markers

    def exact(self, rels: Sequence[str], listed: Collection[str]) -> set[str]:
        """Which of ``rels`` (the empty objects of the ``listed`` paths and directories) are
        exactly the key prefix + rel; the others are `rel/` markers (or, at a bucket's root,
        keys that begin with "/").  Per directory, whichever takes fewer requests: a HEAD of
        each, or one delimited LIST of the directory (a page per 1,000 entries in it: for a
        directory of many empty objects, e.g. empty labels); WORKERS requests at once."""
        if not rels:
            return set()
        entries: dict[str, int] = {}  # directory -> what a delimited LIST of it lists
        for rel in listed:
            d = rel.rpartition("/")[0]
            entries[d] = entries.get(d, 0) + 1
        by_dir: dict[str, list[str]] = {}
        for rel in rels:
            by_dir.setdefault(rel.rpartition("/")[0], []).append(rel)
        # (d, its empty objects): a LIST of d; (None, [rel]): a HEAD of rel
        tasks: list[tuple[str | None, list[str]]] = []
        for d, mine in by_dir.items():
            if len(mine) > -(-entries.get(d, 0) // 1000):
                tasks.append((d, mine))
            else:
                tasks += [(None, [rel]) for rel in mine]

        def run(task: tuple[str | None, list[str]]) -> set[str]:
            d, mine = task
            if d is not None:
                return self.level(d)[0] & set(mine)
            key = self.where.prefix + mine[0]
            try:
                self.obs.head(self.store, key)
            except Exception as e:
                if type(e).__name__ in ("NotFoundError", "FileNotFoundError"):
                    return set()
                raise self.error(e, key) from None
            return set(mine)

        pool = ThreadPoolExecutor(min(WORKERS, len(tasks)), thread_name_prefix="shmstage-empty")
        try:
            return set().union(*pool.map(run, tasks))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def marker(self, rel: str) -> bool:
        """The key prefix + rel + "/" exists (a delimited LIST of that directory lists it as
        the object ``rel``)."""
        path = self.where.prefix + rel
        res = self.obs.list_with_delimiter(self.store, path)
        return any(o["path"] == path for o in res["objects"])

    def level(self, d: str) -> tuple[set[str], set[str]]:
        """One delimited LIST of the directory ``d`` (relative to the prefix): the paths of
        the objects exactly in it, and the paths that some longer key continues with "/"
        ("" at the bucket's root: keys that begin with "/")."""
        base = self.where.prefix + (d + "/" if d else "")
        res = self.obs.list_with_delimiter(self.store, base or None)
        cut = len(self.where.prefix)
        plain = {
            o["path"][cut:] for o in res["objects"]
            if o["path"].startswith(base) and len(o["path"]) > len(base)
        }  # fmt: skip
        return plain, {p[cut:] for p in res["common_prefixes"]}

    def _spellings(
        self, rel: str, real: bool, count: int, under: set[str], children: bool
    ) -> list[str]:
        """The ``count`` keys that stage to ``rel``, quoted, naming no key that may not exist:
        at a bucket's root `/a` and `/a/` list alike (and `a/` is sure only when nothing is
        listed under ``rel``), so a key in doubt is named as "one of" its spellings."""
        key = self.where.prefix + rel
        if self.where.prefix:  # only `a` and `a/` stage to rel: both are there
            return [repr(key), repr(key + "/")]
        sure = [key] if real else []
        maybe = [f"/{key}", f"/{key}/"]
        if rel in under and not children:  # a key `a/...`, none listed: the marker `a/`
            sure.append(key + "/")
        elif rel in under:  # `a/b` is listed: `a/` itself may or may not be there
            maybe.insert(0, key + "/")
        left = count - len(sure)
        names = [repr(k) for k in sure]
        if left <= 0:
            return names
        if left >= len(maybe):
            return names + [repr(k) for k in maybe]
        which = "one" if left == 1 else str(left)
        return [*names, f"{which} of {', '.join(map(repr, maybe))}"]

    def missing(self, rel: str) -> RefusedError | None:
        """Why a listed object's GET found nothing: a key obstore cannot read (``/a``, or a
        non-empty ``a/``; see NOTE [keys obstore strips]), else None (it was deleted)."""
        try:
            plain, under = self.level(rel.rpartition("/")[0])
            if rel in plain:
                return None  # the key is there (again): the usual message
            if rel in under:  # `rel/...` with nothing under rel listed: the key `rel/`
                return self.slashed(rel, under)
            if self.where.prefix or "" not in self.level("")[1]:
                return None  # no key begins with "/": it was deleted
            # Some key begins with "/" (a delimited LIST cannot list them apart): `/rel` is
            # listed again as rel, a deleted key is not.  The whole bucket (`/d/a` is not under
            # `d/`), as the stage's own LIST was: this is a failure's path only.
            again = self.obs.list(self.store, None, chunk_size=1000)
            if not any(m["path"] == rel for chunk in again for m in chunk):
                return None
        except Exception:
            return None  # the usual message, then
        return self.slashed(rel, set())

    def slashed(self, rel: str, under: set[str]) -> RefusedError:
        """A non-empty object listed as ``rel`` that is not the key ``rel``."""
        key = self.where.prefix + rel
        name = f"{key}/" if rel in under or self.where.prefix else f"/{key}"
        return RefusedError(
            f"cannot stage {self.location}: key {name!r} holds data but is not a file path "
            "(a key that begins or ends with '/'; obstore cannot read it); rename it"
        )

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
        """GET every wanted object into ``root`` (see NOTE [fetch lifecycle]); tick() runs
        in this thread only.  ``meanwhile`` runs once the workers are busy."""
        self.checksum = checksum
        self.signed = _signed_gets(self.store)
        signed = self.signed
        tasks = self._tasks(wants, root)
        take = threading.Lock()  # the task generator is not thread-safe
        results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        stop = threading.Event()

        def work() -> None:
            try:
                while not stop.is_set():
                    with take:
                        task = next(tasks, None)
                    if task is None:
                        break
                    results.put(task[0](*task[1:]))
            except BaseException as e:  # sent to the caller's thread as a value
                stop.set()
                results.put(e)
            finally:
                if signed is not None:
                    signed.close()
                results.put(None)

        threads = [
            threading.Thread(target=work, name=f"shmstage-s3-{i}", daemon=True)
            for i in range(max(1, min(workers or WORKERS, _requests(wants))))
        ]
        failed: BaseException | None = None
        try:
            for t in threads:
                t.start()
            if meanwhile is not None:
                meanwhile()  # the workers are busy: the manifest is written meanwhile
            live = len(threads)
            while live and failed is None:
                got = results.get()
                landed = files = 0
                while True:  # what else already arrived: one tick for all of it
                    if got is None:
                        live -= 1
                    elif isinstance(got, BaseException):
                        failed = failed or got
                    else:
                        landed, files = landed + got[0], files + got[1]
                    try:
                        got = results.get_nowait()
                    except queue.Empty:
                        break
                if landed or files:
                    tick(landed, files)
        except BaseException as e:  # Ctrl-C, SIGTERM (the engine's Interrupted), tick()
            failed = failed or e
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join()
        if failed is not None:
            raise failed

    def _tasks(self, wants: Sequence[Want], root: str) -> Iterator[tuple]:
        """What the workers run, made as they ask for it (so that once the server is known
        to ignore Range, later big objects get one whole GET instead of parts)."""
        for w in wants:
            path = os.path.join(root, w.path)
            if w.size <= SMALL:
                yield (self._small, w, path)
            elif w.size <= PART or self.ignores_range:
                yield (self._whole, w, path)
            else:
                fd = os.open(path, _CREATE, 0o600)
                try:
                    os.ftruncate(fd, w.size)  # sized up front: parts land in any order
                finally:
                    os.close(fd)
                big = _Big(w, path, -(-w.size // PART))
                for start in range(0, w.size, PART):
                    if big.whole:
                        break  # fetched whole already: the server ignored Range
                    yield (self._part, big, start, min(w.size, start + PART))

    def _get(self, key: str, w: Want, rng: tuple[int, int] | None) -> Any:
        """The GET (If-Match, version, range), its ETag checked; the body still to read."""
        opts: dict[str, Any] = {"if_match": f'"{w.key[0]}"'} if w.key[0] else {}
        if rng is not None:
            opts["range"] = rng
        if w.key[2]:
            opts["version"] = w.key[2]
        try:
            res = self.obs.get(self.store, key, options=opts)
        except Exception as e:
            if rng is not None and _NOT_PARTIAL in str(e):
                raise _IgnoresRange from None
            err = self.error(e, key)
            if type(e).__name__ in ("NotFoundError", "FileNotFoundError"):
                err = self.missing(w.path) or err
            raise err from None
        self.started = True
        etag = (res.meta.get("e_tag") or "").strip('"')
        if w.key[0] and etag and etag != w.key[0]:  # a server that ignores If-Match
            raise SourceChanged(
                f"{self.where.of(key)} changed while it was being staged; re-run when it is stable"
            )
        return res

    def _small(self, w: Want, path: str) -> tuple[int, int]:
        """One GET collected in memory (at most SMALL bytes), one write."""
        key = self.where.prefix + w.path
        data: Any = b""
        if w.size:  # nothing to fetch for 0 bytes
            res = self._get(key, w, None)
            try:
                data = res.bytes()
            except Exception as e:  # the body broke off
                raise self.error(e, key) from None
        if len(data) != w.size:
            raise SourceChanged(
                f"{self.where.of(key)} changed size while it was being staged; re-run"
            )
        if self.checksum and _is_md5(w.key[0]) and hashlib.md5(data).hexdigest() != w.key[0]:
            raise SourceChanged(f"{self.where.of(key)}: bytes do not match its ETag (MD5)")
        fd = os.open(path, _CREATE, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            _finish(fd, w)
        finally:
            os.close(fd)
        return w.size, 1

    def _whole(self, w: Want, path: str) -> tuple[int, int]:
        """One GET streamed into a new file (above SMALL bytes, or any size when the server
        ignores Range)."""
        fd = os.open(path, _CREATE, 0o600)
        try:
            self._stream(fd, w, None)
            if self.checksum:
                _check_md5(path, w)
            _finish(fd, w)
        finally:
            os.close(fd)
        return w.size, 1

    def _part(self, big: _Big, start: int, end: int) -> tuple[int, int]:
        """A ranged GET of up to ``PART`` bytes written in place.  A server that ignores
        Range (or is known to) turns it into one whole-object GET for this object."""
        if not big.begin():
            return 0, 0  # another worker fetches this object whole
        w, whole, ok = big.want, False, False
        fd = os.open(big.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            try:
                if self.ignores_range:
                    raise _IgnoresRange
                self._stream(fd, w, (start, end))
            except _IgnoresRange:
                self.ignores_range = True  # for the rest of this run: whole GETs only
                whole = big.go_whole()
                if whole:
                    self._stream(fd, w, None)
            ok = True
        finally:
            os.close(fd)
            landed, last = big.end(end - start if ok else None, whole)
        if not last:
            return landed, 0
        # Every byte is in and no task writes to the file any more: it counts as copied.
        if self.checksum:
            _check_md5(big.path, w)
        _finish(big.path, w)
        return landed, 1

    def _stream(self, fd: int, w: Want, rng: tuple[int, int] | None) -> None:
        """GET ``rng`` (None: the whole object) and ``pwrite`` it into ``fd`` as it arrives:
        over a signed URL (stage/signedget.py) while that works, else through obstore."""
        key = self.where.prefix + w.path
        start, end = rng or (0, w.size)
        signed = self.signed
        if signed is not None and not w.key[2]:  # a version id is not in the signed URL
            try:
                url = self.obs.sign(self.store, "GET", key, _SIGNED_FOR)
            except Exception:
                url = None
            if url and signed.get_into(url, fd, start, end, w.size, w.key[0], rng is not None):
                self.started = True
                return
            # Not as expected: obstore from here on, for the rest of the run; it retries,
            # or says what is wrong.
            self.signed = None
        res = self._get(key, w, rng)
        got = tuple(res.range)
        if rng is None and got[1] != w.size:
            raise SourceChanged(
                f"{self.where.of(key)} changed size while it was being staged; re-run"
            )
        if got != (start, end):
            raise SourceError(
                f"{self.where.of(key)}: asked for bytes {start}-{end}, got {got[0]}-{got[1]}"
            )
        # Small chunks: malloc reuses them, where big buffers cost their page faults (and
        # obstore zero-fills each chunk before copying into it); see docs/s3.md.
        off = start
        try:
            for chunk in res.stream(min_chunk_size=STREAM_CHUNK):
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(fd, view, off)
                    view, off = view[n:], off + n
        except OSError:
            raise
        except Exception as e:  # the body broke off mid-way
            raise self.error(e, key) from None
        if off != end:
            raise SourceError(f"{self.where.of(key)}: bytes {start}-{end} ended at {off}")


class _IgnoresRange(Exception):
    """A ranged GET came back whole (200, not 206): object_store refuses it unread."""


class _Big:
    """An object fetched as ranged parts by several workers.

    Landed parts count their bytes.  If the server ignores Range, the first worker to see it
    fetches the object whole, parts not yet started do nothing, and the whole fetch counts
    what the parts had not.  Whichever task ends last finishes the file (mode, mtime), so
    that no write follows the mtime."""

    def __init__(self, want: Want, path: str, parts: int) -> None:
        self.want, self.path, self.parts = want, path, parts  # parts: still to land
        self.lock = threading.Lock()
        self.busy = 0  # tasks writing into the file now
        self.landed = 0  # bytes of landed parts (frozen once it goes whole)
        self.whole = False  # the server ignored Range: one whole GET instead of the parts
        self.complete = False  # every byte is in (the parts, or the whole GET)
        self.finished = False  # the last task has it: mode and mtime

    def begin(self) -> bool:
        with self.lock:
            if self.whole:
                return False
            self.busy += 1
            return True

    def go_whole(self) -> bool:
        """True for the one task that is to fetch the object whole."""
        with self.lock:
            mine, self.whole = not self.whole, True
            return mine

    def end(self, nbytes: int | None, whole: bool) -> tuple[int, bool]:
        """A task ends (``nbytes`` None: it failed): the bytes it adds to the progress and
        whether it is the one to finish the file."""
        with self.lock:
            self.busy -= 1
            landed = 0
            if nbytes is not None and whole:
                landed, self.complete = self.want.size - self.landed, True
            elif nbytes is not None and not self.whole:
                landed, self.parts = nbytes, self.parts - 1
                self.landed += nbytes
                self.complete = self.parts == 0
            last = self.complete and self.busy == 0 and not self.finished
            self.finished = self.finished or last
            return landed, last


def _finish(file: str | int, w: Want) -> None:
    """The last byte is in: the mode and mtime that make the file count as copied."""
    os.chmod(file, w.mode)
    os.utime(file, ns=(w.mtime_ns, w.mtime_ns))


def _signed_gets(store: Any) -> SignedGets | None:
    """The signed-URL path for big bodies, where it can go the way obstore would: an S3
    store, and no proxy in the environment (reqwest would use it; http.client would not)."""
    if type(store).__name__ != "S3Store":
        return None
    if any(os.environ.get(v) or os.environ.get(v.lower()) for v in _PROXY_VARS):
        return None
    return SignedGets()


def _requests(wants: Sequence[Want]) -> int:
    """How many GETs ``wants`` takes at most (no more threads than that are started)."""
    return sum(-(-w.size // PART) if w.size > PART else 1 for w in wants)


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


def _tree(
    location: str, files: dict[str, tuple[int, int, list[Any]]], markers: Collection[str] = ()
) -> Listing:
    """The tree the objects stage to: directories from the keys' ``/`` and the folder
    ``markers``, refusing keys that cannot be file paths and a key that is also a
    "directory" of other keys."""
    dirs: set[str] = set()
    for rel in [*files, *markers]:
        parts = rel.split("/")
        for p in parts:
            if p in ("", ".", "..") or len(p.encode()) > _NAME_MAX or "\0" in p:
                raise RefusedError(
                    f"cannot stage {location}: key {rel!r} is not a safe file path "
                    "(an empty, . or .. segment, or a name over 255 bytes); rename it or stage "
                    "a prefix without it"
                )
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + (rel in markers)))
    both = sorted(dirs & files.keys())
    if both:
        under = min(r for r in [*files, *markers] if r.startswith(both[0] + "/"))
        raise RefusedError(
            f"cannot stage {location}: {both[0]!r} is both an object and a prefix of other "
            f"objects ({under!r}; a file cannot also be a directory); rename one of them"
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
