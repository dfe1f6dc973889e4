"""``speccheck verify``: verify backends in their own processes and report the results.

Importing this module does not import torch: the command imports the verify engine when it
runs, so ``speccheck matrix``, ``docs`` and ``schema`` start without it.

A ``--reproduce`` example is checked against the run's limits before any worker starts
(exit 2, one line naming the limit and the option that raises it). A failure's reproduce
command is re-run in a fresh worker before it is printed, and the summary says whether it
failed the same way there. Without a terminal, progress is a plain line per backend every
few seconds instead of a live bar.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from speccheck import __version__
from speccheck.checks.cli.paths import output_path_problem
from speccheck.checks.cli.runtime_options import (
    MatrixPathOption,
    RuntimeOverrides,
    build_runtime_config,
    runtime_flags,
    with_runtime_options,
)
from speccheck.checks.verify.vocabulary import Check, Status, Tier
from speccheck.contract.runtime_config import RuntimeConfig

if TYPE_CHECKING:
    from speccheck.checks.verify.context import MatrixContext
    from speccheck.checks.verify.examples import Example
    from speccheck.checks.verify.report import BackendReport
    from speccheck.checks.verify.runner import ProgressDisplay

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOTHING_VERIFIED = 3

TIER_DEFAULTS: dict[Tier, dict[str, object]] = {
    Tier.GPU: {"platform": "cuda", "cudagraph_mode": "full", "dtype": "bfloat16",
               "head_size": 128, "num_heads": 16, "num_kv_heads": 4, "block_size": 16,
               "max_model_len": 1024},
    Tier.CPU: {"platform": "cpu", "cudagraph_mode": "none", "dtype": "float32",
               "head_size": 32, "num_heads": 4, "num_kv_heads": 2, "block_size": 4,
               "max_model_len": 64},
}
"""Runtime defaults per tier, overridden by any option given: a small drafter on the CPU,
a realistic head layout on the GPU."""

VERIFY_FIELDS = ("dcp_world_size", "dp_size", "num_speculative_steps", "block_size",
                 "max_model_len", "kv_cache_dtype", "dtype", "head_size", "num_heads",
                 "num_kv_heads")
"""The runtime options ``verify`` takes; platform, compute capability and graph mode come
from the machine."""


def _shown_default(field: str) -> str:
    gpu, cpu = TIER_DEFAULTS[Tier.GPU].get(field), TIER_DEFAULTS[Tier.CPU].get(field)
    if gpu is None and cpu is None:
        return str(RuntimeConfig.model_fields[field].default)
    return f"GPU tier {gpu}, CPU tier {cpu}"


TIER_LINE = {
    Tier.GPU: "tier: GPU ({device}) — real CUDA graphs: fused FULL-graph replay and the eager "
              "fused loop against the eager per-step oracle",
    Tier.CPU: "tier: CPU (no CUDA device) — eager fused loop against the eager per-step "
              "oracle, padding lanes included, and capture-safety probes by tracing; no CUDA "
              "graph is captured and no GPU result is claimed",
}


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, emoji=False, soft_wrap=True)


def _bad_input(message: str) -> typer.Exit:
    _stderr().print(message, markup=False)
    return typer.Exit(EXIT_BAD_INPUT)


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


@with_runtime_options(VERIFY_FIELDS, {field: _shown_default(field) for field in VERIFY_FIELDS})
def verify_command(
    backend: Annotated[str, typer.Option("--backend", help="Backend name from the matrix, or 'all'.")] = "reference",
    examples: Annotated[int, typer.Option("--examples", min=1, help="Examples per backend.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Hypothesis seed.")] = 0,
    reproduce: Annotated[Optional[str], typer.Option("--reproduce", help="Run exactly this example (from a failure report).")] = None,  # noqa: UP045
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the JSON report here.")] = None,  # noqa: UP045
    junit: Annotated[Optional[Path], typer.Option("--junit", help="Write a JUnit XML report here.")] = None,  # noqa: UP045
    example_timeout: Annotated[float, typer.Option("--example-timeout", help="Seconds without progress before a worker counts as hung.")] = 300.0,
    audit_claims: Annotated[bool, typer.Option("--audit-claims", help="For a backend the matrix does not allow to fuse under the config, also run the fused path (in its own worker) and report whether the claim is too strict or confirmed.")] = False,
    capture_sizes: Annotated[Optional[str], typer.Option("--capture-sizes", help="Padded request counts to capture graphs for (and pad eager runs to), comma-separated; the largest bounds the requests and prefill tokens of an example.", show_default="1,2,4,8")] = None,  # noqa: UP045
    matrix_path: MatrixPathOption = None,
    *,
    runtime: RuntimeOverrides,
) -> None:
    """Capture real CUDA graphs (or, without CUDA, run the CPU tier), replay them on
    hypothesis-drawn batches and compare with eager per-step metadata rebuilds."""
    import torch

    from speccheck.checks.verify.context import MatrixContext
    from speccheck.checks.verify.examples import BadExample, decode_example
    from speccheck.contract.matrix_loader import MatrixError

    for flag, path in (("--json", json_path), ("--junit", junit)):
        unwritable = output_path_problem(path) if path is not None else None
        if unwritable is not None:
            raise _bad_input(f"{flag}: {unwritable}")
    sizes = _parse_capture_sizes(capture_sizes) if capture_sizes is not None else None
    tier = Tier.GPU if torch.cuda.is_available() else Tier.CPU
    config = build_runtime_config(runtime, TIER_DEFAULTS[tier])
    try:
        matrices = MatrixContext.load(matrix_path)
    except MatrixError as exc:
        for problem in exc.problems:
            _stderr().print(problem.render(), markup=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    names = list(matrices.matrix.names) if backend == "all" else [backend]
    if backend != "all" and backend not in matrices.matrix.names:
        raise _bad_input(f"unknown backend {backend!r}; valid: {', '.join(matrices.matrix.names)}, all")
    if reproduce is not None:
        if config.dp_size > 1:
            raise _bad_input("--reproduce runs one example in one worker; it cannot be combined "
                             "with --dp-size")
        try:
            example = decode_example(reproduce)
        except ValueError as exc:
            raise _bad_input(str(exc)) from None
        unfit = _example_problem(example, names[0], config, sizes, matrices, tier)
        if unfit is not None:
            raise _bad_input(unfit)
    console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 150)
    device = torch.cuda.get_device_name() if tier is Tier.GPU else "CPU"
    console.print(TIER_LINE[tier].format(device=device), markup=False)
    console.print("runtime config: " + ", ".join(
        f"{name}={value}" for name, value in config.model_dump().items()), markup=False)
    notes: dict[str, str] = {}
    if config.dp_size > 1:
        reports = [_verify_data_parallel(name, config, matrices, examples, seed, tier, console)
                   for name in names]
    else:
        steps = ((config.num_speculative_steps,) if "num_speculative_steps" in runtime
                 else tuple(range(2, 9)))
        sizes_flag = f" --capture-sizes {','.join(map(str, sizes))}" if sizes else ""
        prefix = (f"speccheck verify --seed {seed}{matrices.flag}{sizes_flag} "
                  f"{runtime_flags(runtime)}").strip()
        try:
            reports, notes = _verify_in_workers(
                names, config, matrices, examples, seed, steps, reproduce, prefix,
                example_timeout, tier, audit_claims, sizes, console)
        except BadExample as exc:
            raise _bad_input(str(exc)) from None
    _finish(console, reports, json_path, junit, tier, device, matrices, notes)


def _parse_capture_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``: distinct request counts, 1 up to the most requests
    an example may have, ascending; anything else is bad input (exit 2)."""
    from speccheck.checks.verify.examples import MAX_REQUESTS

    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdecimal() and part.isascii() for part in parts):
        raise _bad_input(f"--capture-sizes: expected comma-separated request counts such as "
                         f"1,2,4,8, got {text!r}")
    digits = len(str(MAX_REQUESTS))
    sizes = sorted({int(part) if len(part) <= digits else MAX_REQUESTS + 1 for part in parts})
    if sizes[0] < 1 or sizes[-1] > MAX_REQUESTS:
        raise _bad_input(f"--capture-sizes: request counts must lie in 1..{MAX_REQUESTS}, "
                         f"got {text!r}")
    return tuple(sizes)


def _example_problem(
    example: Example, backend: str, config: RuntimeConfig,
    capture_sizes: tuple[int, ...] | None, matrices: MatrixContext, tier: Tier,
) -> str | None:
    """Why the ``--reproduce`` example does not fit this run (one line naming the limit
    and the option that raises it), before any worker starts: the engine's own check
    (``BackendVerifier.example_problem``) on the settings the workers will get. The
    limits do not depend on the backend."""
    import torch

    from speccheck.checks.verify.engine import (
        DEFAULT_CAPTURE_SIZES,
        BackendVerifier,
        VerifySettings,
    )

    settings = VerifySettings(backend, config, capture_sizes=capture_sizes or DEFAULT_CAPTURE_SIZES,
                              matrices=matrices)
    device = torch.device("cuda" if tier is Tier.GPU else "cpu")
    return BackendVerifier(settings, device).example_problem(example)


def _verify_in_workers(
    names: list[str], config: RuntimeConfig, matrices: MatrixContext, examples: int, seed: int,
    steps: tuple[int, ...], reproduce: str | None, prefix: str, example_timeout: float,
    tier: Tier, audit_claims: bool, capture_sizes: tuple[int, ...] | None, console: Console,
) -> tuple[list[BackendReport], dict[str, str]]:
    """One worker per backend; with ``audit_claims``, a second worker runs the fused path
    of each backend that the matrix does not allow to fuse. A failure's reproduce command
    is re-run in a fresh worker (:func:`~speccheck.checks.verify.runner.confirm_reproduce`).
    Returns the reports, and for each backend whose reproduce command did not fail the
    same way there, why not."""
    from speccheck.checks.verify.report import ClaimAudit
    from speccheck.checks.verify.runner import confirm_reproduce, run_worker, worker_request

    reports, notes = [], {}
    with _progress_display(console) as progress:
        for name in names:
            reproduce_prefix = prefix.replace("speccheck verify", f"speccheck verify --backend {name}", 1)
            request = worker_request(name, config, examples, seed, steps, reproduce,
                                     reproduce_prefix, matrices.path, capture_sizes)
            report = run_worker(request, progress, example_timeout, tier)
            why = confirm_reproduce(request, report, progress, example_timeout, tier)
            if why is not None:
                notes[name] = why
            if audit_claims and not report.fused_allowed and report.status in (Status.PASSED, Status.FAILED):
                audit_request = {**request, "claim_fused": True,
                                 "reproduce_prefix": reproduce_prefix + " --audit-claims"}
                audited = run_worker(audit_request, progress, example_timeout, tier,
                                     label=f"{name} audit")
                report.claim_audit = ClaimAudit(audited.status, audited.examples,
                                                audited.failures, audited.detail)
            reports.append(report)
    return reports, notes


@contextmanager
def _progress_display(console: Console) -> Iterator[ProgressDisplay]:
    """A live progress bar on a terminal; plain progress lines (every 10 s or so) for
    logs."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from speccheck.checks.verify.runner import PlainProgress

    if not console.is_terminal:
        yield PlainProgress(console)
        return
    with Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        yield progress


def _verify_data_parallel(
    name: str, config: RuntimeConfig, matrices: MatrixContext, examples: int, seed: int,
    tier: Tier, console: Console,
) -> BackendReport:
    """``--dp-size N``: the DFlash drafter on N real ranks (their own processes), each with
    a different real batch size, in eager mode and, with CUDA, in FULL mode."""
    from speccheck.checks.verify.data_parallel import verify_dp
    from speccheck.checks.verify.report import BackendReport
    from speccheck.speculator.dp_launch import RankError

    console.print(f"{name}: data-parallel DFlash drafting on {config.dp_size} ranks", markup=False)
    try:
        return verify_dp(name, config, config.dp_size, examples=examples, seed=seed,
                         matrices=matrices).to_report()
    except RankError as exc:
        return BackendReport(name, tier, Status.CRASHED, detail=str(exc))


def _finish(
    console: Console, reports: list[BackendReport], json_path: Path | None, junit: Path | None,
    tier: Tier, device: str, matrices: MatrixContext, notes: dict[str, str],
) -> None:
    """Print the summary, write the reports, and exit with a status CI can trust.
    ``notes``: why a backend's reproduce command did not fail the same way in a fresh
    worker."""
    from speccheck.checks.verify.report import write_json, write_junit

    _print_summary(console, reports, notes)
    if json_path:
        write_json(reports, json_path, {
            "speccheck": __version__, "commit": _commit(), "tier": tier.value, "device": device,
            "command": "speccheck verify " + shlex.join(sys.argv[2:]),
        })
    if junit:
        write_junit(reports, junit, str(matrices.path or "matrix.yaml"))
    statuses = {r.status for r in reports}
    if statuses & {Status.FAILED, Status.CRASHED}:
        raise typer.Exit(EXIT_FAILED)
    if Status.PASSED not in statuses:
        raise typer.Exit(EXIT_NOTHING_VERIFIED)


def _print_summary(
    console: Console, reports: list[BackendReport], notes: dict[str, str]
) -> None:
    table = Table(title="speccheck verify")
    for column in ("backend", "tier", "status", "fused", "examples", "passed", "failed",
                   "indeterminate", "capture s", "total s"):
        table.add_column(column)
    for r in reports:
        passed = sum(t.passed for t in r.checks.values())
        failed = sum(t.failed for t in r.checks.values())
        indet = sum(t.indeterminate for t in r.checks.values())
        fused = "-" if r.status in (Status.SKIPPED, Status.CRASHED) else (
            "allowed" if r.fused_allowed else "not allowed"
        )
        table.add_row(r.backend, r.tier.value, r.status.value, fused, str(r.examples), str(passed),
                      str(failed), str(indet), f"{r.capture_seconds:.1f}", f"{r.seconds:.1f}")
    console.print(table)
    for r in reports:
        if not r.fused_allowed and r.status in (Status.PASSED, Status.FAILED):
            how = ("host_preplanned path verified against the per-step oracle"
                   if any(c.startswith("preplanned") for c in r.candidates)
                   else "verified on the per-step path only")
            console.print(f"{r.backend}: fused: not allowed ({r.fused_reason}); {how}", markup=False)
        if r.claim_audit is not None:
            console.print(f"{r.backend}: audit: {r.claim_audit.verdict}", markup=False)
        if r.status in (Status.SKIPPED, Status.CRASHED):
            console.print(f"{r.backend}: {r.status.value}: {r.detail}", markup=False)
        for f in r.failures:
            where = "".join(
                [f" step {f.step}" if f.step is not None else "", f" field {f.field}" if f.field else ""]
            )
            console.print(f"FAIL {r.backend} {f.check}{where}: {f.diagnosis}", markup=False)
        if r.minimal_example is not None:
            console.print(f"minimal example: {json.dumps(r.minimal_example)}", markup=False,
                          soft_wrap=True)
        if r.reproduce:
            console.print(f"{_reproduce_label(r, notes)}: {r.reproduce}", markup=False,
                          soft_wrap=True)
    console.print(f"checks: {', '.join(check.value for check in Check)}", markup=False)


def _reproduce_label(report: BackendReport, notes: dict[str, str]) -> str:
    """``reproduce``, saying whether the command failed the same way in a fresh worker."""
    if report.reproduced is None:
        return "reproduce"
    if report.reproduced:
        return "reproduce (checked: fails the same way in a fresh worker)"
    why = notes.get(report.backend, "it ended differently there")
    return f"reproduce (NOT reproduced in a fresh worker: {why})"
