"""Object-store sources staged for a reader (issue 22 item 3): the caller's credentials are
used, never the service's, and the copy is the reader's alone unless shared.

Each stage runs in a fresh interpreter (obstore's runtime does not survive a fork), as root,
with ``reader=`` and ``credentials=`` as the node service passes them; moto checks every
request's signature."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shmstage.stage.sources.callerenv import caller_env

STAGE = """
import json, sys
from shmstage.identity import Caller, Share, adopt_groups
from shmstage.stage import engine
from shmstage.errors import ShmstageError
a = json.loads(sys.argv[1])
reader = Caller(a["uid"], a["gid"], tuple(a["groups"]))
adopt_groups(reader)
share = Share(**a["share"]) if a["share"] is not None else None
try:
    ds = engine.stage(a["src"], dest=a["dest"], reader=reader, credentials=a["creds"], share=share)
except ShmstageError as e:
    print(e, file=sys.stderr)
    sys.exit(e.exit_code)
print(ds.path)
"""

BOB = 4392
TEAM = 4393
CAROL = 4394


def test_the_service_environment_gives_way_to_the_callers():
    """Pure logic: the service's AWS_/GOOGLE_/AZURE_ variables are dropped, the caller's
    kept, the node's metadata credentials switched off, HOME the caller's."""
    base = {"PATH": "/bin", "AWS_ACCESS_KEY_ID": "root-key", "GOOGLE_BEARER_TOKEN": "t"}
    env = caller_env(base, {"AWS_ACCESS_KEY_ID": "bob-key", "PATH": "/evil"}, "/home/bob")
    assert env["PATH"] == "/bin" and env["AWS_ACCESS_KEY_ID"] == "bob-key"
    assert "GOOGLE_BEARER_TOKEN" not in env and env["HOME"] == "/home/bob"
    assert env["AWS_EC2_METADATA_DISABLED"] == "true" and env["NO_GCE_CHECK"] == "true"
    assert env["AZURE_SKIP_SIGNATURE"] == "true"
    forced = caller_env(base, {"AWS_EC2_METADATA_DISABLED": "false"}, "/h")
    assert forced["AWS_EC2_METADATA_DISABLED"] == "true" and "AWS_ACCESS_KEY_ID" not in forced


def test_a_token_file_read_later_as_root_is_refused():
    from shmstage.errors import RefusedError

    with pytest.raises(RefusedError, match="AWS_WEB_IDENTITY_TOKEN_FILE cannot be used"):
        caller_env({}, {"AWS_WEB_IDENTITY_TOKEN_FILE": "/root/token"}, "/h")


@pytest.fixture(scope="module")
def moto():
    """test_stage_s3's moto server (signatures checked), started for this module."""
    pytest.importorskip("obstore", reason="the s3 extra is not installed (pip install '.[s3]')")
    pytest.importorskip("boto3", reason="moto[server] is not installed")
    pytest.importorskip("moto", reason="moto[server] is not installed")
    from tests.test_stage_s3 import _moto_server

    yield from _moto_server(auth=True)


def service_env(m, with_keys: bool) -> dict[str, str]:
    """The service's own environment: none of the caller's keys (``with_keys``: its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["HOME"] = "/nonexistent"
    if with_keys:
        env.update(m.env())
    return env


def stage(
    m, dest: Path, creds: dict | None, share: dict | None, with_keys: bool = False, uid: int = BOB
):
    args = {
        "uid": uid, "gid": uid, "groups": [TEAM] if uid == BOB else [], "src": "s3://data/rd",
        "dest": str(dest), "creds": creds, "share": share,
    }  # fmt: skip
    return subprocess.run(
        [sys.executable, "-c", STAGE, json.dumps(args)],
        env=service_env(m, with_keys),
        capture_output=True,
        text=True,
        timeout=300,
    )


def callers(m) -> dict[str, str]:
    return {k: v for k, v in m.env().items() if k.startswith("AWS_")}


def modes(top: Path) -> set[tuple[str, int, int, int]]:
    out = set()
    for p in [top, *top.rglob("*")]:
        st = p.lstat()
        out.add(("d" if p.is_dir() else "f", st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)))
    return out


@pytest.mark.root
def test_a_readers_copy_is_theirs_alone(moto, open_tmp_path):
    """With the caller's credentials (the service has none): owner bob, dirs 0700, files 0600."""
    moto.put("rd/a.bin", b"a" * 100)
    moto.put("rd/sub/b.bin", b"b" * 200)
    dest = open_tmp_path / "dest"
    done = stage(moto, dest, callers(moto), None)
    assert done.returncode == 0, done.stderr
    assert modes(dest / "rd") == {("d", BOB, BOB, 0o700), ("f", BOB, BOB, 0o600)}
    assert (dest / "rd" / "sub" / "b.bin").read_bytes() == b"b" * 200


@pytest.mark.root
def test_a_copy_shared_with_a_group_is_that_groups(moto, open_tmp_path):
    """Share(gid=TEAM): group TEAM, dirs 0750, files 0640."""
    moto.put("rd/a.bin", b"a" * 100)
    dest = open_tmp_path / "dest"
    done = stage(moto, dest, callers(moto), {"gid": TEAM})
    assert done.returncode == 0, done.stderr
    assert {m[1:] for m in modes(dest / "rd")} >= {(BOB, TEAM, 0o750), (BOB, TEAM, 0o640)}
    assert {m[1:] for m in modes(dest / "rd")} <= {(BOB, TEAM, 0o750), (BOB, TEAM, 0o640)}


@pytest.mark.root
def test_a_reader_without_credentials_never_gets_the_services(moto, open_tmp_path):
    """The service has working keys, the caller none: refused (no credentials), nothing
    staged."""
    moto.put("rd/a.bin", b"a" * 100)
    dest = open_tmp_path / "dest"
    done = stage(moto, dest, None, None, with_keys=True)
    assert done.returncode == 14, (done.returncode, done.stderr)
    assert done.stderr.startswith("no credentials for s3://data/rd"), done.stderr
    assert not (dest / "rd").exists()


@pytest.mark.root
def test_a_second_user_of_an_unshared_copy_is_refused_naming_the_way_out(moto, open_tmp_path):
    """bob's copy of s3://data/rd is his alone: carol, with valid keys of her own, is refused
    in one line (exit 2) by stage and by staged_path, instead of getting a path she cannot
    read; shared with her group, she gets it."""
    moto.put("rd/a.bin", b"a" * 100)
    dest = open_tmp_path / "dest"
    assert stage(moto, dest, callers(moto), None).returncode == 0
    line = (
        f"rd is uid {BOB}'s copy of s3://data/rd; it is not shared with you: ask an admin to "
        "add it to shares: in the node config, or stage it under another --name"
    )
    done = stage(moto, dest, callers(moto), None, uid=CAROL)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")
    find = (
        "import sys\nfrom shmstage.loader import staged_path\nfrom shmstage.errors import "
        f"ShmstageError\ntry:\n    print(staged_path('s3://data/rd', dest={str(dest)!r}))\n"
        "except ShmstageError as e:\n    sys.exit(str(e))\n"
    )
    env = {**service_env(moto, False), "SHMSTAGE_SOCKET": str(open_tmp_path / "no.sock")}
    done = subprocess.run(
        ["setpriv", f"--reuid={CAROL}", f"--regid={CAROL}", "--clear-groups",
         sys.executable, "-c", find],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (1, "", line + "\n")
    plan = STAGE.replace("ds = engine.stage(", "ds = engine.plan(").replace(", share=share)", ")")
    plan = plan.replace("print(ds.path)", "print(ds.tier)")  # the service's find checks this way
    args = {"uid": CAROL, "gid": CAROL, "groups": [], "src": "s3://data/rd", "dest": str(dest),
            "creds": callers(moto), "share": None}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", plan, json.dumps(args)],
        env=service_env(moto, False), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")
    shared = stage(moto, dest, callers(moto), {"everyone": True}, uid=CAROL)
    assert shared.returncode == 0, shared.stderr
