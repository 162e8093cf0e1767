"""`shmstage demo`: the dataset generator, the page-cache helpers, and the whole flow end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from shmstage.demo import busy_note as _busy_note
from shmstage.demo import cached_share, evict_from_page_cache
from shmstage.demo import prepare_dataset as _prepare_dataset
from shmstage.demo.dataset import ImageFolder, ImagenetTrain, generate
from shmstage.errors import ShmstageError

pytest.importorskip("torch")
pytest.importorskip("PIL")

ROWS = ("node", "inspect", "Pillow", "dataset", "staging", "original run", "staged run", "speed-up")
ROWS += ("first step", "pays back", "loader settings", "next", "cleanup")


def test_generate_is_deterministic_with_photo_like_sizes(tmp_path: Path) -> None:
    """The same seed gives byte-identical JPEGs in class folders, sized like photos (50-150 KB typical)."""
    a = generate(tmp_path / "a", images=30, classes=3, seed=7)
    b = generate(tmp_path / "b", images=30, classes=3, seed=7)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jpg"))
    assert [str(p) for p in files_a[:2]] == ["class_000/img_000000.jpg", "class_000/img_000003.jpg"]
    assert len(files_a) == 30 and a.bytes == b.bytes and a.classes == 3
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    sizes = sorted((tmp_path / "a" / rel).stat().st_size for rel in files_a)
    assert 50_000 <= sizes[len(sizes) // 2] <= 150_000
    assert generate(tmp_path / "c", images=30, classes=3, seed=8).bytes != a.bytes


def test_image_folder_reads_classes_with_imagenet_transform(tmp_path: Path) -> None:
    """ImageFolder labels images by sorted class folder and yields normalized 3x224x224 float32."""
    generate(tmp_path / "d", images=6, classes=2)
    ds = ImageFolder(tmp_path / "d", ImagenetTrain(224))
    assert ds.classes == ["class_000", "class_001"] and len(ds) == 6
    x, y = ds[len(ds) - 1]
    assert x.shape == (3, 224, 224) and str(x.dtype) == "float32" and y == 1
    assert -3 < float(x.min()) < float(x.max()) < 3


def test_image_folder_reads_through_a_files_object(tmp_path: Path) -> None:
    """With ``files`` (DatasetFiles' API) ImageFolder takes its names from it, labels by the
    first path component, and the transform gets the file object it opened, not a path."""
    generate(tmp_path / "d", images=6, classes=2)
    opened: list[str] = []

    class Files:
        names = sorted(
            str(p.relative_to(tmp_path / "d")) for p in (tmp_path / "d").rglob("*.jpg")
        ) + ["README", ".hidden/x.jpg"]

        def open(self, name: str):  # noqa: ANN202
            opened.append(name)
            return open(tmp_path / "d" / name, "rb")

    ds = ImageFolder("/nonexistent/staged", ImagenetTrain(64), files=Files())
    assert ds.classes == ["class_000", "class_001"] and len(ds) == 6
    x, y = ds[5]
    assert x.shape == (3, 64, 64) and y == 1 and opened == ["class_001/img_000005.jpg"]
    raw = ImageFolder("/nonexistent/staged", lambda f: f.read(), files=Files())[0][0]
    assert raw == (tmp_path / "d" / "class_000" / "img_000000.jpg").read_bytes()


def test_first_step_row_lists_each_run() -> None:
    """The "first step" row gives each run's wait before its first step, --no-wait last when run."""
    from types import SimpleNamespace as NS

    from shmstage.cli.demo_cmd import _first_step_row

    report = NS(
        original=NS(first_step_s=2.04), staged=NS(first_step_s=15.61),
        staging=NS(seconds=13.6), nowait=None,
    )  # fmt: skip
    assert _first_step_row(report) == (
        "after 2.0 s reading the original; 15.6 s staging first (13.6 s of copy)"
    )
    report.nowait = NS(first_step_s=2.3)
    assert _first_step_row(report).endswith("; 2.3 s with --no-wait")


def _run_offers_no_wait(shmstage_bin) -> bool:
    out = subprocess.run([*shmstage_bin, "run", "--help"], capture_output=True, text=True).stdout
    return "--no-wait" in out.split()


def test_demo_third_run_trains_while_staging(shmstage_bin, demo_dest: Path, tmp_path) -> None:
    """With run --no-wait the demo trains a third time while the copy is made afresh: its row,
    its command, its time to first step; the copy it made is complete (--keep)."""
    if not _run_offers_no_wait(shmstage_bin) or not importlib.util.find_spec(
        "shmstage.datasetfiles"
    ):
        pytest.skip("this tree has no run --no-wait or no DatasetFiles yet (issue 23)")
    work = tmp_path / "work"
    proc = _demo(shmstage_bin, demo_dest, "--workdir", str(work), "--keep", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    nowait = report["nowait"]
    assert (
        nowait["command"].startswith("shmstage run --stage ") and "--no-wait" in nowait["command"]
    )
    assert "--files" in nowait["command"] and nowait["result"]["images"] == 2 * 32
    assert nowait["first_step_s"] > 0
    staged = [p for p in (demo_dest / "shmstage").iterdir() if p.name.startswith("shmstage-demo-")]
    assert len(staged) == 1 and len(list(staged[0].rglob("*.jpg"))) == 64


def test_image_folder_without_images_is_a_clear_error(tmp_path: Path) -> None:
    """A folder with no class subfolders of images raises a one-line ShmstageError."""
    (tmp_path / "x" / "cats").mkdir(parents=True)
    (tmp_path / "x" / "cats" / "notes.txt").write_text("hi")
    with pytest.raises(ShmstageError, match=r"no images found; expected class subfolders"):
        ImageFolder(tmp_path / "x")


def test_evict_from_page_cache_drops_only_cached_pages(tmp_path: Path) -> None:
    """After evict_from_page_cache a just-read file is (almost) out of the page cache, as --cold needs."""
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(4 << 20))
    path.read_bytes()
    before = cached_share([str(path)])
    if before is None or before < 0.9:
        pytest.skip(f"page cache residency not observable here ({before})")
    evict_from_page_cache([str(path)])
    after = cached_share([str(path)])
    assert after is not None and after < 0.5


def test_busy_note_only_when_others_compete() -> None:
    """The demo's own two busy CPUs are not 'busy'; a load far above the CPU count is."""
    assert _busy_note(2.5, 2) is None
    note = _busy_note(7.2, 2)
    assert note is not None and note.startswith("the node was busy (load average 7.2 on 2 CPUs)")


@pytest.fixture
def demo_dest(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Where the demo stages: a real small tmpfs as root, else a temp directory (never the real /dev/shm)."""
    try:
        return request.getfixturevalue("tmpfs")("256M", name="shm")
    except pytest.skip.Exception:
        path = tmp_path / "dest"
        path.mkdir()
        return path


def _demo(shmstage_bin: list[str], dest: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SHMSTAGE_DEST=str(dest / "shmstage"))
    argv = [*shmstage_bin, "demo", "--images", "64", "--steps", "2", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def test_demo_table_with_keep(shmstage_bin, demo_dest: Path, tmp_path: Path) -> None:
    """The demo prints one table with every row, and --keep leaves the dataset and the staged copy."""
    work = tmp_path / "work"
    proc = _demo(shmstage_bin, demo_dest, "--workdir", str(work), "--keep")
    assert proc.returncode == 0, proc.stderr
    labels = [line.split("  ")[0] for line in proc.stdout.splitlines() if line[:1].isalpha()]
    for row in ROWS:
        assert row in labels, f"row {row!r} missing:\n{proc.stdout}"
    assert "$ shmstage run -- python -m shmstage.demo.train --data " in proc.stdout
    assert "$ shmstage run --stage " in proc.stdout and "--data {staged}" in proc.stdout
    assert "demo: training on the staged data: shmstage run --stage" in proc.stderr
    assert len(list((work / "dataset").rglob("*.jpg"))) == 64
    staged = [p for p in (demo_dest / "shmstage").iterdir() if p.name.startswith("shmstage-demo-")]
    assert len(staged) == 1 and len(list(staged[0].rglob("*.jpg"))) == 64


def test_demo_json_and_cleanup(shmstage_bin, demo_dest: Path) -> None:
    """--json reports both measured runs; without --workdir the demo works in a new directory
    under /var/tmp (disk, not tmpfs) and removes it and the staged copy when done."""
    proc = _demo(shmstage_bin, demo_dest, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["kept"] is False and report["dataset"]["images"] == 64
    for run in ("original", "staged"):
        result = report[run]["result"]
        assert result["images"] == 2 * 32 and result["images_per_s"] > 0
        assert 0 <= result["stall_share"] <= 1
        assert report[run]["first_step_s"] > 0
    # the staged run's wait for its first step counts the staging before it
    assert report["staged"]["first_step_s"] > report["staging"]["seconds"]
    assert report["original"]["command"].startswith("shmstage run -- python -m shmstage.demo.train")
    assert report["staged"]["command"].startswith("shmstage run --stage ")
    assert Path(report["staging"]["dest"]).is_relative_to(demo_dest)
    assert report["workdir"].startswith("/var/tmp/shmstage-demo-")
    assert not Path(report["workdir"]).exists()
    assert not Path(report["staging"]["dest"]).exists()


def test_prepare_dataset_reuses_a_kept_dataset(tmp_path: Path) -> None:
    """A second demo in the same --workdir reuses the generated dataset instead of rewriting it."""
    logs: list[str] = []
    first = _prepare_dataset(str(tmp_path), 8, logs.append)
    mtime = (tmp_path / "dataset" / "class_000" / "img_000000.jpg").stat().st_mtime_ns
    second = _prepare_dataset(str(tmp_path), 8, logs.append)
    assert second == first
    assert logs[-1] == f"demo: reusing the dataset in {tmp_path / 'dataset'}"
    assert (tmp_path / "dataset" / "class_000" / "img_000000.jpg").stat().st_mtime_ns == mtime
    third = _prepare_dataset(str(tmp_path), 10, logs.append)  # different size: regenerated
    assert third.images == 10 and logs[-1].startswith("demo: generating 10 synthetic JPEGs")


def test_demo_too_few_images_is_a_usage_error(runner, cli) -> None:
    """--images below one batch is refused by Click (exit 2) before anything is generated."""
    result = runner.invoke(cli, ["demo", "--images", "8"])
    assert result.exit_code == 2
    assert "Invalid value for '--images': 8 is not in the range x>=32." in result.stderr


def test_choose_dest_falls_back_when_the_default_is_not_writable(tmp_path, monkeypatch) -> None:
    """A non-root user who cannot write the default destination stages elsewhere, and is told why."""
    from shmstage.demo import steps as demo

    default = tmp_path / "locked" / "shmstage"
    monkeypatch.setenv("SHMSTAGE_DEST", str(default))
    monkeypatch.setattr(demo, "_writable_dir", lambda path: path != str(default))
    dest, why = demo.choose_dest(1 << 20, str(tmp_path / "work"))
    assert dest == str(tmp_path / "work" / "staged")
    assert why == (
        f"{default} is not writable by this user; staging to local disk instead (no gain expected)"
    )


def test_choose_dest_uses_the_default_when_it_fits(tmp_path, monkeypatch) -> None:
    """The default destination (SHMSTAGE_DEST here) is used as is when writable and big enough."""
    from shmstage.demo import steps as demo

    monkeypatch.setenv("SHMSTAGE_DEST", str(tmp_path / "shmstage"))
    assert demo.choose_dest(1 << 20, str(tmp_path / "work")) == (str(tmp_path / "shmstage"), None)


def _run(label: str, images_per_s: float, stall: float, cached: float | None = None):
    from shmstage.demo import DemoRun, TrainResult

    result = TrainResult(
        data="/d", steps=10, warmup_steps=3, batch_size=32, images=320, seconds=1.0,
        wait_seconds=stall, images_per_s=images_per_s, stall_share=stall, num_workers=1,
        pin_memory=False, prefetch_factor=4, device="cpu", device_name="cpu",
        loss_first=2.3, loss_last=2.2,
    )  # fmt: skip
    return DemoRun(label, "shmstage run ...", cached, result)


@pytest.mark.parametrize(
    ("cached", "speedup", "busy", "first"),
    [
        (0.0, 1.5, False, "Staging made training 1.50x faster here"),
        (1.0, 1.0, False, "No gain expected here: the original was already in the page cache"),
        (0.0, 0.9, True, "Other processes were using the CPU"),
        (0.0, 1.0, False, "Reading was not the limit here"),
    ],
)
def test_next_steps_follow_the_measurements(cached, speedup, busy, first) -> None:
    """The first "next" line explains the speed-up from what was measured (cache, load, gain)."""
    from shmstage.demo import PillowFacts, StagingFacts
    from shmstage.demo import suggest_next_steps as _next_steps

    pillow = PillowFacts("pillow-simd", "9.5", True, True, True, "nothing to do")
    staging = StagingFacts("/dev/shm/shmstage/x", "tmpfs", None, 1.0, 100, 10, 100.0)
    steps = _next_steps(
        _run("original", 100, 0.5, cached), _run("staged", 100 * speedup, 0.05), speedup,
        pillow, staging, busy,
    )  # fmt: skip
    assert steps[0].startswith(first)
    assert not any("Faster decoding" in s or "still waited" in s for s in steps)
    assert steps[-1].startswith("Your data: `shmstage run --stage /path/to/data")


def test_next_steps_point_at_decoding_when_the_staged_run_stalls() -> None:
    """A staged run that still stalls, with stock Pillow, leads to bench loader and pillow-simd."""
    from shmstage.demo import PillowFacts, StagingFacts
    from shmstage.demo import suggest_next_steps as _next_steps

    pillow = PillowFacts("Pillow", "13.0.0", True, True, False, "replace it: shmstage pillow-simd")
    staging = StagingFacts("/var/tmp/w/staged/x", "ext4", "no room", 1.0, 100, 10, 100.0)
    steps = _next_steps(_run("o", 100, 0.6, 0.0), _run("s", 100, 0.6), 1.0, pillow, staging, False)
    assert steps[1] == (
        "Training still waited for data 60% of each step on the staged copy: JPEG decoding on "
        "1 loader worker is the limit; measure worker counts with `shmstage bench loader --data DIR`."
    )
    assert steps[2] == "Faster decoding: replace it: shmstage pillow-simd."
    assert steps[3].startswith("Make room in /dev/shm")


def test_demo_never_deletes_a_dataset_it_did_not_make(runner, cli, tmp_path: Path) -> None:
    """A --workdir that already has a `dataset` folder of someone else's is refused and left intact."""
    theirs = tmp_path / "dataset" / "cats" / "1.jpg"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"precious")
    result = runner.invoke(cli, ["demo", "--workdir", str(tmp_path), "--images", "32"])
    assert result.exit_code == 2
    assert result.stderr.endswith(
        f"Error: {tmp_path / 'dataset'} already exists and was not made by shmstage demo: "
        "pass another --workdir (or an empty one)\n"
    )
    assert theirs.read_bytes() == b"precious"


def test_payback_counts_epochs_from_the_measured_rates() -> None:
    """Pays back = staging time / time saved per epoch (all images once at each run's images/s)."""
    from shmstage.demo import payback

    pb = payback(1200, _run("o", 100, 0.8).result, _run("s", 300, 0.1).result, 4.0)
    assert (pb.original_epoch_s, pb.staged_epoch_s) == (12.0, 4.0)
    assert pb.epochs == 0.5
    assert payback(1200, _run("o", 100, 0.1).result, _run("s", 90, 0.1).result, 4.0).epochs is None


def test_next_steps_name_the_throttle() -> None:
    """With --slow-source the first "next" line says the gain was measured through the throttle."""
    from shmstage.demo import PillowFacts, StagingFacts
    from shmstage.demo import suggest_next_steps as _next_steps

    pillow = PillowFacts("pillow-simd", "9.5", True, True, True, "nothing to do")
    staging = StagingFacts("/dev/shm/shmstage/x", "tmpfs", None, 1.0, 100, 10, 100.0)
    original, staged = _run("o", 100, 0.8, 0.0), _run("s", 250, 0.1)
    steps = _next_steps(original, staged, 2.5, pillow, staging, False, 8.0)
    assert steps[0].startswith(
        "Staging made training 2.50x faster reading a source throttled to 8 MB/s"
    )
    steps = _next_steps(original, _run("s", 100, 0.1), 1.0, pillow, staging, False, 8.0)
    assert steps[0].startswith("Reading was not the limit here even at 8 MB/s")


def test_slow_source_without_root_is_refused(runner, cli, monkeypatch, tmp_path: Path) -> None:
    """An explicit --slow-source needs root: one-line error, exit 2, nothing generated."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    work = tmp_path / "work"
    result = runner.invoke(cli, ["demo", "--slow-source", "5", "--workdir", str(work)])
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: --slow-source throttles reads with a cgroup, which needs root: "
        "run as root, or pass --slow-source 0\n"
    )
    assert not work.exists()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.root
def test_slow_source_as_nobody_is_refused(shmstage_bin) -> None:
    """A real non-root user asking for --slow-source gets the one-line error and exit 2."""
    drop = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    proc = subprocess.run(
        [*drop, *shmstage_bin, "demo", "--slow-source", "5"], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(
        "Error: --slow-source throttles reads with a cgroup"
    )


def test_slow_source_without_root_defaults_to_unthrottled() -> None:
    """Not root and no --slow-source: no throttle, and the reason the table's note gives."""
    import contextlib

    from shmstage.demo import steps as demo

    with contextlib.ExitStack() as stack:
        assert demo.slow_source_throttle(stack, "/", 0, True)[1].reason == "--slow-source 0"
        assert demo.slow_source_throttle(stack, "/", None, False)[1].reason == (
            "--warm keeps it in the page cache"
        )
        if os.geteuid() != 0:
            throttle, slow = demo.slow_source_throttle(stack, "/", None, True)
            assert throttle is None and slow.mbps == 0
            assert slow.reason == "not root: a read throttle needs a cgroup"


def _throttle_possible(path: str) -> bool:
    from shmstage.bench.stage import blkio_throttle
    from shmstage.errors import ShmstageError

    try:
        with blkio_throttle(path, 10**9, name="shmstage-test-probe"):
            return True
    except (ShmstageError, OSError):
        return False


@pytest.mark.root
def test_demo_slow_source_throttles_and_removes_its_cgroup(shmstage_bin, demo_dest: Path) -> None:
    """--slow-source reads the original through a cgroup read throttle, the table says so,
    and the cgroup is gone when the demo ends."""
    if not _throttle_possible("/var/tmp"):
        pytest.skip("no blkio/io controller can throttle the disk under /var/tmp")
    proc = _demo(shmstage_bin, demo_dest, "--slow-source", "20")
    assert proc.returncode == 0, proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        label, _, value = line.partition("  ")
        if label[:1].isalpha():
            rows[label] = value.strip()
    assert rows["dataset"].endswith(
        "; reads throttled to 20 MB/s, standing in for network storage (--slow-source 0 to disable)"
    )
    assert " MB/s from the throttled source -> " in rows["staging"]
    assert (
        "read from " in rows["original run"]
        and " through the 20 MB/s throttle, " in rows["original run"]
    )
    assert re.match(
        r"staging \d+\.\d s (pays back after \d+\.\d epochs|does not pay back)", rows["pays back"]
    )
    group = re.search(r"\(cgroup (/\S+)\)", proc.stderr)
    assert group is not None, proc.stderr
    assert Path(group.group(1)).name.startswith("shmstage-demo-")
    assert not Path(group.group(1)).exists()


def _signal_demo_during_original_run(
    shmstage_bin, demo_dest: Path, images: int, steps: int, send
) -> tuple[subprocess.Popen, str]:
    """Start a throttled demo in its own session; call ``send(pid)`` once the original run
    starts; return the finished process and its stderr."""
    if not _throttle_possible("/var/tmp"):
        pytest.skip("no blkio/io controller can throttle the disk under /var/tmp")
    env = dict(os.environ, SHMSTAGE_DEST=str(demo_dest / "shmstage"))
    argv = [
        *shmstage_bin,
        "demo",
        "--images",
        str(images),
        "--steps",
        str(steps),
        "--slow-source",
        "1",
    ]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own session and group: killpg is a terminal's Ctrl-C
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("demo: training on the original data"):
                send(proc.pid)
                break
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc, "".join(lines) + rest


@pytest.mark.root
def test_demo_ctrl_c_removes_its_cgroup_and_workdir(shmstage_bin, demo_dest: Path) -> None:
    """Ctrl-C while the throttled original run reads: death by SIGINT, the cgroup and the work
    directory are removed."""
    proc, log = _signal_demo_during_original_run(
        shmstage_bin, demo_dest, 64, 2, lambda pid: os.killpg(pid, signal.SIGINT)
    )
    assert proc.returncode == -signal.SIGINT, log  # died of it: a shell loop stops
    group = re.search(r"\(cgroup (/\S+)\)", log)
    workdir = re.search(r"generating 64 synthetic JPEGs in (/\S+)/dataset", log)
    assert group is not None and workdir is not None, log
    assert not Path(group.group(1)).exists()
    assert not Path(workdir.group(1)).exists()


@pytest.mark.root
def test_demo_sigterm_stops_the_training_job_too(shmstage_bin, demo_dest: Path) -> None:
    """SIGTERM to the demo alone (not its group) during the original run: exit 143 and no
    process of its session (shmstage run, the trainer, its workers) is left running."""
    import psutil

    # long enough (256 images read at 1 MB/s: ~20 s) that a job left running is still there
    proc, log = _signal_demo_during_original_run(
        shmstage_bin, demo_dest, 256, 8, lambda pid: os.kill(pid, signal.SIGTERM)
    )

    def session_left() -> list[psutil.Process]:
        left = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except (ProcessLookupError, psutil.Error):
                pass
        return left

    _, alive = psutil.wait_procs(session_left(), timeout=10)
    for p in alive:
        p.kill()
    assert proc.returncode == -signal.SIGTERM, log
    assert alive == [], [p.cmdline() for p in alive]
