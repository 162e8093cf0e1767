"""Listing an object-store prefix: one LIST into the tree stage builds (keys that are no
safe path refused, obstore's stripped slashes told apart) and each object's change key
(ETag, size, version).  See NOTE [keys obstore strips].
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from shmstage.errors import (
    EmptySource,
    RefusedError,
    ShmstageError,
)
from shmstage.stage.sources.base import Listing
from shmstage.stage.sources.s3store import S3Bucket

WORKERS = 32  # requests in flight (measured: 32-64 saturate a local server; docs/s3.md)
FILE_MODE, DIR_MODE = 0o644, 0o755
_NAME_MAX = 255


class S3Prefix(S3Bucket):
    """A prefix of a bucket, listed: the tree and change keys of one LIST."""

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
        tree = _tree(self.location, files, markers)
        return replace(tree, entries=self.moded(tree.entries))

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
