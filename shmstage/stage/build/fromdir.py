"""Filling partial/<name> from a local directory: the forked copier (copier.py), or with peers
the cluster exchange, then big files' owners, modes and times and the checksum pass.

A directory's first copy has a path of its own, :func:`build_first`: the copy starts with
the first directories the walk lists instead of after the whole walk (partial.py does the
rest), checking the fit with the same rule in steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from shmstage.errors import CapacityError, ShmstageError
from shmstage.stage.build import copier
from shmstage.stage.build.chown import give_owner
from shmstage.stage.build.copypipe import Job
from shmstage.stage.build.estimate import SHORT_SYMLINK, of_entries, page_size, require_fit
from shmstage.stage.build.tree import (
    Counter,
    apply_acls,
    finish_tree,
    make_symlink,
    prepare_manifest,
)
from shmstage.stage.sources.base import Tick, Want
from shmstage.stage.sources.beneath import SOURCE_TOP, ident, split_ident
from shmstage.stage.sources.directory import DirSource, replaced
from shmstage.stage.sources.walk import Tree, Walker, scan_threads
from shmstage.stage.store import Store
from shmstage.stage.store.reserve import Claim

FIRST_BATCH_BYTES = 64 << 20  # a first copy claims space and hands out work in steps of this
FIRST_BATCH_FILES = 4096
# ...and its first steps smaller (256 files, then twice as many each time): the workers start
# on the first directory instead of idling while the walk lists eight (50k tiny files, 2 CPUs:
# the first hand-out ~70 ms sooner)
FIRST_STEP_FILES = 256


def fill(
    source: DirSource,
    wants: Sequence[Want],
    root: str,
    tick: Tick,
    workers: int | None,
    checksum: bool,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Copy ``wants`` from the directory into ``root``: the forked copier, or the cluster
    exchange with peers; then :func:`settle`."""
    src = source.prefix
    jobs = jobs_of(source, wants, root)
    old_umask = os.umask(0)
    try:
        tasks, chunked = copier.make_tasks(jobs)
        for i in chunked:  # big files: created here (writable), filled by several workers
            copier.create_sized(jobs[i][1], jobs[i][2])
    finally:
        os.umask(old_umask)
    nworkers = workers or copier.default_workers(source.location)
    if source.peers is not None:
        if meanwhile is not None:
            meanwhile()
        source.peers.fill(jobs, tick, checksum)  # instead of reading all of SRC here
        checksum = False  # checked against the owners' sums
    else:
        copier.run(jobs, tasks, nworkers, tick, meanwhile, tops={src: source.top()})
    settle(source, jobs, [jobs[i] for i in chunked], checksum, nworkers)


def jobs_of(source: DirSource, wants: Sequence[Want], root: str) -> list[Job]:
    """The copier's jobs for ``wants``, from the directory into ``root``."""
    src, dst = source.prefix, root + "/"
    # what the walk found at each path: the copier refuses another file (0: unchecked)
    ident = ((source.tree.idents if source.tree is not None else None) or {}).get
    return [
        (
            src + w.path,
            dst + w.path,
            w.size,
            w.mtime_ns,
            w.atime_ns,
            w.mode,
            w.path,
            ident(w.path, 0),
        )
        for w in wants  # plain concatenation: 1M joins cost seconds
    ]


def settle(
    source: DirSource, jobs: list[Job], chunked: list[Job], checksum: bool, nworkers: int
) -> None:
    """After the copy: big files' owners, modes and times; the checksum pass."""
    for job in chunked:  # the source's mode only now: a 0444 file is reopened by every worker
        st = source.lstat(job[6])
        if len(job) > 7 and job[7] and ident(st) != job[7]:
            raise replaced(job[0], None)
        if not give_owner(job[1], st, job[5], source.own, source.groups):
            raise ShmstageError(
                f"source file changed during the copy: {job[0]} (its group is not the "
                "one the scan found); re-run when the source is stable"
            )
        os.chmod(job[1], job[5], follow_symlinks=False)
        os.utime(job[1], ns=(job[4], job[3]), follow_symlinks=False)
    if checksum and jobs:
        bad = copier.compare(jobs, nworkers, tops={source.prefix: source.top()})
        if bad:
            raise ShmstageError(
                f"checksum mismatch after copying {len(bad)} file(s), e.g. {bad[0]}; the source "
                "changed during the copy or the memory is faulty; re-run"
            )


def build_first(
    source: DirSource,
    store: Store,
    name: str,
    workers: int | None,
    verify: str,
    reserve: int | None,
    report: Callable[..., None],
    claim: Claim,
) -> Tree:
    """The first copy into a new partial/<name>, copying while the walk runs.

    Space is claimed as the walk finds data, before any of it is handed to the workers
    (the same fit rule, in steps); a step that does not fit stops the copy, removes the
    partial tree and refuses with the whole dataset's numbers, as the up-front check
    would.  Writes the new manifest once the walk ended, while the workers still copy."""
    part = store.partial(name)
    os.mkdir(part, 0o700)
    os.chmod(part, 0o700)  # never setgid (inherited from DEST): new files get our egid
    page = page_size(store.dest)
    src_prefix, part_prefix = source.prefix, part + "/"
    nworkers = workers or copier.default_workers(source.location)
    walker = Walker(
        source.location,
        threads=scan_threads(source.location),
        idents=True,
        groups=source.groups,
        top=source.top(),
        acls=source.acls,
    )
    found = iter(walker)
    idents = walker.idents
    assert idents is not None
    jobs: list[Job] = []
    chunked: list[Job] = []
    hard: list[list[Any]] = []
    dirs: list[tuple[str, int, int, int]] = []
    batch: list[Job] = []
    step = [0, 0, 0]  # bytes (page-rounded), data bytes, inodes found but not yet claimed
    claimed = [0]  # page-rounded bytes claimed so far
    counter = Counter(report, 0, 0)
    files_per_step = FIRST_STEP_FILES

    def hand_out(stream: copier.Stream) -> None:
        needed, data, inodes = step
        claimed[0] += needed

        def check(pending: int) -> None:
            require_fit(left, inodes, store.dest, reserve, pending=pending)

        # Ours and not yet on DEST lies between claimed - handed and claimed - landed:
        # files being copied count in DEST's used space already, but not how much of them.
        left = claimed[0] - stream.landed
        try:
            claim.reserve(left, check)
        except CapacityError:
            left = claimed[0] - stream.handed
            claim.reserve(left, check)  # refused even if every handed-out file were written
            stream.drain()  # near the limit: let those land, then the numbers are exact
            left = claimed[0] - stream.landed
            claim.reserve(left, check)
        counter.grow(data, len(batch))
        chunked.extend(stream.add(batch))
        jobs.extend(batch)
        batch.clear()
        step[:] = [0, 0, 0]

    old_umask = os.umask(0)
    try:
        with copier.Stream(
            src_prefix,
            part_prefix,
            nworkers,
            claim.counting(counter),
            page,
            tops={src_prefix: source.top()},
        ) as stream:
            for new in found:
                atimes = walker.atimes[len(walker.entries) - len(new) :]
                pages = data = 0  # (per file of a million: locals, rounded() inline)
                for (rel, kind, size, mtime, mode, extra), atime in zip(new, atimes):
                    if kind == "f":
                        batch.append(
                            (
                                src_prefix + rel,
                                part_prefix + rel,
                                size,
                                mtime,
                                atime,
                                mode,
                                rel,
                                idents[rel],
                            )
                        )
                        pages -= size // -page
                        data += size
                    elif kind == "d":
                        dirs.append((rel, mode, mtime, atime))
                        if rel != ".":
                            os.mkdir(part_prefix + rel, 0o700)
                    elif kind == "l":
                        make_symlink(part_prefix + rel, extra, mtime, source.owner(rel))
                        if len(os.fsencode(extra)) + 1 > SHORT_SYMLINK:
                            step[0] += page
                    else:
                        hard.append([rel, extra])
                step[0] += pages * page
                step[1] += data
                step[2] += len(new)  # tmpfs charges every name, hard links too, to nr_inodes
                if step[0] >= FIRST_BATCH_BYTES or len(batch) >= files_per_step:
                    hand_out(stream)
                    files_per_step = min(FIRST_BATCH_FILES, 2 * files_per_step)
            hand_out(stream)
            tree = walker.tree()
            source.tree = tree
            entries = tree.entries  # tuples: json writes them as lists, nothing alters them
            prepare_manifest(
                store, name, source.location, entries, **{SOURCE_TOP: split_ident(tree.top)}
            )
            stream.finish()
    except CapacityError as e:  # the workers are gone: nothing writes into part/ any more
        _refuse_whole(store, walker, found, part, page, reserve, claim, e)
    finally:
        os.umask(old_umask)
        found.close()  # an early exit: stop the scan threads now
    settle(source, jobs, chunked, verify == "checksum", nworkers)
    finish_tree(part, hard, dirs, source.owner, source.group)
    apply_acls(part, entries)
    return tree


def _refuse_whole(
    store: Store,
    walker: Walker,
    found: Iterator[list[Any]],
    part: str,
    page: int,
    reserve: int | None,
    claim: Claim,
    refused: CapacityError,
) -> None:
    """A step of a first copy did not fit: stop, remove what was copied, and refuse with
    the whole dataset's numbers (exit 2: nothing changed)."""
    raise_from = refused
    for _ in found:  # the rest of the walk, for the numbers (no more copying)
        pass
    tree = walker.tree()
    store.discard(part)
    est = of_entries(tree.root, tree.entries, page)  # the numbers inspect prints
    needed, inodes = est.page_bytes, est.inodes
    try:
        claim.reserve(
            needed,
            lambda pending: require_fit(needed, inodes, store.dest, reserve, pending=pending),
        )
    except CapacityError as e:
        raise_from = e
    raise raise_from
