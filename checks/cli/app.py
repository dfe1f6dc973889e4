"""The ``speccheck`` command line.

Exit statuses: 0 success; 1 a ``--check`` found a stale generated file; 2 bad input (an
invalid matrix file, with one ``PATH:LINE: backend 'NAME', field 'FIELD': ...`` line per
problem on stderr, or a bad option). Machine-readable output (``--json``, ``schema``) goes
to stdout and nothing else does in those modes; messages and logs go to stderr.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from speccheck.checks.docgen.capabilities import render_capability_docs
from speccheck.checks.cli.runtime_options import (
    AdvanceDraftPositionsOption,
    BlockSizeOption,
    ComputeCapabilityOption,
    CudaGraphModeOption,
    DcpWorldSizeOption,
    DpSizeOption,
    DtypeOption,
    HeadSizeOption,
    KvCacheDtypeOption,
    MatrixPathOption,
    MaxModelLenOption,
    NumHeadsOption,
    NumKvHeadsOption,
    NumSpeculativeStepsOption,
    PlatformOption,
    build_runtime_config,
)
from speccheck.checks.selftest.run import selftest_command
from speccheck.checks.cli.verify import verify_command
from speccheck.contract.matrix_loader import MatrixError, load_matrix
from speccheck.contract.matrix_model import Matrix, render_matrix_json_schema
from speccheck.contract.resolution import resolve_matrix
from speccheck.contract.runtime_config import RuntimeConfig

logger = logging.getLogger(__name__)

EXIT_STALE = 1
EXIT_BAD_INPUT = 2
DEFAULT_DOCS_PATH = Path("docs/capabilities.md")
SCHEMA_RESOURCE = "matrix.schema.json"

app = typer.Typer(
    name="speccheck",
    help="Declare, gate and verify fused multi-step draft decoding of attention backends.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _stdout() -> Console:
    return Console(highlight=False)


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


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
    """Load the matrix; on failure print every problem, one line each, and exit 2."""
    try:
        return load_matrix(path)
    except MatrixError as exc:
        console = _stderr()
        for problem in exc.problems:
            console.print(problem.render(), markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None


def _config_summary(config: RuntimeConfig) -> str:
    return ", ".join(f"{name}={value}" for name, value in config.model_dump().items())


@app.command("matrix")
def matrix_command(
    matrix: MatrixPathOption = None,
    platform: PlatformOption = None,
    compute_capability: ComputeCapabilityOption = None,
    dcp_world_size: DcpWorldSizeOption = None,
    dp_size: DpSizeOption = None,
    cudagraph_mode: CudaGraphModeOption = None,
    num_speculative_steps: NumSpeculativeStepsOption = None,
    advance_draft_positions: AdvanceDraftPositionsOption = None,
    block_size: BlockSizeOption = None,
    max_model_len: MaxModelLenOption = None,
    kv_cache_dtype: KvCacheDtypeOption = None,
    dtype: DtypeOption = None,
    head_size: HeadSizeOption = None,
    num_heads: NumHeadsOption = None,
    num_kv_heads: NumKvHeadsOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON list on stdout instead of a table.")
    ] = False,
) -> None:
    """Resolve every backend of the matrix against a runtime configuration: may it run
    fused multi-step draft decoding, with which refresh strategy, and why (not)."""
    config = build_runtime_config(
        platform=platform,
        compute_capability=compute_capability,
        dcp_world_size=dcp_world_size,
        dp_size=dp_size,
        cudagraph_mode=cudagraph_mode,
        num_speculative_steps=num_speculative_steps,
        advance_draft_positions=advance_draft_positions,
        block_size=block_size,
        max_model_len=max_model_len,
        kv_cache_dtype=kv_cache_dtype,
        dtype=dtype,
        head_size=head_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    resolutions = resolve_matrix(_load_or_exit(matrix), config)
    logger.debug("resolved %d backends under %s", len(resolutions), _config_summary(config))
    if as_json:
        payload = [dataclasses.asdict(resolution) for resolution in resolutions]
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return
    table = Table(
        title="Fused multi-step draft decode per backend",
        caption=_config_summary(config),
        show_lines=True,
    )
    table.add_column("Backend", style="bold", no_wrap=True)
    table.add_column("Fused", no_wrap=True)
    table.add_column("Refresh", no_wrap=True)
    table.add_column("Reason")
    for resolution in resolutions:
        fused = "[green]yes[/green]" if resolution.fused_multi_step else "[red]no[/red]"
        table.add_row(
            resolution.name,
            fused,
            resolution.refresh_strategy,
            resolution.reason,
        )
    _stdout().print(table)


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
    output: Annotated[
        Path, typer.Option("--output", help="Markdown file to write or check.", dir_okay=False)
    ] = DEFAULT_DOCS_PATH,
    matrix: MatrixPathOption = None,
) -> None:
    """Generate the capability docs (docs/capabilities.md) from the matrix."""
    text = render_capability_docs(_load_or_exit(matrix))
    if check:
        _check_file(output, text, "speccheck docs")
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
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
        output.write_text(text, encoding="utf-8")
        _stderr().print(f"wrote {output}", markup=False)
        return
    sys.stdout.write(text)


app.command("verify")(verify_command)
app.command("selftest")(selftest_command)


def main() -> None:
    """Console-script entry point (``speccheck``)."""
    app()
