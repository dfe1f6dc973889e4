"""``speccheck bench``: propose latency of every draft-decode path a backend allows, side
by side in one process (:mod:`speccheck.checks.bench`).

The command parses and checks its input (one line on stderr, exit 2, before any work),
settles the backend's runtime config as ``speccheck verify`` does (the tier's defaults,
the entry's ``verify_defaults``, the options given), measures, prints a rich table on a
terminal or one plain line per row in logs, and writes the JSON report and the plots.
Exit statuses: 0 measured; 1 two paths drafted different tokens; 2 bad input; 3 the
backend cannot run on this machine (the line says why).

Importing this module does not import torch; the command does when it runs.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from speccheck.checks.api import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_NOTHING_VERIFIED,
    VERIFY_FIELDS,
    VerifyInputError,
    plan_verification,
)
from speccheck.checks.cli.json_output import (
    JSON_HELP,
    json_path_problem,
    report_console,
    to_stdout,
    write_json_text,
)
from speccheck.checks.cli.paths import output_path_problem
from speccheck.checks.cli.runtime_options import (
    MatrixPathOption,
    RuntimeOverrides,
    build_runtime_config,
    with_runtime_options,
)
from speccheck.checks.cli.verify import shown_tier_default
from speccheck.checks.provenance import commit_under_test

if TYPE_CHECKING:
    from speccheck.checks.bench.measure import BenchRun
    from speccheck.checks.bench.records import BenchReport
    from speccheck.checks.verify.context import MatrixContext
    from speccheck.contract.runtime_config import RuntimeConfig

BENCH_FIELDS = tuple(name for name in VERIFY_FIELDS
                     if name not in ("num_speculative_steps", "dp_size"))
"""The runtime options of the command: verify's, less K (``--steps`` gives them) and the
data-parallel size (the benchmark drafts on one rank)."""
MAX_STEPS = 64
MAX_BATCH = 1024
MAX_REPEATS = 10_000


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, emoji=False, soft_wrap=True)


def _exit(status: int, message: str) -> typer.Exit:
    """Print ``message`` as one line on stderr; the caller raises the returned exit."""
    _stderr().print(" ".join(message.split()), markup=False)
    return typer.Exit(status)


def parse_counts(flag: str, text: str, most: int) -> tuple[int, ...]:
    """``"2,4,8"`` -> ``(2, 4, 8)``: distinct counts in 1..``most``, in the order given.
    Raises ``typer.Exit(2)`` after one line naming ``flag`` otherwise."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdecimal() and len(part) <= 9 for part in parts):
        raise _exit(EXIT_BAD_INPUT, f"{flag}: expected comma-separated counts such as 1,8,64, "
                    f"got {text!r}")
    counts = tuple(dict.fromkeys(int(part) for part in parts))
    if not all(1 <= count <= most for count in counts):
        raise _exit(EXIT_BAD_INPUT, f"{flag}: counts must lie in 1..{most}, got {text!r}")
    return counts


@with_runtime_options(BENCH_FIELDS, {field: shown_tier_default(field) for field in BENCH_FIELDS})
def bench_command(
    backend: Annotated[str, typer.Option("--backend", help="Backend name from the matrix.")],
    steps: Annotated[str, typer.Option("--steps", help="Draft step counts K, comma-separated.")] = "2,4,8",
    batches: Annotated[str, typer.Option("--batches", help="Batch sizes (requests), comma-separated.")] = "1,8,64",
    repeats: Annotated[int, typer.Option("--repeats", help=f"Timed rounds per case (1..{MAX_REPEATS}); each path runs once per round, after 3 warm-up rounds.")] = 30,
    json_path: Annotated[Optional[Path], typer.Option("--json", help=JSON_HELP, dir_okay=False)] = None,  # noqa: UP045
    plots: Annotated[Optional[Path], typer.Option("--plots", help="Write PNG plots into this directory (needs matplotlib: pip install 'speccheck\\[bench]').", file_okay=False)] = None,  # noqa: UP045
    profile_path: Annotated[Optional[Path], typer.Option("--profile", help="Write each case's decode-step timeline (kernels in start order, durations, gaps) and the profiler's tables (operators by host time, kernels by GPU time, the launching thread's Python functions) of every case and path here (CUDA only).", dir_okay=False)] = None,  # noqa: UP045
    matrix_path: MatrixPathOption = None,
    *,
    runtime: RuntimeOverrides,
) -> None:
    """Time launch on every draft-decode path the backend allows (per_step, fused,
    host_preplanned) at each K and batch size: wall, host and GPU time, graph replays, capture
    time and graph memory; the paths must draft identical tokens. Every case is timed
    before any is profiled (the profiler's CUDA callbacks outlive it and would tax the
    later launches' host time)."""
    _check_outputs(json_path, plots)
    if profile_path is not None and (problem := output_path_problem(profile_path)) is not None:
        raise _exit(EXIT_BAD_INPUT, f"--profile: {problem}")
    ks = parse_counts("--steps", steps, MAX_STEPS)
    sizes = parse_counts("--batches", batches, MAX_BATCH)
    if not 1 <= repeats <= MAX_REPEATS:
        raise _exit(EXIT_BAD_INPUT, f"--repeats: must lie in 1..{MAX_REPEATS}, got {repeats}")
    build_runtime_config(runtime)  # flag-named errors for bad values (exit 2)
    matrices = _matrices(matrix_path)
    if backend not in matrices.matrix.names:
        raise _exit(EXIT_BAD_INPUT, f"--backend: unknown backend {backend!r}; valid: "
                    f"{', '.join(matrices.matrix.names)}")
    try:
        config = plan_verification(backend, config=runtime, matrix=matrix_path).config_for(backend)
    except VerifyInputError as exc:
        raise _exit(EXIT_BAD_INPUT, str(exc)) from None
    run = _measure(backend, config, matrices, ks, sizes, repeats,
                   step_timelines=profile_path is not None)
    report = run.report
    _print_report(report, json_path)
    if profile_path is not None:
        profile_path.write_text(run.profile_text(), encoding="utf-8")
        _stderr().print(f"wrote {profile_path}", markup=False)
    if json_path is not None:
        write_json_text(json_path, json.dumps(report.to_json(), indent=2) + "\n")
        if not to_stdout(json_path):
            _stderr().print(f"wrote {json_path}", markup=False)
    if plots is not None:
        from speccheck.checks.bench.plots import write_plots

        for written in write_plots(report, plots):
            _stderr().print(f"wrote {written}", markup=False)


def _check_outputs(json_path: Path | None, plots: Path | None) -> None:
    """Exit 2 before any work when an output cannot be written, or ``--plots`` has no
    matplotlib."""
    if (problem := json_path_problem(json_path)) is not None:
        raise _exit(EXIT_BAD_INPUT, f"--json: {problem}")
    if plots is None:
        return
    from speccheck.checks.bench.plots import matplotlib_missing

    missing = matplotlib_missing()
    if missing is not None:
        raise _exit(EXIT_BAD_INPUT, missing)
    if plots.is_dir():
        problem = None if os.access(plots, os.W_OK | os.X_OK) else f"cannot write into {plots}"
    else:
        problem = output_path_problem(plots / "plot.png", create_parents=True)
    if problem is not None:
        raise _exit(EXIT_BAD_INPUT, f"--plots: {problem}")


def _matrices(path: Path | None) -> MatrixContext:
    from speccheck.checks.verify.context import MatrixContext
    from speccheck.contract.matrix_loader import MatrixError

    try:
        return MatrixContext.load(path)
    except MatrixError as exc:
        console = _stderr()
        for problem in exc.problems:
            console.print(problem.render(), markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None


def _measure(backend: str, config: RuntimeConfig, matrices: MatrixContext,
             ks: tuple[int, ...], sizes: tuple[int, ...], repeats: int,
             step_timelines: bool) -> BenchRun:
    """Run the benchmark, with a progress line per case on stderr; map its errors to exit
    statuses."""
    import torch

    from speccheck.checks.triton_interpreter import interpret_triton_without_cuda

    interpret_triton_without_cuda()
    from speccheck.checks.bench.errors import BackendCannotRun, BenchInputError, DraftTokensDiffer
    from speccheck.checks.bench.measure import BenchPhase, BenchSettings, run_bench

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = BenchSettings(backend, config, matrices, ks, sizes, repeats,
                             step_timelines=step_timelines)
    stderr = _stderr()

    def on_case(phase: BenchPhase, k: int, batch: int, number: int, total: int) -> None:
        stderr.print(f"bench {backend}: {phase.value} case {number}/{total}: K={k}, batch {batch}",
                     markup=False)

    try:
        return run_bench(settings, device, commit=commit_under_test(), on_case=on_case,
                         command="speccheck bench " + shlex.join(sys.argv[2:]))
    except BenchInputError as exc:
        raise _exit(EXIT_BAD_INPUT, str(exc)) from None
    except BackendCannotRun as exc:
        raise _exit(EXIT_NOTHING_VERIFIED, f"{backend}: cannot run here: {exc}") from None
    except DraftTokensDiffer as exc:
        raise _exit(EXIT_FAILED, str(exc)) from None


def _print_report(report: BenchReport, json_path: Path | None) -> None:
    """What ran, then the table (terminal) or one plain line per row (logs); on stderr
    where the JSON goes to stdout (``json_path`` is ``-``)."""
    from speccheck.checks.bench.table import bench_table, bound_line, plain_lines, sync_lines

    console = report_console(json_path, width=None if sys.stdout.isatty() else 200)
    header = [
        f"device: {report.device}, torch {report.torch_version}, commit {report.commit[:12]}",
        "runtime config: " + ", ".join(f"{k}={v}" for k, v in report.config.items()),
        "drafter: " + ", ".join(f"{k} {v}" for k, v in report.drafter.items()),
    ]
    if all(row.host_ms is None for row in report.rows):
        header.append("no CUDA device: eager loops, no graphs; host and GPU time are not measured")
    for line in header:
        console.print(line, markup=False, soft_wrap=True)
    if console.is_terminal:
        bound = bound_line(report)
        if bound:
            console.print(bound, markup=False, soft_wrap=True)
        console.print(bench_table(report))
    else:
        for line in plain_lines(report):
            console.print(line, markup=False, soft_wrap=True)
    for line in sync_lines(report):
        console.print(line, markup=False, soft_wrap=True)
