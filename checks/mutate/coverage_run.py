"""The unmutated run: ``speccheck verify`` on an unchanged copy of the targets' packages,
shadowing the installed ones exactly as a mutant's run does, with
:mod:`~speccheck.checks.mutate.line_tracer` recording the lines every process executes in
the target modules. It gives the baseline (the gate must pass before mutants can be judged;
its wall time sets the mutants' timeout), the code the default run never executed, and the
proof that the shadow reaches verify's worker processes: target lines are recorded under
the copy's paths only if the workers imported the copy."""

from __future__ import annotations

import ast
import enum
import functools
import json
import os
import shutil
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from speccheck.checks.mutate import line_tracer
from speccheck.checks.mutate.operators import function_statements
from speccheck.checks.mutate.shadow import VerifyOutcome, run_verify, shadow_package
from speccheck.checks.mutate.targets import TargetModule

TRACER_FOLDER = "line-tracer"
"""The folder, beside the shadow copies, holding the tracer as ``sitecustomize.py``."""


class CodePhase(enum.StrEnum):
    """What the adapter was doing when a line ran (:func:`~speccheck.checks.mutate.
    line_tracer.phase_of`), in the order a line's phases are judged."""

    METADATA = "metadata"
    """Under a metadata builder's method: a mutant there changes a field a check can name."""
    ATTENTION = "attention"
    """Under an attention impl's method: a mutant there changes only what attention
    computes, which outputs show and no field check can name."""
    OTHER = line_tracer.OTHER_PHASE


@dataclass(frozen=True)
class CoverageRun:
    """What the unmutated run executed."""

    outcome: VerifyOutcome
    executed: dict[Path, frozenset[int]]
    """Lines executed in each target module (by its original path)."""
    processes: int
    """How many processes recorded lines (the command and its workers)."""
    phases: dict[Path, dict[CodePhase, frozenset[int]]] = field(default_factory=dict)
    """The lines of each target module executed in each :class:`CodePhase` (empty for a run
    recorded before phases were kept)."""

    def phase(self, target: TargetModule, first: int, last: int) -> CodePhase | None:
        """The phase of lines ``first`` to ``last`` of ``target``: metadata where any ran
        building or refreshing metadata, else attention where any ran in an attention impl,
        else other where any ran; ``None`` where none ran (or no phases were recorded)."""
        lines = self.phases.get(target.path, {})
        for phase in CodePhase:
            if any(line in lines.get(phase, ()) for line in range(first, last + 1)):
                return phase
        return None

    def ran(self, target: TargetModule, first: int, last: int) -> bool:
        """Whether any line from ``first`` to ``last`` of ``target`` was executed."""
        lines = self.executed.get(target.path, frozenset())
        return any(line in lines for line in range(first, last + 1))

    def never_reached(self, target: TargetModule, first: int, last: int) -> bool:
        """Whether an edit of lines ``first`` to ``last`` of ``target`` starts at a statement
        of a function body and the unmutated run executed none of them: a mutant there
        runs exactly as the unmutated gate did (same draws, same code path), so it
        survives without a run. An edit elsewhere (a ``def`` line's defaults, a class
        body: run at import, which the tracer does not see) is never said to be."""
        return first in _body_statement_lines(target.path) and not self.ran(target, first, last)

    def ran_function_bodies(self, targets: Sequence[TargetModule]) -> bool:
        """Whether any statement inside a function of ``targets`` was executed (importing a
        module runs none: the proof that the processes which call the adapter, verify's
        workers, imported the traced copies)."""
        for target in targets:
            lines = self.executed.get(target.path, frozenset())
            tree = ast.parse(target.path.read_text(encoding="utf-8"))
            if any(statement.lineno in lines for statement in function_statements(tree)):
                return True
        return False


@functools.cache
def _body_statement_lines(path: Path) -> frozenset[int]:
    """The first lines of the function-body statements of the module at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return frozenset(statement.lineno for statement in function_statements(tree))


def run_unmutated(
    targets: Sequence[TargetModule], backend: str, *, examples: int | None, timeout: float,
) -> CoverageRun:
    """Run verify on unchanged copies of the targets' packages with the line tracer in
    every process: a full default run (no ``--fail-fast``), as the user's gate runs."""
    with ExitStack() as stack:
        packages = sorted({(t.package, t.package_dir) for t in targets})
        roots = {name: stack.enter_context(shadow_package(name, folder))
                 for name, folder in packages}
        root = roots[targets[0].package]
        tracer = root / TRACER_FOLDER
        records = tracer / "records"
        records.mkdir(parents=True)
        shutil.copyfile(line_tracer.__file__, tracer / "sitecustomize.py")
        copies = {roots[t.package] / t.package / t.relative: t.path for t in targets}
        path = [*map(str, roots.values()), str(tracer), os.environ.get("PYTHONPATH")]
        env = {
            line_tracer.TRACE_DIR_ENV: str(records),
            line_tracer.TRACE_FILES_ENV: os.pathsep.join(map(str, copies)),
            "PYTHONPATH": os.pathsep.join(filter(None, path)),
        }
        outcome = run_verify(root, backend, examples=examples, timeout=timeout,
                             fail_fast=False, extra_env=env)
        phases: dict[Path, dict[CodePhase, set[int]]] = {}
        files = sorted(records.glob("*.json"))
        for record in files:
            for path, by_phase in json.loads(record.read_text(encoding="utf-8")).items():
                if Path(path) in copies:
                    mine = phases.setdefault(copies[Path(path)], {})
                    for phase, lines in by_phase.items():
                        mine.setdefault(CodePhase(phase), set()).update(lines)
        return CoverageRun(
            outcome, {p: frozenset().union(*by.values()) for p, by in phases.items()},
            len(files), {p: {ph: frozenset(s) for ph, s in by.items()} for p, by in phases.items()})


def never_executed(target: TargetModule, run: CoverageRun) -> list[tuple[int, int]]:
    """The statements inside ``target``'s function bodies that ``run`` never executed, as
    ``(first line, last line)`` ranges of consecutive statement lines."""
    tree = ast.parse(target.path.read_text(encoding="utf-8"))
    executed = run.executed.get(target.path, frozenset())
    statement_lines = sorted({s.lineno for s in function_statements(tree)})
    ranges: list[tuple[int, int]] = []
    previous_missed = False
    for line in statement_lines:
        missed = line not in executed
        if missed and previous_missed:
            ranges[-1] = (ranges[-1][0], line)
        elif missed:
            ranges.append((line, line))
        previous_missed = missed
    return ranges
