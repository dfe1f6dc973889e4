"""Collect one tier's evidence for one backend: ``verify`` at the defaults (in its worker
processes, as the command runs it), the backend's self-test rows (in this process, as
``speccheck selftest`` runs them) and, on CUDA, ``bench``.

Only the example count may differ from what a user gets by default (``examples``); every
other setting is the default, so a status says what ``speccheck verify --backend NAME``
says on that machine.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speccheck.checks.api import backend_runtime_config, verify
from speccheck.checks.bench.errors import BackendCannotRun
from speccheck.checks.bench.measure import BenchSettings, run_bench
from speccheck.checks.bench.records import BASELINE_PATH, BenchReport
from speccheck.checks.provenance import (
    commit_index,
    commit_under_test,
    library_versions,
    tree_dirty,
)
from speccheck.checks.selftest.run import SelftestResult, selftest_rows
from speccheck.checks.status.record import (
    BenchRatio,
    CellRecord,
    CheckResult,
    FailureRecord,
    Provenance,
    SelftestRecord,
    TierStatus,
    Verdict,
)
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.vocabulary import Status, Tier
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.attention_setup import device_name

logger = logging.getLogger(__name__)

BENCH_STEPS = (4,)
BENCH_BATCHES = (1, 8, 64)
BENCH_REPEATS = 20
"""The bench a status runs on CUDA: K = 4 at batches 1, 8 and 64, 20 timed rounds per case
(the figures the project's targets are stated at)."""


@dataclass(frozen=True)
class StatusPlan:
    """What a status run collects for each backend."""

    examples: int = 50
    """Examples of the verify run (``speccheck verify``'s default)."""
    selftest: bool = True
    bench: bool = True
    """Run the bench where the tier has CUDA (it has no figures without)."""


Observer = Callable[[str], None]
"""Told one line per phase started (for the command's progress lines)."""


def collect_tier_status(name: str, matrices: MatrixContext, plan: StatusPlan,
                        on_phase: Observer) -> TierStatus:
    """Run ``name``'s evidence on this machine and return its tier's record."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tier = Tier.GPU if device.type == "cuda" else Tier.CPU
    on_phase(f"{name}: verify, {plan.examples} examples ({tier.value} tier)")
    started = time.perf_counter()
    report = verify(name, examples=plan.examples).backend(name)
    seconds = time.perf_counter() - started
    record = TierStatus(
        tier=tier.value,
        verdict=Verdict(report.status.value),
        detail=report.detail,
        provenance=_provenance(report, matrices.matrix.backend(name).package.distribution,
                               device),
        verify_command=f"speccheck verify --backend {name} --examples {plan.examples}",
        examples=report.examples,
        examples_asked=plan.examples,
        verify_seconds=round(seconds, 1),
        fused_allowed=report.fused_allowed,
        fused_reason=report.fused_reason,
        candidates=list(report.candidates),
        runtime_config=dict(report.runtime_config),
        checks=[CheckResult(check=check.value, passed=tally.passed, failed=tally.failed,
                            indeterminate=tally.indeterminate)
                for check, tally in report.checks.items()],
        failures=[FailureRecord(check=f.check.value, diagnosis=f.diagnosis, step=f.step,
                                field=f.field) for f in report.failures],
        reproduce=report.reproduce,
        breakpoints=_merged_breakpoints(report.breakpoints),
        cells=[CellRecord(name=c.name, verdict=c.verdict, examples=c.examples, detail=c.detail,
                          reproduce=c.reproduce)
               for c in report.cells],
        selftest=None,
    )
    if plan.selftest:
        record = with_selftest(name, record, on_phase)
    if plan.bench and tier is Tier.GPU and report.status is not Status.SKIPPED:
        record = with_bench(name, matrices, record, on_phase)
    return record


def with_selftest(name: str, record: TierStatus, on_phase: Observer) -> TierStatus:
    """``record`` (this machine's tier's) with ``name``'s self-test rows run now, in this
    process, as ``speccheck selftest`` runs them."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [row for row in selftest_rows(device) if row.backend == name]
    results: list[SelftestResult] = []
    for number, row in enumerate(rows, start=1):
        on_phase(f"{name}: self-test row {number}/{len(rows)}: {row.name}")
        results.append(row.result())
    return record.model_copy(update={"selftest": [
        SelftestRecord(name=r.name, expected_check=r.expected_check, outcome=r.outcome.value,
                       detail=r.detail) for r in results]})


def _merged_breakpoints(breakpoints: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report's breakpoints less each batch size's sweep (``batches``): the merged and
    per-field lengths the draw aimed at. The sweeps (FlashInfer's: 50 kB) stay in
    ``verify --json``'s report."""
    if breakpoints is None:
        return None
    return {key: value for key, value in breakpoints.items() if key != "batches"}


def with_bench(name: str, matrices: MatrixContext, record: TierStatus,
               on_phase: Observer) -> TierStatus:
    """``record`` (a GPU tier's) with its bench measured now, at the runtime config
    ``speccheck verify --backend NAME`` runs on this tier (whatever the record's run
    reached); the bench is left out where the backend cannot run it."""
    on_phase(f"{name}: bench, K={BENCH_STEPS}, batches {BENCH_BATCHES}")
    config = backend_runtime_config(Tier.GPU, matrices.matrix, name, {})
    bench = _bench(name, matrices, config, torch.device("cuda"))
    command = (None if bench is None else
               f"speccheck bench --backend {name} --steps {','.join(map(str, BENCH_STEPS))} "
               f"--batches {','.join(map(str, BENCH_BATCHES))} --repeats {BENCH_REPEATS}")
    return record.model_copy(update={"bench": bench, "bench_command": command})


def _provenance(report: BackendReport, distribution: str,
                device: torch.device) -> Provenance:
    """Where ``report`` was made; the device is this machine's where the report names none
    (a worker that crashed before reporting)."""
    return Provenance(commit=commit_under_test(), commit_index=commit_index(),
                      tree_dirty=tree_dirty(),
                      date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
                      device=report.device or device_name(device),
                      versions=library_versions(distribution))


def _bench(name: str, matrices: MatrixContext, config: RuntimeConfig,
           device: torch.device) -> list[BenchRatio] | None:
    """The bench's ratios to the per-step path, or ``None`` where the backend cannot run."""
    settings = BenchSettings(name, config, matrices, BENCH_STEPS, BENCH_BATCHES, BENCH_REPEATS)
    try:
        run = run_bench(settings, device, commit=commit_under_test(),
                        command=f"speccheck status --backend {name}")
    except BackendCannotRun as exc:
        logger.warning("%s: bench skipped: %s", name, exc)
        return None
    return bench_ratios(run.report)


def bench_ratios(report: BenchReport) -> list[BenchRatio]:
    """Every non-baseline row of ``report`` as its ratios to the per-step row."""
    baseline = {(row.k, row.batch): row for row in report.rows if row.path is BASELINE_PATH}
    ratios: Sequence[BenchRatio] = [
        BenchRatio(path=row.path.value, k=row.k, batch=row.batch,
                   wall=_rounded(report.ratios(row).wall), host=_rounded(report.ratios(row).host),
                   gpu=_rounded(report.ratios(row).gpu),
                   per_step_wall_ms=round(baseline[(row.k, row.batch)].wall_ms, 4))
        for row in report.rows
        if row.path is not BASELINE_PATH and (row.k, row.batch) in baseline]
    return list(ratios)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
