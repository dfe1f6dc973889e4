"""``speccheck selftest``: the verifier must catch every mutant with the check meant for it,
and must pass the correct control builder."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from speccheck.checks.api import backend_runtime_config
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
    declaring_matrix,
)
from speccheck.checks.selftest.swa_mutants import SWA_MUTANTS
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.dcp_ranks import verify_dcp
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.scale import DEFAULT_SHRINK_SECONDS, TIER_SCALE
from speccheck.checks.verify.vocabulary import Check, Status, Tier
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import Matrix


@dataclass
class SelftestResult:
    name: str
    expected_check: str
    caught: bool
    detail: str
    recreates: str


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
    one example, say)."""
    tier = Tier.GPU if device.type == "cuda" else Tier.CPU
    config = backend_runtime_config(tier, matrix, backend, config_changes or {})
    scale = TIER_SCALE[tier]
    settings = VerifySettings(backend, config, capture_sizes=scale.capture_sizes,
                              max_new_tokens=scale.max_new_tokens,
                              builder_overrides=((backend, builder),),
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


def _result(name: str, check: str, recreates: str, report: BackendReport,
            names: str) -> SelftestResult:
    """Caught: a failure of ``check`` whose diagnosis mentions ``names`` or whose field is
    ``names``."""
    hits = [f for f in report.failures
            if f.check == check and (names in f.diagnosis or f.field == names)]
    detail = hits[0].diagnosis if hits else (
        "not caught" if not report.failures else
        f"caught by {report.failures[0].check} instead: {report.failures[0].diagnosis}")
    return SelftestResult(name, check, bool(hits), detail, recreates)


def run_selftest(
    device: torch.device, shrink_seconds: float = DEFAULT_SHRINK_SECONDS
) -> list[SelftestResult]:
    """The control must pass; every known-bad builder must be caught by its check: the
    reference-based mutants, the sparse_swa ones (under the shipped entry), the triton_mla
    builder that keeps the DCP-local lengths of step 1 (under the matrix its author would
    ship, at DCP 2, one process), and the reference and triton_attn builders that keep
    them on two real DCP ranks (:data:`~speccheck.checks.selftest.dcp_mutants.
    STALE_DCP_BUILDERS`, under the matrix their author would ship). ``shrink_seconds``:
    each run's budget for shrinking its failure (whether it is caught does not depend on
    it)."""
    gpu = device.type == "cuda"
    control = verify_builder(DerivedBuilder, device, shrink_seconds=shrink_seconds)
    results = [SelftestResult(
        "control (correct builder)", "-", control.status is Status.PASSED,
        "passed" if control.status is Status.PASSED else f"{control.failures[0].check}: {control.failures[0].diagnosis}",
        "none: must pass",
    )]
    for mutant in MUTANTS:
        check, phrase = mutant.expected(gpu)
        report = verify_builder(mutant.builder, device, declares=mutant.declares,
                                rebuilds=mutant.rebuilds, shrink_seconds=shrink_seconds)
        results.append(_result(mutant.name, check, mutant.recreates, report, phrase))
    shipped = load_matrix(None)
    for swa in SWA_MUTANTS:
        report = verify_at_defaults("sparse_swa", swa.builder, device, shipped,
                                    shrink_seconds=shrink_seconds)
        results.append(_result(swa.name, swa.check, swa.recreates, report, swa.names))
    report = verify_at_defaults("triton_mla", StaleDcpLocalLens, device, claiming_matrix(shipped),
                                config_changes={"dcp_world_size": 2},
                                shrink_seconds=shrink_seconds)
    results.append(_result(
        "mla_stale_dcp_local_lens", Check.STEP_METADATA,
        "DCP-local lengths derived at build and not advanced between fused draft steps "
        "(vLLM's Triton MLA refresh under DCP)", report,
        f"triton_mla.metadata.{DCP_LOCAL_FIELD}"))
    for backend, stale in dcp_mutants.STALE_DCP_BUILDERS.items():
        report = verify_dcp_at_defaults(backend, stale, device,
                                        dcp_mutants.claiming_matrix(shipped, backend),
                                        shrink_seconds=shrink_seconds)
        results.append(_result(
            f"{backend}_stale_dcp_local_lens", Check.STEP_METADATA,
            "DCP-local lengths not advanced between fused draft steps while the local slots "
            "are (vLLM's Triton MLA refresh under DCP), on two real DCP ranks", report,
            f"{backend}.metadata.{dcp_mutants.DCP_LOCAL_FIELD}"))
    return results
