"""The status of one backend, as committed under ``docs/status/<backend>.json``.

A :class:`BackendStatus` holds at most one :class:`TierStatus` per machine tier (the CPU
tier's eager checks, the GPU tier's real graphs): a status run overwrites the record of
the tier it ran on and keeps the other, so a CPU run never erases GPU evidence. Every
record names what it was measured at: commit (and its position in history, so that
records can be compared without git), device, library versions, date.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

STATUS_SCHEMA_VERSION = 1
STATUS_README = "README.md"


class Verdict(enum.StrEnum):
    """What a tier's verification of the backend ended in."""

    PASSED = "passed"
    FAILED = "failed"
    CRASHED = "crashed"
    SKIPPED = "skipped"
    """The machine could not run the backend (the record says why)."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CheckResult(_Record):
    """One check, summed over the verify run."""

    check: str
    passed: int
    failed: int
    indeterminate: int


class FailureRecord(_Record):
    """One failure of the verify run, on its minimal example."""

    check: str
    diagnosis: str
    step: int | None = None
    field: str | None = None


class CellRecord(_Record):
    """One configuration cell of the verify run
    (:class:`~speccheck.checks.verify.report.CellReport`): its verdict, or ``not run`` and
    why."""

    name: str
    verdict: str
    examples: int
    detail: str = ""
    reproduce: str | None = None
    """The cell's failure's reproduce command (``None``: it did not fail, or a record
    written before it was kept)."""


class SelftestRecord(_Record):
    """One self-test row of the backend: a known-bad builder (caught by the check meant for
    it) or the control (which must pass)."""

    name: str
    expected_check: str
    outcome: str
    detail: str


class BenchRatio(_Record):
    """One decode path's propose time over the per-step path's, at one K and batch size,
    measured side by side in one process."""

    path: str
    k: int
    batch: int
    wall: float | None
    host: float | None
    gpu: float | None
    per_step_wall_ms: float


class ResumedPart(_Record):
    """A continuation of a mutation run (``speccheck mutate --resume``): the commit whose
    verify judged the mutants an earlier part left unrun, and how many it judged."""

    commit: str
    ran: int
    seconds: float
    shard: str | None = None
    rejudged: int = 0
    """Of ``ran``, survivors another verify had judged, judged again."""


class MutationRecord(_Record):
    """One ``speccheck mutate`` run of the backend on this tier (its ``--json`` report,
    summed up): how many of the valid mutants run ``verify`` at the defaults killed, how,
    and which survived. Written by ``speccheck mutate --status DIR``; it names its own
    commit, as it may run at another commit than the tier's verify."""

    command: str
    commit: str
    date: str
    generated: int
    """Mutants generated; ``valid`` of them were run (a sample where fewer)."""
    valid: int
    killed: int
    not_run: int = 0
    """Mutants of the run left unrun by its budget or ``--stop-after`` (not in ``valid``)."""
    argued_equivalent: int = 0
    """Survivors argued equivalent (``equivalent_mutants.yaml``): out of the score."""
    score: float | None
    kills_by_kind: dict[str, int]
    kills_by_role: dict[str, dict[str, int]] = Field(default_factory=dict)
    """:attr:`kills_by_kind` per role of the mutated module (``builder``, ``refresh``,
    ``attention``, ``helper``, ``chosen``: :class:`~speccheck.checks.mutate.targets.Role`); empty
    in a record made before it was kept."""
    kills_by_phase: dict[str, dict[str, int]] = Field(default_factory=dict)
    """:attr:`kills_by_kind` per phase of the mutated code as the unmutated run ran it
    (``metadata``, ``attention``, ``other``: :class:`~speccheck.checks.mutate.coverage_run.
    CodePhase`); empty in a record made before phases were traced."""
    survivors: list[str]
    """``FILE:LINE OPERATOR (survivor class): - original / + mutated`` of each survivor."""
    seconds: float
    scored_at: str | None = None
    """The commit whose equivalence arguments scored the run, where it was scored again
    later (``speccheck mutate --rescore``) with arguments that differ from the run's own;
    ``None``: scored as the run itself scored it."""
    resumed: list[ResumedPart] = Field(default_factory=list)
    """The run's continuations: the mutants its budget left unrun, judged later, at
    :attr:`ResumedPart.commit` (``commit`` judged the rest)."""

    @property
    def scored(self) -> int:
        """The mutants the score counts: the valid ones less the survivors argued
        equivalent."""
        return self.valid - self.argued_equivalent

    @classmethod
    def from_report(cls, report: dict[str, Any], *, command: str, commit: str,
                    date: str, scored_at: str | None = None) -> MutationRecord:
        """The record of a ``speccheck mutate --json`` report."""
        counts = report["counts"]
        valid = sum(counts.values()) - counts.get("not_run", 0) - counts.get("invalid", 0)
        survivors = [f"{m['file']}:{m['line']} {m['operator']} ({m['survivor']}): "
                     f"- {m['diff']['-'].strip()} / + {m['diff']['+'].strip()}"
                     for m in report["mutants"] if m["outcome"] == "survived"]
        return cls(command=command, commit=commit, date=date, generated=report["generated"],
                   valid=valid, killed=sum(n for n in report["kills_by_kind"].values()),
                   not_run=counts.get("not_run", 0),
                   argued_equivalent=report.get("argued_equivalent", 0),
                   score=report["score"], kills_by_kind=dict(report["kills_by_kind"]),
                   kills_by_role={role: dict(kinds) for role, kinds
                                  in report.get("kills_by_role", {}).items()},
                   kills_by_phase={phase: dict(kinds) for phase, kinds
                                   in report.get("kills_by_phase", {}).items()},
                   survivors=survivors, seconds=report["seconds"], scored_at=scored_at,
                   resumed=[ResumedPart(**part) for part in report.get("resumed", [])])


class Provenance(_Record):
    """Where and on what a record was measured."""

    commit: str
    commit_index: int | None = Field(
        None, description="Commits in the history up to and including `commit` "
        "(`git rev-list --count`): how records compare without git.")
    tree_dirty: bool | None = Field(
        None, description="Whether the working tree differed from `commit` outside "
        "docs/ (None: unknown, e.g. a copy without .git).")
    date: str
    device: str
    versions: dict[str, str]


class TierStatus(_Record):
    """The evidence of one tier: the verify run at the defaults, the self-test rows, the
    bench ratios (GPU only; ``None`` where not measured)."""

    tier: str
    verdict: Verdict
    detail: str = ""
    provenance: Provenance
    verify_command: str
    examples: int
    examples_asked: int
    verify_seconds: float | None = None
    """Wall time of the verify run in the status process (its workers' start-up, discovery,
    capture, every example and cell, the merge; not the ``speccheck`` command's own
    start-up), on a machine that may have run other work beside it; ``None`` in a record
    written before it was kept."""
    fused_allowed: bool
    fused_reason: str
    candidates: list[str]
    runtime_config: dict[str, object]
    checks: list[CheckResult]
    failures: list[FailureRecord]
    reproduce: str | None = None
    """The verify run's first failure's reproduce command (a crash's: the example it died
    in), which runs exactly that example in a fresh worker; ``None`` where it passed, or in
    a record written before it was kept."""
    breakpoints: dict[str, object] | None = None
    """The merged and per-field breakpoint lengths the run's draw aimed at (its report's
    ``breakpoints`` less the per-batch sweeps)."""
    cells: list[CellRecord] = Field(default_factory=list)
    """The configuration cells verified, base first (empty: the run's config alone, or a
    record written before cells)."""
    selftest: list[SelftestRecord] | None
    """The backend's self-test rows on this tier, as run; ``None`` where the run left them
    out (``--no-selftest``, none since), ``[]`` where the backend has no rows here."""
    bench: list[BenchRatio] | None = None
    bench_command: str | None = None
    mutation: MutationRecord | None = None
    """The newest ``speccheck mutate --status`` run of the backend on this tier (kept when
    ``speccheck status`` rewrites the tier's record)."""

    @property
    def selftest_caught(self) -> tuple[int, int]:
        """(rows whose outcome is as required, rows run): skipped rows are not counted."""
        run = [row for row in self.selftest or [] if row.outcome != "skipped"]
        return sum(row.outcome == "caught" for row in run), len(run)


class BackendStatus(_Record):
    """Everything committed about one backend: one record per tier that has run it."""

    schema_version: int = STATUS_SCHEMA_VERSION
    backend: str
    tiers: dict[str, TierStatus]


class StatusFileError(ValueError):
    """A status file that cannot be read; ``str()`` is one line naming the file."""


def status_path(folder: Path, backend: str) -> Path:
    return folder / f"{backend}.json"


def read_status(path: Path) -> BackendStatus:
    """The status in ``path``. Raises :class:`StatusFileError`."""
    try:
        return BackendStatus.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise StatusFileError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise StatusFileError(f"{path}: not a status file: {where}: {first['msg']}") from None


def read_statuses(folder: Path) -> dict[str, BackendStatus]:
    """Every status in ``folder`` by backend (empty when the folder does not exist). Raises
    :class:`StatusFileError` for a file that is not a status or names another backend."""
    statuses = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        status = read_status(path)
        if status.backend != path.stem:
            raise StatusFileError(f"{path}: holds the status of {status.backend!r}, "
                                  f"not of {path.stem!r}")
        statuses[status.backend] = status
    return statuses


def write_tier_status(folder: Path, backend: str, record: TierStatus) -> BackendStatus:
    """Overwrite ``record.tier``'s record in ``backend``'s status file, keeping the other
    tiers' records and, where ``record`` has none, the tier's mutation record; returns what
    was written."""
    path = status_path(folder, backend)
    tiers: dict[str, TierStatus] = {}
    if path.exists():
        tiers = dict(read_status(path).tiers)
    kept = tiers.get(record.tier)
    if record.mutation is None and kept is not None and kept.mutation is not None:
        record = record.model_copy(update={"mutation": kept.mutation})
    tiers[record.tier] = record
    status = BackendStatus(backend=backend, tiers=dict(sorted(tiers.items())))
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(status.model_dump(mode="json"), indent=2) + "\n",
                    encoding="utf-8")
    return status


def tier_record(folder: Path, backend: str, tier: str) -> TierStatus:
    """``tier``'s record of ``backend`` in ``folder``. Raises :class:`StatusFileError`
    where there is none (``speccheck status`` writes it)."""
    path = status_path(folder, backend)
    record = read_status(path).tiers.get(tier) if path.exists() else None
    if record is None:
        raise StatusFileError(f"{path}: no {tier} record of {backend!r}; run "
                              f"`speccheck status --backend {backend}` first")
    return record


def write_mutation(folder: Path, backend: str, tier: str, mutation: MutationRecord) -> None:
    """Put ``mutation`` into ``tier``'s record of ``backend`` in ``folder``
    (:func:`tier_record`, which raises where there is none)."""
    record = tier_record(folder, backend, tier)
    write_tier_status(folder, backend, record.model_copy(update={"mutation": mutation}))
