"""``speccheck mutate``: measure how much of a backend's adapter its gate exercises.

Generates mutants of the adapter's modules (:mod:`speccheck.checks.mutate`), runs the gate
once unmutated with line tracing (it must pass; ``--gate FILE`` saves that run, or reuses
one saved from the same code, e.g. by another ``--shard`` part), then runs ``speccheck
verify --backend NAME`` at its defaults on each mutant in a fresh process, several at once,
until the budget is spent (``--stop-after`` or ``SIGTERM``: and stops the ones still
running), and reports the score, the kills by kind, the survivors, the code the defaults
never executed and candidates for equivalence.

Exit statuses: 0 the run completed (the score is information, not a verdict); 1 the gate
fails or crashes without any mutation, or its processes did not load the copied package,
so no mutant can be judged; 2 bad input (an unknown backend or operator, a backend without
an adapter, a bad ``--module``, an unwritable ``--json``, a ``--gate`` file saved from
other code), one line on stderr.

Importing this module does not import torch; running the command does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console

from speccheck.checks.cli.paths import output_path_problem
from speccheck.checks.mutate.operators import Operator

if TYPE_CHECKING:
    from collections.abc import Mapping

    from speccheck.checks.mutate.coverage_run import CoverageRun
    from speccheck.checks.mutate.equivalents import Key
    from speccheck.checks.mutate.mutants import Mutant, Shard
    from speccheck.checks.mutate.report import MutationReport
    from speccheck.checks.mutate.runner import MutantResult, RunSettings
    from speccheck.checks.mutate.targets import TargetModule

EXIT_GATE_BROKEN = 1
EXIT_BAD_INPUT = 2
STDOUT_PATH = "-"
TIMEOUT_FACTOR = 3.0
"""A mutant's verify may take this many times the unmutated (traced) run's wall time ..."""
MIN_TIMEOUT_SECONDS = 60.0
"""... and never less than this."""


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, emoji=False, soft_wrap=True)


def _fail(status: int, message: str) -> typer.Exit:
    _stderr().print(message, markup=False)
    return typer.Exit(status)


def default_jobs() -> int:
    """Half the CPU cores this process may use (all of the machine's where the platform
    cannot say), at least one."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return max(1, cores // 2)


def _operators(text: str | None) -> list[Operator]:
    if text is None:
        return list(Operator)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in Operator._value2member_map_]
    if unknown or not names:
        given = ", ".join(unknown) or "(none given)"
        raise _fail(EXIT_BAD_INPUT, f"--operators: unknown operator(s) {given}; valid: "
                    f"{', '.join(Operator)}")
    return [Operator(name) for name in dict.fromkeys(names)]


def mutate_command(
    backend: Annotated[str, typer.Option("--backend", help="The backend whose adapter is mutated (a matrix entry with an implementation).")] = "reference",
    modules: Annotated[Optional[list[Path]], typer.Option("--module", help="Mutate this source file instead of the adapter's modules (repeat it; name the derived ones to keep them).", dir_okay=False)] = None,  # noqa: UP045
    operators: Annotated[Optional[str], typer.Option("--operators", help=f"Comma-separated operators: {', '.join(Operator)}.", show_default="all")] = None,  # noqa: UP045
    max_mutants: Annotated[Optional[int], typer.Option("--max-mutants", min=1, help="Run at most this many mutants, a random sample (drawn with --seed) of all generated.", show_default="all")] = None,  # noqa: UP045
    budget: Annotated[float, typer.Option("--budget", min=1, help="Seconds after which no new mutant is started (the ones not started are reported as not run).")] = 3600.0,
    stop_after: Annotated[Optional[float], typer.Option("--stop-after", min=1, help="Seconds after which the mutants under way are stopped and reported as not run, and the report is written (for a run an outside limit would cut).", show_default="none")] = None,  # noqa: UP045
    jobs: Annotated[Optional[int], typer.Option("--jobs", min=1, max=64, help="Mutants run at once, each in its own verify process.", show_default="half the CPU cores, at least 1")] = None,  # noqa: UP045
    examples: Annotated[Optional[int], typer.Option("--examples", min=1, help="Examples of each verify run.", show_default="verify's default")] = None,  # noqa: UP045
    seed: Annotated[int, typer.Option("--seed", help="Seed of the --max-mutants sample.")] = 0,
    shard: Annotated[Optional[str], typer.Option("--shard", metavar="INDEX/COUNT", help="Run only this part of the mutants (every COUNT-th, from the INDEX-th), to spread one run over machines; --rescore with every part's --json merges them.", show_default="all")] = None,  # noqa: UP045
    json_path: Annotated[Optional[str], typer.Option("--json", help="Write the JSON report here ('-': stdout, and the summary goes to stderr).")] = None,  # noqa: UP045
    status: Annotated[Optional[Path], typer.Option("--status", help="Also put the score into this machine tier's record of the backend in this status folder (docs/status; `speccheck status` writes the record).", file_okay=False)] = None,  # noqa: UP045
    gate: Annotated[Optional[Path], typer.Option("--gate", help="Reuse the unmutated gate's traced run saved in this file (by an earlier run of this backend, --examples and code, e.g. another --shard part); where the file does not exist, run the gate and save it there.", dir_okay=False)] = None,  # noqa: UP045
    resume: Annotated[Optional[list[Path]], typer.Option("--resume", help="Run the mutants this saved --json report left unrun (its budget was spent), at this checkout, with the run's gate and sample, and write the whole run (repeat it with every report resuming one run, each run with its own --shard, to combine them).", dir_okay=False)] = None,  # noqa: UP045
    rescore: Annotated[Optional[list[Path]], typer.Option("--rescore", help="Run nothing: score this saved --json report again with the checkout's equivalence arguments (its code under test must be unchanged); repeat it with every --shard part of one run to merge them.", dir_okay=False)] = None,  # noqa: UP045
) -> None:
    """Mutate a backend's adapter (builder, refresh, attention call) and measure how many
    mutants `speccheck verify --backend NAME` kills at its defaults."""
    if json_path is not None and json_path != STDOUT_PATH:
        problem = output_path_problem(Path(json_path))
        if problem is not None:
            raise _fail(EXIT_BAD_INPUT, f"--json: {problem}")
    if gate is not None and not gate.exists():
        problem = output_path_problem(gate)
        if problem is not None:
            raise _fail(EXIT_BAD_INPUT, f"--gate: {problem}")
    chosen_operators = _operators(operators)
    part = _shard(shard)
    started = time.monotonic()
    from speccheck.checks.triton_interpreter import interpret_triton_without_cuda

    interpret_triton_without_cuda()  # before a builder's module imports Triton
    tier = _status_tier(status, backend) if status is not None else None
    targets = _targets(backend, modules or [])
    from speccheck.checks.mutate.equivalents import EquivalentsError, load_equivalents
    from speccheck.checks.mutate.mutants import generate_mutants, sample_mutants
    from speccheck.checks.mutate.report import MutationReport
    from speccheck.checks.mutate.runner import RunSettings

    try:
        arguments = load_equivalents(targets)
    except EquivalentsError as exc:
        raise _fail(EXIT_BAD_INPUT, str(exc)) from None
    if (rescore or resume) and status is not None:
        _check_arguments_committed(targets)
    if rescore:
        if resume:
            raise _fail(EXIT_BAD_INPUT, "--rescore: runs nothing; --resume runs the unrun "
                        "mutants and scores the whole run: give one of them")
        report, changed = _rescored(rescore, backend, targets, arguments)
        _finish(report, status, tier, json_path, rescored=changed)
        return
    from speccheck.checks.mutate.fingerprint import verify_fingerprint

    run = RunSettings(backend=backend, examples=examples, jobs=jobs or default_jobs(),
                      budget=budget, timeout=MIN_TIMEOUT_SECONDS, started=started,
                      stop_after=stop_after, judged_by=verify_fingerprint(targets))
    if resume:
        if max_mutants is not None or operators is not None:
            raise _fail(EXIT_BAD_INPUT, "--resume: the run's own sample and operators are "
                        "resumed; --max-mutants and --operators do not apply")
        _resume(resume, targets, arguments, run, part, gate, status, tier, json_path)
        return
    generated = generate_mutants(targets, chosen_operators)
    chosen = sample_mutants(generated, max_mutants, seed)
    if part is not None:
        chosen = part.of(chosen)
    coverage = _saved_gate(gate, targets, backend, examples)
    _stderr().print(f"{backend}: {len(generated)} mutants of {len(targets)} module(s), running "
                    f"{len(chosen)}; " + ("first the unmutated gate, traced" if coverage is None
                                          else f"the unmutated gate from {gate} "
                                          f"({coverage.outcome.seconds:.0f} s when it ran)"),
                    markup=False)
    if coverage is None:
        coverage = _run_gate(gate, targets, backend, examples, budget)
    results = _run_against(chosen, coverage, coverage.outcome.seconds, run)
    from speccheck.checks.provenance import commit_under_test

    report = MutationReport(backend, examples, targets, [o.value for o in chosen_operators],
                            len(generated), results, coverage, time.monotonic() - started,
                            arguments,
                            _command(backend, modules or [], operators, max_mutants, seed,
                                     examples, part),
                            commit_under_test())
    _finish(report, status, tier, json_path, rescored=False)


def _run_against(chosen: list[Mutant], coverage: CoverageRun, gate_seconds: float,
                 run: RunSettings) -> list[MutantResult]:
    """Every one of ``chosen``'s results under ``run``: its timeout set from the unmutated
    gate's wall time ``gate_seconds``, the mutants whose lines ``coverage`` (the gate's
    traced run) never executed left unrun; each shown as it comes."""
    from speccheck.checks.mutate.runner import run_mutants

    err = _stderr()

    def show(result: MutantResult) -> None:
        checks = f" ({', '.join(result.failed_checks)})" if result.failed_checks else ""
        err.print(f"#{result.mutant.number} {result.mutant.location} "
                  f"{result.mutant.operator.value}: {result.outcome.value}{checks}", markup=False)

    unreached = frozenset(m.number for m in chosen
                          if coverage.never_reached(m.target, m.line, m.end_line))
    settings = dataclasses.replace(
        run, timeout=max(MIN_TIMEOUT_SECONDS, TIMEOUT_FACTOR * gate_seconds),
        unreached=unreached)
    return run_mutants(chosen, settings, on_result=show)


def _resume(paths: list[Path], targets: list[TargetModule], arguments: Mapping[Key, str],
            run: RunSettings, part: Shard | None, gate: Path | None, status: Path | None,
            tier: str | None, json_path: str | None) -> None:
    """``--resume``: the saved run at ``paths`` (the run and its continuations, combined),
    its mutants due run now (``part`` of them), and the whole run written with this
    continuation added (none where it judged nothing: resuming the parts of a run only
    combines them). Due: the survivors another verify judged
    (:func:`~speccheck.checks.mutate.resume.stale_survivors`: verify may catch them now),
    first, then the unrun mutants. Where verify may differ from the run's (another commit) or
    ``gate`` is given, the unmutated gate must pass here first (run, or loaded from
    ``gate``); its wall time sets the timeout. The run's traced gate still classifies the
    survivors, so the whole report reads one coverage. Exit 2 with one line where the
    reports cannot be resumed here, 1 where the gate fails here."""
    from speccheck.checks.mutate.report import Resumption
    from speccheck.checks.mutate.rescore import (
        RescoreError,
        arguments_changed,
        read_report,
        rescored,
    )
    from speccheck.checks.mutate.resume import combined_runs, stale_survivors
    from speccheck.checks.mutate.runner import Outcome
    from speccheck.checks.provenance import commit_under_test

    try:
        data = combined_runs(paths, [read_report(path) for path in paths], run.judged_by)
        saved = rescored(paths[0], data, run.backend, targets, arguments)
    except RescoreError as exc:
        raise _fail(EXIT_BAD_INPUT, f"--resume: {exc}") from None
    if run.examples is not None and run.examples != saved.examples:
        raise _fail(EXIT_BAD_INPUT, f"--examples: the run of {paths[0]} verified "
                    f"{saved.examples or 'the default number of'} examples; resume it so")
    unrun = [r.mutant for r in saved.results if r.outcome is Outcome.NOT_RUN]
    here = commit_under_test()
    stale = stale_survivors(saved, run.judged_by)
    chosen = [*stale, *unrun] if part is None else part.of([*stale, *unrun])
    rejudging = {m.number for m in stale} & {m.number for m in chosen}
    gate_here = bool(chosen) and (here != saved.commit or gate is not None)
    _stderr().print(f"{run.backend}: resuming {paths[0]} ({saved.commit[:10]}): {len(unrun)} "
                    f"of its {len(saved.results)} mutants unrun, running {len(chosen)}"
                    + (f" ({len(rejudging)} survivors another verify judged first)"
                       if rejudging else "")
                    + (f"; first the unmutated gate at {here[:10]}" if gate_here else ""),
                    markup=False)
    gate_seconds = saved.coverage.outcome.seconds
    if gate_here:
        current = (_saved_gate(gate, targets, run.backend, saved.examples)
                   or _run_gate(gate, targets, run.backend, saved.examples, run.budget))
        gate_seconds = current.outcome.seconds
    results = {r.mutant.number: r for r in _run_against(
        chosen, saved.coverage, gate_seconds, dataclasses.replace(run, examples=saved.examples))
        if r.outcome is not Outcome.NOT_RUN}  # a survivor cut keeps its older judgement
    seconds = time.monotonic() - run.started
    rejudged = len(rejudging & results.keys())
    report = saved if not results else dataclasses.replace(
        saved, results=[results.get(r.mutant.number, r) for r in saved.results],
        seconds=saved.seconds + seconds,
        resumed=(*saved.resumed, Resumption(here, len(results), seconds,
                                            None if part is None else str(part), rejudged)))
    _finish(report, status, tier, json_path, rescored=arguments_changed(data, report))


def _saved_gate(saved: Path | None, targets: list[TargetModule], backend: str,
                examples: int | None) -> CoverageRun | None:
    """The unmutated gate saved in ``saved`` where that file exists (``None`` otherwise);
    exit 2 with one line where it cannot serve this run, exit 1 where it did not pass."""
    from speccheck.checks.mutate.fingerprint import code_fingerprint
    from speccheck.checks.mutate.gate_file import GateFileError, load_gate

    if saved is None or not saved.exists():
        return None
    try:
        coverage = load_gate(saved, targets, backend=backend, examples=examples,
                             fingerprint=code_fingerprint(targets))
    except GateFileError as exc:
        raise _fail(EXIT_BAD_INPUT, f"--gate: {exc}") from None
    _check_baseline(backend, targets, coverage)
    return coverage


def _run_gate(save_to: Path | None, targets: list[TargetModule], backend: str,
              examples: int | None, budget: float) -> CoverageRun:
    """The unmutated gate's traced run (exit 1 where it does not pass:
    :func:`_check_baseline`), written to ``save_to`` when given."""
    from speccheck.checks.mutate.coverage_run import run_unmutated
    from speccheck.checks.mutate.fingerprint import code_fingerprint
    from speccheck.checks.mutate.gate_file import GateFileError, save_gate

    coverage = run_unmutated(targets, backend, examples=examples, timeout=budget)
    _check_baseline(backend, targets, coverage)
    if save_to is not None:
        try:
            save_gate(save_to, coverage, targets, backend=backend, examples=examples,
                      fingerprint=code_fingerprint(targets))
        except GateFileError as exc:
            raise _fail(EXIT_BAD_INPUT, f"--gate: {exc}") from None
        _stderr().print(f"saved the unmutated gate in {save_to}", markup=False)
    return coverage


def _shard(text: str | None) -> Shard | None:
    from speccheck.checks.mutate.mutants import Shard

    if text is None:
        return None
    try:
        return Shard.parse(text)
    except ValueError as exc:
        raise _fail(EXIT_BAD_INPUT, f"--shard: {exc}") from None


def _check_arguments_committed(targets: list[TargetModule]) -> None:
    """Exit 2 with one line where an equivalents file of ``targets`` differs from the
    commit under test: a rescored record names that commit as the one whose arguments
    scored it, so they must be in it."""
    from speccheck.checks.mutate.equivalents import equivalents_paths
    from speccheck.checks.provenance import uncommitted

    dirty = uncommitted(equivalents_paths(targets))
    if dirty:
        raise _fail(EXIT_BAD_INPUT, f"--status: {', '.join(map(str, dirty))} differs from "
                    "the commit under test; commit the arguments before --rescore writes a "
                    "record naming that commit as the one that scored it")


def _rescored(paths: list[Path], backend: str, targets: list[TargetModule],
              arguments: Mapping[Key, str]) -> tuple[MutationReport, bool]:
    """The saved report at ``paths`` (the parts of one sharded run, merged) scored with
    ``arguments``, and whether they argue any mutant otherwise than the run did; exit 2
    with one line where it cannot be scored (:mod:`~speccheck.checks.mutate.rescore`)."""
    from speccheck.checks.mutate.rescore import (
        RescoreError,
        arguments_changed,
        merged_shards,
        read_report,
        rescored,
    )

    try:
        parts = [read_report(path) for path in paths]
        data = parts[0] if len(parts) == 1 else merged_shards(paths, parts)
        report = rescored(paths[0], data, backend, targets, arguments)
    except RescoreError as exc:
        raise _fail(EXIT_BAD_INPUT, f"--rescore: {exc}") from None
    return report, arguments_changed(data, report)


def _finish(report: MutationReport, status: Path | None, tier: str | None,
            json_path: str | None, *, rescored: bool) -> None:
    """Write ``report`` into the status record (``--status``) and the JSON report
    (``--json``), and show it."""
    from speccheck.checks.mutate.report import render

    err = _stderr()
    report_json = report.to_json()
    if status is not None and tier is not None:
        _write_status(status, report.backend, tier, report_json, rescored=rescored)
    if json_path == STDOUT_PATH:
        sys.stdout.write(json.dumps(report_json, indent=2) + "\n")
        render(report, err)
        return
    render(report, Console(highlight=False, emoji=False))
    if json_path is not None:
        try:
            Path(json_path).write_text(json.dumps(report_json, indent=2) + "\n",
                                       encoding="utf-8")
        except OSError as exc:
            raise _fail(EXIT_BAD_INPUT, f"--json: cannot write {json_path}: "
                        f"{exc.strerror or exc}") from None
        err.print(f"wrote {json_path}", markup=False)


def _command(backend: str, modules: list[Path], operators: str | None,
             max_mutants: int | None, seed: int, examples: int | None,
             shard: Shard | None) -> str:
    """The command that repeats this run's sample (its modules, operators and shard
    included)."""
    from speccheck.checks.mutate.rescore import SHARD_OPTION

    parts = ["speccheck", "mutate", "--backend", backend]
    for module in modules:
        parts += ["--module", str(module)]
    if operators is not None:
        parts += ["--operators", operators]
    if max_mutants is not None:
        parts += ["--max-mutants", str(max_mutants), "--seed", str(seed)]
    if examples is not None:
        parts += ["--examples", str(examples)]
    if shard is not None:
        parts += [SHARD_OPTION, str(shard)]
    return shlex.join(parts)


def _status_tier(folder: Path, backend: str) -> str:
    """This machine's tier, whose record of ``backend`` in ``folder`` ``--status`` adds the
    score to; exit 2, before any mutant runs, where there is no such record."""
    import torch

    from speccheck.checks.status.record import StatusFileError, tier_record
    from speccheck.checks.verify.vocabulary import Tier

    tier = (Tier.GPU if torch.cuda.is_available() else Tier.CPU).value
    try:
        tier_record(folder, backend, tier)
    except StatusFileError as exc:
        raise _fail(EXIT_BAD_INPUT, f"--status: {exc}") from None
    return tier


def _write_status(folder: Path, backend: str, tier: str, report: dict[str, Any], *,
                  rescored: bool) -> None:
    """Put the run's :class:`~speccheck.checks.status.record.MutationRecord` into
    ``tier``'s record of ``backend`` in ``folder`` (checked by :func:`_status_tier`); a
    ``rescored`` report (one the checkout's arguments score otherwise than its run did)
    names the commit whose arguments scored it."""
    import datetime

    from speccheck.checks.provenance import commit_under_test
    from speccheck.checks.status.record import MutationRecord, write_mutation

    record = MutationRecord.from_report(
        report, command=report["command"], commit=report["commit"],
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        scored_at=commit_under_test() if rescored else None)
    write_mutation(folder, backend, tier, record)
    _stderr().print(f"wrote the mutation score into {folder / (backend + '.json')} ({tier})",
                    markup=False)


def _targets(backend: str, modules: list[Path]) -> list[TargetModule]:
    """The target modules of ``backend``'s adapter, or the ``--module`` files; exits 2 with
    one line on bad input."""
    from speccheck.checks.mutate.targets import TargetError, backend_targets, chosen_targets
    from speccheck.contract.matrix_loader import MatrixError
    from speccheck.contract.plugins import load_matrix_with_plugins

    try:
        matrix = load_matrix_with_plugins(None)
    except MatrixError as exc:
        raise _fail(EXIT_BAD_INPUT, "; ".join(p.render() for p in exc.problems)) from None
    names = [entry.name for entry in matrix.backends]
    if backend not in names:
        raise _fail(EXIT_BAD_INPUT, f"--backend: unknown backend {backend!r}; valid: "
                    f"{', '.join(names)}")
    implementation = matrix.backend(backend).implementation
    if implementation is None:
        raise _fail(EXIT_BAD_INPUT, f"--backend: {backend!r} has no adapter to mutate")
    try:
        derived = backend_targets(implementation)
        return chosen_targets(modules, derived) if modules else derived
    except TargetError as exc:
        raise _fail(EXIT_BAD_INPUT, str(exc)) from None


def _check_baseline(backend: str, targets: list[TargetModule], coverage: CoverageRun) -> None:
    """Exit 1 with one line unless the unmutated gate passed and its workers ran the
    copied package (without both, no mutant can be judged)."""
    from speccheck.checks.verify.vocabulary import Status

    outcome = coverage.outcome
    report = outcome.report
    if outcome.timed_out or report is None or report.get("status") != Status.PASSED:
        why = ("it ran past the budget" if outcome.timed_out
               else f"status {report['status']}: {report.get('detail') or 'checks failed'}"
               if report is not None
               else (outcome.output_tail or ["no output"])[-1])
        raise _fail(EXIT_GATE_BROKEN, f"speccheck verify --backend {backend} does not pass "
                    f"without any mutation ({why}); mutants can only be judged against a "
                    "passing gate")
    if not coverage.ran_function_bodies(targets):
        raise _fail(EXIT_GATE_BROKEN, "verify's processes never executed the copied target "
                    "modules: the copy does not shadow the installed package here (is it "
                    "installed in a way that comes before PYTHONPATH?)")
