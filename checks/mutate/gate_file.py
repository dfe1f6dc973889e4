"""The unmutated gate's run saved for reuse (``speccheck mutate --gate FILE``).

The traced unmutated run (:func:`~speccheck.checks.mutate.coverage_run.run_unmutated`) is
one full default verify under a line tracer: on the CPU tier it is the longest single run
of a mutation run, and every ``--shard`` part of one run repeats it. Saved once, it serves
every part run on the same code: what it executed (lines and phases, keyed by package and
module path, so that a copy of the checkout elsewhere reads it), how many processes
recorded lines and its wall time (which sets the mutants' timeout).

A saved gate holds the fingerprint of the code it ran: every file a mutant's run copies of
the targets' packages (:func:`~speccheck.checks.mutate.fingerprint.code_fingerprint`). A
gate is reused only for the same backend, ``--examples`` and fingerprint; anything else is
refused (:class:`GateFileError`), never silently run again or trusted.
Only a passing gate is saved.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from speccheck.checks.mutate.coverage_run import CodePhase, CoverageRun
from speccheck.checks.mutate.shadow import VerifyOutcome
from speccheck.checks.mutate.targets import TargetModule
from speccheck.checks.verify.vocabulary import Status
from speccheck.contract.bounded_read import UnreadableFile, read_regular_file

GATE_FORMAT = 1
MAX_GATE_BYTES = 16 << 20
"""Largest gate file read (the executed lines of a backend's modules: tens of KiB)."""


class GateFileError(ValueError):
    """A gate file that cannot serve this run (one line, naming the file)."""


class _SavedGate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int
    backend: str
    examples: int | None
    fingerprint: str
    seconds: float
    processes: int
    executed_phases: dict[str, dict[CodePhase, list[int]]]
    """Per ``package/module path``: the lines executed in each phase."""


def _key(target: TargetModule) -> str:
    return f"{target.package}/{target.relative}"


def save_gate(
    path: Path, coverage: CoverageRun, targets: Sequence[TargetModule], *, backend: str,
    examples: int | None, fingerprint: str,
) -> None:
    """Write the passing gate ``coverage`` of ``targets`` to ``path``."""
    if coverage.outcome.report is None or coverage.outcome.report.get("status") != Status.PASSED:
        raise ValueError("only a passing gate is saved")
    saved = _SavedGate(
        format=GATE_FORMAT, backend=backend, examples=examples, fingerprint=fingerprint,
        seconds=round(coverage.outcome.seconds, 1), processes=coverage.processes,
        executed_phases={
            _key(t): {phase: sorted(lines) for phase, lines in coverage.phases[t.path].items()}
            for t in targets if t.path in coverage.phases})
    try:
        path.write_text(saved.model_dump_json(indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise GateFileError(f"{path}: cannot write it: {exc.strerror or exc}") from None


def load_gate(
    path: Path, targets: Sequence[TargetModule], *, backend: str, examples: int | None,
    fingerprint: str,
) -> CoverageRun:
    """The gate saved at ``path`` as the coverage run of ``targets``; :class:`GateFileError`
    where it is unreadable or was run for another backend, ``--examples`` or code."""
    try:
        raw = read_regular_file(path, MAX_GATE_BYTES)
        saved = _SavedGate.model_validate(json.loads(raw.decode("utf-8")))
    except UnreadableFile as exc:
        raise GateFileError(f"{path}: cannot read it: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, ValidationError) as exc:
        first = str(exc).splitlines()[0]
        raise GateFileError(f"{path}: not a saved gate of this version ({first})") from None
    if saved.format != GATE_FORMAT:
        raise GateFileError(f"{path}: gate format {saved.format}, this version reads "
                            f"{GATE_FORMAT}")
    if (saved.backend, saved.examples) != (backend, examples):
        raise GateFileError(f"{path}: the gate of --backend {saved.backend} with --examples "
                            f"{saved.examples or 'default'}, not of this run's")
    if saved.fingerprint != fingerprint:
        raise GateFileError(f"{path}: saved from other code than this checkout's (its "
                            "packages' files differ); remove it to run the gate again")
    by_key = {_key(t): t.path for t in targets}
    phases = {by_key[key]: {phase: frozenset(lines) for phase, lines in by_phase.items()}
              for key, by_phase in saved.executed_phases.items() if key in by_key}
    executed = {p: frozenset().union(*by_phase.values()) for p, by_phase in phases.items()}
    outcome = VerifyOutcome(0, {"status": Status.PASSED.value}, saved.seconds, [])
    return CoverageRun(outcome, executed, saved.processes, phases)
