"""The node service (issue 22): a real `shmstage serve` as root on a socket in a private tmpfs,
clients as real other users through setpriv; what they get, what they are refused, and how the
service survives bad clients and its own death."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from shmstage.stage.build import copier
from tests.nodeservice import ALICE, BOB, Service, as_user, make_ds, own

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]


@pytest.fixture
def world(service_world):
    """The service's tmpfs (conftest.py), also in tests that start a service of their own."""
    return service_world


def record(store: Path, name: str) -> dict:
    return json.loads((store / ".shmstage" / "meta" / f"{name}.json").read_text())


# --- the service itself -----------------------------------------------------------------


def test_serve_refuses_to_run_as_a_user(world, shmstage_bin):
    """Not root: one line, exit 2, no socket."""
    sock = world / "run" / "s.sock"
    r = subprocess.run(
        [*as_user(ALICE), *shmstage_bin, "serve", "--socket", str(sock)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("Error: shmstage serve runs as root") and r.stderr.count("\n") == 1
    assert not sock.exists()


def test_a_second_serve_on_a_live_socket_refuses_and_a_stale_socket_is_replaced(
    service, shmstage_bin
):
    """A live service keeps its socket; one SIGKILLed leaves a file that the next replaces."""
    r = subprocess.run(
        [*shmstage_bin, "serve"], env=service.env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert r.stderr == f"Error: another shmstage service is running on {service.socket}\n"
    assert service.answers()
    service.proc.kill()
    service.proc.wait()
    assert service.socket.exists() and not service.answers()  # stale
    service.start()
    assert oct(service.socket.stat().st_mode & 0o777) == "0o666"
    assert oct((service.socket.parent).stat().st_mode & 0o777) == "0o755"


def test_sigterm_removes_the_socket_and_exits_0(service):
    service.proc.send_signal(signal.SIGTERM)
    assert service.proc.wait(timeout=30) == 0
    assert not service.socket.exists()


# --- staging through it -----------------------------------------------------------------


def test_two_users_share_one_copy(service, world):
    """Alice stages her readable dataset through the service; Bob asks for it too and gets the
    same path, the copy made once (its staged_at unchanged), the store staying root's."""
    src = make_ds(world / "data" / "ds", uid=ALICE)
    r = service.run("stage", str(src), "--json", uid=ALICE)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert first["path"] == str(service.store / "ds") and first["changed"]
    staged_at = record(service.store, "ds")["staged_at"]
    r = service.run("stage", str(src), uid=BOB)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{service.store}/ds\n"
    assert "is up to date" in r.stderr
    assert record(service.store, "ds")["staged_at"] == staged_at
    assert (service.store / "ds" / "f1").read_bytes() == (src / "f1").read_bytes()
    assert os.stat(service.store).st_uid == 0  # the store stays the service's


def test_output_through_the_service_is_todays(service, world):
    """stage -q, list --json, verify, evict --dry-run, gc, metrics: the same through the
    service as in-process (--no-service)."""
    src = make_ds(world / "data" / "ds")
    r = service.run("stage", str(src), "-q")
    assert r.returncode == 0 and r.stdout == f"{service.store}/ds\n" and r.stderr == ""
    for args in (
        ("list",),
        ("list", "--json"),
        ("verify", "ds"),
        ("verify", "ds", "--json"),
        ("evict", "ds", "--dry-run"),
        ("gc", "--dry-run"),
        ("stage", str(src), "--dry-run"),
        ("stage", str(src), "--json", "--dry-run"),
    ):
        via = service.run(*args)
        here = service.run(*args, "--no-service")
        assert (via.returncode, via.stdout, via.stderr) == (
            here.returncode,
            here.stdout,
            here.stderr,
        ), args
    via = service.run("metrics")
    assert via.returncode == 0 and "shmstage_" in via.stdout


def test_a_relative_source_is_the_clients(service, world):
    """SRC relative to the client's cwd, not the service's."""
    make_ds(world / "data" / "rel", uid=ALICE)
    r = service.run("stage", "rel", "-q", uid=ALICE, cwd=world / "data")
    assert r.returncode == 0 and r.stdout == f"{service.store}/rel\n", r.stderr


def test_a_user_is_refused_a_source_they_cannot_read_and_nothing_is_copied(service, world):
    """Bob asks the service (its socket, not the CLI, which checks the path first) for
    Alice's 0700 dataset: refused, one line, nothing copied, not even a partial tree."""
    src = make_ds(world / "data" / "secret", uid=ALICE)
    src.chmod(0o700)
    python = os.path.join(os.path.dirname(service.bin[0]), "python")
    code = (
        "from shmstage.service.client import connect\n"
        "from shmstage.errors import ShmstageError\n"
        "try:\n"
        f"    connect().call('stage', {{'src': {str(src)!r}}})\n"
        "except ShmstageError as e:\n"
        "    print(type(e).__name__, e.exit_code, e)\n"
    )
    r = subprocess.run(
        [*as_user(BOB), python, "-c", code], env=service.env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.count("\n") == 1, (r.stdout, r.stderr)
    assert r.stdout.startswith("PermissionDenied") or "denied" in r.stdout.lower(), r.stdout
    assert not (service.store / "secret").exists()
    partial = service.store / ".shmstage" / "partial"
    assert not partial.exists() or not any(partial.iterdir())


def test_evict_is_the_owners_or_roots(service, world):
    """Bob may not evict what Alice staged, nor use --force or --all; Alice may; root may."""
    src = make_ds(world / "data" / "ds", uid=ALICE)
    assert service.run("stage", str(src), uid=ALICE).returncode == 0
    for args in (("evict", "ds"), ("evict", "ds", "--force"), ("evict", "--all")):
        r = service.run(*args, uid=BOB)
        assert r.returncode == 1 and r.stderr.startswith("Error: ") and "root" in r.stderr, args
    assert (service.store / "ds").exists()
    r = service.run("evict", "ds", uid=ALICE)
    assert r.returncode == 0 and r.stdout == "evicted: ds\n", r.stderr
    assert not (service.store / "ds").exists()


def test_no_service_runs_in_process(service, world):
    """--no-service: a user's stage into the root store is today's in-process refusal."""
    src = make_ds(world / "data" / "ds", uid=ALICE)
    service.run("stage", str(make_ds(world / "data" / "other")))  # the store exists, root's
    r = service.run("stage", str(src), "--no-service", uid=ALICE)
    assert r.returncode == 2 and "may not write there" in r.stderr
    assert not (service.store / "ds").exists()
    assert service.run("stage", str(src), uid=ALICE).returncode == 0


def test_a_dest_of_the_users_own_runs_in_process(service, world):
    """--dest outside the service's tiers: staged by the user, into their own directory."""
    src = make_ds(world / "data" / "ds", uid=ALICE)
    mine = world / "alice"
    mine.mkdir()
    own(mine, ALICE)
    r = service.run("stage", str(src), "--dest", str(mine), "-q", uid=ALICE)
    assert r.returncode == 0 and r.stdout == f"{mine}/ds\n", r.stderr
    assert os.stat(mine / ".shmstage").st_uid == ALICE


# --- items 7 and 8 ----------------------------------------------------------------------


def test_stage_nodes_says_in_one_line_that_it_runs_in_process(service, world):
    """Item 7: --nodes with a service answering: one line first, then today's cluster stage
    (here node 0 of 2 alone: it times out waiting for node 1, as today)."""
    src = make_ds(world / "data" / "ds")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        where = f"127.0.0.1:{s.getsockname()[1]}"
    r = service.run("stage", str(src), "--nodes", "2", "--node-rank", "0", "--rendezvous",
                    where, "--timeout", "1")  # fmt: skip
    line = (
        "note: staging with --nodes runs in this process, not through the shmstage service "
        f"on {service.socket}\n"
    )
    assert r.stderr.startswith(line), r.stderr
    assert r.stderr.count("shmstage service") == 1
    here = service.run("stage", str(src), "--nodes", "2", "--node-rank", "0", "--rendezvous",
                       where, "--timeout", "1", "--no-service")  # fmt: skip
    assert r.returncode == here.returncode != 0
    assert r.stderr[len(line) :] == here.stderr


def test_a_user_on_a_root_store_with_no_service_is_told_what_to_do(world, shmstage_bin):
    """Item 8: no service answers; a user's stage into root's store: one line, exit 2."""
    store = world / "store"
    root_src = make_ds(world / "data" / "a")
    subprocess.run([*shmstage_bin, "stage", str(root_src), "--dest", str(store)], check=True,
                   capture_output=True)  # fmt: skip
    src = make_ds(world / "data" / "b", uid=ALICE)
    sock = world / "run" / "none.sock"
    r = subprocess.run(
        [*as_user(ALICE), *shmstage_bin, "stage", str(src), "--dest", str(store)],
        env={**os.environ, "SHMSTAGE_SOCKET": str(sock)}, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr == (
        f"Error: b is not staged in {store}; "
        f"{store} is managed by root and no shmstage service answers on {sock}: ask an "
        "admin to start it (systemctl start shmstage) or stage into a directory of your own "
        "with --dest, e.g. --dest /dev/shm/shmstage-$USER\n"
    )
    dry = subprocess.run(
        [*as_user(ALICE), *shmstage_bin, "stage", str(src), "--dest", str(store), "--dry-run"],
        env={**os.environ, "SHMSTAGE_SOCKET": str(sock)}, capture_output=True, text=True,
    )  # fmt: skip
    assert (dry.returncode, dry.stderr) == (r.returncode, r.stderr)
    gone = subprocess.run(
        [*as_user(ALICE), *shmstage_bin, "evict", "a", "--dest", str(store)],
        env={**os.environ, "SHMSTAGE_SOCKET": str(sock)}, capture_output=True, text=True,
    )  # fmt: skip
    assert gone.returncode == 2 and f"no shmstage service answers on {sock}" in gone.stderr
    forced = subprocess.run(
        [*as_user(ALICE), *shmstage_bin, "stage", str(src), "--dest", str(store), "--no-service"],
        env={**os.environ, "SHMSTAGE_SOCKET": str(sock)}, capture_output=True, text=True,
    )  # fmt: skip
    assert forced.returncode == 2 and "may not write there" in forced.stderr  # today's words


def test_the_client_refuses_a_socket_another_user_owns(world, shmstage_bin, procs):
    """A socket served by Bob is not the service for Alice: one line, exit 1, nothing read."""
    sock_dir = world / "bobs"
    sock_dir.mkdir()
    own(sock_dir, BOB)
    sock = sock_dir / "s.sock"
    fake = (
        "import socket,os,time\n"
        f"s=socket.socket(socket.AF_UNIX);s.bind({str(sock)!r});os.chmod({str(sock)!r},0o666)\n"
        "s.listen(8)\nwhile True:\n c,_=s.accept();time.sleep(0.2);c.close()\n"
    )
    procs.start([*as_user(BOB), sys.executable, "-c", fake])
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    src = make_ds(world / "data" / "ds", uid=ALICE)
    r = subprocess.run(
        [*as_user(ALICE), *shmstage_bin, "stage", str(src), "--dest", str(world / "a")],
        env={**os.environ, "SHMSTAGE_SOCKET": str(sock)}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 1
    assert r.stderr == f"Error: {sock} is not the shmstage service (owned by uid {BOB})\n"


# --- robustness ---------------------------------------------------------------------------


def test_garbage_half_and_oversized_requests_then_a_good_client(service, world):
    """Garbage, a wrong schema, half a line (then silence), 2 MiB without a newline and 1000
    idle connections: each gets an error or is dropped; the service then answers a stage."""

    def send(data: bytes, wait: bool = True) -> bytes:
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(service.socket))
        with contextlib.suppress(OSError):
            s.sendall(data)
        if not wait:
            return b""
        s.settimeout(30)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        s.close()
        return out

    for bad in (
        b'{"v":1,"op":"stage","args":{"src":"/x","workers":1000000}}\n',
        b'{"v":1,"op":"stage","args":{"src":"/x","strip_components":-1}}\n',
        b"\x00\xffgarbage\n",
        b'{"v":1,"op":"rm -rf","args":{}}\n',
        b'{"v":1,"op":"stage","args":{"src":"relative"}}\n',
        b'{"v":1,"op":"stage","args":{"src":"/x","uid":0}}\n',
        b'{"v":2,"op":"hello","args":{}}\n',
        b"[" * 200_000 + b"\n",  # deeper than Python's json recursion
        b'{"v":1,"op":"hello"',  # half a line, then nothing: the deadline
        b"x" * (2 << 20),
    ):
        reply = send(bad)
        (size,) = struct.unpack("!I", reply[:4])
        assert size == len(reply) - 4 and (b"bad request" in reply or b"must be" in reply), bad[:40]
    idle = []
    for _ in range(1000):
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError, OSError):
            s.connect(str(service.socket))
        idle.append(s)
    src = make_ds(world / "data" / "ds")
    r = service.run("stage", str(src), "-q")
    for s in idle:
        s.close()
    assert r.returncode == 0 and r.stdout == f"{service.store}/ds\n", r.stderr
    assert service.proc.poll() is None


def test_the_service_killed_mid_stage_then_restarted_resumes(world, shmstage_bin, procs):
    """SIGKILL mid-copy: the client says so in one line (exit 1), nothing is published, no
    copier is left; restarted, the same stage resumes the partial copy and publishes it whole."""
    svc = Service(world, shmstage_bin, procs)
    svc.start(**{copier.SLOW_ENV: "0.3"})
    src = make_ds(world / "data" / "ds", files=12, uid=ALICE)
    client = procs.start(
        [*as_user(ALICE), *shmstage_bin, "stage", str(src), "--workers", "1"],
        env=svc.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    partial = svc.store / ".shmstage" / "partial" / "ds"
    deadline = time.monotonic() + 60
    while len(list(partial.glob("f*"))) < 3:
        assert client.poll() is None and time.monotonic() < deadline, client.communicate()
        time.sleep(0.02)
    svc.proc.kill()
    out, err = client.communicate(timeout=60)
    assert client.returncode == 1 and out == ""
    assert err == (
        f"Error: the shmstage service on {svc.socket} closed the connection mid-request "
        "(restarted?): run the command again; a partial copy resumes\n"
    )
    assert not (svc.store / "ds").exists()
    svc.start()
    r = svc.run("stage", str(src), "--json", uid=ALICE)
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)
    assert done["copied_bytes"] < done["bytes"]  # resumed: what was copied stayed
    for f in src.iterdir():
        assert (svc.store / "ds" / f.name).read_bytes() == f.read_bytes()
    assert sorted(p.name for p in (svc.store / "ds").iterdir()) == sorted(
        p.name for p in src.iterdir()
    )


# --- run --stage and the loader -------------------------------------------------------------


def test_run_stage_goes_through_the_service_and_leases_in_process(service, world, procs):
    """A user's `run --stage` on root's store: staged by the service, the job sees the path,
    and its lease (held by the user's shmstage) makes root's evict refuse while it runs."""
    src = make_ds(world / "data" / "ds", uid=ALICE)
    flag = world / "data" / "go"
    job = procs.start(
        [*as_user(ALICE), *service.bin, "run", "--stage", str(src), "--", "sh", "-c",
         f"echo {{staged}}; while [ ! -e {flag} ]; do sleep 0.05; done"],
        env=service.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = job.stdout.readline()
    assert line == f"{service.store}/ds\n", line or job.stderr.read()
    r = service.run("evict", "ds")
    assert r.returncode == 2 and "is in use by" in r.stderr, r.stderr
    flag.touch()
    assert job.wait(timeout=60) == 0
    assert service.run("evict", "ds").returncode == 0


def test_staged_path_asks_the_service(service, world):
    """shmstage.loader.staged_path as a user finds the copy the service staged."""
    src = make_ds(world / "data" / "ds", uid=ALICE)
    assert service.run("stage", str(src), uid=ALICE).returncode == 0
    python = os.path.join(os.path.dirname(service.bin[0]), "python")
    code = f"from shmstage.loader import staged_path; print(staged_path({str(src)!r}))"
    r = subprocess.run(
        [*as_user(BOB), python, "-W", "error", "-c", code], env=service.env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout == f"{service.store}/ds\n", r.stderr


# --- one decision-maker ---------------------------------------------------------------------


def _dataset_bytes(store: Path) -> int:
    """Bytes of the datasets' files in ``store`` now: the published trees, then the partial
    ones being built.  In that order a tree published while this walks is counted at most
    once (missed by both walks at worst, never seen in both); a file gone meanwhile is not
    counted."""
    tops = [p for p in store.iterdir() if p.name != ".shmstage"]
    total = 0
    for top in [*tops, store / ".shmstage" / "partial"]:
        for folder, _, names in os.walk(top):  # a directory gone meanwhile: skipped
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(os.path.join(folder, name))
                    total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def test_concurrent_stagers_never_copy_twice_nor_overshoot_max_size(world, shmstage_bin, procs):
    """Item 5: two users staging one dataset at once get one copy (one of them copied);
    two datasets of 3 MiB each against a 4 MiB max_size at once: one is staged, the other
    refused, and the store never holds more than the cap."""
    store = world / "store"
    cap = 4 << 20
    svc = Service(
        world, shmstage_bin, procs,
        config=f"version: 1\ndest:\n  - path: {store}\n    cache: {{max_size: 4M}}\n",
    )  # fmt: skip
    svc.start(**{copier.SLOW_ENV: "0.05"})

    def both(argv_a: list[str], argv_b: list[str]) -> list[tuple[int, str, str]]:
        ps = [
            procs.start([*as_user(uid), *shmstage_bin, *argv], env=svc.env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for uid, argv in ((ALICE, argv_a), (BOB, argv_b))
        ]  # fmt: skip
        peak = 0
        while any(p.poll() is None for p in ps):
            data = store / ".shmstage"
            if data.exists():
                peak = max(peak, _dataset_bytes(store))
            time.sleep(0.01)
        out = [(p.returncode, *p.communicate(timeout=60)) for p in ps]
        assert peak <= cap, peak
        return out

    shared = make_ds(world / "data" / "shared", files=8, size=128 * 1024)
    got = both(["stage", str(shared), "--json"], ["stage", str(shared), "--json"])
    assert [rc for rc, _, _ in got] == [0, 0], got
    results = [json.loads(out) for _, out, _ in got]
    assert {r["path"] for r in results} == {str(store / "shared")}
    assert sorted(r["changed"] for r in results) == [False, True]
    assert svc.run("evict", "shared").returncode == 0

    a = make_ds(world / "data" / "a", files=12, size=256 * 1024)
    b = make_ds(world / "data" / "b", files=12, size=256 * 1024)
    got = both(["stage", str(a)], ["stage", str(b)])
    assert sorted(rc for rc, _, _ in got) == [0, 2], got
    refused = next(err for rc, _, err in got if rc == 2)
    assert refused.startswith("Error: ") and "max_size" in refused, refused
    assert sum((store / n).exists() for n in ("a", "b")) == 1


def test_one_user_cannot_crowd_out_the_others(service, world, procs):
    """Bob holding 70 silent connections: his next request is refused in one line; Alice is
    served meanwhile."""
    hog = (
        "import socket,sys\n"
        "from shmstage.service.client import connect\n"
        "from shmstage.errors import ShmstageError\n"
        "held=[socket.socket(socket.AF_UNIX) for _ in range(70)]\n"
        f"[s.connect({str(service.socket)!r}) for s in held]\n"
        "try:\n"
        "    connect()\n"
        "    print('served',flush=True)\n"
        "except ShmstageError as e:\n"
        "    print(e,flush=True)\n"
        "sys.stdin.read()\n"
    )
    p = procs.start(
        [*as_user(BOB), sys.executable, "-c", hog], env=service.env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout.readline() == (
        f"uid {BOB} already has 64 requests open with the shmstage service: wait for some to "
        "finish\n"
    )
    r = service.run("list", uid=ALICE)
    assert r.returncode == 0 and r.stdout == "nothing staged\n", r.stderr


def test_sigterm_mid_stage_stops_the_copy_tells_the_client_and_exits_0(world, shmstage_bin, procs):
    """SIGTERM while a stage runs: the child's copy is killed (its partial copy kept, to
    resume), the client gets one line and exit 1, the service removes its socket, exits 0."""
    svc = Service(world, shmstage_bin, procs)
    svc.start(**{copier.SLOW_ENV: "0.3"})
    src = make_ds(world / "data" / "ds", files=12, uid=ALICE)
    client = procs.start(
        [*as_user(ALICE), *shmstage_bin, "stage", str(src), "--workers", "1"],
        env=svc.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    partial = svc.store / ".shmstage" / "partial" / "ds"
    deadline = time.monotonic() + 60
    while len(list(partial.glob("f*"))) < 2:
        assert client.poll() is None and time.monotonic() < deadline, client.communicate()
        time.sleep(0.02)
    svc.proc.send_signal(signal.SIGTERM)
    out, err = client.communicate(timeout=60)
    assert client.returncode == 1 and out == ""
    assert err == (
        f"Error: the shmstage service on {svc.socket} stopped mid-request: run the command "
        "again (once it is back); a partial copy resumes\n"
    )
    assert svc.proc.wait(timeout=30) == 0
    assert not svc.socket.exists()
    assert partial.exists() and not (svc.store / "ds").exists()


def test_a_client_killed_mid_stage_stops_its_copy(world, shmstage_bin, procs):
    """The client SIGKILLed mid-copy: the service stops that request (the engine cleans up
    as on ^C: no partial, no copier left) and goes on serving."""
    svc = Service(world, shmstage_bin, procs)
    svc.start(**{copier.SLOW_ENV: "0.3"})
    src = make_ds(world / "data" / "ds", files=12, uid=ALICE)
    client = procs.start(
        [*as_user(ALICE), *shmstage_bin, "stage", str(src), "--workers", "1"],
        env=svc.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    partial = svc.store / ".shmstage" / "partial" / "ds"
    deadline = time.monotonic() + 60
    while len(list(partial.glob("f*"))) < 2:
        assert client.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    client.kill()
    client.wait()
    while partial.exists():
        assert time.monotonic() < deadline, "the copy went on without its client"
        time.sleep(0.05)
    assert not (svc.store / "ds").exists()
    while psutil.Process(svc.proc.pid).children(recursive=True):  # the child, its copier
        assert time.monotonic() < deadline, "a child of the service outlived its request"
        time.sleep(0.05)
    r = svc.run("stage", str(src), "-q", uid=ALICE)
    assert r.returncode == 0 and r.stdout == f"{svc.store}/ds\n", r.stderr


def test_the_node_configs_socket_is_used_by_service_and_clients(world, shmstage_bin, procs):
    """service.socket in the node config, no $SHMSTAGE_SOCKET: serve listens there and a
    user's stage finds it (the copy is made by the service, in root's store)."""
    sock = world / "sock" / "node.sock"
    svc = Service(world, shmstage_bin, procs)
    svc.config.write_text(f"version: 1\ndest: {svc.store}\nservice:\n  socket: {sock}\n")
    svc.env.pop("SHMSTAGE_SOCKET")
    svc.socket = sock
    svc.start()
    src = make_ds(world / "data" / "ds", uid=ALICE)
    r = svc.run("stage", str(src), "-q", uid=ALICE)
    assert r.returncode == 0 and r.stdout == f"{svc.store}/ds\n", r.stderr
    assert os.stat(svc.store).st_uid == 0


def test_list_through_the_service_shows_only_copies_the_caller_may_list(service, world):
    """alice's private dataset (her 0700 home): `list` shows it to alice and root, not to bob,
    who sees neither its name nor its source path."""
    home = world / "home" / "alice"
    make_ds(home / "secret-plans", uid=ALICE)
    own(home, ALICE)
    home.chmod(0o700)
    (world / "home").chmod(0o755)
    r = service.run("stage", str(home / "secret-plans"), uid=ALICE)
    assert r.returncode == 0, r.stderr
    for uid, shown in ((ALICE, True), (None, True), (BOB, False)):
        r = service.run("list", "--json", uid=uid)
        assert r.returncode == 0, r.stderr
        assert ("secret-plans" in r.stdout) is shown, (uid, r.stdout)


# --- grants taken back ------------------------------------------------------------------------

TEAM = 4560  # alice's home's group; bob is in it (in /etc/group, as the kernel would not say)


@pytest.fixture
def team_users(world):
    """alice and bob in /etc/passwd, bob a member of TEAM in /etc/group: copies bind-mounted
    over the real ones in this private mount namespace (the service's too), for as long as
    the test runs."""
    etc = world / "etc"
    etc.mkdir()
    passwd = Path("/etc/passwd").read_text()
    group = Path("/etc/group").read_text()
    (etc / "passwd").write_text(
        passwd + f"sst-alice:x:{ALICE}:{ALICE}::/:/bin/sh\nsst-bob:x:{BOB}:{BOB}::/:/bin/sh\n"
    )
    (etc / "group").write_text(
        group + f"sst-alice:x:{ALICE}:\nsst-bob:x:{BOB}:\nsst-team:x:{TEAM}:sst-alice,sst-bob\n"
    )
    mounted = []
    try:
        for name in ("passwd", "group"):
            (etc / name).chmod(0o644)
            subprocess.run(["mount", "--bind", str(etc / name), f"/etc/{name}"], check=True)
            mounted.append(f"/etc/{name}")
        yield
    finally:
        for path in reversed(mounted):
            subprocess.run(["umount", path], check=False)


def as_member(uid: int, *cmd: str) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={TEAM}", *cmd]


def test_a_grant_is_taken_back_once_its_user_no_longer_reaches_the_source(
    service, world, team_users
):
    """Alice's home (alice:TEAM, 0750) holds her dataset; bob (in TEAM) is handed the copy
    through the service (a grant).  A find or a stage by anyone re-checks him as himself and
    keeps him while he reaches the source; once alice closes her home (0700) the next find
    (alice's) takes his grant back, off the copy's top and its manifest and record; let in
    again, the next stage (alice's restage) takes it back too."""
    home = world / "home"
    src = make_ds(home / "ds", uid=ALICE)
    os.chown(home, ALICE, TEAM)
    home.chmod(0o750)
    assert service.run("stage", str(src), "-q", uid=ALICE).returncode == 0
    top = service.store / "ds"
    python = os.path.join(os.path.dirname(service.bin[0]), "python")
    find = f"from shmstage.loader import staged_path; print(staged_path({str(src)!r}))"

    def bob_reads() -> bool:
        r = subprocess.run(as_member(BOB, "cat", str(top / "f1")), capture_output=True)
        return r.returncode == 0

    def find_as(uid: int) -> None:
        cmd = as_member(uid, python, "-c", find)
        r = subprocess.run(cmd, env=service.env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout == f"{top}\n", r.stderr

    def named(path: Path) -> set[int]:
        try:
            raw = os.getxattr(path, "system.posix_acl_access")
        except OSError:
            return set()
        entries = [struct.unpack_from("<HHI", raw, o) for o in range(4, len(raw), 8)]
        return {uid for tag, _, uid in entries if tag == 0x02}

    meta = service.store / ".shmstage" / "meta" / "ds.json"
    assert not bob_reads()
    find_as(BOB)  # the service checks him at the source and lets him in
    assert bob_reads() and BOB in named(top) and BOB in named(meta)
    find_as(ALICE)  # re-checked as bob: he still reaches it
    assert service.run("stage", str(src), "-q", uid=ALICE).returncode == 0
    assert bob_reads() and BOB in named(top)

    home.chmod(0o700)  # alice shuts him out
    find_as(ALICE)
    assert not bob_reads()
    assert BOB not in named(top) and BOB not in named(meta)
    assert (top / "f1").read_bytes() == (src / "f1").read_bytes()  # the copy itself untouched

    home.chmod(0o750)
    find_as(BOB)
    assert bob_reads()
    home.chmod(0o700)
    r = service.run("stage", str(src), "-q", uid=ALICE)  # unchanged: the recheck
    assert r.returncode == 0, r.stderr
    assert not bob_reads() and BOB not in named(top)


def test_a_partial_stage_goes_through_the_service_and_the_user_reads_it_all(
    world, shmstage_bin, procs
):
    """`stage --partial` by a user on root's store: the service keeps what its max_size
    allows of the user's dataset in RAM (the user's own source read as the user); the user's
    DatasetFiles reads every file, the rest from the source as the user."""
    store = world / "store"
    svc = Service(
        world, shmstage_bin, procs,
        config=f"version: 1\ndest:\n  - path: {store}\n    cache: {{max_size: 150K}}\n",
    )  # fmt: skip
    svc.start()
    src = make_ds(world / "data" / "ds", files=6, size=50 * 1024, uid=ALICE)
    r = svc.run("stage", str(src), "--partial", "--json", uid=ALICE)
    assert r.returncode == 0, r.stderr
    ds = json.loads(r.stdout)
    assert 0 < ds["resident"] < 1 and ds["total_files"] == 6 and ds["path"] == str(store / "ds")
    assert os.stat(store).st_uid == 0  # staged by the service
    code = (
        "import sys; from shmstage.datasetfiles import DatasetFiles; f = DatasetFiles(sys.argv[1]);"
        "print(f.kind, sum(len(f.read(n)) for n in f.names))"
    )
    r = subprocess.run(
        [*as_user(ALICE), sys.executable, "-c", code, ds["path"]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["partial", str(6 * 50 * 1024)]


def test_the_service_loads_the_archive_codecs_before_it_reads_as_anyone():
    """A user's .tar.gz read through the service imports gzip while reading as that user, who
    may not be able to read the interpreter's library (a python under /root, 0700): the
    service imports the codecs, and what the commands load lazily, before its first fork."""
    code = (
        "import sys; from shmstage.service import ops; ops.warm_up(); "
        "print(sorted(m for m in ('tarfile', 'gzip', 'bz2', 'lzma', 'zlib', "
        "'concurrent.futures', 'shmstage.stage.build.untar') if m not in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout == "[]\n", r.stdout + r.stderr
