"""`shmstage stage / list / verify / evict`: output contract, exit codes, exact error lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shmstage.stage.build import copier


def make_src(root: Path) -> Path:
    (root / "c1").mkdir(parents=True)
    (root / "c1" / "a.jpg").write_bytes(b"a" * 3000)
    (root / "c1" / "b.jpg").write_bytes(b"b" * 5000)
    (root / "README").write_text("hi\n")
    return root


def test_stage_prints_path_as_last_line(runner, cli, tmp_path):
    """The staged path is the only stdout line with --quiet, and stderr stays empty."""
    src = make_src(tmp_path / "ds")
    dest = tmp_path / "dest"
    r = runner.invoke(cli, ["stage", str(src), "--dest", str(dest), "--quiet"])
    assert r.exit_code == 0, r.output
    assert r.stdout == f"{dest / 'ds'}\n" and r.stderr == ""
    assert (dest / "ds" / "c1" / "b.jpg").read_bytes() == b"b" * 5000


def test_stage_summary_goes_to_stderr(runner, cli, tmp_path):
    """Without --quiet a one-line summary goes to stderr (not a tty: no progress bar)."""
    src = make_src(tmp_path / "ds")
    dest = tmp_path / "dest"
    r = runner.invoke(cli, ["stage", str(src), "--dest", str(dest), "--name", "x"])
    assert r.exit_code == 0
    assert r.stdout == f"{dest / 'x'}\n"
    assert r.stderr.startswith("staged x: 3 files, 7.8 KiB (7.8 KiB copied) in ")
    r = runner.invoke(cli, ["stage", str(src), "--dest", str(dest), "--name", "x"])
    assert r.stderr.startswith("x is up to date (3 files, 7.8 KiB) in ")


def test_stage_json(runner, cli, tmp_path):
    """--json prints one JSON document and nothing else on stdout."""
    src = make_src(tmp_path / "ds")
    r = runner.invoke(cli, ["stage", str(src), "--dest", str(tmp_path / "d"), "--json"])
    doc = json.loads(r.stdout)
    assert (
        doc["name"] == "ds"
        and doc["files"] == 3
        and doc["bytes"] == 8003
        and doc["changed"] is True
    )
    assert set(doc) == {
        "name",
        "source",
        "path",
        "bytes",
        "files",
        "staged_at",
        "last_used",
        "changed",
        "copied_bytes",
        "seconds",
        "resident",  # stage --partial: the fraction in RAM, and the whole dataset's size
        "total_bytes",
        "total_files",
        "tier",  # DEST may list tiers (docs/cache.md)
        "tier_index",
        "skipped",
        "evicted",
        "notes",
    }


def test_dest_from_environment(runner, cli, tmp_path, monkeypatch):
    """SHMSTAGE_DEST sets the default destination."""
    monkeypatch.setenv("SHMSTAGE_DEST", str(tmp_path / "envdest"))
    r = runner.invoke(cli, ["stage", str(make_src(tmp_path / "ds")), "--quiet"])
    assert r.stdout == f"{tmp_path / 'envdest' / 'ds'}\n"


def test_empty_tier_in_dest_is_one_error_line(runner, cli, tmp_path):
    """An empty tier in a --dest list (two commas) is refused before anything is written."""
    src = make_src(tmp_path / "ds")
    r = runner.invoke(cli, ["stage", str(src), "--dest", f"{tmp_path / 'a'},,{tmp_path / 'b'}"])
    assert r.exit_code == 2
    assert r.stderr == (
        f"Error: invalid destination '{tmp_path / 'a'},,{tmp_path / 'b'}': an empty tier; list "
        "tiers fastest first, separated by commas, e.g. /dev/shm/shmstage,/local/nvme/shmstage\n"
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_missing_source_error(runner, cli, tmp_path):
    """A missing source: exact error line, exit 2."""
    r = runner.invoke(cli, ["stage", str(tmp_path / "nope"), "--dest", str(tmp_path / "d")])
    assert r.exit_code == 2
    assert r.stderr == f"Error: source {tmp_path / 'nope'} does not exist\n"


def test_plain_file_source_error(runner, cli, tmp_path):
    """A regular file that is not a tar archive is refused."""
    (tmp_path / "x.txt").write_text("x")
    r = runner.invoke(cli, ["stage", str(tmp_path / "x.txt"), "--dest", str(tmp_path / "d")])
    assert r.exit_code == 2
    assert r.stderr == (
        f"Error: source {tmp_path / 'x.txt'} is not a tar archive (unknown data); "
        "stage a directory or a tar archive (plain, gzip, bzip2 or xz)\n"
    )


def test_bad_name_error(runner, cli, tmp_path):
    """An unsafe --name is refused with exit 2."""
    r = runner.invoke(
        cli,
        ["stage", str(make_src(tmp_path / "ds")), "--dest", str(tmp_path / "d"), "--name", "../x"],
    )
    assert r.exit_code == 2
    assert r.stderr == (
        "Error: invalid dataset name '../x': use letters, digits, '.', '_', '-' or '+' "
        "(at most 200, not starting with '.' or '-')\n"
    )


def test_dest_inside_source_refused(runner, cli, tmp_path):
    """Staging a tree into itself is refused."""
    src = make_src(tmp_path / "ds")
    r = runner.invoke(cli, ["stage", str(src), "--dest", str(src / "inner")])
    assert r.exit_code == 2
    assert (
        r.stderr
        == f"Error: source {src} and destination {src / 'inner'} overlap; stage to a separate directory\n"
    )
    assert not (src / "inner").exists()


def test_bad_verify_mode_is_usage_error(runner, cli, tmp_path):
    """--verify takes size or checksum only."""
    r = runner.invoke(cli, ["stage", str(tmp_path), "--verify", "md5"])
    assert r.exit_code == 2 and "'md5' is not one of 'size', 'checksum'" in r.stderr


def test_list_and_json(runner, cli, tmp_path):
    """list shows staged datasets as a table and as JSON."""
    dest = tmp_path / "d"
    assert runner.invoke(cli, ["list", "--dest", str(dest)]).stdout == "nothing staged\n"
    runner.invoke(cli, ["stage", str(make_src(tmp_path / "ds")), "--dest", str(dest), "--quiet"])
    r = runner.invoke(cli, ["list", "--dest", str(dest)])
    assert r.stdout.splitlines()[0].split() == [
        "NAME",
        "SIZE",
        "FILES",
        "STAGED",
        "LAST",
        "USED",
        "STATE",
        "SOURCE",
    ]
    assert r.stdout.splitlines()[2].split()[:4] == ["ds", "7.8", "KiB", "3"]
    assert r.stdout.splitlines()[2].split()[-2:] == ["staged", str(tmp_path / "ds")]
    docs = json.loads(runner.invoke(cli, ["list", "--dest", str(dest), "--json"]).stdout)
    assert [(d["name"], d["files"], d["source"]) for d in docs] == [("ds", 3, str(tmp_path / "ds"))]


def test_verify_exit_codes(runner, cli, tmp_path):
    """verify: exit 0 when intact, exit 3 with the list when a byte flipped (--checksum)."""
    dest = tmp_path / "d"
    runner.invoke(cli, ["stage", str(make_src(tmp_path / "ds")), "--dest", str(dest), "--quiet"])
    ok = runner.invoke(cli, ["verify", "ds", "--dest", str(dest), "--checksum"])
    assert (
        ok.exit_code == 0
        and ok.stdout == "OK ds: 3 files match (every byte compared with the source)\n"
    )
    f = dest / "ds" / "c1" / "a.jpg"
    st = f.stat()
    f.write_bytes(b"a" * 2999 + b"X")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    bad = runner.invoke(cli, ["verify", "ds", "--dest", str(dest), "--checksum"])
    assert bad.exit_code == 3
    assert "content  c1/a.jpg  bytes differ from the source" in bad.stdout
    assert (
        bad.stdout.splitlines()[-1]
        == "FAIL ds: 1 difference(s) (every byte compared with the source)"
    )
    doc = json.loads(
        runner.invoke(cli, ["verify", "ds", "--dest", str(dest), "--checksum", "--json"]).stdout
    )
    assert doc["ok"] is False and doc["differences"] == [
        {"path": "c1/a.jpg", "problem": "content", "detail": "bytes differ from the source"}
    ]


def test_verify_unknown_name(runner, cli, tmp_path):
    """verify of a dataset that is not staged: exact error, exit 1."""
    r = runner.invoke(cli, ["verify", "nope", "--dest", str(tmp_path)])
    assert r.exit_code == 1
    assert r.stderr == f"Error: nope is not staged in {tmp_path} (see `shmstage list`)\n"


def test_evict_cli(runner, cli, tmp_path):
    """evict NAME removes it; --dry-run removes nothing; selectors are exclusive."""
    dest = tmp_path / "d"
    runner.invoke(cli, ["stage", str(make_src(tmp_path / "ds")), "--dest", str(dest), "--quiet"])
    r = runner.invoke(cli, ["evict", "--all", "--dest", str(dest), "--dry-run"])
    assert r.stdout == "would evict: ds\n" and (dest / "ds").exists()
    r = runner.invoke(cli, ["evict", "ds", "--all", "--dest", str(dest)])
    assert r.exit_code == 2 and "give exactly one of NAME, --all or --older-than" in r.stderr
    r = runner.invoke(cli, ["evict", "ds", "--dest", str(dest)])
    assert r.exit_code == 0 and r.stdout == "evicted: ds\n" and not (dest / "ds").exists()
    r = runner.invoke(cli, ["evict", "--older-than", "1d", "--dest", str(dest), "--json"])
    assert json.loads(r.stdout)["evicted"] == []


@pytest.mark.root
def test_capacity_error_line(runner, cli, tmpfs, tmp_path):
    """The capacity refusal is one line with the numbers and the remount command; exit 2."""
    src = tmp_path / "big"
    src.mkdir()
    (src / "a.bin").write_bytes(b"\1" * (6 << 20))
    shm = tmpfs("4M")
    r = runner.invoke(cli, ["stage", str(src), "--dest", str(shm / "d"), "--reserve", "1M"])
    assert r.exit_code == 2
    assert r.stderr.startswith(
        "Error: dataset does not fit: needs 6.0 MiB + 1.0 MiB reserve but only "
    )
    assert f"`shmstage remount --path {shm} --size " in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_make_tasks_batches_small_and_chunks_big():
    """Small files go in batches; big files are split into chunks listed first."""
    jobs = [("s", "d", 10, 0, 0, 0o644, f"f{i}") for i in range(600)]
    jobs.append(("s", "d", 5 * copier.CHUNK, 0, 0, 0o644, "big"))
    tasks, chunked = copier.make_tasks(jobs)
    assert chunked == [600]
    assert [t.length for t in tasks[:5]] == [copier.CHUNK] * 5
    assert [(t.first, t.last) for t in tasks[5:]] == [(0, 256), (256, 512), (512, 600)]


def test_threaded_walk_matches_serial_walk(tmp_path):
    """The thread-pool scan (network file systems) yields exactly the serial scan's entries."""
    from shmstage.stage.sources.walk import walk

    for c in range(5):
        d = tmp_path / "ds" / f"c{c}" / "sub"
        d.mkdir(parents=True)
        for i in range(7):
            (d / f"f{i}").write_bytes(b"x" * i)
        (d / "ln").symlink_to("f1")
    serial = walk(str(tmp_path / "ds"), threads=1)
    threaded = walk(str(tmp_path / "ds"), threads=4)
    assert threaded.entries == serial.entries and len(serial.entries) == 1 + 5 * (2 + 8)


def test_batches_are_dealt_across_directories():
    """Concurrent batches land in different directories (tmpfs locks a directory on create)."""
    jobs = [("s", "d", 10, 0, 0, 0o644, f"c{c}/f{i}") for c in range(3) for i in range(300)]
    tasks, _ = copier.make_tasks(jobs)
    firsts = [jobs[t.first][6].split("/")[0] for t in tasks]
    assert firsts == ["c0", "c1", "c2", "c0", "c1", "c2"]
    assert sorted((t.first, t.last) for t in tasks) == [
        (0, 256),
        (256, 300),
        (300, 556),
        (556, 600),
        (600, 856),
        (856, 900),
    ]


def test_user_chosen_names_reach_the_terminal_escaped(runner, cli, tmp_path):
    """A source path carrying terminal escapes (OSC: set the title, write the clipboard) is
    printed escaped, in an error line and in `list`'s SOURCE column; JSON keeps it exact."""
    bad = "x\x1b]0;PWNED\x07y"
    src = tmp_path / bad
    src.mkdir()
    (src / "a").write_text("a")
    os.mkfifo(src / f"{bad}.fifo")
    dest = tmp_path / "d"
    r = runner.invoke(cli, ["stage", str(src), "--dest", str(dest), "--name", "ds", "-q"])
    assert r.exit_code == 2
    assert "\x1b" not in r.output and "\x07" not in r.output
    assert "named pipe at" in r.output and "x\\x1b]0;PWNED\\x07y.fifo" in r.output
    os.unlink(src / f"{bad}.fifo")
    r = runner.invoke(cli, ["stage", str(src), "--dest", str(dest), "--name", "ds", "-q"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["list", "--dest", str(dest)])
    assert r.exit_code == 0
    assert "\x1b" not in r.output and "x\\x1b]0;PWNED\\x07y" in r.output
    r = runner.invoke(cli, ["list", "--dest", str(dest), "--json"])
    assert json.loads(r.output)[0]["source"] == str(src)


@pytest.mark.parametrize("command", [["stage", "SRC", "--dest", "DEST"], ["run"], ["inspect"]])
@pytest.mark.parametrize("value", ["100%", "100.0%"])
def test_a_100_percent_reserve_is_refused_as_the_config_refuses_it(
    runner, cli, tmp_path, command, value
):
    """--reserve 100% leaves nothing to stage into: refused up front (exit 2) with the words
    the node config's `reserve: 100%` gets, not "does not fit" after looking."""
    src = make_src(tmp_path)
    argv = [str(src) if a == "SRC" else str(tmp_path / "d") if a == "DEST" else a for a in command]
    r = runner.invoke(cli, [*argv, "--reserve", value] + (["--", "true"] if command == ["run"] else []))
    assert r.exit_code == 2, r.output
    assert (
        f"invalid reserve '{value}': a percentage must be above 0% and below 100% of the tmpfs "
        "(0 for no reserve)"
    ) in r.output
    assert not (tmp_path / "d").exists()
