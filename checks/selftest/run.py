"""``speccheck selftest``: the verifier must catch every mutant with the check meant for it,
and must pass the correct control builder."""

from __future__ import annotations

import dataclasses
import enum
import logging
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from speccheck.checks.api import backend_runtime_config, verify
from speccheck.checks.device_memory import release_device_memory
from speccheck.checks.selftest import dcp_mutants
from speccheck.checks.selftest.latent_mutants import (
    DCP_LOCAL_FIELD,
    StaleDcpLocalLens,
    claiming_matrix,
)
from speccheck.checks.selftest.mutants import (
    DERIVED_FIELD,
    MUTANTS,
    DerivedBuilder,
    Mutant,
    declaring_matrix,
    naming_matrix,
)
from speccheck.checks.selftest.dflash_mutants import DFLASH_MUTANTS
from speccheck.checks.selftest.process_mutants import PROCESS_MUTANTS, ProcessMutant
from speccheck.checks.selftest.swa_mutants import SWA_MUTANTS, SWAMutant
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.dcp_ranks import verify_dcp
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.one_line import exception_line
from speccheck.checks.verify.report import BackendReport, CheckTally, Failure
from speccheck.checks.verify.scale import DEFAULT_SHRINK_SECONDS, TIER_SCALE
from speccheck.checks.verify.vocabulary import Check, Status, Tier
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import Matrix
from speccheck.speculator.attention_setup import machine_platform, unrunnable_reason
from speccheck.speculator.dp_launch import RankFailed, rank_device, run_ranks

logger = logging.getLogger(__name__)


class Outcome(enum.StrEnum):
    """What the self-test found for one builder."""

    CAUGHT = "caught"
    """A mutant failed the check meant for it (the control: it passed)."""
    MISSED = "missed"
    """A mutant got through, or was caught by another check (the control: it failed)."""
    SKIPPED = "skipped"
    """This machine cannot run the mutant's backend (no CUDA, no kernel package)."""
    ERROR = "error"
    """The row's verification raised (the machine ran out of memory, say): no verdict on
    the builder either way."""


@dataclass
class SelftestResult:
    """One row's result, as ``speccheck selftest --json`` writes it."""

    name: str
    expected_check: str
    outcome: Outcome
    detail: str
    recreates: str
    failures: list[Failure] = field(default_factory=list)
    """Every check its verification failed, on :attr:`minimal_example` (none for a pass, a
    skip or a crash)."""
    minimal_example: dict[str, Any] | None = None
    """The (shrunk) example the failures were found on, as a report holds it
    (:func:`~speccheck.checks.verify.examples.example_from_json` reads it): what a
    reproduce command re-runs."""
    checks: dict[Check, CheckTally] = field(default_factory=dict)
    """How often each check passed, failed, ... over its verification's examples (none for
    a skip or a crash)."""


def settings_at_defaults(
    backend: str,
    builder: type[AttentionMetadataBuilder],  # type: ignore[type-arg]
    device: torch.device,
    matrix: Matrix,
    *,
    config_changes: Mapping[str, object] | None = None,
    **settings_changes: Any,
) -> VerifySettings:
    """The settings ``speccheck verify --backend BACKEND`` uses by default on ``device``'s
    tier, with ``builder`` swapped in, under ``matrix`` (the fp32 reference under the
    shipped one): the tier's runtime config, then the entry's ``verify_defaults``, then
    ``config_changes``; the tier's batch scale, draft step counts and example count, unless
    ``settings_changes`` replaces a :class:`VerifySettings` field (a mechanism test pinning
    one example, say). The search ends at its first failure (``fail_fast``): what catches
    a mutant is that failure, which the default search finds the same way before it
    searches on."""
    tier = Tier.GPU if device.type == "cuda" else Tier.CPU
    config = backend_runtime_config(tier, matrix, backend, config_changes or {})
    scale = TIER_SCALE[tier]
    settings = VerifySettings(backend, config, capture_sizes=scale.capture_sizes,
                              max_new_tokens=scale.max_new_tokens,
                              builder_overrides=((backend, builder),), fail_fast=True,
                              matrices=MatrixContext(matrix, None, load_matrix(None)))
    return dataclasses.replace(settings, **settings_changes)


def verify_at_defaults(
    backend: str,
    builder: type[AttentionMetadataBuilder],  # type: ignore[type-arg]
    device: torch.device,
    matrix: Matrix,
    *,
    config_changes: Mapping[str, object] | None = None,
    **settings_changes: Any,
) -> BackendReport:
    """Verify ``backend`` with ``builder`` swapped in, in this process, at
    :func:`settings_at_defaults`. With no changes, a known-bad builder caught here is
    caught by the search a user gets."""
    settings = settings_at_defaults(backend, builder, device, matrix,
                                    config_changes=config_changes, **settings_changes)
    report = BackendReport(backend, Tier.GPU if device.type == "cuda" else Tier.CPU,
                           Status.PASSED)
    BackendVerifier(settings, device).run(report, lambda i, e: None)
    release_device_memory(device)  # the self-test runs many verifiers in one process
    return report


def verify_dcp_at_defaults(
    backend: str,
    builder: type[AttentionMetadataBuilder],  # type: ignore[type-arg]
    device: torch.device,
    matrix: Matrix,
    world: int = 2,
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
) -> BackendReport:
    """Verify ``backend`` with ``builder`` swapped in on ``world`` real DCP ranks, as
    ``speccheck verify --backend BACKEND --dcp-world-size WORLD`` does by default
    (:func:`settings_at_defaults` at that DCP size; the examples drawn in this process)."""
    settings = settings_at_defaults(backend, builder, device, matrix,
                                    config_changes={"dcp_world_size": world},
                                    shrink_seconds=shrink_seconds)
    return verify_dcp(settings, world)


def verify_builder(
    builder: type[AttentionMetadataBuilder],  # type: ignore[type-arg]
    device: torch.device,
    *,
    seed: int = 0,
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
    declares: tuple[str, ...] = (DERIVED_FIELD,),
    rebuilds: bool = False,
) -> BackendReport:
    """:func:`verify_at_defaults` of the reference backend with ``builder`` swapped in,
    under a matrix whose ``reference`` entry declares ``declares`` as refreshed (and
    ``refresh_rebuilds`` as ``rebuilds``)."""
    matrix = declaring_matrix(load_matrix(None), declares, rebuilds=rebuilds)
    return verify_at_defaults("reference", builder, device, matrix, seed=seed,
                              shrink_seconds=shrink_seconds)


def mutant_result(name: str, check: str, recreates: str, report: BackendReport,
                  names: str) -> SelftestResult:
    """Caught: a failure of ``check`` whose diagnosis mentions ``names`` or whose field is
    ``names``. Otherwise missed, unless the verification crashed (a rank process died, say)
    or was skipped: that says nothing of the builder, so it is an error (or skipped) with
    the report's detail, never a miss reading "not caught"."""
    hits = [f for f in report.failures
            if f.check == check and (names in f.diagnosis or f.field == names)]
    if not hits and report.status in (Status.CRASHED, Status.SKIPPED):
        crashed = report.status is Status.CRASHED
        return SelftestResult(
            name, check, Outcome.ERROR if crashed else Outcome.SKIPPED,
            f"the verification crashed: {report.detail}" if crashed else report.detail,
            recreates, report.failures, report.minimal_example, report.checks)
    detail = hits[0].diagnosis if hits else (
        "not caught" if not report.failures else
        f"caught by {report.failures[0].check} instead: {report.failures[0].diagnosis}")
    return SelftestResult(name, check, Outcome.CAUGHT if hits else Outcome.MISSED, detail,
                          recreates, report.failures, report.minimal_example, report.checks)


def verify_process_mutant(mutant: ProcessMutant,
                          shrink_seconds: float = DEFAULT_SHRINK_SECONDS) -> SelftestResult:
    """Verify ``mutant`` as ``speccheck verify --backend B --matrix M`` does by default,
    under the shipped matrix naming it (written to a temporary file), in worker processes:
    caught when its check fails naming :attr:`~ProcessMutant.names`, or where
    :meth:`~ProcessMutant.caught_by_crash`, when a worker crashes; skipped, with the reason,
    where this machine cannot run the backend."""
    shipped = load_matrix(None)
    reason = unrunnable_reason(mutant.backend, machine_platform(), shipped)
    if reason is None:
        with tempfile.TemporaryDirectory(prefix="speccheck-selftest-") as folder:
            path = Path(folder) / "matrix.yaml"
            matrix = naming_matrix(shipped, mutant.builder)
            path.write_text(yaml.safe_dump(matrix.model_dump(mode="json", exclude_none=True),
                                           sort_keys=False))
            report = verify(mutant.builder, matrix=path,
                            shrink_seconds=shrink_seconds).backend(mutant.backend)
        if report.status is Status.SKIPPED:
            reason = report.detail
        elif report.status is Status.CRASHED:
            outcome = Outcome.CAUGHT if mutant.caught_by_crash(report.detail) else Outcome.MISSED
            return SelftestResult(mutant.name, mutant.check, outcome,
                                  f"crashed: {report.detail}", mutant.recreates)
        else:
            return mutant_result(mutant.name, mutant.check, mutant.recreates, report, mutant.names)
    return SelftestResult(mutant.name, mutant.check, Outcome.SKIPPED, reason, mutant.recreates)


CONTROL = "control"
"""The control row's name in :func:`selftest_rows` (its result is named in full)."""
CONTROL_RESULT = "control (correct builder)"
"""The name the control row's result carries."""
MLA_STALE_DCP_LOCAL_LENS = "mla_stale_dcp_local_lens"
"""The row (and result) of the triton_mla builder that keeps step 1's DCP-local lengths."""


def stale_dcp_local_lens_name(backend: str) -> str:
    """The row (and result) of ``backend``'s builder that keeps the DCP-local lengths on two
    real DCP ranks."""
    return f"{backend}_stale_dcp_local_lens"


ROW_PROCESS_TIMEOUT_S = 3600.0
"""How long an isolated row's process may run (start-up, verification and shrinking) before
it is ended and the row is an error."""


@dataclass(frozen=True)
class SelftestRow:
    """One row of the self-test: the name ``speccheck selftest --only`` selects it by (the
    name its result carries, but for the control's) and the verification that makes its
    result."""

    name: str
    backend: str
    """The backend whose builder the row's known-bad builder (or the control) derives from:
    the status of that backend lists the row."""
    run: Callable[[], SelftestResult]
    isolated: bool = False
    """Run :attr:`run` in a process of its own (forked from the fork server, the rows
    rebuilt there at :attr:`shrink_seconds`): set for rows whose verification runs in the
    calling process on a CUDA device, where a known-bad builder can leave state that no
    collection frees: a failed graph capture keeps its memory pool reserved until the
    process exits (torch's ``CUDAGraph.reset`` releases a pool only after a capture that
    ended), an illegal memory access ends the CUDA context. Neither may reach the next
    row (or the DCP ranks a later row starts on the same device)."""
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS

    def result(self) -> SelftestResult:
        """:attr:`run`'s result (in a process of its own where :attr:`isolated`); where
        the row's verification raises, or its process dies or outlives
        :data:`ROW_PROCESS_TIMEOUT_S`, an :attr:`Outcome.ERROR` result naming the cause in
        one line (its traceback logged at debug level), so one row that cannot run ends
        neither the self-test nor a status run."""
        try:
            if self.isolated:
                return run_ranks(_run_isolated_row, 1, (self.name, self.shrink_seconds),
                                 timeout_s=ROW_PROCESS_TIMEOUT_S)[0]
            return self.run()
        except Exception as exc:  # noqa: BLE001 - any row error is that row's result
            cause = (f"{exc.exc_type}: {exc.message}" if isinstance(exc, RankFailed)
                     else exception_line(exc))
            detail = f"raised {(cause.splitlines() or [''])[0]}".rstrip(": ")
            logger.warning("self-test row %s %s", self.name, detail)
            logger.debug("self-test row %s", self.name, exc_info=True)
            return SelftestResult(self.name, "-", Outcome.ERROR, detail, "")


def _run_isolated_row(rank: int, world: int, name: str, shrink_seconds: float) -> SelftestResult:
    """Body of an :attr:`~SelftestRow.isolated` row's process: the row named ``name`` of
    this process's device's rows, run here."""
    device = rank_device(rank)
    for row in selftest_rows(device, shrink_seconds):
        if row.name == name:
            return row.run()
    raise UnknownSelftestRow(f"no self-test row {name!r} on {device}")


class UnknownSelftestRow(ValueError):
    """``--only`` named no row; ``str()`` is one line listing the rows."""


def selftest_rows(device: torch.device,
                  shrink_seconds: float = DEFAULT_SHRINK_SECONDS) -> list[SelftestRow]:
    """The self-test's rows in order: the control, which must pass; every known-bad builder,
    which must be caught by its check: the reference-based mutants, the sparse_swa ones
    (under the shipped entry), the triton_mla builder that keeps the DCP-local lengths of
    step 1 (under the matrix its author would ship, at DCP 2, one process), and the
    reference and triton_attn builders that keep them on two real DCP ranks
    (:data:`~speccheck.checks.selftest.dcp_mutants.STALE_DCP_BUILDERS`, under the matrix
    their author would ship); the builders only a DFlash drafter exposes
    (:data:`~speccheck.checks.selftest.dflash_mutants.DFLASH_MUTANTS`, in verify's worker
    and rank processes); then the CUDA-only kernel backends'
    (:data:`~speccheck.checks.selftest.process_mutants.PROCESS_MUTANTS`, in verify's
    worker processes; skipped where the machine cannot run them). Nothing runs until a
    row's ``run`` is called; on CUDA, the rows whose verification runs in the calling
    process are :attr:`~SelftestRow.isolated`. ``shrink_seconds``: each run's budget for
    shrinking its failure (whether it is caught does not depend on it)."""
    gpu = device.type == "cuda"
    shipped = load_matrix(None)

    def control() -> SelftestResult:
        report = verify_builder(DerivedBuilder, device, shrink_seconds=shrink_seconds)
        passed = report.status is Status.PASSED
        return SelftestResult(
            CONTROL_RESULT, "-", Outcome.CAUGHT if passed else Outcome.MISSED,
            "passed" if passed else
            f"{report.failures[0].check}: {report.failures[0].diagnosis}",
            "none: must pass", report.failures, report.minimal_example, report.checks)

    def reference_mutant(mutant: Mutant) -> SelftestResult:
        check, phrase = mutant.expected(gpu)
        report = verify_builder(mutant.builder, device, declares=mutant.declares,
                                rebuilds=mutant.rebuilds, shrink_seconds=shrink_seconds)
        return mutant_result(mutant.name, check, mutant.recreates, report, phrase)

    def swa_mutant(swa: SWAMutant) -> SelftestResult:
        report = verify_at_defaults("sparse_swa", swa.builder, device, shipped,
                                    shrink_seconds=shrink_seconds)
        return mutant_result(swa.name, swa.check, swa.recreates, report, swa.names)

    def mla_stale_dcp_local_lens() -> SelftestResult:
        report = verify_at_defaults("triton_mla", StaleDcpLocalLens, device,
                                    claiming_matrix(shipped),
                                    config_changes={"dcp_world_size": 2},
                                    shrink_seconds=shrink_seconds)
        return mutant_result(
            MLA_STALE_DCP_LOCAL_LENS, Check.STEP_METADATA,
            "DCP-local lengths derived at build and not advanced between fused draft steps "
            "(vLLM's Triton MLA refresh under DCP)", report,
            f"triton_mla.metadata.{DCP_LOCAL_FIELD}")

    def stale_dcp_local_lens(backend: str) -> SelftestResult:
        report = verify_dcp_at_defaults(backend, dcp_mutants.STALE_DCP_BUILDERS[backend],
                                        device, dcp_mutants.claiming_matrix(shipped, backend),
                                        shrink_seconds=shrink_seconds)
        return mutant_result(
            stale_dcp_local_lens_name(backend), Check.STEP_METADATA,
            "DCP-local lengths not advanced between fused draft steps while the local slots "
            "are (vLLM's Triton MLA refresh under DCP), on two real DCP ranks", report,
            f"{backend}.metadata.{dcp_mutants.DCP_LOCAL_FIELD}")

    def in_process(name: str, backend: str, run: Callable[[], SelftestResult]) -> SelftestRow:
        return SelftestRow(name, backend, run, isolated=gpu, shrink_seconds=shrink_seconds)

    return [
        in_process(CONTROL, "reference", control),
        *(in_process(m.name, "reference", partial(reference_mutant, m)) for m in MUTANTS),
        *(in_process(m.name, "sparse_swa", partial(swa_mutant, m)) for m in SWA_MUTANTS),
        in_process(MLA_STALE_DCP_LOCAL_LENS, "triton_mla", mla_stale_dcp_local_lens),
        *(SelftestRow(stale_dcp_local_lens_name(backend), backend,
                      partial(stale_dcp_local_lens, backend))
          for backend in dcp_mutants.STALE_DCP_BUILDERS),
        *(SelftestRow(m.name, m.backend, partial(verify_process_mutant, m, shrink_seconds))
          for m in (*DFLASH_MUTANTS, *PROCESS_MUTANTS)),
    ]


def run_selftest(
    device: torch.device, shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
    only: Sequence[str] = (),
) -> list[SelftestResult]:
    """The results of :func:`selftest_rows`, in order; of the rows named in ``only`` alone
    when it names any. Raises :class:`UnknownSelftestRow`, before anything runs, for a name
    that is no row's."""
    rows = selftest_rows(device, shrink_seconds)
    names = [row.name for row in rows]
    for name in only:
        if name not in names:
            raise UnknownSelftestRow(f"no self-test row is named {name!r}; the rows are: "
                                     f"{', '.join(names)}")
    return [row.result() for row in rows if not only or row.name in only]
