"""``speccheck verify``: verify backends in their own processes and report the results."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from speccheck import __version__
from speccheck.checks.verify.data_parallel import verify_dp
from speccheck.checks.cli.runtime_options import (
    BlockSizeOption,
    DcpWorldSizeOption,
    DpSizeOption,
    DtypeOption,
    HeadSizeOption,
    MatrixPathOption,
    MaxModelLenOption,
    NumHeadsOption,
    NumKvHeadsOption,
    NumSpeculativeStepsOption,
    build_runtime_config,
    option_flag,
)
from speccheck.checks.verify.engine import decode_example
from speccheck.checks.verify.report import CHECK_NAMES, BackendReport, write_json, write_junit
from speccheck.checks.verify.runner import run_worker, worker_request
from speccheck.contract.matrix_loader import MatrixError, load_matrix
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.dp_launch import RankError

EXIT_FAILED = 1
EXIT_NOTHING_VERIFIED = 3

TIER_DEFAULTS = {
    "gpu": {"platform": "cuda", "cudagraph_mode": "full", "dtype": "bfloat16", "head_size": 128,
            "num_heads": 16, "num_kv_heads": 4, "block_size": 16, "max_model_len": 1024},
    "cpu": {"platform": "cpu", "cudagraph_mode": "none", "dtype": "float32", "head_size": 32,
            "num_heads": 4, "num_kv_heads": 2, "block_size": 4, "max_model_len": 64},
}
"""Runtime defaults per tier, overridden by any option given: a small drafter on the CPU,
a realistic head layout on the GPU."""

TIER_LINE = {
    "gpu": "tier: GPU ({device}) — real CUDA graphs: fused FULL-graph replay and the eager fused "
           "loop against the eager per-step oracle",
    "cpu": "tier: CPU (no CUDA device) — eager fused loop against the eager per-step oracle, "
           "padding lanes included, and capture-safety probes by tracing; no CUDA graph is "
           "captured and no GPU result is claimed",
}


def _commit() -> str:
    """The commit under verification: ``$SPECCHECK_COMMIT`` when set (copies of the tree
    whose ``.git`` is missing or stale, as on the GPU machine), else ``git rev-parse HEAD``,
    else ``unknown``."""
    if os.environ.get("SPECCHECK_COMMIT"):
        return os.environ["SPECCHECK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def verify_command(
    backend: Annotated[str, typer.Option("--backend", help="Backend name from matrix.yaml, or 'all'.")] = "reference",
    examples: Annotated[int, typer.Option("--examples", min=1, help="Examples per backend.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Hypothesis seed.")] = 0,
    reproduce: Annotated[Optional[str], typer.Option("--reproduce", help="Run exactly this example (from a failure report).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the JSON report here.")] = None,
    junit: Annotated[Optional[Path], typer.Option("--junit", help="Write a JUnit XML report here.")] = None,
    example_timeout: Annotated[float, typer.Option("--example-timeout", help="Seconds without progress before a worker counts as hung.")] = 300.0,
    matrix_path: MatrixPathOption = None,
    dcp_world_size: DcpWorldSizeOption = None,
    dp_size: DpSizeOption = None,
    num_speculative_steps: NumSpeculativeStepsOption = None,
    block_size: BlockSizeOption = None,
    max_model_len: MaxModelLenOption = None,
    dtype: DtypeOption = None,
    head_size: HeadSizeOption = None,
    num_heads: NumHeadsOption = None,
    num_kv_heads: NumKvHeadsOption = None,
) -> None:
    """Capture real CUDA graphs (or, without CUDA, run the CPU tier), replay them on
    hypothesis-drawn batches and compare with eager per-step metadata rebuilds."""
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    given = {"dcp_world_size": dcp_world_size, "dp_size": dp_size, "block_size": block_size,
             "max_model_len": max_model_len, "dtype": dtype, "head_size": head_size,
             "num_heads": num_heads, "num_kv_heads": num_kv_heads,
             "num_speculative_steps": num_speculative_steps}
    tier = "gpu" if torch.cuda.is_available() else "cpu"
    config = build_runtime_config(**{**TIER_DEFAULTS[tier], **{k: v for k, v in given.items() if v is not None}})
    try:
        matrix = load_matrix(matrix_path)
    except MatrixError as exc:
        for problem in exc.problems:
            Console(stderr=True, highlight=False).print(problem.render(), markup=False)
        raise typer.Exit(2) from None
    names = matrix.names if backend == "all" else [backend]
    if backend != "all" and backend not in matrix.names:
        console.print(f"unknown backend {backend!r}; valid: {', '.join(matrix.names)}, all", markup=False)
        raise typer.Exit(2)
    if reproduce is not None:
        try:
            decode_example(reproduce)
        except ValueError as exc:
            console.print(str(exc), markup=False)
            raise typer.Exit(2) from None
    steps = (num_speculative_steps,) if num_speculative_steps else tuple(range(2, 9))
    device = torch.cuda.get_device_name() if tier == "gpu" else "CPU"
    console.print(TIER_LINE[tier].format(device=device), markup=False)
    flags = " ".join(f"{option_flag(k)} {v}" for k, v in given.items() if v is not None)
    reports: list[BackendReport] = []
    if config.dp_size > 1:
        reports = [
            _verify_data_parallel(name, config, examples, seed, tier, console) for name in names
        ]
        _finish(console, reports, json_path, junit, tier, device)
        return
    with Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        for name in names:
            matrix_flag = f" --matrix {shlex.quote(str(matrix_path))}" if matrix_path else ""
            prefix = f"speccheck verify --backend {name} --seed {seed}{matrix_flag} {flags}".strip()
            request = worker_request(name, config, examples, seed, steps, reproduce, prefix, matrix_path)
            reports.append(run_worker(request, progress, example_timeout, tier))
    _finish(console, reports, json_path, junit, tier, device)


def _verify_data_parallel(
    name: str, config: RuntimeConfig, examples: int, seed: int, tier: str, console: Console
) -> BackendReport:
    """``--dp-size N``: the DFlash drafter on N real ranks (their own processes), each with
    a different real batch size, in eager mode and, with CUDA, in FULL mode."""
    console.print(f"{name}: data-parallel DFlash drafting on {config.dp_size} ranks", markup=False)
    try:
        return verify_dp(name, config, config.dp_size, examples=examples, seed=seed).to_report()
    except RankError as exc:
        return BackendReport(name, tier, "crashed", detail=str(exc))


def _finish(
    console: Console, reports: list[BackendReport], json_path: Path | None, junit: Path | None,
    tier: str, device: str,
) -> None:
    """Print the summary, write the reports, and exit with a status CI can trust."""
    _print_summary(console, reports)
    if json_path:
        write_json(reports, json_path, {"speccheck": __version__, "commit": _commit(), "tier": tier,
                                         "device": device, "command": "speccheck verify " + shlex.join(_argv())})
    if junit:
        write_junit(reports, junit)
    statuses = {r.status for r in reports}
    if statuses & {"failed", "crashed"}:
        raise typer.Exit(EXIT_FAILED)
    if "passed" not in statuses:
        raise typer.Exit(EXIT_NOTHING_VERIFIED)


def _argv() -> list[str]:
    return sys.argv[2:] if len(sys.argv) > 2 else []


def _print_summary(console: Console, reports: list[BackendReport]) -> None:
    table = Table(title="speccheck verify")
    for column in ("backend", "tier", "status", "fused", "examples", "passed", "failed",
                   "indeterminate", "capture s", "total s"):
        table.add_column(column)
    for r in reports:
        passed = sum(t.passed for t in r.checks.values())
        failed = sum(t.failed for t in r.checks.values())
        indet = sum(t.indeterminate for t in r.checks.values())
        fused = "-" if r.status in ("skipped", "crashed") else (
            "allowed" if r.fused_allowed else "not allowed"
        )
        table.add_row(r.backend, r.tier, r.status, fused, str(r.examples), str(passed), str(failed),
                      str(indet), f"{r.capture_seconds:.1f}", f"{r.seconds:.1f}")
    console.print(table)
    for r in reports:
        if not r.fused_allowed and r.status in ("passed", "failed"):
            how = ("host_preplanned path verified against the per-step oracle"
                   if any(c.startswith("preplanned") for c in r.candidates)
                   else "verified on the per-step path only")
            console.print(f"{r.backend}: fused: not allowed ({r.fused_reason}); {how}", markup=False)
        if r.status in ("skipped", "crashed"):
            console.print(f"{r.backend}: {r.status}: {r.detail}", markup=False)
        for f in r.failures:
            where = "".join(
                [f" step {f.step}" if f.step is not None else "", f" field {f.field}" if f.field else ""]
            )
            console.print(f"FAIL {r.backend} {f.check}{where}: {f.diagnosis}", markup=False)
        if r.minimal_example is not None:
            console.print(f"minimal example: {json.dumps(r.minimal_example)}", markup=False)
        if r.reproduce:
            console.print(f"reproduce: {r.reproduce}", markup=False)
    checks = ", ".join(CHECK_NAMES)
    console.print(f"checks: {checks}", markup=False)
