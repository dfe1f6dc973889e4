"""``speccheck verify``: the command over :mod:`speccheck.checks.api`.

The command parses options, checks its output paths, builds the
:class:`~speccheck.checks.verify.run.VerifyRun` (one field per option), plans it with
:func:`~speccheck.checks.api.plan_verification` (bad input: one line on stderr, exit 2,
before any worker starts), shows progress (a live bar on a terminal, a plain line per
backend every few seconds in logs), prints the summary and writes the JSON and JUnit
reports. What runs, and how, is the API's: the command holds no verification logic.

Importing this module does not import torch, so ``speccheck matrix``, ``docs`` and
``schema`` start without it.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from speccheck import __version__
from speccheck.checks.api import (
    EXIT_BAD_INPUT,
    VERIFY_FIELDS,
    VerifyInputError,
    checked_run,
    plan_verification,
)
from speccheck.checks.cli.json_output import (
    JSON_HELP,
    json_path_problem,
    report_console,
    write_json_text,
)
from speccheck.checks.cli.paths import output_path_problem
from speccheck.checks.cli.runtime_options import (
    MatrixPathOption,
    RuntimeOverrides,
    build_runtime_config,
    with_runtime_options,
)
from speccheck.checks.provenance import commit_under_test
from speccheck.checks.verify.run import MAX_JOBS, VerifyRun
from speccheck.checks.verify.scale import (
    AUTO_JOBS,
    DEFAULT_SHRINK_SECONDS,
    DEVICE_GIB_PER_JOB,
    EXAMPLES_PER_JOB,
    TIER_DEFAULTS,
    TIER_SCALE,
)
from speccheck.checks.verify.vocabulary import Check, Status, Tier
from speccheck.checks.verify.worker_process import WorkerProcess
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.drafter_kind import DrafterKind

if TYPE_CHECKING:
    from speccheck.checks.api import VerifyReport
    from speccheck.checks.verify.report import BackendReport
    from speccheck.checks.verify.runner import ProgressDisplay


def shown_tier_default(field: str) -> str:
    """``field``'s default as ``--help`` shows it: one value, or one per tier where the
    tiers' defaults (:data:`TIER_DEFAULTS`, else the field's own) differ."""
    default = RuntimeConfig.model_fields[field].default
    gpu, cpu = (TIER_DEFAULTS[tier].get(field, default) for tier in (Tier.GPU, Tier.CPU))
    return str(gpu) if gpu == cpu else f"GPU tier {gpu}, CPU tier {cpu}"


def _shown_scale(field: str) -> str:
    gpu, cpu = (getattr(TIER_SCALE[tier], field) for tier in (Tier.GPU, Tier.CPU))
    render = (lambda v: ",".join(map(str, v))) if isinstance(gpu, tuple) else str
    return f"GPU tier {render(gpu)}, CPU tier {render(cpu)}"


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


@with_runtime_options(VERIFY_FIELDS, {field: shown_tier_default(field) for field in VERIFY_FIELDS})
def verify_command(
    backend: Annotated[str, typer.Option("--backend", help="Backend name from the matrix, or 'all'.")] = "reference",
    examples: Annotated[int, typer.Option("--examples", min=1, help="Examples per backend.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Hypothesis seed.")] = 0,
    reproduce: Annotated[Optional[str], typer.Option("--reproduce", help="Run exactly this example (from a failure report): its blob, or @FILE for a blob kept in a file (reports keep blobs too long for one argument in speccheck-reproduce/).")] = None,  # noqa: UP045
    json_path: Annotated[Optional[Path], typer.Option("--json", help=JSON_HELP)] = None,  # noqa: UP045
    junit: Annotated[Optional[Path], typer.Option("--junit", help="Write a JUnit XML report here.")] = None,  # noqa: UP045
    example_timeout: Annotated[float, typer.Option("--example-timeout", help="Seconds without progress before a worker counts as hung (once it has finished examples: 20 times its slowest, at least 120 s, at most this).")] = 300.0,
    shrink_seconds: Annotated[float, typer.Option("--shrink-seconds", min=0, help="Seconds a worker may spend shrinking a failure to a smaller example (the report keeps the smallest found by then); finding the failure does not depend on it.")] = DEFAULT_SHRINK_SECONDS,
    jobs: Annotated[Optional[int], typer.Option("--jobs", min=1, max=MAX_JOBS, help="Worker processes per backend, each running its share of --examples from a seed of its own (--seed + i) on the same device; their reports merge. Each holds its own drafters, graphs and KV caches. DP and DCP runs and --reproduce take one. --jobs 1 draws every example from --seed alone.", show_default=f"GPU tier {AUTO_JOBS} where each gets {EXAMPLES_PER_JOB} examples, two CPU cores and {DEVICE_GIB_PER_JOB} GiB of the device, else 1; CPU tier 1")] = None,  # noqa: UP045
    audit_claims: Annotated[bool, typer.Option("--audit-claims", help="For a backend the matrix does not allow to fuse under the config, also run the fused path (in its own worker) and report whether the claim is too strict or confirmed.")] = False,
    capture_sizes: Annotated[Optional[str], typer.Option("--capture-sizes", help="Padded request counts to capture graphs for (and pad eager runs to), comma-separated; the largest bounds the requests and prefill tokens of an example.", show_default=_shown_scale("capture_sizes"))] = None,  # noqa: UP045
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", min=1, help="Most tokens a request brings to the first (prefill) pass; the prefill budget is this many per request of the largest capture size.", show_default=_shown_scale("max_new_tokens"))] = None,  # noqa: UP045
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="End each worker's search at its first failure (one minimal example and reproduce command), and a backend's run at its first failing configuration cell; by default it searches on with the examples left for failures of other checks, each with its own, in every cell.")] = False,
    kv_layout: Annotated[Optional[KvLayout], typer.Option("--kv-layout", help="Drafter layers of this KV-cache layout, for a backend whose matrix entry states none (it reads both); by default each layout the entry claims is a cell of its own.", show_default="the entry's")] = None,  # noqa: UP045
    drafter: Annotated[Optional[DrafterKind], typer.Option("--drafter", help="dflash: the DFlash drafter (blocks of 1 + K tokens attended non-causally) on real ranks, the runtime config alone: data-parallel ranks with --dp-size N, the DCP group's with --dcp-world-size N for a backend whose builders hold a DCP share, else one rank. autoregressive: the single-rank and DCP verification without the DFlash cells; it cannot take --dp-size.", show_default="dflash with --dp-size N, else autoregressive, whose cells include the DFlash ones the matrix entry claims")] = None,  # noqa: UP045
    cells: Annotated[bool, typer.Option("--cells/--no-cells", help="Verify every configuration cell the matrix entry claims fused support for around the runtime config (DCP on real ranks, another layout, a window, a second block size, each allowed dtype, lengths past 32767), the examples spread over them; runtime options given narrow them (--dcp-world-size 1: only cells at DCP 1). --no-cells: the runtime config alone.")] = True,
    matrix_path: MatrixPathOption = None,
    *,
    runtime: RuntimeOverrides,
) -> None:
    """Capture real CUDA graphs (or, without CUDA, run the CPU tier), replay them on
    hypothesis-drawn batches and compare with eager per-step metadata rebuilds."""
    from speccheck.contract.matrix_loader import MatrixError

    for flag, unwritable in (("--json", json_path_problem(json_path)),
                             ("--junit", output_path_problem(junit) if junit else None)):
        if unwritable is not None:
            raise _bad_input(f"{flag}: {unwritable}")
    sizes = _parse_capture_sizes(capture_sizes) if capture_sizes is not None else None
    build_runtime_config(runtime)  # flag-named errors for bad values (exit 2)
    try:
        run = checked_run(
            backend=backend, config=runtime, matrix=matrix_path, examples=examples, seed=seed,
            capture_sizes=sizes, max_new_tokens=max_new_tokens, reproduce=reproduce,
            audit_claims=audit_claims, example_timeout=example_timeout, jobs=jobs,
            shrink_seconds=shrink_seconds, fail_fast=fail_fast, json_path=json_path,
            junit_path=junit, kv_layout=kv_layout, drafter=drafter, cells=cells)
    except VerifyInputError as exc:
        raise _bad_input(str(exc)) from None
    # The first worker starts now: its imports (torch and the engine, seconds) overlap the
    # plan's; it is killed unused if planning fails or no plain worker runs.
    with WorkerProcess() as early_worker:
        try:
            plan = plan_verification(run)
        except MatrixError as exc:
            for problem in exc.problems:
                _stderr().print(problem.render(), markup=False)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except VerifyInputError as exc:
            raise _bad_input(str(exc)) from None
        console = report_console(json_path, width=None if sys.stdout.isatty() else 150)
        console.print(TIER_LINE[plan.tier].format(device=plan.device), markup=False)
        console.print("runtime config: " + ", ".join(
            f"{name}={value}" for name, value in plan.config.model_dump().items()), markup=False)
        scale = plan.scale()
        console.print(f"scale: up to {max(scale.capture_sizes)} requests (capture sizes "
                      f"{','.join(map(str, scale.capture_sizes))}), up to "
                      f"{scale.max_new_tokens} new tokens per request"
                      + (f", K in {','.join(map(str, run.draft_steps))}"
                         if plan.reproduce is None else ""), markup=False)
        if plan.reproduce is not None:
            console.print(reproduced_example_line(plan.reproduce), markup=False)
        for name in plan.names:
            own = plan.config_for(name).model_dump()
            differs = {k: v for k, v in own.items() if plan.config.model_dump()[k] != v}
            if differs:
                console.print(f"{name}: verified at " + ", ".join(
                    f"{k}={v}" for k, v in differs.items())
                    + " (its matrix entry's verify_defaults)", markup=False)
        if plan.drafter is DrafterKind.DFLASH:
            for name in plan.names:
                ranks = plan.dcp_ranks(name)
                where = (f"{ranks} real DCP ranks, each holding its share of the KV cache"
                         if ranks > 1 else f"{plan.config.dp_size} data-parallel rank(s)")
                console.print(f"{name}: the DFlash drafter on {where}", markup=False)
        else:
            for name in plan.names:
                claimed = plan.cells(name)
                if len(claimed) > 1:
                    console.print(f"{name}: {len(claimed)} configuration cells, the examples "
                                  "spread over them: " + "; ".join(
                                      c.name if c.not_run is None else f"{c.name} (not run)"
                                      for c in claimed), markup=False)
                note = plan.dcp_note(name)
                if note is not None:
                    console.print(f"{name}: {note}", markup=False)
                elif (workers := plan.shards(name)) > 1:
                    console.print(f"{name}: {workers} workers at once, worker i drawing "
                                  f"its share of the examples from seed {run.seed} + i (--jobs)",
                                  markup=False)
        with _progress_display(console) as progress:
            try:
                result = plan.run(progress, worker=early_worker)
            except VerifyInputError as exc:
                raise _bad_input(str(exc)) from None
        _finish(console, result, run)


def reproduced_example_line(blob: str) -> str:
    """What a ``--reproduce`` run replays, in one line: the example's own K and shape
    (requests, new tokens and context length of each), not the run's K range."""
    from speccheck.checks.verify.examples import decode_example

    k, batch = decode_example(blob)
    return (f"reproducing one example: K = {k}, {batch.num_reqs} request(s), new tokens "
            f"{','.join(str(len(new)) for new in batch.new_tokens)}, context lengths "
            f"{','.join(map(str, batch.context_lens))}")


def _print_cells(console: Console, reports: list[BackendReport]) -> None:
    """One table of every configuration cell verified (backends run in one cell print
    none): each cell's verdict, examples and how it ran or why it did not."""
    if not any(r.cells for r in reports):
        return
    table = Table(title="configuration cells")
    for column in ("backend", "cell", "verdict", "examples", "detail"):
        table.add_column(column)
    for r in reports:
        for cell in r.cells:
            table.add_row(r.backend, cell.name, cell.status.value if cell.run else "not run",
                          str(cell.examples), cell.detail)
    console.print(table)


def _parse_capture_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``; text that is not comma-separated counts is bad
    input (exit 2). The API checks the range."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdecimal() and part.isascii() for part in parts):
        raise _bad_input(f"--capture-sizes: expected comma-separated request counts such as "
                         f"1,2,4,8, got {text!r}")
    return tuple(int(part) if len(part) <= 9 else 10**9 for part in parts)  # API: out of range


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


def _finish(console: Console, result: VerifyReport, run: VerifyRun) -> None:
    """Print the summary, write the reports (the JSON one records ``run``), and exit with a
    status CI can trust."""
    from speccheck.checks.verify.report import json_report, write_junit

    reports = list(result.backends)
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
        examples = (f"{r.examples} of {r.examples_asked} (stopped)" if r.stop_note is not None
                    else str(r.examples))
        table.add_row(r.backend, r.tier.value, r.status.value, fused, examples, str(passed),
                      str(failed), str(indet), f"{r.capture_seconds:.1f}", f"{r.seconds:.1f}")
    console.print(table)
    _print_cells(console, reports)
    for line in result.summary_lines():
        console.print(line, markup=False, soft_wrap=True)
    for r in reports:
        if r.data_parallel is not None:
            dp = r.data_parallel
            console.print(f"{r.backend}: {dp['dp_size']} DP ranks on {', '.join(dp['devices'])}, "
                          f"collectives {dp['collectives']}", markup=False)
    console.print(f"checks: {', '.join(check.value for check in Check)}", markup=False)
    if run.json_path:
        write_json_text(run.json_path, json_report(reports, {
            "speccheck": __version__, "commit": commit_under_test(), "tier": result.tier.value,
            "device": result.device, "command": "speccheck verify " + shlex.join(sys.argv[2:]),
            "run": run.model_dump(mode="json"),
        }))
    if run.junit_path:
        write_junit(reports, run.junit_path, str(result.matrix or "matrix.yaml"))
    if result.exit_code:
        raise typer.Exit(result.exit_code)
