"""Who reads what: the files any node needs, cut into N shares of equal bytes and pieces.

The files' bytes, in tree order, form one stream; share r is the r-th N-th of that
stream (a file crossing a boundary is split between two owners, so a big file is read
by several nodes), and each share is cut into pieces of ``piece`` bytes that travel the
ring one at a time.  Every node computes the same plan from the same inputs, so a piece
carries no header: its layout (which files, which offsets) is known to all.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

CRC = 4  # bytes of one segment's checksum (zlib.crc32) after a piece's data


@dataclass(frozen=True)
class Segment:
    """``length`` bytes of file ``file`` (an index into ``Plan.files``) from ``offset``,
    at ``at`` in its piece."""

    file: int
    offset: int
    length: int
    at: int


@dataclass(frozen=True)
class Plan:
    files: list[tuple[str, int]]  # (rel, size) of every non-empty file some node needs
    starts: list[int]  # each file's offset in the stream
    total: int  # bytes in the stream
    nodes: int
    piece: int  # bytes per piece (the last pieces of a share are shorter or empty)

    def share(self, r: int) -> tuple[int, int]:
        """Share ``r``'s range [start, end) of the stream."""
        return self.total * r // self.nodes, self.total * (r + 1) // self.nodes

    @property
    def pieces(self) -> int:
        """Pieces per share: the same for every share (some may be empty)."""
        longest = max(e - s for s, e in (self.share(r) for r in range(self.nodes)))
        return max(1, -(-longest // self.piece))

    def piece_range(self, r: int, k: int) -> tuple[int, int]:
        start, end = self.share(r)
        a = min(end, start + k * self.piece)
        return a, min(end, a + self.piece)

    def segments(self, r: int, k: int) -> list[Segment]:
        """The file pieces that make up piece ``k`` of share ``r``, in stream order."""
        a, b = self.piece_range(r, k)
        out: list[Segment] = []
        i = bisect_right(self.starts, a) - 1
        while a < b and i < len(self.files):
            start = self.starts[i]
            end = start + self.files[i][1]
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                out.append(Segment(i, lo - start, hi - lo, lo - a))
            if end >= b:
                break
            i += 1
        return out

    def size(self, r: int, k: int) -> int:
        """Bytes piece ``k`` of share ``r`` takes on the wire: data, then one CRC per segment."""
        a, b = self.piece_range(r, k)
        return b - a + CRC * len(self.segments(r, k))


def make_plan(files: list[tuple[str, int]], nodes: int, piece: int) -> Plan:
    """A plan for ``files`` (rel, size), in the order given; empty files are left out
    (every node creates those itself)."""
    if nodes < 1 or piece < 1:
        raise ValueError(f"nodes and piece must be positive, not {nodes} and {piece}")
    kept = [(rel, size) for rel, size in files if size > 0]
    starts: list[int] = []
    total = 0
    for _, size in kept:
        starts.append(total)
        total += size
    return Plan(kept, starts, total, nodes, piece)


def piece_size(inflight: int, slots: int) -> int:
    """Bytes per piece so that ``slots`` pieces fit in ``inflight`` bytes: 1 to 64 MiB
    (below ~16 MiB per message gloo's per-message cost shows; measured on loopback)."""
    return max(1 << 20, min(64 << 20, inflight // slots))
