"""Big GET bodies read straight into the file: a URL signed by obstore, fetched over a plain
keep-alive connection of the calling thread, ``readinto`` a reused buffer, ``pwrite``.

obstore hands a streamed body to Python as new ``bytes`` per chunk, each zero-filled then
copied into (pyo3's ``PyBytes::new_with``): per GiB about 0.25 s more CPU than this path
(measured in docs/benchmarks.md, where client and server share two cores, ~10% of the
wall time).  Only what a correct answer must look like is accepted; anything else (another
status, a header that does not match, a broken connection) returns False and the caller
does the GET through obstore, which retries and says what went wrong.
"""

from __future__ import annotations

import http.client
import os
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

BUFFER = 256 << 10  # per thread, reused for every body
TIMEOUT = 30  # seconds without a byte before giving the GET back to obstore
_NETWORK = (http.client.HTTPException, OSError)  # OSError: refused, reset, timeout, TLS


def expected(
    status: int,
    header: Callable[[str], str | None],
    start: int,
    end: int,
    size: int,
    etag: str,
    ranged: bool,
) -> bool:
    """The answer is exactly bytes ``start``-``end`` of this version of the object: 200 for a
    whole GET; for a ranged one 206, or 200 with the matching Content-Range (some servers)."""
    got = (header("ETag") or "").strip('"')
    if etag and got and got != etag:
        return False
    if header("Content-Length") != str(end - start):
        return False
    if not ranged:
        return status == 200
    return status in (200, 206) and header("Content-Range") == f"bytes {start}-{end - 1}/{size}"


class SignedGets:
    """Connections and a buffer per calling thread; ``close`` from each thread at its end."""

    def __init__(self) -> None:
        self.local = threading.local()

    def get_into(
        self, url: str, fd: int, start: int, end: int, size: int, etag: str, ranged: bool
    ) -> bool:
        """GET ``url`` (bytes ``start``-``end`` of an object of ``size`` bytes whose ETag is
        ``etag``; ``ranged``: with a Range header) into ``fd`` at ``start``.  True when every
        byte is in; False when the answer was not the one expected.  File errors raise."""
        u = urlsplit(url)
        headers = {"If-Match": f'"{etag}"'} if etag else {}
        if ranged:
            headers["Range"] = f"bytes={start}-{end - 1}"
        conn = self._conn(u.scheme, u.netloc)
        try:
            conn.request("GET", f"{u.path}?{u.query}", headers=headers)
            r = conn.getresponse()
        except _NETWORK:
            return self._drop(conn)
        if not expected(r.status, r.getheader, start, end, size, etag, ranged):
            return self._drop(conn)  # its body unread: the connection cannot be reused
        buf = self._buffer()
        off = start
        try:
            while off < end:
                try:
                    n = r.readinto(buf)
                except _NETWORK:
                    return self._drop(conn)
                if not n:
                    return self._drop(conn)  # the body ended early
                view = buf[:n]
                while view:
                    k = os.pwrite(fd, view, off)
                    view, off = view[k:], off + k
        except BaseException:
            self._drop(conn)
            raise  # the file's error (no space, ...), or an interrupt
        return True

    def close(self) -> None:
        """Close the calling thread's connections."""
        for conn in getattr(self.local, "conns", {}).values():
            conn.close()
        self.local.conns = {}

    def _conn(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        conns = getattr(self.local, "conns", None)
        if conns is None:
            conns = self.local.conns = {}
        conn = conns.get((scheme, netloc))
        if conn is None:
            kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = conns[(scheme, netloc)] = kind(netloc, timeout=TIMEOUT)
        return conn

    def _drop(self, conn: http.client.HTTPConnection) -> bool:
        """Close ``conn`` and forget it; False, for the caller to return."""
        conn.close()
        conns = getattr(self.local, "conns", {})
        for k, v in list(conns.items()):
            if v is conn:
                del conns[k]
        return False

    def _buffer(self) -> memoryview:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = memoryview(bytearray(BUFFER))
        return buf
