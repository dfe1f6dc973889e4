"""``speccheck selftest``: prove the verifier catches every known-bad builder.

Importing this module does not import torch; the command imports the self-test when it runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from speccheck.checks.cli.json_output import (
    JSON_HELP,
    json_path_problem,
    report_console,
    write_json_text,
)
from speccheck.checks.verify.scale import DEFAULT_SHRINK_SECONDS


def selftest_command(
    json_path: Annotated[Optional[Path], typer.Option("--json", help=JSON_HELP)] = None,  # noqa: UP045
    shrink_seconds: Annotated[float, typer.Option("--shrink-seconds", min=0, help="Seconds each run may spend shrinking its failure to a smaller example; whether a mutant is caught does not depend on it.")] = DEFAULT_SHRINK_SECONDS,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Run only this row (the table's mutant name, or 'control'); repeat for more.")] = None,  # noqa: UP045
) -> None:
    """Prove the verifier catches every known-bad builder (exit 1 if one slips through;
    those of backends this machine cannot run are listed as skipped, with the reason)."""
    if not shrink_seconds >= 0:  # also NaN, which the option's range lets through
        raise typer.BadParameter(f"{shrink_seconds} is not 0 or more",
                                 param_hint="'--shrink-seconds'")
    if (unwritable := json_path_problem(json_path)) is not None:
        raise typer.BadParameter(unwritable, param_hint="'--json'")
    import torch

    from speccheck.checks.triton_interpreter import interpret_triton_without_cuda

    interpret_triton_without_cuda()
    from speccheck.checks.selftest.run import Outcome, UnknownSelftestRow, run_selftest

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    console = report_console(json_path)
    try:
        results = run_selftest(device, shrink_seconds, only or ())
    except UnknownSelftestRow as exc:
        raise typer.BadParameter(str(exc), param_hint="'--only'") from None
    tier = "GPU, real graphs" if device.type == "cuda" else "CPU tier"
    table = Table(title=f"speccheck selftest ({tier})")
    for column in ("mutant", "must be caught by", "result", "re-creates"):
        table.add_column(column)
    shown = {Outcome.CAUGHT: "ok", Outcome.MISSED: "MISSED", Outcome.SKIPPED: "skipped",
             Outcome.ERROR: "ERROR"}
    for r in results:
        table.add_row(r.name, r.expected_check, shown[r.outcome], r.recreates)
    console.print(table)
    for r in results:
        if r.outcome is not Outcome.CAUGHT:
            console.print(f"{shown[r.outcome]} {r.name}: {r.detail}", markup=False)
    if json_path:
        write_json_text(json_path, json.dumps([asdict(r) for r in results], indent=2))
    if any(r.outcome in (Outcome.MISSED, Outcome.ERROR) for r in results):
        raise typer.Exit(1)
