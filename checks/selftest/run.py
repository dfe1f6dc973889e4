"""``speccheck selftest``: the verifier must catch every mutant with the check meant for it,
and must pass the correct control builder."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speccheck.checks.selftest.mutants import DERIVED_FIELD, MUTANTS, DerivedBuilder, declaring_matrix
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.scale import TIER_DEFAULTS, TIER_SCALE
from speccheck.checks.verify.vocabulary import Status, Tier
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.runtime_config import RuntimeConfig

@dataclass
class SelftestResult:
    name: str
    expected_check: str
    caught: bool
    detail: str
    recreates: str


def verify_builder(
    builder: type[AttentionMetadataBuilder],  # type: ignore[type-arg]
    device: torch.device,
    *,
    seed: int = 0,
    shrink_seconds: float = 120.0,
    declares: tuple[str, ...] = (DERIVED_FIELD,),
) -> BackendReport:
    """Verify the reference backend with ``builder`` swapped in, against a matrix whose
    ``reference`` entry declares ``declares`` as refreshed, at the settings ``speccheck
    verify`` uses by default on ``device``'s tier: its runtime config, batch scale, draft
    step counts and example count. Nothing is pinned, so a mutant caught here is caught by
    the search a user gets."""
    tier = Tier.GPU if device.type == "cuda" else Tier.CPU
    config = RuntimeConfig(**TIER_DEFAULTS[tier])
    scale = TIER_SCALE[tier]
    shipped = load_matrix(None)
    matrices = MatrixContext(declaring_matrix(shipped, declares), None, shipped)
    settings = VerifySettings("reference", config, seed=seed, capture_sizes=scale.capture_sizes,
                              max_new_tokens=scale.max_new_tokens,
                              builder_overrides=(("reference", builder),),
                              shrink_seconds=shrink_seconds, matrices=matrices)
    report = BackendReport("reference", tier, Status.PASSED)
    BackendVerifier(settings, device).run(report, lambda i, e: None)
    return report


def run_selftest(device: torch.device) -> list[SelftestResult]:
    gpu = device.type == "cuda"
    control = verify_builder(DerivedBuilder, device)
    results = [SelftestResult(
        "control (correct builder)", "-", control.status is Status.PASSED,
        "passed" if control.status is Status.PASSED else f"{control.failures[0].check}: {control.failures[0].diagnosis}",
        "none: must pass",
    )]
    for mutant in MUTANTS:
        check, phrase = mutant.expected(gpu)
        report = verify_builder(mutant.builder, device, declares=mutant.declares)
        hits = [f for f in report.failures if f.check == check and phrase in f.diagnosis]
        detail = hits[0].diagnosis if hits else (
            "not caught" if not report.failures else
            f"caught by {report.failures[0].check} instead: {report.failures[0].diagnosis}")
        results.append(SelftestResult(mutant.name, check, bool(hits), detail, mutant.recreates))
    return results
