"""Scoring a saved run again: a ``speccheck mutate --json`` report read back with the
equivalence arguments of the checkout (``equivalent_mutants.yaml`` grows after a run, as
its survivors are read), so that adding an argument never needs the run repeated, and a
record scored so says which commit's arguments scored it.

The kills are the run's; only the survivors' classes and the score are computed again. A
report is rescored only against the very mutants the checkout generates: every mutant it
holds must be generated here with the same number, place and diff (otherwise the code under
test changed, and the run says nothing about it).
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from speccheck.checks.mutate.coverage_run import CodePhase, CoverageRun
from speccheck.checks.mutate.equivalents import Key
from speccheck.checks.mutate.mutants import Mutant, Shard, generate_mutants
from speccheck.checks.mutate.operators import Operator
from speccheck.checks.mutate.report import MutationReport, Resumption
from speccheck.checks.mutate.runner import MutantResult, Outcome
from speccheck.checks.mutate.shadow import VerifyOutcome
from speccheck.checks.mutate.targets import TargetModule
from speccheck.contract.bounded_read import UnreadableFile, read_regular_file

SHARD_OPTION = "--shard"
MAX_REPORT_BYTES = 64 << 20
"""Largest saved report read (a full run of a few hundred mutants is well under 1 MiB)."""


class RescoreError(ValueError):
    """A saved report that cannot be rescored here (one line)."""


class _SavedMutant(BaseModel):
    model_config = ConfigDict(extra="ignore")

    number: int
    file: str
    line: int
    diff: dict[str, str]
    outcome: Outcome
    failed_checks: list[str]
    named_fields: list[str]
    seconds: float
    detail: str
    judged_by: str | None = None


class _SavedResumption(BaseModel):
    model_config = ConfigDict(extra="forbid")

    commit: str
    ran: int
    seconds: float
    shard: str | None = None
    rejudged: int = 0

    def resumption(self) -> Resumption:
        return Resumption(self.commit, self.ran, self.seconds, self.shard, self.rejudged)


class _SavedReport(BaseModel):
    model_config = ConfigDict(extra="ignore")

    backend: str
    examples: int | None
    targets: list[dict[str, str]]
    operators: list[Operator]
    generated: int
    mutants: list[_SavedMutant]
    executed_lines: dict[str, list[int]]
    executed_phases: dict[str, dict[CodePhase, list[int]]] = {}
    processes: int
    baseline_seconds: float
    seconds: float
    command: str
    commit: str
    resumed: list[_SavedResumption] = []


def saved_resumptions(path: Path, data: Mapping[str, Any]) -> tuple[Resumption, ...]:
    """The continuations a saved report lists (none for a run never resumed);
    :class:`RescoreError` naming the file where the list is malformed."""
    items = data.get("resumed") or []
    if not isinstance(items, list):
        raise RescoreError(f"{path}: resumed: not a list")
    parts = []
    for index, item in enumerate(items):
        try:
            parts.append(_SavedResumption.model_validate(item).resumption())
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"]) or "(the entry)"
            raise RescoreError(f"{path}: resumed[{index}]: {where}: {error['msg']}") from None
    return tuple(parts)


def read_report(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a regular file, read no further than
    :data:`MAX_REPORT_BYTES`: a FIFO is refused, never waited on); :class:`RescoreError`
    naming the file otherwise."""
    try:
        raw = read_regular_file(path, MAX_REPORT_BYTES)
    except UnreadableFile as exc:
        raise RescoreError(f"{path}: cannot read it: {exc}") from None
    if len(raw) > MAX_REPORT_BYTES:
        raise RescoreError(f"{path}: larger than {MAX_REPORT_BYTES >> 20} MiB; not a "
                           "mutation report")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RescoreError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise RescoreError(f"{path}: not a mutation report (a JSON object)")
    return data


def merged_shards(paths: Sequence[Path], parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The saved reports ``parts`` (read from ``paths``) of every ``--shard`` of one run,
    merged into the report of the whole run: the same command but the shard, the same
    commit, every mutant in exactly one part (:func:`_check_partition`). Its ``seconds``
    are the parts' summed (time on all machines, not wall time); :class:`RescoreError`
    naming the file otherwise."""
    saved = [_validated(path, part) for path, part in zip(paths, parts, strict=True)]
    first = saved[0]
    run = (first.backend, first.commit, first.generated, first.examples, first.operators,
           first.targets)
    whole: set[str] = set()
    shards: dict[Shard, Path] = {}
    for path, report in zip(paths, saved, strict=True):
        command, text = _without_shard(report.command)
        if text is None:
            raise RescoreError(f"{path}: not the report of a --shard run ({report.command})")
        try:
            shard = Shard.parse(text)
        except ValueError as exc:
            raise RescoreError(f"{path}: --shard {exc}") from None
        if shard in shards:
            raise RescoreError(f"{path}: shard {shard} again (also {shards[shard]})")
        shards[shard] = path
        whole.add(command)
        if (report.backend, report.commit, report.generated, report.examples,
                report.operators, report.targets) != run:
            raise RescoreError(f"{path}: not a part of the run of {paths[0]} (another backend, "
                               "commit, operators, modules or examples)")
    if len(whole) != 1:
        raise RescoreError(f"{paths[-1]}: its command differs from {paths[0]}'s beyond "
                           "--shard: parts of different runs")
    _check_partition(paths[0], shards)
    merged = dict(parts[0])
    merged["command"] = whole.pop()
    merged["mutants"] = sorted((dict(m) for part in parts for m in part["mutants"]),
                               key=lambda mutant: mutant["number"])
    merged["executed_lines"] = {
        shown: sorted({line for r in saved for line in r.executed_lines.get(shown, [])})
        for shown in {shown for r in saved for shown in r.executed_lines}}
    merged["executed_phases"] = {
        shown: {phase.value: sorted({line for r in saved
                                     for line in r.executed_phases.get(shown, {}).get(phase, [])})
                for phase in CodePhase
                if any(phase in r.executed_phases.get(shown, {}) for r in saved)}
        for shown in {shown for r in saved for shown in r.executed_phases}}
    merged["processes"] = sum(r.processes for r in saved)
    merged["baseline_seconds"] = max(r.baseline_seconds for r in saved)
    merged["seconds"] = round(sum(r.seconds for r in saved), 1)
    return merged


def _check_partition(path: Path, shards: Mapping[Shard, Path]) -> None:
    """Refuse ``shards`` (each to the report holding it) that overlap or leave a mutant
    out. They may have different counts (``1/2`` beside ``2/4`` and ``4/4``: a part split
    again later): mutant ``m`` is in ``I/N`` where ``m % N == I - 1``, so the parts are
    compared on the residues modulo the counts' least common multiple."""
    period = math.lcm(*(shard.count for shard in shards))
    owner: dict[int, Shard] = {}
    for shard, held_in in shards.items():
        for residue in range(shard.index - 1, period, shard.count):
            if residue in owner:
                raise RescoreError(f"{held_in}: shard {shard} overlaps shard "
                                   f"{owner[residue]} ({shards[owner[residue]]})")
            owner[residue] = shard
    if len(owner) != period:
        missing = [Shard(r % period + 1, period) for r in range(period) if r not in owner]
        raise RescoreError(f"{path}: the parts do not make the whole run: missing --shard "
                           f"{', '.join(str(shard) for shard in missing)}")


def _without_shard(command: str) -> tuple[str, str | None]:
    """``command`` without its ``--shard INDEX/COUNT``, and that shard (``None``: none)."""
    words = shlex.split(command)
    if SHARD_OPTION not in words[:-1]:
        return command, None
    at = words.index(SHARD_OPTION)
    return shlex.join(words[:at] + words[at + 2:]), words[at + 1]


def _validated(path: Path, data: Mapping[str, Any]) -> _SavedReport:
    try:
        return _SavedReport.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise RescoreError(f"{path}: {where}: {error['msg']} (a `speccheck mutate --json` "
                           "report of this version is needed)") from None


def rescored(
    path: Path, data: Mapping[str, Any], backend: str, targets: list[TargetModule],
    arguments: Mapping[Key, str],
) -> MutationReport:
    """The report saved in ``data`` (read from ``path``), scored with ``arguments``.

    Raises :class:`RescoreError` where ``data`` is not a full report of ``backend`` over
    ``targets`` (a report written before it kept ``executed_lines`` cannot be rescored),
    or where a mutant it holds is not the one ``targets`` generate now."""
    saved = _validated(path, data)
    if saved.backend != backend:
        raise RescoreError(f"{path}: a report of {saved.backend!r}, not of {backend!r}")
    files = sorted(target.shown for target in targets)
    if sorted(t.get("file", "") for t in saved.targets) != files:
        raise RescoreError(f"{path}: its modules are not {', '.join(files)} (give the run's "
                           "--module options)")
    generated = {m.number: m for m in generate_mutants(targets, saved.operators)}
    if len(generated) != saved.generated:
        raise RescoreError(f"{path}: the run generated {saved.generated} mutants, this "
                           f"checkout {len(generated)}: the code under test changed; run "
                           "speccheck mutate again")
    results = [_result(path, m, generated.get(m.number)) for m in saved.mutants]
    by_file = {target.shown: target.path for target in targets}
    executed = {by_file[shown]: frozenset(lines) for shown, lines in saved.executed_lines.items()
                if shown in by_file}
    phases = {by_file[shown]: {phase: frozenset(lines) for phase, lines in by_phase.items()}
              for shown, by_phase in saved.executed_phases.items() if shown in by_file}
    baseline = VerifyOutcome(0, None, saved.baseline_seconds, [])
    return MutationReport(
        backend, saved.examples, targets, [o.value for o in saved.operators], saved.generated,
        results, CoverageRun(baseline, executed, saved.processes, phases), saved.seconds,
        arguments, command=saved.command, commit=saved.commit,
        resumed=tuple(r.resumption() for r in saved.resumed))


def _result(path: Path, saved: _SavedMutant, mutant: Mutant | None) -> MutantResult:
    same = (mutant is not None and mutant.target.shown == saved.file
            and mutant.line == saved.line and mutant.original_line == saved.diff.get("-")
            and mutant.mutated_line == saved.diff.get("+"))
    if mutant is None or not same:
        raise RescoreError(f"{path}: mutant #{saved.number} ({saved.file}:{saved.line}) is not "
                           "the one this checkout generates: the code under test changed; "
                           "run speccheck mutate again")
    return MutantResult(mutant, saved.outcome, tuple(saved.failed_checks),
                        tuple(saved.named_fields), saved.seconds, saved.detail, saved.judged_by)


def arguments_changed(data: Mapping[str, Any], report: MutationReport) -> bool:
    """Whether ``report``, rescored from the saved ``data``, argues any mutant equivalent
    otherwise than the saved run did (a record then names the commit that scored it)."""
    saved = {m.get("number"): m.get("argument") for m in data.get("mutants", [])
             if isinstance(m, Mapping)}
    return any(saved.get(r.mutant.number) != report.argument(r) for r in report.results)
