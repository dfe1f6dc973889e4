"""The ``speccheck`` command line.

Exit statuses: 0 success; 1 a ``--check`` found a stale generated file; 2 bad input (an
invalid matrix file, with one ``PATH:LINE: backend 'NAME', field 'FIELD': ...`` line per
problem on stderr, or a bad option). Machine-readable output (``--json``, ``schema``) goes
to stdout and nothing else does in those modes; messages and logs go to stderr.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from speccheck.checks.cli.bench import bench_command
from speccheck.checks.cli.mutate import mutate_command
from speccheck.checks.cli.paths import output_path_problem
from speccheck.checks.cli.runtime_options import (
    MatrixPathOption,
    RuntimeOverrides,
    build_runtime_config,
    with_runtime_options,
)
from speccheck.checks.cli.selftest import selftest_command
from speccheck.checks.cli.status import DEFAULT_STATUS_DIR, status_command
from speccheck.checks.cli.verify import verify_command
from speccheck.checks.docgen.capabilities import render_capability_docs
from speccheck.checks.docgen.checks import render_check_docs
from speccheck.checks.status.record import StatusFileError, read_statuses
from speccheck.contract.matrix_loader import MatrixError
from speccheck.contract.matrix_model import Matrix, render_matrix_json_schema
from speccheck.contract.plugins import load_matrix_with_plugins
from speccheck.contract.resolution import FusedVerdict, resolve_matrix
from speccheck.contract.runtime_config import RuntimeConfig

logger = logging.getLogger(__name__)

EXIT_STALE = 1
EXIT_BAD_INPUT = 2
DEFAULT_DOCS_PATH = Path("docs/capabilities.md")
DEFAULT_CHECKS_DOCS_PATH = Path("docs/checks.md")
SCHEMA_RESOURCE = "matrix.schema.json"
SHIPPED_MATRIX = Path(str(importlib.resources.files("speccheck") / "matrix.yaml"))

app = typer.Typer(
    name="speccheck",
    help="Declare, gate and verify fused multi-step draft decoding of attention backends.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _stdout() -> Console:
    return Console(highlight=False, emoji=False)


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, emoji=False, soft_wrap=True)


def configure_logging(verbose: bool) -> None:
    """Send log records to stderr through rich: warnings and up, or everything of speccheck
    with ``verbose``. Leaves an already configured root logger (e.g. under pytest) alone."""
    logging.basicConfig(
        level=logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=_stderr(), show_time=False, show_path=False)],
    )
    logging.getLogger("speccheck").setLevel(logging.DEBUG if verbose else logging.WARNING)


@app.callback()
def _app_options(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log debug messages to stderr.")
    ] = False,
) -> None:
    configure_logging(verbose)


def _load_or_exit(path: Path | None) -> Matrix:
    """Load the matrix (``path`` alone, or the shipped one merged with the installed
    plug-ins' fragments); on failure print every problem, one line each, and exit 2."""
    try:
        return load_matrix_with_plugins(path)
    except MatrixError as exc:
        console = _stderr()
        for problem in exc.problems:
            console.print(problem.render(), markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None


def _exit_on_bad_output(flag: str, path: Path, *, create_parents: bool = False) -> None:
    """Exit 2 with one line when ``path`` cannot be written, before any work is done."""
    problem = output_path_problem(path, create_parents=create_parents)
    if problem is not None:
        _stderr().print(f"{flag}: {problem}", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT)


def _config_summary(config: RuntimeConfig) -> str:
    return ", ".join(f"{name}={value}" for name, value in config.model_dump().items())


WIDE_TABLE_COLUMNS = 120
"""Below this console width ``speccheck matrix`` prints each reason in full under the table
instead of in a column squeezed to a few characters."""

VERDICT_STYLE = {
    FusedVerdict.YES: "[green]yes[/green]",
    FusedVerdict.NO: "[red]no[/red]",
    FusedVerdict.DECLARED_UNVERIFIED: "[yellow]declared, unverified[/yellow]",
}


@app.command("matrix")
@with_runtime_options()
def matrix_command(
    matrix: MatrixPathOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON list on stdout instead of a table.")
    ] = False,
    *,
    runtime: RuntimeOverrides,
) -> None:
    """Resolve every backend of the matrix against a runtime configuration: may it run
    fused multi-step draft decoding, with which refresh strategy, and why (not)."""
    config = build_runtime_config(runtime)
    resolutions = resolve_matrix(_load_or_exit(matrix), config)
    logger.debug("resolved %d backends under %s", len(resolutions), _config_summary(config))
    if as_json:
        payload = [resolution.to_json() for resolution in resolutions]
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return
    console = _stdout()
    reasons_below = console.width < WIDE_TABLE_COLUMNS
    table = Table(
        title="Fused multi-step draft decode per backend",
        caption=_config_summary(config),
        show_lines=not reasons_below,
    )
    table.add_column("Backend", style="bold", no_wrap=True)
    table.add_column("Fused")
    table.add_column("Refresh", no_wrap=True)
    if not reasons_below:
        table.add_column("Reason")
    for resolution in resolutions:
        cells = [resolution.name, VERDICT_STYLE[resolution.verdict],
                 resolution.refresh_strategy.value]
        table.add_row(*cells, *([] if reasons_below else [resolution.reason]))
    console.print(table)
    if reasons_below:
        for resolution in resolutions:
            console.print(f"{resolution.name}: {resolution.reason}", markup=False,
                          soft_wrap=True)


def _check_file(path: Path, expected: str, regenerate: str) -> None:
    """Exit 1 with a message when ``path`` does not hold exactly ``expected``."""
    try:
        actual = path.read_text(encoding="utf-8")
    except OSError as exc:
        _stderr().print(
            f"{path} cannot be read ({exc.strerror or exc}); run `{regenerate}` to create it.",
            markup=False,
        )
        raise typer.Exit(EXIT_STALE) from None
    if actual != expected:
        _stderr().print(
            f"{path} is stale: it does not match what `{regenerate}` generates from the "
            f"current matrix; run `{regenerate}` and commit the result.",
            markup=False,
        )
        raise typer.Exit(EXIT_STALE)
    _stderr().print(f"{path} is up to date.", markup=False)


@app.command("docs")
def docs_command(
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 if the file differs from what would be written.")
    ] = False,
    checks: Annotated[
        bool, typer.Option("--checks", help="Render the check table (docs/checks.md) instead "
                           "of the capability docs.")
    ] = False,
    output: Annotated[
        Optional[Path],  # noqa: UP045 - typer on the GPU image needs Optional
        typer.Option("--output", help="Markdown file to write (or, with --check, to check) "
                     "instead of printing to stdout; --check defaults to docs/capabilities.md "
                     "or docs/checks.md.", dir_okay=False, show_default=False),
    ] = None,
    matrix: MatrixPathOption = None,
    plugins: Annotated[
        bool, typer.Option("--plugins", help="With --check: include the installed plug-ins' "
                           "fragments (by default --check compares the shipped matrix.yaml "
                           "alone, which is what the committed file is generated from).")
    ] = False,
    status: Annotated[
        Path, typer.Option("--status", help="The status folder the \"last verified\" column "
                           "reads (written by `speccheck status`); a backend without a file "
                           "there reads \"not verified\".", file_okay=False)
    ] = DEFAULT_STATUS_DIR,
) -> None:
    """Generate the capability docs from the matrix and the backends' status, or the check
    table from the check registry."""
    if output is not None and not check:
        _exit_on_bad_output("--output", output, create_parents=True)
    if checks:
        text, default = render_check_docs(), DEFAULT_CHECKS_DOCS_PATH
    else:
        try:
            verified = read_statuses(status)
        except StatusFileError as exc:
            _stderr().print(f"--status: {exc}", markup=False)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        shipped_alone = check and matrix is None and not plugins
        source = _load_or_exit(SHIPPED_MATRIX if shipped_alone else matrix)
        text = render_capability_docs(source, verified)
        default = DEFAULT_DOCS_PATH
    if check:
        _check_file(output or default, text, "speccheck docs" + (" --checks" if checks else ""))
        return
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        _stderr().print(f"--output: cannot write {output}: {exc.strerror or exc}", markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    _stderr().print(f"wrote {output}", markup=False)


@app.command("schema")
def schema_command(
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 if the committed schema is stale.")
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            help="Schema file to write (or, with --check, to check) instead of printing it; "
            "--check defaults to the matrix.schema.json shipped with speccheck.",
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print the JSON Schema of matrix.yaml (stable key order)."""
    text = render_matrix_json_schema()
    if check:
        committed = output or Path(str(importlib.resources.files("speccheck") / SCHEMA_RESOURCE))
        _check_file(committed, text, "speccheck schema --output matrix.schema.json")
        return
    if output is not None:
        _exit_on_bad_output("--output", output)
        output.write_text(text, encoding="utf-8")
        _stderr().print(f"wrote {output}", markup=False)
        return
    sys.stdout.write(text)


app.command("verify")(verify_command)
app.command("selftest")(selftest_command)
app.command("bench")(bench_command)
app.command("status")(status_command)
app.command("mutate")(mutate_command)


def main() -> None:
    """Console-script entry point (``speccheck``). A command line the parser rejects (an
    unknown option, a value out of range or of the wrong type) is one line on stderr naming
    the command and the option, exit status 2."""
    try:
        code = app(prog_name="speccheck", standalone_mode=False)
    except Exception as exc:
        usage_error = getattr(exc, "format_message", None)
        exit_code = getattr(exc, "exit_code", None)
        if usage_error is None or not isinstance(exit_code, int) or exit_code == 0:
            raise
        context = getattr(exc, "ctx", None)
        command = context.command_path if context is not None else "speccheck"
        message = " ".join(str(usage_error()).split())
        if message:  # empty: the parser has printed the help (no command given)
            print(f"{command}: {message}", file=sys.stderr)
        sys.exit(exit_code)
    sys.exit(code if isinstance(code, int) else 0)
