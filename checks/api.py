"""The Python API of ``speccheck verify``, re-exported at the package root
(``speccheck.verify``): the same run as the command, returning a typed report instead of
printing one and exiting.

Two steps, so that a caller can show what will run before it runs (the command prints the
tier and the effective runtime config first):

- :func:`plan_verification` takes a :class:`~speccheck.checks.verify.run.VerifyRun` (the
  run as given, which :func:`checked_run` builds from keyword arguments, as the command
  and the pytest plugin do) and settles everything it depends on (the machine's tier, the
  effective runtime config, the matrices, the backends, the jobs); bad input raises :class:`VerifyInputError` (one line) or
  :class:`~speccheck.contract.matrix_loader.MatrixError` (one ``PATH:LINE`` line per
  problem), before any process starts;
- :meth:`VerifyPlan.run` verifies each backend in a worker process of its own, exactly as
  the command does, and returns a :class:`VerifyReport`.

:func:`verify` does both. Importing this module does not import torch; planning does (to
find the tier), and the workers do.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails
from rich.console import Console
from rich.progress import Progress

from speccheck.checks.verify.cells import (
    CELL_SEED_STRIDE,
    Cell,
    CellAxis,
    claimed_cells,
    example_shares,
    narrowed,
    simulates_dcp,
)
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.report import BackendReport, CellReport, Failure, Finding, cut_short
from speccheck.checks.verify.run import VerifyRun, WorkerTask, bound_problem, runtime_flags
from speccheck.checks.verify.scale import HarnessScale, default_jobs, memory_jobs
from speccheck.checks.verify.vocabulary import Check, Status, Tier
from speccheck.contract.adapter_status import implementation_path
from speccheck.contract.matrix_model import VERIFIABLE_FIELDS, Matrix
from speccheck.contract.resolution import backend_failures
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.drafter_kind import DrafterKind

if TYPE_CHECKING:
    from speccheck.checks.verify.engine import VerifySettings
    from speccheck.checks.verify.runner import ProgressDisplay
    from speccheck.checks.verify.worker_process import WorkerProcess
    from speccheck.contract.builder import AttentionMetadataBuilder

logger = logging.getLogger(__name__)

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOTHING_VERIFIED = 3

VERIFY_FIELDS = VERIFIABLE_FIELDS
"""The runtime fields a verification takes
(:data:`~speccheck.contract.matrix_model.VERIFIABLE_FIELDS`); platform, compute capability
and graph mode come from the machine."""

MAX_DCP_RANKS = 16
"""Most DCP ranks a verification spawns (``--dcp-world-size`` for a backend whose builders
hold a real DCP share: one process per rank)."""

class VerifyInputError(ValueError):
    """Input a verification cannot run with (an unknown backend, a bad runtime value, a
    builder class the worker cannot import, a bad ``reproduce`` blob). ``str()`` is one line;
    the command prints it on stderr and exits 2."""


def _device_gib(tier: Tier) -> float:
    """The GPU's memory in GiB on the GPU tier (0 on the CPU tier)."""
    if tier is not Tier.GPU:
        return 0.0
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30


def machine_tier() -> tuple[Tier, str]:
    """What this machine can verify on, and the device's name: the GPU tier (real CUDA
    graphs) when torch sees a CUDA device, else the CPU tier. Imports torch."""
    import torch

    if torch.cuda.is_available():
        return Tier.GPU, torch.cuda.get_device_name()
    return Tier.CPU, "CPU"


@dataclass(frozen=True)
class CheckVerdict:
    """One check of one backend, summed over a run: ``PASSED`` (it held on every example
    it was decided on), ``FAILED`` (``message``: every failure on the minimal example, the
    example and the reproduce command) or ``SKIPPED`` (``message`` says why: the check does
    not apply to this tier or config, or the backend did not run)."""

    check: Check
    status: Status
    message: str


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found: one :class:`BackendReport` per backend, in order, and the
    run's tier, device, effective runtime config and matrix (``None``: the shipped matrix
    merged with the installed plug-ins)."""

    backends: tuple[BackendReport, ...]
    tier: Tier
    device: str
    config: RuntimeConfig
    matrix: Path | None
    notes: Mapping[str, str] = field(default_factory=dict)
    """By backend: why its reproduce command did not fail the same way when re-run in a
    fresh worker (``BackendReport.reproduced`` is then false)."""

    @property
    def status(self) -> Status:
        """``FAILED`` when a check failed or a worker crashed; else ``SKIPPED`` when no
        backend was verified (each was skipped); else ``PASSED``."""
        statuses = {report.status for report in self.backends}
        if statuses & {Status.FAILED, Status.CRASHED}:
            return Status.FAILED
        return Status.PASSED if Status.PASSED in statuses else Status.SKIPPED

    @property
    def passed(self) -> bool:
        """Whether the gate passed: the status is ``PASSED``."""
        return self.status is Status.PASSED

    @property
    def exit_code(self) -> int:
        """The exit status ``speccheck verify`` gives for this report: 0 passed, 1 failed
        or crashed, 3 nothing verified."""
        return {Status.PASSED: EXIT_PASSED, Status.FAILED: EXIT_FAILED,
                Status.SKIPPED: EXIT_NOTHING_VERIFIED}[self.status]

    def backend(self, name: str) -> BackendReport:
        """The report of backend ``name``; ``KeyError`` when it was not verified."""
        for report in self.backends:
            if report.backend == name:
                return report
        raise KeyError(f"{name!r} was not verified; verified: "
                       f"{', '.join(r.backend for r in self.backends)}")

    def verdicts(self, name: str) -> tuple[CheckVerdict, ...]:
        """One :class:`CheckVerdict` per check of backend ``name``, in report order."""
        report = self.backend(name)
        return tuple(_verdict(report, check) for check in Check)

    def summary_lines(self) -> list[str]:
        """What the command prints under its table, per backend: why fusing is not
        allowed, the claims audit's verdict, why it was skipped or crashed, every failure,
        the minimal example and the reproduce command. Each entry is one line."""
        lines = []
        for r in self.backends:
            if not r.fused_allowed and r.status in (Status.PASSED, Status.FAILED):
                how = ("host_preplanned path verified against the per-step oracle"
                       if any(c.startswith("host_preplanned") for c in r.candidates)
                       else "verified on the per-step path only")
                lines.append(f"{r.backend}: fused: not allowed ({r.fused_reason}); {how}")
            if r.claim_audit is not None:
                lines.append(f"{r.backend}: audit: {r.claim_audit.verdict}")
            if r.status in (Status.SKIPPED, Status.CRASHED):
                lines.append(f"{r.backend}: {r.status.value}: {r.detail}")
            elif r.detail:
                lines.append(f"{r.backend}: {r.detail}")
            lines += [f"{r.backend}: latent field (reaches no output; checked by its meaning "
                      f"only): {path}" for path in r.latent_fields]
            if r.findings:
                for finding in r.findings:
                    lines += [f"FAIL {r.backend} {f.check}{_where(f)}: {f.diagnosis}"
                              for f in finding.failures]
                    lines += _finding_lines(finding, self.notes.get(r.backend))
            else:
                lines += [f"FAIL {r.backend} {f.check}{_where(f)}: {f.diagnosis}"
                          for f in r.failures]
                lines += _example_lines(r, self.notes.get(r.backend))
            if r.stop_note is not None:
                lines.append(f"{r.backend}: {r.stop_note}: checks that did not fail ran on "
                             f"{r.examples} of {r.examples_asked} examples, not all")
        return lines


def _data_parallel_note(report: BackendReport) -> str:
    """What a data-parallel run drafted with and on what, in words ("" for another run)."""
    if report.data_parallel is None:
        return ""
    ranks = report.data_parallel
    return (f"the DFlash drafter (blocks of 1 + K tokens, attended non-causally) on "
            f"{ranks['dp_size']} data-parallel ranks over {ranks['collectives']}")


def _where(failure: Failure) -> str:
    return "".join([f" step {failure.step}" if failure.step is not None else "",
                    f" field {failure.field}" if failure.field else ""])


def _example_lines(report: BackendReport, note: str | None = None) -> list[str]:
    """The minimal example and the reproduce command of a report without findings (a DP or
    DCP run, a crash), saying whether the command failed the same way in a fresh worker
    (``note``: why not)."""
    return _reproduce_lines(report.minimal_example, report.reproduce, report.reproduced, note)


def _finding_lines(finding: Finding, note: str | None = None) -> list[str]:
    """A finding's minimal example and reproduce command (:func:`_reproduce_lines`)."""
    return _reproduce_lines(finding.example, finding.reproduce, finding.reproduced, note)


def _reproduce_lines(
    example: Mapping[str, Any] | None, reproduce: str | None, reproduced: bool | None,
    note: str | None,
) -> list[str]:
    """``minimal example: ...`` and ``reproduce ...: COMMAND``, saying whether the command
    failed the same way in a fresh worker (``note``: why not)."""
    lines = []
    if example is not None:
        lines.append(f"minimal example: {json.dumps(example)}")
    if reproduce:
        label = "reproduce"
        if reproduced:
            label += " (checked: fails the same way in a fresh worker)"
        elif reproduced is not None:
            label += (" (NOT reproduced in a fresh worker: "
                      f"{note or 'it ended differently there'})")
        lines.append(f"{label}: {reproduce}")
    return lines


def _verdict(report: BackendReport, check: Check) -> CheckVerdict:
    if report.status in (Status.SKIPPED, Status.CRASHED):
        return CheckVerdict(check, Status.SKIPPED, f"not run: {report.backend} "
                            f"{report.status.value}: {report.detail}")
    failures = [f for f in report.failures if f.check == check]
    if failures:
        lines = [f"{report.backend}: {check.value} failed on the {report.tier.value.upper()} "
                 "tier, on the minimal example:"]
        lines += [f"  {f.diagnosis}" for f in failures]
        finding = next((f for f in report.findings if check in f.checks), None)
        shown = _example_lines(report) if finding is None else _finding_lines(finding)
        return CheckVerdict(check, Status.FAILED, "\n".join(lines + shown))
    tally = report.checks[check]
    decided = tally.passed + tally.indeterminate > 0
    needs = None if decided else _needs(report, check)
    if needs is None and report.stop_note is not None:
        return CheckVerdict(check, Status.SKIPPED, cut_short(report, tally))
    if not decided:
        why = needs or (f"no example of this run exercised it ({report.examples} examples "
                        f"on the {report.tier.value.upper()} tier, candidates: "
                        f"{', '.join(report.candidates) or 'none'})")
        return CheckVerdict(check, Status.SKIPPED, f"{why}; it checks: {check.description}")
    return CheckVerdict(check, Status.PASSED, f"{tally.passed} passed, {tally.indeterminate} "
                        f"indeterminate, on {report.examples} examples")


def _needs(report: BackendReport, check: Check) -> str | None:
    """What ``check`` needs that ``report``'s run did not have, in words (``None``: nothing
    the run lacked by its tier, options or backend)."""
    if check is Check.CAPTURE and report.tier is not Tier.GPU:
        return f"needs CUDA graphs: this run is on the {report.tier.value.upper()} tier"
    if check in (Check.DP_TOKEN_COUNT, Check.DP_MATCHES_SINGLE_RANK, Check.DP_VS_FP32_REFERENCE):
        return "needs a data-parallel run (--dp-size 2 or more)"
    if check is Check.DCP_BLOCKS_VS_FP32_REFERENCE:
        return ("needs the DFlash drafter on real DCP ranks (--dcp-world-size 2 --drafter "
                "dflash, a backend whose builders hold a DCP share)")
    if check is Check.VS_FP32_REFERENCE and report.backend == "reference":
        return "the oracle is the fp32 reference"
    return None


@dataclass(frozen=True)
class VerifyPlan:
    """A checked verification, ready to run: made by :func:`plan_verification` from a
    :class:`~speccheck.checks.verify.run.VerifyRun`, which it keeps unchanged
    (:attr:`verify_run`) and hands to every worker, with what planning settled on this
    machine."""

    verify_run: VerifyRun
    """The run as given."""
    names: tuple[str, ...]
    """The backends, in the order they run."""
    config: RuntimeConfig
    """The tier's defaults overridden by the run's runtime fields; each backend runs with
    :meth:`config_for`, which puts its matrix entry's ``verify_defaults`` in between."""
    matrices: MatrixContext
    tier: Tier
    device: str
    reproduce: str | None
    """The example blob the run reproduces (``@FILE`` read), else ``None``."""
    jobs: int
    """Worker processes per single-rank backend (the run's ``jobs``, else the machine's
    default), each drawing its share of the examples from a seed of its own (``seed``,
    ``seed + 1``, ...); their reports merge
    (:func:`~speccheck.checks.verify.report.merge_shards`)."""

    cell: Cell = Cell(CellAxis.BASE)
    """The configuration cell this plan verifies (:meth:`for_cell`); the base cell: the
    run's own configuration, and every cell :meth:`cells` derives."""
    cell_examples: int | None = None
    """The cell's share of the run's examples (``None``: all of them)."""
    cell_index: int = 0
    """The cell's place in :meth:`cells` (0: the base cell)."""

    @property
    def seed(self) -> int:
        """The seed this plan's cell draws from: the run's, plus :data:`~speccheck.checks.
        verify.cells.CELL_SEED_STRIDE` per cell before it."""
        return self.verify_run.seed + self.cell_index * CELL_SEED_STRIDE

    @property
    def drafter(self) -> DrafterKind:
        """The drafter this plan's cell verifies: the cell's, else the run's, else DFlash
        at ``dp_size > 1`` and autoregressive otherwise."""
        chosen = self.cell.drafter or self.verify_run.drafter
        if chosen is not None:
            return chosen
        return DrafterKind.DFLASH if self.config.dp_size > 1 else DrafterKind.AUTOREGRESSIVE

    @property
    def examples(self) -> int:
        """Examples per backend in this plan's cell."""
        return self.verify_run.examples if self.cell_examples is None else self.cell_examples

    def config_for(self, name: str) -> RuntimeConfig:
        """The runtime config backend ``name`` is verified at: the tier's defaults, then
        its matrix entry's ``verify_defaults``, then the fields given, then the
        :attr:`cell`'s."""
        from speccheck.speculator.attention_setup import machine_platform

        return self.verify_run.config_for(name, self.tier, self.matrices.matrix,
                                          machine_platform()).model_copy(
                                              update=dict(self.cell.config))

    def task(self, name: str, examples: int | None = None, seed: int | None = None,
             claim_fused: bool = False) -> WorkerTask:
        """What a worker verifying backend ``name`` is given: the run unchanged, the
        run's examples and seed unless told (a shard's share), whether it audits the fused
        claim, and the example the run reproduces."""
        run = self.verify_run
        return WorkerTask(run=run, backend=name,
                          examples=self.examples if examples is None else examples,
                          seed=self.seed if seed is None else seed, claim_fused=claim_fused,
                          reproduce=self.reproduce, cell=dict(self.cell.config),
                          kv_layout=self.cell.kv_layout)

    def settings_for(self, name: str) -> VerifySettings:
        """The engine settings backend ``name``'s worker runs with
        (:meth:`VerifySettings.for_task` of :meth:`task`: what a test of "the settings a
        user gets" builds its :class:`~speccheck.checks.verify.engine.BackendVerifier`
        from). Imports torch."""
        from speccheck.checks.verify.engine import VerifySettings

        return VerifySettings.for_task(self.task(name), self.tier, self.matrices)

    def scale(self) -> HarnessScale:
        """The batch scale of this run on this tier."""
        return self.verify_run.scale(self.tier)

    def dcp_ranks(self, name: str) -> int:
        """How many DCP rank processes backend ``name`` is verified on: its config's
        ``dcp_world_size`` when that is above 1 and its builders hold a real DCP share
        (:func:`~speccheck.speculator.attention_setup.holds_dcp_share`), else 1 (one
        process; ``dcp_world_size`` is then a configuration value only). Imports torch."""
        from speccheck.speculator.attention_setup import builder_class, holds_dcp_share

        world = self.config_for(name).dcp_world_size
        entry = self.matrices.matrix.backend(name)
        if world == 1 or entry.implementation is None:
            return 1
        return world if holds_dcp_share(builder_class(name, self.matrices.matrix)) else 1

    def dcp_note(self, name: str) -> str | None:
        """How backend ``name`` runs decode context parallelism, in words, or ``None`` at
        ``dcp_world_size == 1``."""
        world = self.config_for(name).dcp_world_size
        if world == 1:
            return None
        if self.dcp_ranks(name) > 1:
            return (f"decode context parallelism on {world} real ranks, each holding its "
                    "interleaved share of the KV cache")
        if simulates_dcp(self.matrices.matrix.backend(name)):
            return (f"decode context parallelism of {world} ranks simulated in one process "
                    "(its builder holds every rank's local lengths; its attention merges the "
                    "ranks' partial results)")
        return (f"dcp_world_size={world} is a configuration value only (its builder holds no "
                "DCP share: one process attends the whole KV cache)")

    def run(
        self, progress: ProgressDisplay | None = None, worker: WorkerProcess | None = None
    ) -> VerifyReport:
        """Verify every backend: its single-rank configuration cells one after another in
        a worker process (one process takes task after task while it stays idle), or, with
        the DFlash drafter (:attr:`drafter`), on rank processes, or, for a backend
        with a real DCP share at ``dcp_world_size > 1`` (:meth:`dcp_ranks`), on that many
        DCP rank processes (:func:`~speccheck.checks.verify.dcp_ranks.verify_dcp`; the
        report's ``detail`` says how they ran; a backend without a share notes that
        ``dcp_world_size`` was a configuration value only). A failure's
        reproduce command is re-run in a fresh worker (the report says whether it failed the
        same way there); with ``audit_claims``, another worker runs the fused path of a
        backend the matrix does not allow to fuse. A worker that dies or hangs is a
        ``crashed`` report: nothing is raised for a backend's failure. ``progress`` shows
        one task per worker (none shown when ``None``). ``worker``: a process started
        before planning (the command line starts one so that its imports overlap the
        plan's), which the first single-rank run takes; closed here either way, with every
        idle worker. Raises :class:`VerifyInputError` when a worker rejects the
        ``reproduce`` example."""
        from speccheck.checks.triton_interpreter import interpret_triton_without_cuda

        # Rank processes take this process's environment, and import their kernels under
        # it: without CUDA it must say TRITON_INTERPRET=1 (workers set it themselves).
        interpret_triton_without_cuda()
        if progress is None:
            progress = Progress(console=Console(quiet=True), disable=True)
        notes: dict[str, str] = {}
        spare = [worker] if worker is not None else []
        """Idle worker processes, taken by the next single-rank run."""
        try:
            if self.drafter is DrafterKind.DFLASH:
                reports = [self._verify_dflash(name) for name in self.names]
            else:
                reports = [self._verify_cells(name, progress, notes, spare)
                           for name in self.names]
        finally:
            for unused in spare:
                unused.close()
        for report in reports:
            if report.status in (Status.PASSED, Status.FAILED) and not report.detail:
                report.detail = self.dcp_note(report.backend) or ""
        return VerifyReport(tuple(reports), self.tier, self.device, self.config,
                            self.matrices.path, notes)

    def cells(self, name: str) -> tuple[Cell, ...]:
        """The configuration cells backend ``name`` is verified in, base first: those its
        entry claims fused support for around :meth:`config_for`
        (:func:`~speccheck.checks.verify.cells.claimed_cells`), narrowed by the run's
        explicit options (:func:`~speccheck.checks.verify.cells.narrowed`); the base cell
        alone where the run asks for no cells, reproduces an example, runs data
        parallelism or the DFlash drafter, or the entry has no adapter. Imports torch."""
        from speccheck.speculator.attention_setup import builder_class, holds_dcp_share

        run, base = self.verify_run, (Cell(CellAxis.BASE),)
        entry = self.matrices.matrix.backend(name)
        if (not run.cells or self.reproduce is not None or self.drafter is DrafterKind.DFLASH
                or entry.implementation is None):
            return base
        holds = holds_dcp_share(builder_class(name, self.matrices.matrix))
        claimed = claimed_cells(entry, self.config_for(name), self.tier, holds)
        return narrowed(claimed, run.config, run.kv_layout, run.drafter)

    def for_cell(self, cell: Cell, examples: int, index: int = 0) -> VerifyPlan:
        """This plan narrowed to ``cell``, the ``index``-th of :meth:`cells`, with
        ``examples`` examples: its workers get the run unchanged, the cell in their task
        (:attr:`~speccheck.checks.verify.run.WorkerTask.cell`) and a seed of the cell's
        own (:attr:`seed`)."""
        return dataclasses.replace(self, config=self.config.model_copy(update=dict(cell.config)),
                                   cell=cell, cell_examples=examples, cell_index=index)

    def _verify_one(
        self, name: str, progress: ProgressDisplay, notes: dict[str, str],
        spare: list[WorkerProcess],
    ) -> BackendReport:
        """Backend ``name`` at this plan's one configuration: the DFlash drafter on real
        ranks where :attr:`drafter` says so (the data-parallel and DCP-blocks cells), the
        autoregressive one on real DCP ranks where :meth:`dcp_ranks` says so, else in
        worker processes."""
        if self.drafter is DrafterKind.DFLASH:
            return self._verify_dflash(name)
        if self.dcp_ranks(name) > 1:
            return self._verify_dcp_ranks(name)
        return self._verify_in_worker(name, progress, notes, spare)

    def _verify_cells(
        self, name: str, progress: ProgressDisplay, notes: dict[str, str],
        spare: list[WorkerProcess],
    ) -> BackendReport:
        """Backend ``name`` in each of its :meth:`cells`, the run's examples spread over
        those the machine can run (:func:`~speccheck.checks.verify.cells.example_shares`),
        each cell verified as a run of its own (:meth:`for_cell`); one report, their
        tallies merged and the worst status with its failure
        (:func:`~speccheck.checks.verify.report.merge_shards`), and the failures of every
        other failed cell run on ranks (whose reports hold no findings: the cells table
        gives each its reproduce command), listing every cell's verdict. A cell the
        machine cannot run, or that the example budget does not reach, is listed as not
        run, with the reason, as are, with ``fail_fast``, the cells after the first that
        fails or crashes. The single-rank cells run one after another in one
        worker process (``spare``: the idle ones), which pays its imports once."""
        import time

        from speccheck.checks.verify.report import merge_shards

        cells = self.cells(name)
        if len(cells) == 1:
            return self._verify_one(name, progress, notes, spare)
        started = time.perf_counter()
        shares = iter(example_shares(self.verify_run.examples,
                                     sum(cell.not_run is None for cell in cells)))
        plans = [None if cell.not_run is not None or not (examples := next(shares))
                 else self.for_cell(cell, examples, i) for i, cell in enumerate(cells)]
        reports: list[BackendReport] = []
        rows: list[CellReport] = []
        stopped_by: str | None = None
        for cell, plan in zip(cells, plans, strict=True):
            if plan is None or stopped_by is not None:
                why = cell.not_run or stopped_by or (
                    f"the {self.verify_run.examples} examples are spent on the cells before "
                    "it; raise --examples")
                rows.append(CellReport(cell.name, Status.SKIPPED, run=False, detail=why))
                continue
            report = plan._verify_one(name, progress, notes, spare)
            reports.append(report)
            said = [_data_parallel_note(report), report.detail or plan.dcp_note(name) or ""]
            if backend_failures(self.matrices.matrix.backend(name), plan.config_for(name)):
                said.append("fused not allowed here: the per-step path it falls back to "
                             "is verified")
            rows.append(CellReport(cell.name, report.status, examples=report.examples,
                                   detail="; ".join(part for part in said if part),
                                   reproduce=report.reproduce))
            if self.verify_run.fail_fast and report.status in (Status.FAILED, Status.CRASHED):
                stopped_by = f"fail-fast: the run stopped at the {cell.name} cell's failure"
        merged = merge_shards(reports, time.perf_counter() - started)
        merged.failures += [failure for report in reports if not report.findings
                            for failure in report.failures if failure not in merged.failures]
        worst = next(r for r in reports if r.status is merged.status)
        merged.reproduced, merged.cells = worst.reproduced, rows
        return merged

    def shards(self, name: str) -> int:
        """How many workers verify backend ``name`` at once: :attr:`jobs` (at most one per
        example) for a single-rank run drawing its own examples, else 1. An automatic
        ``--jobs`` is held to what the device holds at this configuration's dtype
        (:func:`~speccheck.checks.verify.scale.memory_jobs`: an fp32 cell's workers need
        twice the memory, and so do a cell's with twice the query or KV heads)."""
        if (self.reproduce is not None or self.drafter is DrafterKind.DFLASH
                or self.dcp_ranks(name) > 1):
            return 1
        jobs = min(self.jobs, self.examples)
        if self.verify_run.jobs is None and self.tier is Tier.GPU:
            config = self.config_for(name)
            jobs = min(jobs, memory_jobs(_device_gib(self.tier), config.dtype,
                                         config.num_heads * config.head_size,
                                         config.num_kv_heads * config.head_size))
        return jobs

    def shard_tasks(self, name: str) -> list[WorkerTask]:
        """The :meth:`task` of each of backend ``name``'s :meth:`shards` workers: the
        examples split as evenly as they go, worker ``i`` drawing from ``seed + i``."""
        count, examples, seed = self.shards(name), self.examples, self.seed
        return [self.task(name, examples // count + (i < examples % count), seed + i)
                for i in range(count)]

    def shard_settings(self, name: str) -> list[VerifySettings]:
        """The engine settings of each worker of backend ``name`` (:meth:`shard_tasks`):
        what a test of "the settings a user gets" runs, one engine per worker. Imports
        torch."""
        from speccheck.checks.verify.engine import VerifySettings

        return [VerifySettings.for_task(task, self.tier, self.matrices)
                for task in self.shard_tasks(name)]

    def _verify_in_worker(
        self, name: str, progress: ProgressDisplay, notes: dict[str, str],
        spare: list[WorkerProcess],
    ) -> BackendReport:
        from speccheck.checks.verify.examples import BadExample
        from speccheck.checks.verify.report import ClaimAudit
        from speccheck.checks.verify.runner import confirm_reproduce, run_worker
        from speccheck.checks.verify.worker_process import WorkerProcess

        task = self.task(name)
        worker = spare.pop() if spare else WorkerProcess()
        try:
            if self.shards(name) > 1:
                report = self._verify_in_shards(name, progress, worker)
            else:
                report = run_worker(task, progress, self.tier, worker=worker)
        except BadExample as exc:
            raise VerifyInputError(str(exc)) from None
        finally:
            if worker.idle:
                spare.append(worker)
            else:
                worker.close()
        why = confirm_reproduce(task, report, progress, self.tier)
        if why is not None:
            notes[name] = why
        if (self.verify_run.audit_claims and not report.fused_allowed
                and report.status in (Status.PASSED, Status.FAILED)):
            audited = run_worker(self.task(name, claim_fused=True), progress, self.tier,
                                 label=f"{name} audit")
            report.claim_audit = ClaimAudit(audited.status, audited.examples,
                                            audited.failures, audited.detail)
        return report

    def _verify_in_shards(
        self, name: str, progress: ProgressDisplay, first: WorkerProcess,
    ) -> BackendReport:
        """Backend ``name`` in :meth:`shards` workers at once (:meth:`shard_tasks`), their
        reports merged; the first shard runs in ``first`` (left to the caller), the others
        in fresh processes. Each worker holds its own drafters, graphs and KV caches on the
        device."""
        import time
        from concurrent.futures import ThreadPoolExecutor

        from speccheck.checks.verify.report import merge_shards
        from speccheck.checks.verify.runner import run_worker

        tasks = self.shard_tasks(name)
        count = len(tasks)

        def shard(i: int) -> BackendReport:
            return run_worker(tasks[i], progress, self.tier, label=f"{name} [{i + 1}/{count}]",
                              worker=first if i == 0 else None)

        started = time.perf_counter()
        with ThreadPoolExecutor(count) as pool:
            reports = list(pool.map(shard, range(count)))
        return merge_shards(reports, time.perf_counter() - started)

    def _verify_dcp_ranks(self, name: str) -> BackendReport:
        """Backend ``name`` on :meth:`dcp_ranks` real DCP ranks (their own processes), on
        examples drawn here, or on the ``reproduce`` example alone; with ``audit_claims``
        and fusing not allowed, again with the fused path claimed, on the same examples.
        The ranks get the engine settings of their :meth:`task` (pickled, as every rank's
        arguments are)."""
        from speccheck.checks.verify.dcp_ranks import verify_dcp
        from speccheck.checks.verify.engine import VerifySettings
        from speccheck.checks.verify.examples import decode_example
        from speccheck.checks.verify.report import ClaimAudit

        examples = None if self.reproduce is None else [decode_example(self.reproduce)]
        world, timeout = self.dcp_ranks(name), self.verify_run.example_timeout
        report = verify_dcp(self.settings_for(name), world, examples, example_timeout=timeout,
                            reproduce_prefix=self.task(name).reproduce_prefix)
        if (self.verify_run.audit_claims and not report.fused_allowed
                and report.status in (Status.PASSED, Status.FAILED)):
            audit = self.task(name, claim_fused=True)
            audited = verify_dcp(VerifySettings.for_task(audit, self.tier, self.matrices), world,
                                 examples, example_timeout=timeout,
                                 reproduce_prefix=audit.reproduce_prefix)
            report.claim_audit = ClaimAudit(audited.status, audited.examples,
                                            audited.failures, audited.detail)
        return report

    def _verify_dflash(self, name: str) -> BackendReport:
        """The DFlash drafter on real ranks (their own processes), in eager mode and, with
        CUDA, in FULL mode: on :meth:`dcp_ranks` DCP ranks drafting the same batches where
        there are more than one, else on ``dp_size`` data-parallel ranks, each with a
        different real batch size. A failed run's ``reproduce`` is the command that draws
        its rounds again (:meth:`_dflash_command`)."""
        from speccheck.checks.verify.data_parallel import verify_dcp_blocks, verify_dp
        from speccheck.checks.verify.one_line import RaisedError
        from speccheck.checks.verify.raise_site import site_of
        from speccheck.speculator.dp_launch import RankError, RankFailed

        try:
            config = self.config_for(name)
            if self.dcp_ranks(name) > 1:
                result = verify_dcp_blocks(name, config, examples=self.examples,
                                           seed=self.seed, matrices=self.matrices,
                                           kv_layout=self.verify_run.kv_layout)
            else:
                result = verify_dp(name, config, config.dp_size, examples=self.examples,
                                   seed=self.seed, matrices=self.matrices,
                                   kv_layout=self.verify_run.kv_layout)
            report = result.to_report()
        except RankError as exc:
            logger.info("%s", exc)  # with a raising rank's traceback
            raised = RaisedError(str(exc).splitlines()[0],
                                 site_of(exc.frames) if isinstance(exc, RankFailed) else "")
            return BackendReport(name, self.tier, Status.CRASHED, detail=raised.summary,
                                 raised_at=raised.site)
        if report.status is Status.FAILED:
            report.reproduce = self._dflash_command(name)
        return report

    def _dflash_command(self, name: str) -> str:
        """The command that draws this plan's DFlash rounds again: the run's options at this
        cell's seed and examples, with the cell's fields (and drafter) and no other cell."""
        run = self.verify_run.model_copy(update={"seed": self.seed})
        cell = f" {runtime_flags(self.cell.config)} --no-cells" if self.cell.config else ""
        if self.cell.drafter is not None:
            cell += f" --drafter {self.cell.drafter.value}"
        return f"{run.reproduce_prefix(name)}{cell} --examples {self.examples}"


def checked_run(
    backend: VerifyRun | str | type[AttentionMetadataBuilder[Any]] = "reference",
    **options: Any,
) -> VerifyRun:
    """The :class:`~speccheck.checks.verify.run.VerifyRun` of :func:`verify`'s arguments
    (``backend`` itself when it is one, then with no ``options``): how the command, the
    API and the pytest plugin each build theirs. A builder class names its matrix entry
    (see :func:`verify`). Raises :class:`VerifyInputError` (one line for every problem) or
    :class:`~speccheck.contract.matrix_loader.MatrixError`."""
    if isinstance(backend, VerifyRun):
        if options:
            raise VerifyInputError(f"give a VerifyRun or options, not both; got {sorted(options)}")
        return backend
    name = backend if isinstance(backend, str) else "reference"
    try:
        run = VerifyRun(backend=name, **options)
    except ValidationError as exc:
        raise VerifyInputError("; ".join(_problem(error) for error in exc.errors())) from None
    if isinstance(backend, str):
        return run
    return run.model_copy(update={"backend": _declared_backend(backend,
                                                               MatrixContext.load(run.matrix))})


def _problem(error: ErrorDetails) -> str:
    """One rejected field in words: ``FIELD: WHY`` for a field's own check, ``FIELD should
    be ..., got VALUE`` for a bound or a type."""
    where = ".".join(map(str, error["loc"]))
    if error["type"] == "value_error":
        why = str(error.get("ctx", {}).get("error", error["msg"]))
        return f"{where}: {why}" if where else why
    if error["type"] == "extra_forbidden":
        return (f"{where}: not an option of a verification; options: "
                f"{', '.join(VerifyRun.model_fields)}")
    return bound_problem(error)


def plan_verification(
    backend: VerifyRun | str | type[AttentionMetadataBuilder[Any]] = "reference",
    **options: Any,
) -> VerifyPlan:
    """Check the input of a verification and settle what it runs; see :func:`verify` for
    the arguments. Raises :class:`VerifyInputError` or
    :class:`~speccheck.contract.matrix_loader.MatrixError`; starts no process."""
    run = checked_run(backend, **options)
    reproduce = None
    if run.reproduce is not None:
        from speccheck.checks.verify.examples import read_reproduce

        try:
            reproduce = read_reproduce(run.reproduce)
        except ValueError as exc:
            raise VerifyInputError(str(exc)) from None
    from speccheck.speculator.attention_setup import machine_platform

    tier, device = machine_tier()
    effective = run.tier_config(tier, machine_platform())
    matrices = MatrixContext.load(run.matrix)
    names = _named_backends(run.backend, matrices)
    _preflight(names, matrices)
    jobs = run.jobs or default_jobs(tier, run.examples, os.cpu_count() or 1, _device_gib(tier))
    plan = VerifyPlan(run, names, effective, matrices, tier, device, reproduce, jobs)
    _check_dcp(plan)
    if reproduce is not None:
        _check_reproduce(reproduce, plan)
    return plan


def verify(
    backend: VerifyRun | str | type[AttentionMetadataBuilder[Any]] = "reference",
    **options: Any,
) -> VerifyReport:
    """Verify ``backend`` as ``speccheck verify`` does, each backend in a worker process of
    its own, and return the report (raising nothing for a failed check or a crash: read
    :attr:`VerifyReport.passed` or :attr:`VerifyReport.exit_code`).

    ``backend`` is a :class:`~speccheck.checks.verify.run.VerifyRun` (then no ``options``),
    or what its ``backend`` field takes, with ``options`` its other fields by name:

    - ``backend``: a backend name from the matrix, ``"all"``, or a builder class. A class
      is verified under the matrix entry named by its ``backend_name``, and that entry's
      ``implementation`` must name this very class: the worker process imports the builder
      by that ``module:Class`` path (so the class cannot live in ``__main__`` or inside a
      function), and a failure's reproduce command runs what the entry names.
    - ``config``: runtime fields that override the tier's defaults
      (:data:`~speccheck.checks.verify.scale.TIER_DEFAULTS`)
      and the backend's ``verify_defaults`` (its matrix entry), as a mapping or a
      :class:`RuntimeConfig` (its explicitly set fields count); only
      :data:`VERIFY_FIELDS`: platform, compute capability and graph mode come from the
      machine.
    - ``matrix``: a matrix file, verified alone; ``None``: the shipped matrix merged with
      the installed plug-ins' fragments (``speccheck.backends`` entry points).
    - ``examples`` per backend (50), hypothesis ``seed`` (0); ``steps``: the draft step
      counts (K) to draw from, by default ``num_speculative_steps`` when ``config`` gives
      it, else 2..8.
    - ``capture_sizes``: padded request counts to capture graphs for (and pad eager runs
      to); the largest bounds an example's requests. ``max_new_tokens``: most tokens a
      request brings to the first pass. ``None``: the tier's (:data:`~speccheck.checks.
      verify.scale.TIER_SCALE`: up to 64 requests of 16 new tokens on the GPU, 8 of 3 on
      the CPU).
    - ``reproduce``: run exactly this example (a blob from a failure's reproduce command,
      or ``@FILE`` for one kept in a file); it must fit the run's limits, and cannot be
      combined with ``dp_size > 1`` or the DFlash drafter.
    - ``drafter``: ``"dflash"`` runs the DFlash drafter on real ranks, the run's config
      alone (data-parallel ranks at ``dp_size > 1``, the DCP group's for a backend holding
      a share at ``dcp_world_size > 1``, else one); ``None``: DFlash at ``dp_size > 1``,
      else the autoregressive drafter, whose cells include the DFlash ones.
    - ``audit_claims``: for a backend the matrix does not allow to fuse under the config,
      also run the fused path and report whether the claim is too strict or confirmed.
    - ``fail_fast``: end each worker's search at its first failure (False: it searches on
      with the examples left for failures of checks, and ``step_metadata`` fields, not
      failed yet; each failure gets its own minimal example and reproduce command).
    - ``example_timeout``: seconds without progress before a worker counts as hung (300).
    - ``jobs``: worker processes per backend (at most :data:`~speccheck.checks.verify.run.
      MAX_JOBS`), each running its share of ``examples`` from a seed of its own
      (``seed + i``) on the same device, their reports merged (the worst status wins, with
      its failure and reproduce command). Each holds its own drafters, graphs and KV
      caches: device memory grows with it. Runs on DP or DCP ranks, and ``reproduce``,
      take one. ``None``: :func:`~speccheck.checks.verify.scale.default_jobs` (on the GPU
      tier two where each gets 50 examples, two CPU cores and 32 GiB of the device; one on
      the CPU tier). ``jobs=1`` draws every example from ``seed`` alone.
    - ``shrink_seconds``: how long each worker may shrink a failure to a smaller example
      (the report keeps the smallest found by then); finding it does not depend on this.
    - ``json_path``, ``junit_path``: where ``speccheck verify`` writes its reports; this
      function returns the report and writes nothing.

    Bad input raises :class:`VerifyInputError` or
    :class:`~speccheck.contract.matrix_loader.MatrixError` before any worker starts.
    """
    return plan_verification(backend, **options).run()


def _check_dcp(plan: VerifyPlan) -> None:
    """A backend verified on real DCP ranks (:meth:`VerifyPlan.dcp_ranks`) needs at most
    :data:`MAX_DCP_RANKS` of them, and data parallelism off (DP and DCP together are not
    verified)."""
    for name in plan.names:
        config = plan.config_for(name)
        if plan.dcp_ranks(name) == 1:
            continue
        if config.dcp_world_size > MAX_DCP_RANKS:
            raise VerifyInputError(
                f"--dcp-world-size {config.dcp_world_size}: {name} is verified on one process "
                f"per DCP rank, at most {MAX_DCP_RANKS}")
        if config.dp_size > 1:
            raise VerifyInputError(
                f"--dcp-world-size {config.dcp_world_size} runs {name} on real DCP ranks, which "
                f"cannot be combined with --dp-size {config.dp_size} (data parallelism runs "
                "the DFlash drafter without DCP)")


def _check_reproduce(blob: str, plan: VerifyPlan) -> None:
    """A ``reproduce`` blob must be an example that fits the run's limits (the engine's
    own check, ``BackendVerifier.example_problem``, on the settings the worker gets), in a
    single-rank run."""
    import torch

    from speccheck.checks.verify.engine import BackendVerifier
    from speccheck.checks.verify.examples import decode_example

    name = plan.names[0]
    if plan.drafter is DrafterKind.DFLASH:
        raise VerifyInputError("--reproduce runs one example in one worker; it cannot be "
                               "combined with --dp-size or --drafter dflash (their "
                               "reproduce commands draw their rounds again)")
    try:
        example = decode_example(blob)
    except ValueError as exc:
        raise VerifyInputError(str(exc)) from None
    device = torch.device("cuda" if plan.tier is Tier.GPU else "cpu")
    problem = BackendVerifier(plan.settings_for(name), device).example_problem(example)
    if problem is not None:
        raise VerifyInputError(problem)


def backend_runtime_config(
    tier: Tier, matrix: Matrix, name: str, overrides: Mapping[str, object]
) -> RuntimeConfig:
    """The runtime config backend ``name`` is verified at on ``tier`` (on this machine's
    platform): the tier's defaults, then its entry's ``verify_defaults`` in ``matrix``,
    then ``overrides`` (runtime fields, checked as a :class:`VerifyRun` checks them)."""
    from speccheck.speculator.attention_setup import machine_platform

    return checked_run(config=overrides).config_for(name, tier, matrix, machine_platform())


def _preflight(names: Sequence[str], matrices: MatrixContext) -> None:
    """Before any worker starts, each named entry's fragment
    (:func:`~speccheck.checks.verify.preflight.fragment_mistake`: the class imports and is
    a builder, its ``backend_name`` and ``refreshed_fields`` agree with the code). The
    first mistake is one line, ``PATH:LINE: backend 'NAME', field 'FIELD': ...``, at the
    field to change (the traceback of a failed import is logged at debug level:
    ``speccheck -v``)."""
    from speccheck.checks.verify.preflight import fragment_mistake
    from speccheck.contract.plugins import located_matrix_files

    for name in names:
        mistake = fragment_mistake(matrices.matrix.backend(name), matrices.matrix)
        if mistake is None:
            continue
        (located,) = [part for part in located_matrix_files(matrices.path)
                      if name in part.matrix.names]
        raise VerifyInputError(located.problem(name, mistake.field, mistake.message).render())


def _named_backends(backend: str, matrices: MatrixContext) -> tuple[str, ...]:
    if backend == "all":
        return matrices.matrix.names
    if backend not in matrices.matrix.names:
        raise VerifyInputError(
            f"unknown backend {backend!r}; valid: {', '.join(matrices.matrix.names)}, all")
    return (backend,)


def _declared_backend(cls: object, matrices: MatrixContext) -> str:
    """The entry name of builder class ``cls``: its ``backend_name``, whose entry must name
    ``cls`` itself as its implementation (see :func:`verify`)."""
    from speccheck.contract.builder import AttentionMetadataBuilder
    from speccheck.speculator.attention_setup import builder_class

    if not (isinstance(cls, type) and issubclass(cls, AttentionMetadataBuilder)):
        raise VerifyInputError(f"backend must be a backend name or an AttentionMetadataBuilder "
                               f"subclass, got {cls!r}")
    name = getattr(cls, "backend_name", None)
    where = implementation_path(cls)
    if not isinstance(name, str) or name not in matrices.matrix.names:
        source = matrices.path or "the shipped matrix and the installed plug-ins"
        raise VerifyInputError(
            f"{cls.__qualname__}.backend_name is {name!r}, which no entry of {source} declares; "
            f"valid: {', '.join(matrices.matrix.names)}")
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise VerifyInputError(
            f"{where} cannot be imported by a worker process, which imports builders by "
            "'module:Class': define it at the top level of an importable module and name "
            f"that path in the matrix entry {name!r} (implementation)")
    declared = matrices.matrix.backend(name).implementation
    try:
        found = builder_class(name, matrices.matrix)
    except Exception as exc:  # the adapter's own import: any failure is reported as input
        raise VerifyInputError(f"the matrix entry {name!r} names implementation {declared!r}, "
                               f"which cannot be loaded: {type(exc).__name__}: {exc}") from None
    if found is not cls:
        raise VerifyInputError(
            f"the matrix entry {name!r} names implementation {declared!r}, not {where}; the "
            "worker process runs the class the entry names, so point its implementation at "
            f"{where} (or verify by name)")
    return name
