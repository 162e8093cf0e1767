"""``shmstage pillow-simd``: check or install an AVX2 + libjpeg-turbo pillow-simd."""

from __future__ import annotations

import click

from shmstage import pillow
from shmstage.cli.output import emit, json_option, log, table, verdict


def _yes(value: bool | None) -> str:
    return "unknown" if value is None else "yes" if value else "no"


def render_status(status: pillow.PillowStatus) -> None:
    record = status.record
    build = _yes(status.avx2_build)
    if record is not None:
        build += f" (CC={record.cc!r}, {record.built_at})"
    elif status.flavor == "pillow-simd":
        build += " (no shmstage build record for this binary)"
    active = f"{status.flavor} {status.version}" if status.version else status.flavor
    rows = [
        ("python", status.python),
        ("PIL", active),
        ("installed", ", ".join(_dists(status)) or "-"),
        ("libjpeg-turbo", _yes(status.libjpeg_turbo)),
        ("AVX2 build", build),
        ("AVX2 code", avx2_code(status)),
        ("CPU AVX2", _yes(status.cpu_avx2)),
    ]
    if status.import_error:
        rows.append(("import error", status.import_error))
    if status.dependents:
        rows.append(("require pillow", ", ".join(status.dependents)))
    click.echo(table(rows))
    click.echo(f"{verdict('OK' if status.ok else 'FAIL')}: {status.next_step}")


def avx2_code(status: pillow.PillowStatus) -> str:
    """The disassembly verdict on PIL/_imaging, for the table."""
    if status.avx2 == "unverified":
        return f"unverified ({status.avx2_reason})"
    return f"{status.avx2} ({status.avx2_instructions} AVX2 instructions in PIL/_imaging)"


def _dists(status: pillow.PillowStatus) -> list[str]:
    names = [("Pillow", status.pillow_version), ("pillow-simd", status.simd_version)]
    return [f"{name} {version}" for name, version in names if version]


def render_plan(plan: pillow.InstallPlan) -> None:
    if plan.nothing_to_do:
        click.echo(
            f"{verdict('OK')}: nothing to do: {_built(plan)} is already active in {plan.python}"
        )
        return
    click.echo(
        f"# plan for {plan.python}: {plan.requirement}, CC={plan.cc!r}, system deps: {plan.system_deps}"
    )
    click.echo(f"# {pillow.WORK} stands for a fresh temporary directory")
    for step in plan.steps:
        click.echo(step.command())


def render_result(result: pillow.InstallResult) -> None:
    if not result.changed:
        render_plan(result.plan)
        return
    after = result.after
    click.echo(
        f"{verdict('CHANGED')}: {_built(result.plan, after.simd_version)} is active in "
        f"{result.plan.python} ({result.seconds:.0f} s)"
    )
    render_status(after)


def _built(plan: pillow.InstallPlan, version: str | None = None) -> str:
    version = version or plan.before.simd_version or ""
    return f"pillow-simd {version} ({'AVX2' if plan.avx2 else 'SSE4'} build, libjpeg-turbo)"


@click.command("pillow-simd")
@click.option(
    "--check",
    is_flag=True,
    help="Only report what provides PIL; exit 0 only when pillow-simd with libjpeg-turbo is active.",
)
@click.option(
    "--dry-run", is_flag=True, help="Print the exact commands an install would run; change nothing."
)
@click.option(
    "--python",
    "python",
    type=click.Path(exists=True, dir_okay=False),
    metavar="PATH",
    help="Target interpreter (e.g. the training venv's bin/python); default: the one running shmstage.",
)
@click.option(
    "--version",
    "version",
    metavar="V",
    help="Build this pillow-simd version (default: the newest on PyPI).",
)
@click.option("--no-avx2", is_flag=True, help="Build the SSE4 variant even when the CPU has AVX2.")
@click.option(
    "--no-system-deps",
    is_flag=True,
    help="Do not install libjpeg-turbo/zlib headers with apt or conda.",
)
@json_option
@click.pass_context
def pillow_cmd(
    ctx: click.Context,
    check: bool,
    dry_run: bool,
    python: str | None,
    version: str | None,
    no_avx2: bool,
    no_system_deps: bool,
    as_json: bool,
) -> None:
    """Install and verify an AVX2 + libjpeg-turbo pillow-simd (or --check).

    \b
    pillow-simd replaces Pillow (both own PIL/): it is built from source without
    pip's cache, with CC="cc -mavx2" on CPUs that have AVX2, verified in the
    target interpreter and recorded. A failed build leaves the previous Pillow
    in place. Running it again when the right build is active does nothing.
    """
    if check:
        if dry_run or version or no_avx2 or no_system_deps:
            raise click.UsageError("--check takes only --python and --json")
        status = pillow.check(python)
        emit(status, as_json, render_status)
        ctx.exit(0 if status.ok else 1)

    plan = pillow.plan_install(
        python, version=version, avx2=not no_avx2, system_deps=not no_system_deps
    )
    for warning in plan.warnings:
        log(f"warning: {warning}")
    if dry_run or plan.nothing_to_do:
        emit(plan, as_json, render_plan)
        return
    result = pillow.install(plan, log=log)
    emit(result, as_json, render_result)
