"""Issue 22 through a real `shmstage serve`: the symlink-swap attack of the trust issue made
against the service (it must never copy what the user cannot read), and `stage --lease-for $$`
held by the service's keeper until the shell exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.nodeservice import ALICE, BOB, as_user, make_ds, own

pytestmark = pytest.mark.root

SECRET = b"TOP-SECRET-" * 1000


def _holds_secret(root: Path) -> list[str]:
    found = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                with open(p, "rb") as fh:
                    if SECRET[:22] in fh.read():
                        found.append(p)
            except OSError:
                pass
    return found


def test_a_symlink_swapped_in_during_a_stage_through_the_service_copies_nothing_secret(
    service, procs
):
    """Alice owns src/d and keeps swapping it for a symlink to a 0700 root directory holding a
    world-readable file of the same name while she stages src through the service, again and
    again; whatever each stage does, no byte of the secret is ever in the store."""
    vault = service.world / "vault"
    vault.mkdir(mode=0o700)
    (vault / "x.bin").write_bytes(SECRET)
    (vault / "x.bin").chmod(0o644)
    src = service.world / "src"
    make_ds(src / "d", files=64, size=4096)
    (src / "d" / "x.bin").write_bytes(b"alice's own bytes")
    own(src, ALICE)
    flip = (
        "import os,sys\n"
        "src, vault = sys.argv[1], sys.argv[2]\n"
        "d, real = os.path.join(src, 'd'), os.path.join(src, 'd.real')\n"
        "while True:\n"
        "    try:\n"
        "        os.rename(d, real); os.symlink(vault, d)\n"
        "        os.unlink(d); os.rename(real, d)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    flipper = procs.start([*as_user(ALICE), "--", sys.executable, "-c", flip, str(src), str(vault)])
    outcomes = set()
    try:
        for i in range(12):
            r = service.run("stage", str(src), "--name", f"s{i}", "-q", uid=ALICE)
            outcomes.add(r.returncode)
            assert "Traceback" not in r.stderr, r.stderr
            assert not _holds_secret(service.store), (i, _holds_secret(service.store))
    finally:
        flipper.kill()
        flipper.wait()
    assert outcomes <= {0, 1, 2}, outcomes  # staged her own bytes, or refused in one line


def test_lease_for_the_shell_is_held_by_the_service_until_the_shell_exits(service, procs):
    """`D=$(shmstage stage SRC --lease-for $$ -q)` through the service: the keeper holds the
    lease for the shell (evict is refused, naming it) and lets go when the shell exits."""
    src = make_ds(service.world / "data")
    script = 'D=$("$@" stage "$SRC" --lease-for $$ -q) || exit 9; echo "$D"; exec sleep 300'
    shell = procs.start(
        ["bash", "-c", script, "bash", *service.bin],
        env={**service.env, "SRC": str(src)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = shell.stdout.readline().strip()
    assert line == str(service.store / "data"), line
    r = service.run("evict", "data")
    assert r.returncode == 2 and f"pid {shell.pid}" in r.stderr, r.stderr
    # held for the shell by the service itself (its keeper), not by a holder of the user's
    assert f"held for it by shmstage (pid {service.proc.pid})" in r.stderr, r.stderr
    assert (service.store / "data").is_dir()
    shell.kill()
    shell.wait()
    deadline = time.monotonic() + 30
    while True:
        r = service.run("evict", "data")
        if r.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.returncode == 0 and not (service.store / "data").exists(), r.stderr


def test_a_dest_through_a_users_symlink_is_never_written_through(service, procs):
    """Bob names the service's tier through a symlink he owns and flips it to another
    root-owned directory meanwhile: the service answers with, and writes into, only its own
    tier (its configured path), never through his link; the other directory stays empty."""
    other = service.world / "other" / "store"
    other.mkdir(parents=True)
    bob = service.world / "bob"
    bob.mkdir()
    src = make_ds(bob / "mine", files=2, size=1000)
    own(bob, BOB)
    (bob / "L").symlink_to(service.world)
    os.lchown(bob / "L", BOB, BOB)
    r = service.run("stage", str(src), "--dest", str(bob / "L" / "store"), "--json", uid=BOB)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == str(service.store / "mine")  # not .../bob/L/store
    flip = (
        "import os,sys\n"
        "link, a, b = sys.argv[1:4]\n"
        "while True:\n"
        "    for t in (a, b):\n"
        "        try:\n"
        "            os.symlink(t, link + '.new'); os.rename(link + '.new', link)\n"
        "        except OSError:\n"
        "            pass\n"
    )
    argv = [sys.executable, "-c", flip, str(bob / "L"), str(service.world), str(other.parent)]
    flipper = procs.start([*as_user(BOB), "--", *argv])
    try:
        for i in range(10):
            r = service.run(
                "stage", str(src), "--name", f"m{i}", "--dest", str(bob / "L" / "store"), "-q",
                uid=BOB,
            )  # fmt: skip
            assert "Traceback" not in r.stderr, r.stderr
    finally:
        flipper.kill()
        flipper.wait()
    assert list(other.iterdir()) == []


MAL = 4553


def test_a_leased_dataset_is_never_replaced_by_another_source_even_by_root(service, procs):
    """Alice's job leases ds (a copy of Mal's source); Mal, then root, stage another source
    --name ds --force: both refused, naming the job, its files unchanged; a forced recopy of
    the same source stays allowed; once the job is gone, root may replace it."""
    src = make_ds(service.world / "mal" / "ds", files=3, size=1000)
    evil = make_ds(service.world / "mal" / "evil", files=3, size=7)
    own(service.world / "mal", MAL)
    job = procs.start([*as_user(ALICE), "--", "sleep", "300"])
    r = service.run("stage", str(src), "--lease-for", str(job.pid), "-q", uid=ALICE)
    assert r.returncode == 0, r.stderr
    before = (service.store / "ds" / "f1").read_bytes()
    for uid in (MAL, None):
        r = service.run("stage", str(evil), "--name", "ds", "--force", "-q", uid=uid)
        assert r.returncode != 0, (uid, r.stdout)
        assert "Traceback" not in r.stderr, r.stderr
        assert (service.store / "ds" / "f1").read_bytes() == before
    assert f"ds is in use by pid {job.pid}" in r.stderr, r.stderr
    assert f"replacing it with {evil} would change the files under that job" in r.stderr
    r = service.run("stage", str(src), "--force", "-q", uid=MAL)
    assert r.returncode == 0, r.stderr  # the same source, recopied
    job.kill()
    job.wait()
    deadline = time.monotonic() + 30
    while True:
        r = service.run("stage", str(evil), "--name", "ds", "--force", "-q")
        if r.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.returncode == 0, r.stderr
    assert (service.store / "ds" / "f1").read_bytes() == (evil / "f1").read_bytes()


def test_only_root_replaces_a_dataset_by_another_source_through_the_service(service):
    """Mal owns the source of ds (so its copy's top): he still may not put another source
    under that name through the service, and is told to use another --name."""
    src = make_ds(service.world / "mal" / "ds", files=2, size=1000)
    other = make_ds(service.world / "mal" / "other", files=2, size=7)
    own(service.world / "mal", MAL)
    assert service.run("stage", str(src), "-q", uid=ALICE).returncode == 0
    r = service.run("stage", str(other), "--name", "ds", "--force", "-q", uid=MAL)
    assert r.returncode != 0 and "only root may replace" in r.stderr, r.stderr
    assert "under another --name" in r.stderr
    assert (service.store / "ds" / "f1").read_bytes() == (src / "f1").read_bytes()
    r = service.run("stage", str(other), "--name", "ds", "--force", "-q")
    assert r.returncode == 0, r.stderr


def test_a_user_who_cannot_reach_a_copy_learns_nothing_of_it(service):
    """Alice stages a dataset from her 0700 home: Bob's verify (with and without --checksum)
    is refused as find refuses him, never "OK" nor "gone"; list and metrics do not show it to
    him; root's metrics do."""
    home = service.world / "alicehome"
    src = make_ds(home / "secretds", files=3, size=1000)
    own(home, ALICE)
    home.chmod(0o700)
    assert service.run("stage", str(src), "-q", uid=ALICE).returncode == 0
    for extra in ([], ["--checksum"]):
        r = service.run("verify", "secretds", *extra, uid=BOB)
        assert r.returncode != 0, (extra, r.stdout)
        assert f"you cannot read {src} at the source (Permission denied)" in r.stderr, r.stderr
        assert "OK" not in r.stdout and "gone" not in r.stderr
    r = service.run("list", uid=BOB)
    assert r.returncode == 0 and "secretds" not in r.stdout, r.stdout
    r = service.run("metrics", uid=BOB)
    assert r.returncode == 0 and "secretds" not in r.stdout, r.stdout
    r = service.run("metrics")
    assert r.returncode == 0 and 'name="secretds"' in r.stdout, r.stdout
    r = service.run("verify", "secretds", "--checksum", uid=ALICE)
    assert r.returncode == 0, r.stderr


def test_verify_checksum_tells_a_source_one_cannot_read_from_one_that_is_gone(service):
    """Bob got Alice's copy while her home was open; she closes it: his verify --checksum
    says he cannot read the source, not that it is gone."""
    home = service.world / "alicehome"
    src = make_ds(home / "ds", files=3, size=1000)
    own(home, ALICE)
    home.chmod(0o755)
    assert service.run("stage", str(src), "-q", uid=ALICE).returncode == 0
    assert service.run("stage", str(src), "-q", uid=BOB).returncode == 0
    home.chmod(0o700)
    r = service.run("verify", "ds", "--checksum", uid=BOB)
    assert r.returncode != 0, r.stdout
    assert f"you cannot read {src} at the source (Permission denied)" in r.stderr, r.stderr
    assert "gone" not in r.stderr
