"""`shmstage run`: placeholders, environment, exit status, signals and no orphans, for real."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import psutil
import pytest

from shmstage import launch
from shmstage.launch import PlaceholderError, StageRequest, check_placeholders, substitute
from shmstage.supervisor import slurm_signals_tasks_only

# --- placeholders (unit) ----------------------------------------------------


def test_stage_request_parse(tmp_path):
    """--stage SRC is the whole path, '=' included; the old SRC=NAME only where SRC=NAME is
    no path and SRC is one."""
    (tmp_path / "split=train").mkdir()
    (tmp_path / "plain").mkdir()
    t = str(tmp_path)
    assert StageRequest.parse(f"{t}/split=train") == StageRequest(f"{t}/split=train")
    assert StageRequest.parse(f"{t}/plain=inet") == StageRequest(f"{t}/plain", "inet")
    assert StageRequest.parse(f"{t}/missing=x") == StageRequest(f"{t}/missing=x")
    assert StageRequest.parse(f"{t}/plain=a/b") == StageRequest(f"{t}/plain=a/b")
    assert StageRequest.parse("/nfs/imagenet") == StageRequest("/nfs/imagenet")


def test_run_stages_a_path_with_equals_sign(shmstage_bin, tmp_path):
    """`run --stage /data/split=train` stages that directory, named split_train."""
    (tmp_path / "split=train").mkdir()
    (tmp_path / "split=train" / "f").write_text("x")
    (tmp_path / "split").mkdir()  # the old reading would have staged this one as "train"
    dest = tmp_path / "dest"
    done = subprocess.run(
        [*shmstage_bin, "run", "--stage", f"{tmp_path}/split=train", "--dest", str(dest), "--",
         "sh", "-c", 'test -f "$1/f" && echo "$1"', "sh", "{staged:split_train}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{dest}/split_train\n"


def test_run_name_option_names_the_stage_before_it(shmstage_bin, runner, cli, tmp_path):
    """--stage A --name a --stage B: a is A's name, B keeps its base name; a stray --name is exit 2."""
    for d in ("A", "B"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "f").write_text(d)
    dest = tmp_path / "dest"
    done = subprocess.run(
        [*shmstage_bin, "run", "--stage", str(tmp_path / "A"), "--name", "a", "--stage",
         str(tmp_path / "B"), "--dest", str(dest), "--", "sh", "-c", 'cat "$1/f" "$2/f"', "sh",
         "{staged:a}", "{staged:B}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "AB"
    stray = runner.invoke(cli, ["run", "--name", "a", "--stage", str(tmp_path / "A"), "--", "true"])
    assert stray.exit_code == 2
    assert stray.stderr.splitlines()[-1] == (
        "Error: --name a must follow the --stage it names: --stage SRC --name NAME"
    )
    two = runner.invoke(cli, ["run", "--stage", "/x", "--name", "a", "--name", "b", "--", "true"])
    assert two.exit_code == 2
    assert two.stderr.splitlines()[-1] == "Error: --stage /x has two names (a, b): give one --name"
    assert not dest.joinpath(".shmstage", "partial", "a").exists()


def test_substitute_fills_staged_and_names():
    """{staged} and {staged:NAME} become paths, also inside a larger argument."""
    one = [("toy", "/dev/shm/shmstage/toy")]
    assert substitute(["--data", "{staged}", "--x={staged}/train"], one) == [
        "--data",
        "/dev/shm/shmstage/toy",
        "--x=/dev/shm/shmstage/toy/train",
    ]
    two = [("a", "/s/a"), ("b", "/s/b")]
    assert substitute(["{staged:b}:{staged:a}"], two) == ["/s/b:/s/a"]


def test_substitute_leaves_other_braces_alone():
    """Escapes give literal placeholders; JSON, shell groups and ${VAR} pass unchanged."""
    args = [
        "{{staged}}",
        "{{epoch}}-{{loss:.2f}}",
        '{"a": {"b": 1}}',
        "f() { x; }",
        "${HOME}",
        "{}",
    ]
    assert substitute(args, []) == [
        "{staged}",
        "{epoch}-{loss:.2f}",
        '{"a": {"b": 1}}',
        "f() { x; }",
        "${HOME}",
        "{}",
    ]


@pytest.mark.parametrize(
    ("args", "names", "message"),
    [
        (
            ["ckpt_{epoch}.pt"],
            ["toy"],
            "unknown placeholder {epoch} in 'ckpt_{epoch}.pt': use {staged} or {staged:NAME}, "
            "or write {{epoch}} for a literal {epoch}",
        ),
        (["{staged}"], [], "{staged} needs exactly one --stage: add --stage SRC"),
        (["{staged}"], ["a", "b"], "{staged} needs exactly one --stage (got 2): use {staged:NAME}"),
        (["{staged:c}"], ["a", "b"], "{staged:c}: no --stage is named 'c' (names: a, b)"),
        (["{staged:}"], ["a"], "empty name in {staged:} in '{staged:}': write {staged:NAME}"),
    ],
)
def test_bad_placeholders_are_refused(args, names, message):
    """Each unfillable placeholder is refused with a message saying what to write instead."""
    with pytest.raises(PlaceholderError) as e:
        check_placeholders(args, names)
    assert str(e.value) == message
    assert e.value.exit_code == 2


def test_unknown_names_are_checked_after_staging():
    """A {staged:NAME} cannot be judged before staging when a name is not yet known."""
    check_placeholders(["{staged:whatever}"], [None])
    with pytest.raises(PlaceholderError, match="no --stage is named 'whatever'"):
        substitute(["{staged:whatever}"], [("toy", "/x")])


def test_env_name():
    """SHMSTAGE_DATA_<NAME>: upper case, other characters as '_'."""
    assert launch.env_name("imagenet-1k.v2") == "SHMSTAGE_DATA_IMAGENET_1K_V2"


def test_loader_settings_precedence(monkeypatch, tmp_path):
    """Flags beat the caller's environment, which beats the node config's loader section."""
    cfg = tmp_path / "shmstage.yaml"
    cfg.write_text(
        "version: 1\nloader:\n  num_workers: 5\n  pin_memory: false\n  prefetch_factor: 3\n"
    )
    env = {"SHMSTAGE_PREFETCH_FACTOR": "2"}
    got = launch.loader_settings(workers=None, pin=True, environ=env, config_path=str(cfg))
    assert got == {"SHMSTAGE_NUM_WORKERS": "5", "SHMSTAGE_PIN_MEMORY": "1"}


# --- the CLI refuses before starting anything -------------------------------


def test_missing_command(runner, cli, tmp_path):
    """A command that does not exist: `Error: command not found: X`, exit 127."""
    result = runner.invoke(cli, ["run", "--", "no-such-command-xyz", "arg"])
    assert result.exit_code == 127
    assert result.stderr == "Error: command not found: no-such-command-xyz\n"


def test_command_that_cannot_execute(runner, cli, tmp_path):
    """An executable file that is not a program: exit 126; a #! to nowhere: exit 127."""
    junk = tmp_path / "junk"
    junk.write_text("not a program\n")
    junk.chmod(0o755)
    result = runner.invoke(cli, ["run", "--", str(junk)])
    assert result.exit_code == 126
    assert result.stderr == f"Error: cannot run {junk}: Exec format error\n"
    junk.write_text("#!/no/such/interpreter\n")
    result = runner.invoke(cli, ["run", "--", str(junk)])
    assert result.exit_code == 127
    assert result.stderr == f"Error: cannot run {junk}: bad interpreter\n"


def test_bad_placeholder_starts_nothing(runner, cli, tmp_path):
    """An unknown placeholder is refused (exit 2) and the command never runs."""
    marker = tmp_path / "ran"
    result = runner.invoke(cli, ["run", "--", "touch", str(marker), "{data}"])
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: unknown placeholder {data} in '{data}'")
    assert not marker.exists()


def test_bad_node_config_starts_nothing(runner, cli, tmp_path):
    """An invalid node config (loader defaults) is refused (exit 2) before the job starts."""
    cfg = tmp_path / "shmstage.yaml"
    cfg.write_text("version: 1\nloader:\n  num_workers: lots\n")
    marker = tmp_path / "ran"
    result = runner.invoke(cli, ["run", "--config", str(cfg), "--", "touch", str(marker)])
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: ")
    assert not marker.exists()


def test_missing_command_stages_nothing(runner, cli, tmp_path):
    """With a missing command, the --stage source is not copied either."""
    src = make_dataset(tmp_path / "src")
    dest = tmp_path / "dest"
    result = runner.invoke(
        cli, ["run", "--stage", str(src), "--dest", str(dest), "--", "no-such-xyz"]
    )
    assert result.exit_code == 127
    assert not (dest / "src").exists()


# --- real processes ---------------------------------------------------------


def make_dataset(root: Path, files: int = 3) -> Path:
    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(files):
            (root / c / f"{i}.bin").write_bytes(os.urandom(1000 + i))
    return root


def run_cli(shmstage_bin, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*shmstage_bin, "run", *args], capture_output=True, text=True, timeout=120, **kw
    )


def test_exit_status_is_the_jobs(shmstage_bin):
    """The job's exit status is returned unchanged."""
    assert run_cli(shmstage_bin, "--", "sh", "-c", "exit 7").returncode == 7
    assert run_cli(shmstage_bin, "--", "true").returncode == 0


def test_job_killed_by_signal_kills_shmstage_with_it(shmstage_bin):
    """A job killed by signal N makes shmstage die of signal N (a shell shows 128+N)."""
    assert run_cli(shmstage_bin, "--", "sh", "-c", "kill -KILL $$").returncode == -signal.SIGKILL


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGQUIT])
def test_job_killed_by_signal_dies_of_it_after_cleanup(shmstage_bin, tmp_path, sig):
    """waitpid sees shmstage killed by the job's signal (not exit 128+N, no core), after --cleanup ran."""
    src = make_dataset(tmp_path / "src")
    dest = tmp_path / "dest"
    p = subprocess.Popen(
        [*shmstage_bin, "run", "--stage", str(src), "--dest", str(dest), "--cleanup", "--",
         "sh", "-c", f"kill -{sig.name[3:]} $$"],
        cwd=tmp_path, stderr=subprocess.PIPE, text=True,
        # a suite started as `cmd &` from a script inherits SIGINT and SIGQUIT ignored
        # (POSIX, for asynchronous lists): the job would ignore its own kill
        preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL),
    )  # fmt: skip
    try:
        err = p.stderr.read()
        _, status = os.waitpid(p.pid, 0)
    finally:
        p.stderr.close()
        p.returncode = 0  # reaped above: keep Popen from waiting again
    assert os.WIFSIGNALED(status), (os.WEXITSTATUS(status), err)
    assert os.WTERMSIG(status) == sig
    assert not os.WCOREDUMP(status)
    assert "evicted: src" in err  # cleanup ran before shmstage died
    assert not (dest / "src").exists()


@pytest.mark.timeout(60)
def test_second_signal_while_terminating_leftovers_kills_them_and_dies_of_the_first(
    shmstage_bin, tmp_path, procs
):
    """A second ^C during the leftovers' SIGTERM grace: the leftover that ignores SIGTERM is
    SIGKILLed (not orphaned to init), and shmstage dies of the job's SIGINT."""
    marker = tmp_path / "leftover-marker"
    job = f'(trap "" TERM; exec -a {marker} sleep 1000 2>/dev/null) & sleep 0.2; kill -INT $$'
    p = procs.start(
        [*shmstage_bin, "run", "--", "bash", "-c", job, "bash"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        err = ""
        while "terminating 1 process(es)" not in err:
            line = p.stderr.readline()
            assert line, f"shmstage ended before terminating the leftover: {err}"
            err += line
        p.send_signal(signal.SIGINT)  # the impatient user's second ^C, within the grace
        err += p.stderr.read()
        assert p.wait(timeout=30) == -signal.SIGINT, err
        left = [
            q.pid
            for q in psutil.process_iter(["cmdline"])
            if str(marker) in " ".join(q.info["cmdline"] or ())
        ]
        assert left == [], "the leftover outlived shmstage"
        assert "Interrupted" not in err
    finally:
        kill_leftover_jobs(tmp_path)


EVICT_INTERRUPTED = """
import os, signal, sys
from shmstage.service import api
from shmstage.cli import main

real = api.evict_report


def evict_report(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # the user's ^C, just as the cleanup starts
    return real(*args, **kwargs)


api.evict_report = evict_report
sys.argv = ["shmstage", *sys.argv[1:]]
main()
"""


@pytest.mark.timeout(60)
def test_signal_during_cleanup_waits_for_it_then_dies_of_it(tmp_path, procs):
    """^C while --cleanup evicts: the evict finishes (nothing left, no trash), then shmstage
    says it was interrupted and dies of SIGINT."""
    src = make_dataset(tmp_path / "src", files=50)
    dest = tmp_path / "dest"
    script = tmp_path / "evict_interrupted.py"
    script.write_text(EVICT_INTERRUPTED)
    p = procs.start(
        [sys.executable, str(script), "run", "--stage", str(src), "--dest", str(dest),
         "--cleanup", "--", "true"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGINT, err
    assert "evicted: src" in err and "Interrupted." in err
    assert not (dest / "src").exists()
    trash = dest / ".shmstage" / "trash"
    assert not trash.exists() or not any(trash.iterdir())
    assert "Traceback" not in err


LOOP_JOB = """
import pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text("started")
time.sleep(60)  # ^C ends it: Python dies of SIGINT after KeyboardInterrupt
"""


@pytest.mark.timeout(90)
def test_ctrl_c_stops_a_shell_loop_of_runs(shmstage_bin, tmp_path):
    """`for i in 1 2; do shmstage run ...; done` on a terminal: ^C in run 1 ends the loop.

    bash goes on with a loop after ^C when its command exited (even with 130), and stops
    only when the command died of SIGINT, as the job did."""
    job = tmp_path / "job.py"
    job.write_text(LOOP_JOB)
    script = (
        f"for i in 1 2; do {' '.join(shmstage_bin)} run -- {sys.executable} {job} {tmp_path}/started.$i; done\n"
        f"echo after-loop > {tmp_path}/after\n"
    )
    master, slave = os.openpty()

    def controlling_tty() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    p = subprocess.Popen(
        ["bash", "-c", script],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True, preexec_fn=controlling_tty,
    )  # fmt: skip
    os.close(slave)
    try:
        wait_for(tmp_path / "started.1")
        os.write(master, b"\x03")  # the tty sends SIGINT to its foreground group: bash and shmstage
        deadline = time.monotonic() + 30
        while p.poll() is None and not (tmp_path / "started.2").exists():
            assert time.monotonic() < deadline, "neither the loop ended nor run 2 started"
            time.sleep(0.05)
        assert not (tmp_path / "started.2").exists(), "the loop went on to run 2 after ^C"
        assert p.wait(timeout=30) == -signal.SIGINT  # bash itself died of ^C, as it should
        assert not (tmp_path / "after").exists()
    finally:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        kill_leftover_jobs(tmp_path)
        os.close(master)


def kill_leftover_jobs(tmp_path: Path) -> None:
    """SIGKILL any job of this test still running (in its own session, outside the test's group)."""
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(tmp_path) in a for a in proc.info["cmdline"] or ()):
                proc.kill()


def test_staged_path_and_environment(shmstage_bin, tmp_path):
    """The job gets the staged path in ARGS and SHMSTAGE_DATA(_NAME), plus loader flags as env."""
    src = make_dataset(tmp_path / "src")
    dest = tmp_path / "dest"
    script = 'echo "$1|$SHMSTAGE_DATA|$SHMSTAGE_DATA_TOY_1|$SHMSTAGE_NUM_WORKERS|$SHMSTAGE_PIN_MEMORY|$SHMSTAGE_PREFETCH_FACTOR"'
    r = run_cli(
        shmstage_bin,
        "--stage", str(src), "--name", "toy-1", "--dest", str(dest),
        "--workers", "3", "--no-pin", "--prefetch-factor", "2",
        "--", "sh", "-c", script, "sh", "{staged}/a",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    staged = dest / "toy-1"
    assert r.stdout == f"{staged}/a|{staged}|{staged}|3|0|2\n"
    assert sorted(p.name for p in (staged / "a").iterdir()) == ["0.bin", "1.bin", "2.bin"]
    assert (staged / "b" / "2.bin").read_bytes() == (src / "b" / "2.bin").read_bytes()


def test_node_config_dest_is_the_default(shmstage_bin, tmp_path):
    """Without --dest, run stages where the node config says and tells the job (SHMSTAGE_DEST)."""
    src = make_dataset(tmp_path / "src")
    dest = tmp_path / "node-dest"
    cfg = tmp_path / "shmstage.yaml"
    cfg.write_text(f"version: 1\ndest: {dest}\n")
    env = {k: v for k, v in os.environ.items() if k != "SHMSTAGE_DEST"}
    env["SHMSTAGE_CONFIG"] = str(cfg)
    r = run_cli(
        shmstage_bin, "--stage", str(src), "--name", "toy", "--", "sh", "-c", 'echo "$1|$SHMSTAGE_DEST"', "sh", "{staged}",
        env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{dest / 'toy'}|{dest}\n"


def test_two_datasets_by_name(shmstage_bin, tmp_path):
    """{staged:NAME} picks each of several staged datasets; SHMSTAGE_DATA is the first."""
    a, b = make_dataset(tmp_path / "a"), make_dataset(tmp_path / "b")
    dest = tmp_path / "dest"
    r = run_cli(
        shmstage_bin, "--stage", str(a), "--stage", str(b), "--name", "bee", "--dest", str(dest),
        "--", "sh", "-c", 'echo "$1 $2 $SHMSTAGE_DATA $SHMSTAGE_DATA_BEE"', "sh", "{staged:bee}", "{staged:a}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [
        str(dest / "bee"),
        str(dest / "a"),
        str(dest / "a"),
        str(dest / "bee"),
    ]


def test_failed_staging_does_not_start_the_job(shmstage_bin, tmp_path):
    """A source that cannot be staged gives `Error: ...` and the job never runs."""
    marker = tmp_path / "ran"
    r = run_cli(
        shmstage_bin, "--stage", str(tmp_path / "missing"), "--dest", str(tmp_path / "d"),
        "--", "touch", str(marker),
    )  # fmt: skip
    assert r.returncode != 0
    assert r.stderr.startswith("Error: ") and "Traceback" not in r.stderr
    assert not marker.exists()


def test_cleanup_evicts_only_what_this_run_staged(shmstage_bin, tmp_path):
    """--cleanup removes a dataset this run copied, and keeps one that was already staged."""
    from shmstage import stage as engine

    fresh, kept = make_dataset(tmp_path / "fresh"), make_dataset(tmp_path / "kept")
    dest = tmp_path / "dest"
    engine.stage(str(kept), dest=str(dest))
    r = run_cli(
        shmstage_bin, "--stage", str(fresh), "--stage", str(kept), "--dest", str(dest), "--cleanup",
        "--", "sh", "-c", 'test -d "$1" && test -d "$2"', "sh", "{staged:fresh}", "{staged:kept}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert engine.find("fresh", dest=str(dest)) is None
    assert engine.find("kept", dest=str(dest)) is not None


RESTAGER = """
import sys, time
from shmstage.stage.store import Store
with Store(sys.argv[1]).lock(sys.argv[2]):  # what a restaging `shmstage stage` holds
    print("locked", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


@pytest.mark.timeout(60)
def test_cleanup_refused_by_a_restage_keeps_the_jobs_status(shmstage_bin, tmp_path, procs):
    """--cleanup while someone else restages the dataset: said on stderr; exit status is the job's."""
    src, dest = make_dataset(tmp_path / "src"), tmp_path / "dest"
    ready, go = tmp_path / "ready", tmp_path / "go"
    p = procs.start(
        [*shmstage_bin, "run", "--stage", str(src), "--dest", str(dest), "--cleanup", "--",
         "sh", "-c", 'echo ready > "$1"; while [ ! -e "$2" ]; do sleep 0.05; done; exit 5',
         "sh", ready, go],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(ready)
    restager = procs.start(
        [sys.executable, "-c", RESTAGER, str(dest), "src"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert restager.stdout.readline() == "locked\n"
        go.touch()
        _, err = p.communicate(timeout=30)
    finally:
        restager.stdin.close()
        restager.wait(timeout=30)
        restager.stdout.close()
    assert p.returncode == 5, err
    assert f"not evicting src: src is being staged by another shmstage (pid {restager.pid})" in err
    assert "Error:" not in err
    assert (dest / "src").is_dir()  # left to the restager


def test_concurrent_runs_make_one_copy(shmstage_bin, tmp_path, procs):
    """Two runs staging the same source at once share one copy."""
    src = make_dataset(tmp_path / "src", files=50)
    dest = tmp_path / "dest"
    cmd = [
        *shmstage_bin,
        "run",
        "--stage",
        str(src),
        "--dest",
        str(dest),
        "--",
        "sh",
        "-c",
        'echo "$1"',
        "sh",
        "{staged}",
    ]
    runs = [
        procs.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs
    assert outs[0][0] == outs[1][0] == f"{dest / 'src'}\n"
    assert [p.name for p in dest.iterdir() if not p.name.startswith(".")] == ["src"]


# --- signals ----------------------------------------------------------------

TRAPPING_JOB = """
trap 'echo "$1" > "$2"; trap - {sig}; kill -{sig} $$' {sig}
sleep 300 &
echo $! > "$3"
echo ready > "$4"
wait
"""


def wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_signal_to_shmstage_reaches_the_job(shmstage_bin, tmp_path, sig, procs):
    """`kill -SIG <shmstage pid>` reaches the job, shmstage dies of SIG as it did, nothing is orphaned."""
    name = sig.name.removeprefix("SIG")
    got, pidfile, ready = tmp_path / "got", tmp_path / "pid", tmp_path / "ready"
    p = procs.start(
        [*shmstage_bin, "run", "--", "sh", "-c", TRAPPING_JOB.format(sig=name), "sh", name, got, pidfile, ready],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    wait_for(ready)
    sleeper = int(pidfile.read_text())
    assert psutil.pid_exists(sleeper)
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert got.read_text() == f"{name}\n"
    assert p.returncode == -sig
    assert not psutil.pid_exists(sleeper)  # the job's leftover child was terminated and reaped
    assert "terminating 1 process(es) the job left running" in err


@pytest.mark.timeout(60)
def test_terminal_ctrl_c_is_not_delivered_twice(shmstage_bin, tmp_path):
    """^C on a terminal reaches the job once (forwarded by shmstage: the job is not in the tty's group)."""
    job = tmp_path / "job.py"
    job.write_text(
        "import pathlib, signal, sys, time\n"
        "n = 0\n"
        "def on_int(s, f):\n"
        "    global n\n"
        "    n += 1\n"
        "signal.signal(signal.SIGINT, on_int)\n"
        "pathlib.Path(sys.argv[1]).write_text('ready')\n"
        "end = time.monotonic() + 20\n"
        "while n == 0 and time.monotonic() < end:\n"
        "    time.sleep(0.02)\n"
        "time.sleep(1.0)  # a forwarded duplicate would arrive within this second\n"
        "pathlib.Path(sys.argv[2]).write_text(str(n))\n"
    )
    ready, count = tmp_path / "ready", tmp_path / "count"
    master, slave = os.openpty()

    def controlling_tty() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    p = subprocess.Popen(
        [*shmstage_bin, "run", "--", sys.executable, str(job), str(ready), str(count)],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True, preexec_fn=controlling_tty,
    )  # fmt: skip
    os.close(slave)
    try:
        wait_for(ready)
        os.write(master, b"\x03")  # the tty sends SIGINT to its foreground group
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    assert count.read_text() == "1"


COUNTING_JOB = """
import os, pathlib, signal, sys, time
counts = {"TERM": 0, "USR1": 0}
def count(signum, frame):
    counts[signal.Signals(signum).name[3:]] += 1
    pathlib.Path(sys.argv[1]).write_text(repr(counts))
def done(signum, frame):
    # signals are handled in number order (USR1=10 < USR2=12 < TERM=15): a USR1 sent before
    # this USR2 is counted already; for TERM, wait a moment more (see the test)
    pathlib.Path(sys.argv[2]).write_text(repr(counts))
    sys.exit(0)
signal.signal(signal.SIGTERM, count)
signal.signal(signal.SIGUSR1, count)
signal.signal(signal.SIGUSR2, done)
pathlib.Path(sys.argv[3]).write_text(str(os.getpid()))
time.sleep(120)  # a safety net: the test ends it with USR2, or kills it
"""

# A stand-in for slurmstepd: named so in /proc/PID/comm, it starts `shmstage run` (as a
# step's task or the batch shell) and, on a line on stdin, signals either every process
# of the step ("all SIG": scancel, --signal=SIG@T) or the batch shell alone ("shell SIG":
# --signal=B:SIG, scancel -b).
FAKE_SLURMSTEPD = """
import ctypes, os, signal, subprocess, sys
import psutil
ctypes.CDLL(None).prctl(15, b"slurmstepd", 0, 0, 0)  # PR_SET_NAME
task = subprocess.Popen(sys.argv[1:], start_new_session=True)
print(task.pid, flush=True)
for line in sys.stdin:
    who, sig = line.split()
    procs = [task.pid] + [p.pid for p in psutil.Process(task.pid).children(recursive=True)]
    for pid in procs if who == "all" else [task.pid]:
        os.kill(pid, signal.Signals["SIG" + sig])
    print("sent", flush=True)
sys.exit(task.wait())
"""


def start_counting_job(shmstage_bin, tmp_path, prefix=(), env=None):
    job = tmp_path / "job.py"
    job.write_text(COUNTING_JOB)
    counts, final, ready = tmp_path / "counts", tmp_path / "final", tmp_path / "ready"
    cmd = [*prefix, *shmstage_bin, "run", "--", sys.executable, str(job), str(counts), str(final), str(ready)]  # fmt: skip
    return cmd, counts, final, ready


def pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` is pending on process ``pid`` (sent, not yet delivered)."""
    fields = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    mask = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return bool(mask & (1 << (sig - 1)))


def settle(pid: int, sig: int) -> None:
    """Wait until ``sig`` is no longer pending on ``pid``, and its Python handler had time to run."""
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and pending(pid, sig):
        assert time.monotonic() < deadline, f"signal {sig} stays pending on {pid}"
        time.sleep(0.01)
    time.sleep(0.3)  # delivered: the job's Python-level handler runs at its next bytecode


def deliver_and_count(
    shmstage_pid: int, job_pid: int, send, sig: str, counts: Path, final: Path
) -> dict:
    """Deliver ``sig`` with ``send()`` while shmstage is stopped, then let it forward; count.

    Two deliveries that overlap in time merge into one (a pending signal is not queued
    twice), which would hide a duplicate: so shmstage is stopped while the signal is sent,
    a direct delivery to the job is handled first, and only then may shmstage forward.
    """
    signum = signal.Signals["SIG" + sig]
    os.kill(shmstage_pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(shmstage_pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        send(signum)
        settle(job_pid, signum)  # a direct delivery, if any, is counted now
    finally:
        os.kill(shmstage_pid, signal.SIGCONT)
    settle(shmstage_pid, signum)  # shmstage took it (and forwarded it, or not)
    settle(job_pid, signum)
    deadline = time.monotonic() + 30
    while not (counts.exists() and f"'{sig}': 0" not in counts.read_text()):
        assert time.monotonic() < deadline, "the signal never reached the job"
        time.sleep(0.02)
    os.kill(shmstage_pid, signal.SIGUSR2)  # ends the job: it writes what it counted
    wait_for(final)
    return eval(final.read_text())  # noqa: S307 - our own repr of a dict of ints


def kill_job(ready: Path) -> None:
    with contextlib.suppress(ValueError, OSError):
        os.kill(int(ready.read_text()), signal.SIGKILL)


def kill_session(sid: int, sig: int) -> None:
    """What a session-wide sender does: signal every process whose session is ``sid``."""
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", ["TERM", "USR1"])
@pytest.mark.parametrize("how", ["pid", "group", "session"])
def test_each_signal_reaches_the_job_once(shmstage_bin, tmp_path, how, sig):
    """kill PID, kill -- -PGID and a kill of every process in shmstage's session: one delivery."""
    cmd, counts, final, ready = start_counting_job(shmstage_bin, tmp_path)
    p = subprocess.Popen(cmd, start_new_session=True)  # shmstage leads its group and session
    try:
        wait_for(ready)
        send = {
            "pid": lambda signum: os.kill(p.pid, signum),
            "group": lambda signum: os.killpg(p.pid, signum),
            "session": lambda signum: kill_session(p.pid, signum),
        }[how]
        got = deliver_and_count(p.pid, int(ready.read_text()), send, sig, counts, final)
        assert got[sig] == 1, got
        assert p.wait(timeout=30) == 0  # the job's status
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        kill_job(ready)


@pytest.mark.parametrize(
    ("cgroups", "job", "want"),
    [
        ("6:freezer:/slurm_node1/uid_1001/job_7/step_0\n4:memory:/\n0::/\n", "7", True),
        ("0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n", "7", True),
        ("4:memory:/slurm_node1/uid_1001/job_7/step_0\n6:freezer:/\n0::/\n", "7", False),
        ("6:freezer:/slurm_node1/uid_1001/job_17/step_0\n0::/\n", "7", False),
        ("6:freezer:/slurm_node1/uid_1001/job_7/step_0\n0::/\n", None, False),
    ],
    ids=["v1-proctrack-cgroup", "v2-proctrack-cgroup", "v1-task-cgroup", "other-job", "no-job"],
)
def test_proctrack_cgroup_is_known_by_the_steps_own_cgroup(cgroups, job, want):
    """Slurm signals only a step's tasks under proctrack/cgroup, whose freezer (v1) or unified
    (v2) cgroup is named after the job's step: then shmstage forwards slurmstepd's signals;
    not under linuxproc (no such cgroup; task/cgroup's memory one alone says nothing)."""
    env = {"SLURM_JOB_ID": job} if job else {}
    assert slurm_signals_tasks_only(env, cgroups) is want


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", ["TERM", "USR1"])
@pytest.mark.parametrize(
    "step, who, in_script",
    [("0", "all", False), (None, "all", True), (None, "shell", False)],
    ids=["srun-step-wide", "batch-script-step-wide", "batch-shell-only"],
)
def test_slurm_signals_reach_the_job_once(shmstage_bin, tmp_path, sig, step, who, in_script):
    """slurmstepd signalling every process of the step, or only the batch shell: one delivery.

    srun-step-wide: `srun shmstage run ...`, then scancel / --signal=SIG@T.
    batch-script-step-wide: an sbatch script runs `shmstage run ...`, then scancel --full.
    batch-shell-only: the script did `exec shmstage run ...`, then --signal=B:SIG.
    """
    script = ("sh", "-c", '"$@"; exit $?', "sh") if in_script else ()
    cmd, counts, final, ready = start_counting_job(shmstage_bin, tmp_path, prefix=script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    if step is not None:
        env["SLURM_STEP_ID"] = step
    stepd = subprocess.Popen(
        [sys.executable, "-c", FAKE_SLURMSTEPD, *cmd],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        task = int(stepd.stdout.readline())
        wait_for(ready)
        shmstage_pid = psutil.Process(task).children()[0].pid if in_script else task

        def send(signum: int) -> None:
            stepd.stdin.write(f"{who} {sig}\n")
            stepd.stdin.flush()
            assert stepd.stdout.readline() == "sent\n"

        got = deliver_and_count(shmstage_pid, int(ready.read_text()), send, sig, counts, final)
        assert got[sig] == 1, got
        stepd.stdin.close()
        stepd.wait(timeout=30)  # (the sh of a batch script died of SIG: shmstage is orphaned)
    finally:
        with contextlib.suppress(psutil.Error, NameError):
            psutil.Process(shmstage_pid).kill()  # orphaned when the script's sh died
        if stepd.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(stepd.pid).children(recursive=True):
                    child.kill()
            stepd.kill()
        stepd.wait()
        stepd.stdout.close()
        if not stepd.stdin.closed:
            stepd.stdin.close()
        kill_job(ready)


def wait_status(pid: int, stopped: bool) -> None:
    deadline = time.monotonic() + 30
    while (psutil.Process(pid).status() == psutil.STATUS_STOPPED) != stopped:
        assert time.monotonic() < deadline, f"{pid} never {'stopped' if stopped else 'resumed'}"
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_terminal_ctrl_z_stops_and_resumes_the_job(shmstage_bin, tmp_path):
    """^Z stops shmstage and the job (in its own session); continuing shmstage resumes both."""
    pidfile, ready = tmp_path / "pid", tmp_path / "ready"
    master, slave = os.openpty()

    def controlling_tty() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    p = subprocess.Popen(
        [*shmstage_bin, "run", "--", "sh", "-c", 'echo $$ > "$1"; echo ready > "$2"; exec sleep 300', "sh", pidfile, ready],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True, preexec_fn=controlling_tty,
    )  # fmt: skip
    os.close(slave)
    try:
        wait_for(ready)
        job = int(pidfile.read_text())
        os.write(master, b"\x1a")  # ^Z: SIGTSTP to the terminal's foreground group
        wait_status(p.pid, stopped=True)
        wait_status(job, stopped=True)
        os.kill(p.pid, signal.SIGCONT)  # what the shell's `fg` sends
        wait_status(p.pid, stopped=False)
        wait_status(job, stopped=False)
        p.terminate()
        assert p.wait(timeout=30) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)


@pytest.mark.timeout(60)
def test_sigkill_of_shmstage_takes_the_job_down(shmstage_bin, tmp_path, procs):
    """If shmstage itself is SIGKILLed, the job gets SIGTERM (PR_SET_PDEATHSIG), not orphaned."""
    pidfile, ready = tmp_path / "pid", tmp_path / "ready"
    p = procs.start(
        [*shmstage_bin, "run", "--", "sh", "-c", 'echo $$ > "$1"; echo ready > "$2"; exec sleep 300', "sh", pidfile, ready],
        start_new_session=True,
    )  # fmt: skip
    wait_for(ready)
    job = psutil.Process(int(pidfile.read_text()))
    p.kill()
    p.wait(timeout=10)
    try:
        job.wait(timeout=10)
    except psutil.TimeoutExpired:
        job.kill()
        pytest.fail("the job outlived a SIGKILLed shmstage")


@pytest.mark.timeout(60)
def test_orphans_of_the_job_are_reaped_while_it_runs(shmstage_bin, tmp_path, procs):
    """A process the job orphans is re-parented to shmstage and reaped when it exits (no zombie)."""
    pidfile = tmp_path / "pid"
    p = procs.start(
        [*shmstage_bin, "run", "--", "sh", "-c", '(sleep 0.2 & echo $! > "$1"); exec sleep 30', "sh", pidfile],
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(pidfile)
        orphan = int(pidfile.read_text())
        deadline = time.monotonic() + 20
        while psutil.pid_exists(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not psutil.pid_exists(orphan)  # a zombie would still "exist"
        assert p.poll() is None  # reaped during the run, not at the end
    finally:
        p.terminate()
        p.wait(timeout=30)
