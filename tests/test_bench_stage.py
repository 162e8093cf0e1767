"""The staging benchmark library: peers copy correctly, results add up, the read throttle is set and removed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shmstage.bench import stage as bench
from shmstage.errors import RefusedError

PEERS = ("cp", "rsync", "tar")


def _make_tree(root: Path) -> Path:
    """A small dataset with nested dirs, an empty file and dir, odd modes, a relative symlink."""
    src = root / "src"
    for cls in ("n01", "n02", "n03"):
        (src / cls).mkdir(parents=True)
        for i in range(7):
            (src / cls / f"img{i}.JPEG").write_bytes(os.urandom(1000 * i + 17))
    (src / "empty.txt").write_bytes(b"")
    (src / "emptydir").mkdir()
    (src / "n01" / "img1.JPEG").chmod(0o600)
    os.utime(src / "n02" / "img2.JPEG", (1_000_000_000, 1_000_000_000))
    (src / "latest").symlink_to("n03/img6.JPEG")
    return src


def _snapshot(root: Path) -> dict[str, tuple]:
    """Everything a faithful copy keeps: type, bytes, mode, mtime, link target."""
    out: dict[str, tuple] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            out[rel] = ("dir", st.st_mode)
        else:
            out[rel] = ("file", path.read_bytes(), st.st_mode, int(st.st_mtime))
    return out


def _fake_shmstage(tmp_path: Path, drop: str | None = None) -> list[str]:
    """A stand-in `shmstage` that copies SRC to DEST/<name> (minus file ``drop``) and prints the path."""
    script = tmp_path / "fake_shmstage.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import shutil, sys, os
            args = sys.argv[1:]
            assert args[0] == "stage", args
            src, dest, name = args[1], args[args.index("--dest") + 1], args[args.index("--name") + 1]
            out = os.path.join(dest, name)
            shutil.copytree(src, out, symlinks=True)
            if {drop!r}:
                os.remove(os.path.join(out, {drop!r}))
            print("staging...")
            print(out)
            """
        )
    )
    return [sys.executable, str(script)]


@pytest.mark.parametrize("tool", PEERS)
def test_peer_command_makes_an_exact_copy(tmp_path: Path, tool: str) -> None:
    """Each peer's command copies the tree exactly: bytes, modes, mtimes, symlinks, empty dirs."""
    src = _make_tree(tmp_path)
    dest = tmp_path / tool
    dest.mkdir()
    subprocess.run(bench.tool_argv(tool, src, dest), check=True)
    assert _snapshot(dest) == _snapshot(src)


def test_cat_reads_without_writing(tmp_path: Path) -> None:
    """The read-limit command succeeds and writes nothing into the destination."""
    src = _make_tree(tmp_path)
    dest = tmp_path / "cat"
    dest.mkdir()
    proc = subprocess.run(bench.tool_argv("cat", src, dest, cat_jobs=3), capture_output=True)
    assert proc.returncode == 0 and proc.stdout == b""
    assert list(dest.iterdir()) == []


def test_cat_reads_a_few_big_files_in_parallel() -> None:
    """Parallel cat reads with every job it has: 4 shards are 4 cats at once (64 files per
    cat made it one cat reading them one by one, a limit lower than the disk's)."""
    assert bench.cat_batch(4, 8) == 1
    assert bench.cat_batch(20, 8) == 3  # 7 cats
    assert bench.cat_batch(50_000, 8) == 64
    assert bench.cat_batch(0, 8) == 1


def test_benchmark_result_fields(tmp_path: Path) -> None:
    """One run of every tool gives one time each, a median, MB/s and files/s from the source size, and ratios vs shmstage."""
    src = _make_tree(tmp_path)
    summary = bench.tree_summary(src)
    assert (summary.files, summary.dirs, summary.links) == (22, 4, 1)
    result = bench.run_stage_benchmark(
        src, tmp_path / "dest", runs=1, shmstage_cmd=_fake_shmstage(tmp_path)
    )
    assert [r.tool for r in result.tools] == list(bench.TOOLS)
    assert (result.files, result.bytes, result.runs) == (summary.files, summary.bytes, 1)
    assert not result.drop_caches and result.throttle_bps is None
    base = result.get("shmstage").median_s
    for r in result.tools:
        assert len(r.times) == 1 and r.median_s == r.times[0] > 0
        assert r.mb_per_s == pytest.approx(summary.bytes / r.median_s / 1e6)
        assert r.files_per_s == pytest.approx(summary.files / r.median_s)
        assert r.vs_shmstage == pytest.approx(r.median_s / base)
    assert result.get("rsync").command == "rsync -a SRC/ DEST/"
    assert not (tmp_path / "dest").exists(), "the benchmark leaves nothing behind"


def test_baseline_runs_another_checkouts_shmstage_side_by_side(tmp_path: Path) -> None:
    """The tool ``baseline`` stages with the shmstage package of another checkout (here this
    one's, copied and marked), also when run from a checkout's root (where ``python -m``
    would find that one's first), checked like shmstage's copy; without a checkout it is
    refused."""
    src = _make_tree(tmp_path)
    other = tmp_path / "before"
    shutil.copytree(Path(bench.__file__).parents[1], other / "shmstage")
    main = other / "shmstage" / "__main__.py"
    main.write_text("import sys\nprint('BASELINE', file=sys.stderr)\n" + main.read_text())
    argv = bench.tool_argv("baseline", src, tmp_path / "x", baseline=other)
    assert argv[0] == sys.executable and argv[3] == str(other) and argv[4] == "stage"
    here = Path(bench.__file__).parents[2]  # this checkout's root: its shmstage in '.'
    ran = subprocess.run(
        [*argv[:4], "--version"], capture_output=True, text=True, check=True, cwd=here
    )
    assert ran.stderr == "BASELINE\n" and ran.stdout.startswith("shmstage"), ran
    result = bench.run_stage_benchmark(
        src, tmp_path / "dest", tools=("shmstage", "baseline"), runs=1, baseline=other
    )
    assert [r.tool for r in result.tools] == ["shmstage", "baseline"]
    assert result.get("baseline").label == "shmstage (baseline)"
    with pytest.raises(RefusedError, match="baseline=CHECKOUT"):
        bench.run_stage_benchmark(src, tmp_path / "dest", tools=("baseline",), runs=1)


def test_runs_are_interleaved_round_robin(tmp_path: Path) -> None:
    """Tools alternate within each round and the order rotates between rounds; no ratios without shmstage."""
    src = _make_tree(tmp_path)
    lines: list[str] = []
    result = bench.run_stage_benchmark(
        src, tmp_path / "dest", tools=("cp", "tar"), runs=3, progress=lines.append
    )
    order = [(line.split()[1], line.split()[2]) for line in lines]
    assert order == [
        ("1/3", "cp"),
        ("1/3", "tar"),
        ("2/3", "tar"),
        ("2/3", "cp"),
        ("3/3", "cp"),
        ("3/3", "tar"),
    ]
    assert all(len(r.times) == 3 and r.vs_shmstage is None for r in result.tools)
    assert result.get("cp").median_s == sorted(result.get("cp").times)[1]


def test_wrong_copy_is_caught(tmp_path: Path) -> None:
    """A tool whose copy lacks a file fails the benchmark with the counts, instead of timing a wrong copy."""
    src = _make_tree(tmp_path)
    fake = _fake_shmstage(tmp_path, drop="n01/img3.JPEG")
    with pytest.raises(
        bench.BenchError,
        match=r"shmstage stage made a wrong copy at .*: 21 files, .*the source has 22",
    ):
        bench.run_stage_benchmark(
            src, tmp_path / "dest", tools=("shmstage",), runs=1, shmstage_cmd=fake
        )
    assert not (tmp_path / "dest").exists()


def test_failing_tool_reports_its_error(tmp_path: Path) -> None:
    """A tool that exits non-zero fails the benchmark with its last stderr line."""
    src = _make_tree(tmp_path)
    with pytest.raises(bench.BenchError, match=r"^shmstage stage failed: boom: disk on fire$"):
        bench.run_stage_benchmark(
            src,
            tmp_path / "dest",
            tools=("shmstage",),
            runs=1,
            shmstage_cmd=[
                sys.executable,
                "-c",
                "import sys; sys.exit('warming up\\nboom: disk on fire')",
            ],
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tools": ("cp", "scp")},
            r"bad tool list \['cp', 'scp'\]: choose distinct tools from cp, rsync, tar, cat, shmstage",
        ),
        ({"runs": 0}, "runs must be at least 1, not 0"),
        (
            {"throttle_bps": 10**8},
            "a read throttle only shows with a cold page cache: also pass drop_caches=True",
        ),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    """Bad tool lists, run counts and a throttle on a warm cache are refused before anything runs."""
    src = _make_tree(tmp_path)
    with pytest.raises(RefusedError, match=f"^{message}$"):
        bench.run_stage_benchmark(src, tmp_path / "dest", **kwargs)
    assert not (tmp_path / "dest").exists()


def test_source_must_be_a_directory_outside_the_destination(tmp_path: Path) -> None:
    """A missing source and a destination inside the source are refused."""
    src = _make_tree(tmp_path)
    with pytest.raises(RefusedError, match="is not a directory"):
        bench.run_stage_benchmark(tmp_path / "nope", tmp_path / "dest")
    with pytest.raises(RefusedError, match="is inside the source"):
        bench.run_stage_benchmark(src, src / "out")


def test_markdown_table(tmp_path: Path) -> None:
    """The table has a row per tool, escapes the pipe in `tar | tar`, and shows shmstage's speedup per peer."""

    def tool(name: str, times: tuple[float, ...], ratio: float | None) -> bench.ToolResult:
        med = sorted(times)[len(times) // 2]
        return bench.ToolResult(
            name, bench.LABELS[name], "", times, med, 2e9 / med / 1e6, 20000 / med, ratio
        )

    result = bench.StageBenchResult(
        "/src",
        "/dst",
        20000,
        2 * 10**9,
        3,
        True,
        None,
        (tool("shmstage", (1.0, 1.1, 0.9), 1.0), tool("tar", (2.5, 2.4, 2.6), 2.5)),
    )
    assert bench.format_markdown(result).splitlines() == [
        "| tool | median s | runs min–max s | MB/s | files/s | shmstage speedup |",
        "|---|---:|---:|---:|---:|---:|",
        "| shmstage stage | 1.00 | 0.90–1.10 | 2,000 | 20,000 | — |",
        r"| tar \| tar | 2.50 | 2.40–2.60 | 800 | 8,000 | 2.50× |",
    ]


def test_whole_disk_of_a_partition(tmp_path: Path) -> None:
    """A partition resolves to its whole disk's MAJ:MIN; a device with no block node is refused."""
    sys_root = tmp_path / "sys"
    disk = sys_root / "devices" / "pci0" / "block" / "sda"
    (disk / "sda1").mkdir(parents=True)
    (disk / "dev").write_text("8:0\n")
    (disk / "sda1" / "dev").write_text("8:1\n")
    (disk / "sda1" / "partition").write_text("1\n")
    (sys_root / "dev" / "block").mkdir(parents=True)
    (sys_root / "dev" / "block" / "8:1").symlink_to(disk / "sda1")
    (sys_root / "dev" / "block" / "8:0").symlink_to(disk)
    assert bench.whole_disk(8, 1, str(sys_root)) == "8:0"
    assert bench.whole_disk(8, 0, str(sys_root)) == "8:0"
    with pytest.raises(
        RefusedError,
        match=r"^/x is not on a block device \(device 0:42\): a read throttle needs a local disk$",
    ):
        bench.whole_disk(0, 42, str(sys_root), what="/x")


def _on_block_device(path: Path) -> bool:
    try:
        bench.block_device(path)
    except RefusedError:
        return False
    return True


@pytest.mark.root
def test_throttle_cgroup_is_set_and_removed(tmp_path: Path) -> None:
    """The throttle writes `MAJ:MIN BPS` for the source's disk, puts children in the group, and removes it."""
    if not _on_block_device(tmp_path):
        pytest.skip("tmp_path is not on a block device")
    device = bench.block_device(tmp_path)
    with bench.blkio_throttle(tmp_path, 123_456_789, name="shmstage-test") as t:
        assert t.device == device and t.cgroup.is_dir()
        if t.version == 1:
            assert (
                t.cgroup / "blkio.throttle.read_bps_device"
            ).read_text() == f"{device} 123456789\n"
        else:
            assert f"{device} rbps=123456789 " in (t.cgroup / "io.max").read_text()
        out = subprocess.run(
            ["cat", "/proc/self/cgroup"], capture_output=True, text=True, preexec_fn=t.enter
        )
        assert f"/{t.cgroup.name}\n" in out.stdout
        assert str(os.getpid()) not in (t.cgroup / "cgroup.procs").read_text().split()
    assert not t.cgroup.exists()


@pytest.mark.root
def test_cold_cache_throttled_benchmark(tmp_path: Path) -> None:
    """With drop_caches and a throttle, peers run (cold, inside the group) and the group is gone afterwards."""
    if not _on_block_device(tmp_path):
        pytest.skip("tmp_path is not on a block device")
    src = _make_tree(tmp_path)
    result = bench.run_stage_benchmark(
        src, tmp_path / "dest", tools=("cat", "cp"), runs=1, drop_caches=True, throttle_bps=10**9
    )
    assert result.drop_caches and result.throttle_bps == 10**9
    assert all(len(r.times) == 1 for r in result.tools)
    group_root = Path("/sys/fs/cgroup/blkio")
    assert not list(group_root.glob(f"shmstage-bench-{os.getpid()}"))


def _has_stage_command() -> bool:
    exe = shutil.which("shmstage", path=os.path.dirname(sys.executable))
    if not exe:
        return False
    return subprocess.run([exe, "stage", "--help"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_stage_command(), reason="`shmstage stage` is not built yet")
def test_real_shmstage_runs_in_the_benchmark(tmp_path: Path) -> None:
    """The real `shmstage stage` makes a correct copy under the benchmark and gets a ratio vs cp."""
    src = _make_tree(tmp_path)
    result = bench.run_stage_benchmark(src, tmp_path / "dest", tools=("cp", "shmstage"), runs=1)
    assert result.get("shmstage").vs_shmstage == 1.0
    assert result.get("cp").vs_shmstage > 0


@pytest.mark.root
def test_script_writes_its_docs_section_and_json(tmp_path: Path) -> None:
    """benchmarks/stage.py replaces only the Staging section, with the command and machine, and writes JSON."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "stage.py"
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n\n## Staging\n\nold table\n\n## Loader\n\nkeep me\n")
    workdir = tmp_path / "work"
    args = ["--scale", "0.002", "--runs", "1", "--tools", "cp,cat", "--shapes", "tiny"]
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            *args,
            "--workdir",
            str(workdir),
            "--write-docs",
            str(doc),
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n## Staging\n\n_(benchmarks/stage.py)_\n")
    assert text.endswith("\n## Loader\n\nkeep me\n") and "old table" not in text
    assert "Command (as root): `.venv/bin/python benchmarks/stage.py --scale 0.002 --runs 1" in text
    assert "### Many tiny files: 100 files, 0.00 GB" in text and "| cp -a |" in text
    assert "GiB RAM" in text and "dropped before every run" in text
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["cold_cache"] is True
    assert [t["tool"] for t in result["shapes"]["tiny"]["tools"]] == ["cp", "cat"]
    assert not workdir.exists(), (
        "generated data and the tmpfs mount point are removed without --keep"
    )
