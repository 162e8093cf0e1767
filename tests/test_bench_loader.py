"""`shmstage bench loader` / `bench stage`: measurements, recommendation, JSON fields, errors."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from shmstage.bench.loader import LoaderMeasurement, default_workers, recommend

pytest.importorskip("torch")
pytest.importorskip("PIL")

DOCS_CLI = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def m(workers: int, rate: float, stall: float) -> LoaderMeasurement:
    return LoaderMeasurement(workers, False, rate, stall, 0.0, 0.0, 0.0)


def documented_fields(type_name: str) -> set[str]:
    """Field names in docs/cli.md's table for the result type ``type_name``."""
    text = DOCS_CLI.read_text()
    start = text.index(f"`{type_name}`:\n")
    table = text[start:].split("\n\n")[1]
    return set(re.findall(r"^\| `(\w+)` \|", table, re.M))


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shmstage.demo.dataset import generate

    root = tmp_path_factory.mktemp("bench") / "data"
    generate(root, images=24, classes=3)
    return root


def test_recommend_fewest_workers_near_best_with_low_stall() -> None:
    """The pick is the fewest workers within 5% of the best throughput whose stall is under 10%."""
    results = [m(0, 100, 0.6), m(1, 380, 0.08), m(2, 395, 0.05), m(4, 400, 0.04)]
    best, reason = recommend(results)
    assert best == results[1]
    assert "fewest workers within 5% of the best throughput (400 samples/s)" in reason


def test_recommend_skips_near_best_settings_that_still_stall() -> None:
    """A setting within 5% of the best but stalling 10% or more loses to one that does not stall."""
    results = [m(1, 390, 0.15), m(2, 400, 0.05)]
    assert recommend(results)[0] == results[1]


def test_recommend_data_bound_with_more_workers_helping() -> None:
    """When every setting stalls and the most workers win, the reason says the CPUs are the limit."""
    results = [m(0, 100, 0.8), m(1, 200, 0.6), m(2, 390, 0.4)]
    best, reason = recommend(results, cpus=2)
    assert best == results[2]
    assert reason.startswith(
        "data-bound: throughput still grows with workers, but with 2 workers 40%"
    )
    assert "--workers" not in reason  # already one worker per CPU
    assert "(or try more than 2 workers with --workers)" in recommend(results, cpus=8)[1]


def test_recommend_data_bound_flat() -> None:
    """When every setting stalls and throughput is flat, the fewest workers win and staging is suggested."""
    results = [m(1, 200, 0.5), m(2, 201, 0.5), m(4, 199, 0.5)]
    best, reason = recommend(results)
    assert best == results[0]
    assert "more workers do not help" in reason and "stage the data" in reason


@pytest.mark.parametrize(
    ("cpus", "expected"),
    [(1, [0, 1]), (2, [0, 1, 2]), (6, [0, 1, 2, 4, 6]), (8, [0, 1, 2, 4, 8])],
)
def test_default_workers(cpus: int, expected: list[int]) -> None:
    """Default worker counts: 0, 1, powers of two, and the CPU count itself."""
    assert default_workers(cpus) == expected


def test_bench_loader_json_has_documented_fields_and_plot(
    runner, cli, tiny_dataset, tmp_path
) -> None:
    """Two settings on a tiny dataset: one result each, a recommendation among them, every JSON
    field documented in docs/cli.md, a PNG written, and a progress line per setting on stderr."""
    png = tmp_path / "chart.png"
    args = ["bench", "loader", "--data", str(tiny_dataset), "--workers", "0,1", "--batch-size", "4"]
    args += ["--steps", "2", "--compute-ms", "1", "--plot", str(png), "--json"]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["workers"] for r in report["results"]] == [0, 1]
    assert report["recommended"] in report["results"]
    assert report["dataset_samples"] == 24
    assert set(report) == documented_fields("LoaderBenchReport")
    for r in report["results"]:
        assert set(r) == documented_fields("LoaderMeasurement")
        assert r["samples_per_s"] > 0 and 0 <= r["stall_share"] <= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[1/2] workers=0" in result.stderr and "[2/2] workers=1" in result.stderr


def test_bench_loader_table(runner, cli, tiny_dataset) -> None:
    """The table marks the recommended setting and says how to use it; --pin without a GPU is
    skipped with a note rather than pinning memory nothing will read."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour of --pin")
    args = ["bench", "loader", "--data", str(tiny_dataset), "--workers", "0", "--transform", "none"]
    args += ["--pin", "--batch-size", "4", "--steps", "2", "--compute-ms", "0"]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "<- recommended" in result.stdout
    assert "Recommended: num_workers=0, pin_memory=off" in result.stdout
    assert "use: shmstage run --workers 0 -- ..." in result.stdout
    assert (
        "Note: pin_memory skipped: no accelerator (pinned memory only speeds up copies to a GPU)"
        in result.stdout
    )


def test_bench_loader_bad_worker_list(runner, cli, tiny_dataset) -> None:
    """A worker list that is not comma-separated integers is a usage error (exit 2)."""
    result = runner.invoke(
        cli, ["bench", "loader", "--data", str(tiny_dataset), "--workers", "1,x"]
    )
    assert result.exit_code == 2
    assert result.stderr.endswith(
        "Error: Invalid value for '--workers': '1,x': give worker counts separated by commas, e.g. 0,1,2,4\n"
    )


def test_bench_loader_no_images(runner, cli, tmp_path) -> None:
    """A folder without class subfolders of images is a one-line error, not a traceback."""
    (tmp_path / "empty").mkdir()
    result = runner.invoke(cli, ["bench", "loader", "--data", str(tmp_path / "empty")])
    assert result.exit_code == 1
    assert result.stderr.endswith(
        f"Error: {tmp_path / 'empty'}: no images found; expected class subfolders with .jpg/.png "
        "files (the ImageFolder layout, e.g. DIR/cat/001.jpg)\n"
    )


def test_bench_loader_plot_without_matplotlib(
    runner, cli, tiny_dataset, tmp_path, monkeypatch
) -> None:
    """--plot without matplotlib fails at once with the install hint, before measuring anything."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = runner.invoke(
        cli, ["bench", "loader", "--data", str(tiny_dataset), "--plot", str(tmp_path / "x.png")]
    )
    assert result.exit_code == 1
    assert result.stderr == "Error: --plot needs matplotlib: pip install 'shmstage[plot]'\n"
    assert not (tmp_path / "x.png").exists()


def test_bench_stage_json(runner, cli, tiny_dataset, tmp_path) -> None:
    """bench stage times each tool on the user's data and reports every documented field."""
    dest = tmp_path / "dest"
    dest.mkdir()
    args = ["bench", "stage", str(tiny_dataset), "--dest", str(dest), "--runs", "1"]
    result = runner.invoke(cli, [*args, "--tools", "cp,shmstage", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [t["tool"] for t in report["tools"]] == ["cp", "shmstage"]
    assert report["files"] == 24 and report["drop_caches"] is False
    assert set(report) == documented_fields("StageBenchResult")
    assert set(report["tools"][0]) == documented_fields("ToolResult")
    assert list(dest.iterdir()) == []  # scratch copies removed


def test_bench_stage_drop_caches_needs_root(runner, cli, tiny_dataset, monkeypatch) -> None:
    """--drop-caches as a normal user is refused (exit 2) before anything runs."""
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    result = runner.invoke(cli, ["bench", "stage", str(tiny_dataset), "--drop-caches"])
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: --drop-caches needs root (it writes /proc/sys/vm/drop_caches): run as root or leave it out\n"
    )


def test_bench_stage_unknown_tool(runner, cli, tiny_dataset) -> None:
    """An unknown tool name is a usage error listing the valid ones."""
    result = runner.invoke(cli, ["bench", "stage", str(tiny_dataset), "--tools", "cp,scp"])
    assert result.exit_code == 2
    assert "'cp,scp': choose from cp, rsync, tar, cat, shmstage (comma-separated)" in result.stderr
