"""s3:// sources through obstore (the optional ``shmstage[s3]`` extra), see docs/s3.md.

One LIST, then GETs without a HEAD: objects up to ``SMALL`` bytes collected and written at
once, bigger ones streamed into the file, those above ``PART`` as ranged GETs of ``PART``
written in place with ``pwrite`` (a whole GET instead when the server ignores Range).
``WORKERS`` threads call obstore's sync API (its async streams aborted the interpreter at
exit in some runs; the sync calls release the GIL).  Every GET carries ``If-Match`` and the
response's ETag is compared too (some servers ignore If-Match).  Credentials and the
endpoint come from the AWS_* environment or a ~/.aws profile, never from the command line.
gs:// (gcs.py) and az:// (azure.py) subclass ``S3Source``: the same LIST and fetch.
The store and its errors are s3store.py's, the LIST s3list.py's; this module fetches.

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

import hashlib
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from shmstage.errors import (
    SourceChanged,
    SourceError,
)
from shmstage.stage.sources.base import Tick, Want
from shmstage.stage.sources.s3list import WORKERS, S3Prefix
from shmstage.stage.sources.signedget import SignedGets

PART = 64 << 20  # objects above this are fetched as ranged GETs of this size
SMALL = 256 << 10  # objects up to this are collected in memory, then written at once
STREAM_CHUNK = 256 << 10  # bigger ones are written as they arrive, in chunks of about this
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_PARTIAL = "non-partial response"  # object_store's error for a 200 to a ranged GET
_SIGNED_FOR = timedelta(hours=1)  # a signed URL is used at once; this only bounds a stall
_PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")


class S3Source(S3Prefix):
    """A prefix of a bucket as a listed source (see stage/sources/base.py), fetched.

    The LIST and fetch machinery of every object store: gcs.py and azure.py subclass it and
    override only the hooks of s3store.S3Bucket."""

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
            _finish(fd, w, self.copy_ids)
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
            _finish(fd, w, self.copy_ids)
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
        _finish(big.path, w, self.copy_ids)
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


def _finish(file: str | int, w: Want, ids: tuple[int, int] | None) -> None:
    """The last byte is in: the owner (``ids``: a reader's copy), mode and mtime that make
    the file count as copied."""
    if ids is not None:
        os.chown(file, *ids)
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
