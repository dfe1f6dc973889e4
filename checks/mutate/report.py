"""The mutation report: the score, the kills by kind, every survivor with its ``file:line``
and diff line (split into those on lines the unmutated run never executed, candidates for
equivalence and the rest), the code never executed, and how many mutants were not run; as
JSON, as a rich table on a terminal, or as plain lines in a log."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from speccheck.checks.mutate.coverage_run import CodePhase, CoverageRun, never_executed
from speccheck.checks.mutate.equivalents import Key, argument_for
from speccheck.checks.mutate.runner import KillKind, MutantResult, Outcome
from speccheck.checks.mutate.targets import Role, TargetModule

EQUIVALENCE_HEURISTIC = (
    "heuristic: the mutated line was executed and the mutation changes an argument of "
    "min/max/clamp, which may clip it back to the original value"
)


class SurvivorClass(enum.StrEnum):
    """Why a survivor may have survived."""

    NOT_EXECUTED = "not_executed"
    """The unmutated run never executed its line: the defaults do not reach it."""
    ARGUED_EQUIVALENT = "argued_equivalent"
    """Its author argues no input can tell it from the original
    (:mod:`~speccheck.checks.mutate.equivalents`): left out of the score."""
    EQUIVALENCE_CANDIDATE = "equivalence_candidate"
    """Executed, but the mutation may not change a value (:data:`EQUIVALENCE_HEURISTIC`)."""
    UNCAUGHT = "uncaught"
    """Executed, and nothing suggests it is equivalent: a gap in the gate."""


@dataclass(frozen=True)
class Resumption:
    """One continuation of a run (``speccheck mutate --resume``): where it ran and how much
    it did."""

    commit: str
    """The commit whose ``speccheck verify`` judged this part's mutants (the run's own
    commit judged the rest)."""
    ran: int
    """Mutants it judged (run, or found invalid or unreached)."""
    seconds: float
    shard: str | None = None
    """The ``--shard`` of the mutants due it took (``None``: all of them)."""
    rejudged: int = 0
    """Of :attr:`ran`, survivors another verify had judged, judged again (their new result
    kept)."""

    def to_json(self) -> dict[str, Any]:
        return {"commit": self.commit, "ran": self.ran, "seconds": round(self.seconds, 1),
                "shard": self.shard, "rejudged": self.rejudged}


@dataclass(frozen=True)
class MutationReport:
    """Everything one ``speccheck mutate`` run found."""

    backend: str
    examples: int | None
    targets: list[TargetModule]
    operators: list[str]
    generated: int
    """Mutants generated before sampling (``--max-mutants``)."""
    results: list[MutantResult]
    coverage: CoverageRun
    seconds: float
    arguments: Mapping[Key, str] = field(default_factory=dict)
    """The equivalents files' arguments beside the targets (:func:`~speccheck.checks.mutate.
    equivalents.load_equivalents`)."""
    command: str = ""
    """The command that repeats the run (its sample, modules and operators)."""
    commit: str = ""
    """The commit the mutants were made from and first run at."""
    resumed: tuple[Resumption, ...] = ()
    """The run's continuations, each judging mutants an earlier part left unrun."""

    def count(self, outcome: Outcome) -> int:
        return sum(result.outcome is outcome for result in self.results)

    @property
    def run(self) -> int:
        """Mutants that were started or found invalid."""
        return len(self.results) - self.count(Outcome.NOT_RUN)

    @property
    def killed(self) -> int:
        return sum(result.outcome.killed for result in self.results)

    @property
    def argued_survivors(self) -> int:
        """Survivors argued equivalent."""
        return sum(self.argument(r) is not None for r in self.results
                   if r.outcome is Outcome.SURVIVED)

    @property
    def scored(self) -> int:
        """Mutants the score counts: run, valid, and not survivors argued equivalent."""
        return self.run - self.count(Outcome.INVALID) - self.argued_survivors

    @property
    def score(self) -> float | None:
        """killed / (run - invalid - survivors argued equivalent); ``None`` when none is
        left."""
        return self.killed / self.scored if self.scored else None

    def argument(self, result: MutantResult) -> str | None:
        """The argument that ``result``'s mutant is equivalent, if one is made."""
        return argument_for(result.mutant, self.arguments)

    def refuted(self) -> list[MutantResult]:
        """Mutants argued equivalent that a check killed: the argument is wrong."""
        return [r for r in self.results if r.outcome.killed and self.argument(r) is not None]

    def kills_by_kind(self) -> dict[KillKind, int]:
        kinds = Counter(result.kill_kind for result in self.results)
        return {kind: kinds[kind] for kind in KillKind}

    def kills_by_role(self) -> dict[Role, dict[KillKind, int]]:
        """:meth:`kills_by_kind` per role of the mutated module (a builder's mutants can
        be named by a field check; an attention kernel's change no field)."""
        kinds = Counter((r.mutant.target.role, r.kill_kind) for r in self.results
                        if r.kill_kind is not None)
        roles = dict.fromkeys(target.role for target in self.targets)
        return {role: {kind: kinds[role, kind] for kind in KillKind} for role in roles}

    def phase(self, result: MutantResult) -> CodePhase | None:
        """The phase of the code ``result``'s mutant changed, as the unmutated run ran it
        (:meth:`~speccheck.checks.mutate.coverage_run.CoverageRun.phase`)."""
        mutant = result.mutant
        return self.coverage.phase(mutant.target, mutant.line, mutant.end_line)

    def kills_by_phase(self) -> dict[CodePhase, dict[KillKind, int]]:
        """:meth:`kills_by_kind` per phase of the mutated code (only a metadata line's
        mutant changes a field a check can name); empty where the run kept no phases."""
        if not self.coverage.phases:
            return {}
        kinds = Counter((self.phase(r), r.kill_kind) for r in self.results
                        if r.kill_kind is not None)
        return {phase: {kind: kinds[phase, kind] for kind in KillKind} for phase in CodePhase}

    def survivor_class(self, result: MutantResult) -> SurvivorClass:
        mutant = result.mutant
        if self.argument(result) is not None:
            return SurvivorClass.ARGUED_EQUIVALENT
        if not self.coverage.ran(mutant.target, mutant.line, mutant.end_line):
            return SurvivorClass.NOT_EXECUTED
        if mutant.clipped:
            return SurvivorClass.EQUIVALENCE_CANDIDATE
        return SurvivorClass.UNCAUGHT

    def survivors(self) -> list[tuple[MutantResult, SurvivorClass]]:
        return [(r, self.survivor_class(r)) for r in self.results if r.outcome is Outcome.SURVIVED]

    def never_executed(self) -> dict[str, list[str]]:
        """Per target, the function-body lines the unmutated run never executed
        (``"12"`` or ``"12-30"``)."""
        shown: dict[str, list[str]] = {}
        for target in self.targets:
            ranges = never_executed(target, self.coverage)
            if ranges:
                shown[target.shown] = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges]
        return shown

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "examples": self.examples,
            "targets": [{"file": t.shown, "package": t.package, "role": t.role.value}
                        for t in self.targets],
            "operators": self.operators,
            "generated": self.generated,
            "score": self.score,
            "counts": {outcome.value: self.count(outcome) for outcome in Outcome},
            "kills_by_kind": {kind.value: n for kind, n in self.kills_by_kind().items()},
            "kills_by_role": {role.value: {kind.value: n for kind, n in kinds.items()}
                              for role, kinds in self.kills_by_role().items()},
            "kills_by_phase": {phase.value: {kind.value: n for kind, n in kinds.items()}
                               for phase, kinds in self.kills_by_phase().items()},
            "argued_equivalent": self.argued_survivors,
            "refuted_equivalence": [r.mutant.location for r in self.refuted()],
            "equivalence_heuristic": EQUIVALENCE_HEURISTIC,
            "never_executed": self.never_executed(),
            "mutants": [self._mutant_json(result) for result in self.results],
            "executed_lines": {t.shown: sorted(self.coverage.executed.get(t.path, ()))
                               for t in self.targets},
            "executed_phases": {t.shown: {phase.value: sorted(lines) for phase, lines
                                          in self.coverage.phases.get(t.path, {}).items()}
                                for t in self.targets if t.path in self.coverage.phases},
            "processes": self.coverage.processes,
            "baseline_seconds": round(self.coverage.outcome.seconds, 1),
            "seconds": round(self.seconds, 1),
            "command": self.command,
            "commit": self.commit,
            "resumed": [resumption.to_json() for resumption in self.resumed],
        }

    def _mutant_json(self, result: MutantResult) -> dict[str, Any]:
        mutant = result.mutant
        kind = result.kill_kind
        return {
            "number": mutant.number,
            "file": mutant.target.shown,
            "line": mutant.line,
            "operator": mutant.operator.value,
            "description": mutant.description,
            "diff": {"-": mutant.original_line, "+": mutant.mutated_line},
            "outcome": result.outcome.value,
            "kill_kind": kind.value if kind is not None else None,
            "failed_checks": list(result.failed_checks),
            "named_fields": list(result.named_fields),
            "survivor": (self.survivor_class(result).value
                         if result.outcome is Outcome.SURVIVED else None),
            "argument": self.argument(result),
            "executed": self.coverage.ran(mutant.target, mutant.line, mutant.end_line),
            "phase": None if (phase := self.phase(result)) is None else phase.value,
            "seconds": round(result.seconds, 1),
            "detail": result.detail,
            "judged_by": result.judged_by,
        }


def named_field_share(kinds: Sequence[Mapping[str, int]], scope: str) -> str:
    """``named field N of M {scope} kills`` over ``kinds`` (kills by kind, keyed by
    :class:`~speccheck.checks.mutate.runner.KillKind` value), summed."""
    total = sum(sum(k.values()) for k in kinds)
    named = sum(k.get(KillKind.NAMED_FIELD.value, 0) for k in kinds)
    return f"named field {named} of {total} {scope} kills"


def metadata_kills_line(report: MutationReport) -> str | None:
    """``named field N of M metadata-code kills (...)``: how many kills of mutants of code
    that built or refreshed metadata a field check named; ``None`` without phases."""
    by_phase = report.kills_by_phase()
    if not by_phase:
        return None
    kinds = by_phase[CodePhase.METADATA]
    others = ", ".join(f"{kind.value} {n}" for kind, n in kinds.items()
                       if n and kind is not KillKind.NAMED_FIELD)
    attention = sum(by_phase[CodePhase.ATTENTION].values())
    share = named_field_share([{kind.value: n for kind, n in kinds.items()}], "metadata-code")
    return (share + (f" ({others})" if others else "")
            + f"; {attention} kills of attention code (outputs only: no field to name)")


def summary_line(report: MutationReport) -> str:
    score = "n/a" if report.score is None else f"{report.score:.0%}"
    return (f"{report.backend}: mutation score {score} ({report.killed} of {report.scored} "
            f"valid mutants killed; {report.argued_survivors} argued equivalent, "
            f"{report.count(Outcome.INVALID)} invalid, "
            f"{report.count(Outcome.NOT_RUN)} not run for the budget, {report.generated} "
            f"generated) in {report.seconds:.0f} s")


def render(report: MutationReport, console: Console) -> None:
    """The report for people: tables on a terminal, plain lines otherwise."""
    kinds = ", ".join(f"{kind.value} {n}" for kind, n in report.kills_by_kind().items())
    metadata = metadata_kills_line(report)
    if metadata is not None:
        kinds += f"; {metadata}"
    survivors = report.survivors()
    missed = report.never_executed()
    if not console.is_terminal:
        lines = [summary_line(report), f"kills by kind: {kinds}"]
        for result, kind in survivors:
            m = result.mutant
            lines += [f"survived ({kind.value}): {m.location} {m.operator.value}: "
                      f"{m.description}", f"  - {m.original_line}", f"  + {m.mutated_line}"]
            argument = report.argument(result)
            if argument is not None:
                lines.append(f"  argued: {argument}")
        lines += [f"refuted equivalence (argued equivalent, yet killed): {r.mutant.location}"
                  for r in report.refuted()]
        lines += [f"never executed: {shown}: {', '.join(ranges)}"
                  for shown, ranges in missed.items()]
        lines.append(f"equivalence candidates: {EQUIVALENCE_HEURISTIC}")
        for line in lines:
            console.print(line, markup=False, soft_wrap=True)
        return
    console.print(f"[bold]{summary_line(report)}[/bold]")
    console.print(f"kills by kind: {kinds}", markup=False)
    if survivors:
        table = Table(title="Surviving mutants", show_lines=True)
        for column in ("location", "operator", "class", "diff"):
            table.add_column(column, overflow="fold")
        for result, kind in survivors:
            m = result.mutant
            argument = report.argument(result)
            argued = "" if argument is None else f"\nargued: {argument}"
            table.add_row(Text(m.location), m.operator.value, kind.value,
                          Text(f"- {m.original_line}\n+ {m.mutated_line}{argued}"))
        console.print(table)
    for result in report.refuted():
        console.print(f"refuted equivalence (argued equivalent, yet killed): "
                      f"{result.mutant.location}", markup=False)
    if missed:
        table = Table(title="Never executed by the default run (function-body lines)")
        table.add_column("file")
        table.add_column("lines", overflow="fold")
        for shown, ranges in missed.items():
            table.add_row(Text(shown), Text(", ".join(ranges)))
        console.print(table)
    console.print(f"equivalence candidates: {EQUIVALENCE_HEURISTIC}", markup=False)
