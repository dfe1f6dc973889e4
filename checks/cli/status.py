"""``speccheck status``: run each backend's evidence on this machine and overwrite its
status (:mod:`speccheck.checks.status`), or re-render / check the generated pages.

Exit statuses: 0 every backend run passed and every self-test row was caught (or, with
``--render`` / ``--check``, the pages are written / up to date); 1 a verdict failed or
crashed, a self-test row was missed, or a page is stale; 2 bad input.

Importing this module does not import torch; running backends does.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from speccheck.checks.cli.json_output import (
    json_path_problem,
    report_console,
    write_json_text,
)

from speccheck.checks.status.record import (
    STATUS_README,
    BackendStatus,
    StatusFileError,
    TierStatus,
    Verdict,
    read_statuses,
    write_tier_status,
)
from speccheck.checks.status.render import (
    MissingMarkers,
    render_status_readme,
    selftest_cell,
    verify_seconds_cell,
    with_bench_table,
)
from speccheck.checks.verify.vocabulary import Tier
from speccheck.contract.adapter_status import AdapterStatus, adapter_status
from speccheck.contract.matrix_loader import load_matrix

EXIT_STALE = 1
EXIT_BAD_INPUT = 2
DEFAULT_STATUS_DIR = Path("docs/status")
DEFAULT_BENCH_PAGE = Path("docs/benchmarks/README.md")


class AddedPhase(enum.Enum):
    """A phase run alone into the record a run without it wrote at the same commit: its
    flag, and the flag of the run that left it out."""

    BENCH = ("--bench-only", "--no-bench")
    SELFTEST = ("--selftest-only", "--no-selftest")

    @property
    def flag(self) -> str:
        return self.value[0]

    @property
    def left_out_by(self) -> str:
        return self.value[1]


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, emoji=False, soft_wrap=True)


def _fail(status: int, message: str) -> typer.Exit:
    _stderr().print(message, markup=False)
    return typer.Exit(status)


def status_command(
    backend: Annotated[str, typer.Option("--backend", help="A backend of the shipped matrix with an adapter, or 'all'.")] = "all",
    out: Annotated[Path, typer.Option("--out", help="The status folder: <backend>.json and README.md.", file_okay=False)] = DEFAULT_STATUS_DIR,
    bench_page: Annotated[Path, typer.Option("--bench-page", help="The benchmarks page whose generated table is rewritten.", dir_okay=False)] = DEFAULT_BENCH_PAGE,
    examples: Annotated[int, typer.Option("--examples", min=1, max=100_000, help="Examples of each verify run.")] = 50,
    selftest: Annotated[bool, typer.Option("--selftest/--no-selftest", help="Run the backend's self-test rows.")] = True,
    bench: Annotated[bool, typer.Option("--bench/--no-bench", help="Run the bench (CUDA only).")] = True,
    bench_only: Annotated[bool, typer.Option("--bench-only", help="Only run the bench (CUDA) and put it into this machine's record of the backend, which a run with --no-bench at this commit wrote (so that backends can be verified side by side and benched alone).")] = False,
    selftest_only: Annotated[bool, typer.Option("--selftest-only", help="Only run the self-test rows and put them into this machine's record of the backend, which a run with --no-selftest at this commit wrote (so that a GPU session's calls can split a backend's evidence).")] = False,
    render: Annotated[bool, typer.Option("--render", help="Only re-render the pages from the status files.")] = False,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 if a page differs from what the status files render to.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the status records this run wrote (a JSON list, one backend's record each) to this file, or to stdout with '-' (everything else then goes to stderr).", dir_okay=False)] = None,  # noqa: UP045
) -> None:
    """Run verify at the defaults, the self-test rows and (CUDA) the bench of each backend,
    overwrite this tier's record in the status folder, and render the status table."""
    if render or check:
        if json_path is not None:
            raise _fail(EXIT_BAD_INPUT, "--json: --render and --check write no records; "
                        "give --json to a run")
        _render(out, bench_page, check=check, json_path=None)
        return
    if bench_only and selftest_only:
        raise _fail(EXIT_BAD_INPUT, "--bench-only and --selftest-only: give one (a run without "
                    "either does both)")
    if (unwritable := json_path_problem(json_path)) is not None:
        raise _fail(EXIT_BAD_INPUT, f"--json: {unwritable}")
    shipped = load_matrix(None)
    with_adapter = [entry.name for entry in shipped.backends
                    if adapter_status(entry) is AdapterStatus.FOUND]
    if backend != "all" and backend not in with_adapter:
        raise _fail(EXIT_BAD_INPUT, f"--backend: {backend!r} is not a shipped backend with "
                    f"an adapter; valid: {', '.join(with_adapter)}, all")
    names = with_adapter if backend == "all" else [backend]
    _pages(out, bench_page)  # a corrupt status or page is bad input before any run
    from speccheck.checks.triton_interpreter import interpret_triton_without_cuda

    interpret_triton_without_cuda()  # before anything imports Triton
    from speccheck.checks.status.collect import (
        StatusPlan,
        collect_tier_status,
        with_bench,
        with_selftest,
    )
    from speccheck.checks.verify.context import MatrixContext

    matrices = MatrixContext.load(None)
    plan = StatusPlan(examples=examples, selftest=selftest, bench=bench)
    stderr = _stderr()
    bad = False
    written = []
    for name in names:
        progress = lambda line: stderr.print(f"status: {line}", markup=False)  # noqa: E731
        if bench_only:
            record = with_bench(name, matrices,
                                _record_to_complete(out, name, AddedPhase.BENCH), progress)
        elif selftest_only:
            record = with_selftest(name, _record_to_complete(out, name, AddedPhase.SELFTEST),
                                   progress)
        else:
            record = collect_tier_status(name, matrices, plan, progress)
        written.append(write_tier_status(out, name, record))
        caught, run = record.selftest_caught
        stderr.print(f"status: {name}: {record.verdict.value}, self-test {caught}/{run}; "
                     f"wrote {out / (name + '.json')}", markup=False)
        bad |= record.verdict in (Verdict.FAILED, Verdict.CRASHED) or caught < run
    _render(out, bench_page, check=False, json_path=json_path)
    if json_path is not None:
        write_json_text(json_path, json.dumps(
            [status.model_dump(mode="json") for status in written], indent=2) + "\n")
    if bad:
        raise typer.Exit(1)


def _record_to_complete(out: Path, name: str, phase: AddedPhase) -> TierStatus:
    """The record of ``name`` on this machine's tier that ``phase`` completes: written at
    this commit. Exit 2 where there is none, or where the bench has no CUDA device."""
    import torch

    from speccheck.checks.provenance import commit_under_test

    gpu = torch.cuda.is_available()
    if phase is AddedPhase.BENCH and not gpu:
        raise _fail(EXIT_BAD_INPUT, f"{phase.flag}: the bench needs a CUDA device")
    tier = Tier.GPU if gpu else Tier.CPU
    status = _existing(out).get(name)
    record = status.tiers.get(tier.value) if status is not None else None
    if record is None or record.provenance.commit != commit_under_test():
        raise _fail(EXIT_BAD_INPUT, f"{phase.flag}: {out / (name + '.json')} has no "
                    f"{tier.value} record at this commit; run `speccheck status --backend "
                    f"{name} {phase.left_out_by}` first")
    return record


def _existing(out: Path) -> dict[str, BackendStatus]:
    try:
        return read_statuses(out)
    except StatusFileError as exc:
        raise _fail(EXIT_BAD_INPUT, str(exc)) from None


def _pages(out: Path, bench_page: Path) -> tuple[dict[str, BackendStatus], dict[Path, str]]:
    """The status records and what each generated page should hold (the benchmarks page
    only where it exists); exit 2 on a corrupt record or a page without its markers."""
    statuses = _existing(out)
    wanted = {out / STATUS_README: render_status_readme(statuses)}
    if bench_page.exists():
        try:
            wanted[bench_page] = with_bench_table(bench_page.read_text(encoding="utf-8"),
                                                  statuses)
        except MissingMarkers as exc:
            raise _fail(EXIT_BAD_INPUT, f"{bench_page}: {exc}") from None
    return statuses, wanted


def _render(out: Path, bench_page: Path, *, check: bool, json_path: Path | None) -> None:
    """Write (or check) the status README and the benchmarks page's table, then print the
    table (on stderr where ``json_path`` is ``-``)."""
    statuses, wanted = _pages(out, bench_page)
    stderr = _stderr()
    for path, text in wanted.items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if check:
            if current != text:
                raise _fail(EXIT_STALE, f"{path} is stale: it does not match what the status "
                            "files render to; run `speccheck status --render` and commit it.")
            stderr.print(f"{path} is up to date.", markup=False)
        elif current != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            stderr.print(f"wrote {path}", markup=False)
    if not check:
        _print_table(statuses, report_console(json_path))


def _print_table(statuses: dict[str, BackendStatus], console: Console) -> None:
    """The current status on ``console``: a table on a terminal, plain lines (one JSON
    object each) in logs."""
    rows = [(name, tier, record) for name, status in sorted(statuses.items())
            for tier, record in status.tiers.items()]
    if not console.is_terminal:
        for name, tier, record in rows:
            console.file.write(json.dumps({"backend": name, "tier": tier,
                                         "verdict": record.verdict.value,
                                         "examples": record.examples,
                                         "verify_seconds": record.verify_seconds,
                                         "selftest": selftest_cell(record),
                                         "commit": record.provenance.commit[:10],
                                         "device": record.provenance.device}) + "\n")
        return
    table = Table(title="speccheck status")
    for column in ("backend", "tier", "verdict", "examples", "verify s", "self-test", "commit",
                   "device"):
        table.add_column(column)
    for name, tier, record in rows:
        table.add_row(name, tier, record.verdict.value, str(record.examples),
                      verify_seconds_cell(record), selftest_cell(record),
                      record.provenance.commit[:10], record.provenance.device)
    console.print(table)
