"""Known-bad builders the self-test verifies as ``speccheck verify --backend B --matrix M``
does, each backend in worker processes of its own (:func:`~speccheck.checks.api.verify`):
those of the CUDA-only kernel backends, whose stale plans can fault the device (a worker
that dies is a ``crashed`` verdict, not a crash of the self-test).

Each runs under the shipped matrix with its entry's ``implementation`` pointed at it
(:func:`~speccheck.checks.selftest.mutants.naming_matrix`), as the author of such an
adapter would ship it, at the settings the command uses by default. Where the machine
cannot run the backend (no CUDA, no kernel package) the self-test reports the mutant
skipped, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from speccheck.checks.selftest.fa3_mutants import SCHEDULE_FIELD, WithoutScheduleRefresh
from speccheck.checks.selftest.flashinfer_mutants import (
    SplitKVFixedPlan,
    WithoutReplan,
    WithoutRefresh,
)
from speccheck.checks.verify.vocabulary import Check
from speccheck.contract.builder import AttentionMetadataBuilder


@dataclass(frozen=True)
class ProcessMutant:
    """A known-bad builder of a shipped backend (its ``backend_name``'s entry), the check
    that must fail on it, and the bug it re-creates."""

    name: str
    builder: type[AttentionMetadataBuilder]  # type: ignore[type-arg]
    check: Check
    names: str
    """What the failure must name: its field, or a phrase of its diagnosis (a step_metadata
    diagnosis names the field's path; empty: any failure of :attr:`check`)."""
    recreates: str
    crash_catches: bool
    """Whether a crashed worker counts as caught: where the stale metadata addresses
    memory (page tables, split plans), the device may fault before any check runs."""

    @property
    def backend(self) -> str:
        return str(self.builder.backend_name)

    def caught_by_crash(self, detail: str) -> bool:
        """Whether a crash whose report says ``detail`` catches this mutant: where
        :attr:`crash_catches`, unless the crash is the verifier running out of a resource
        (:data:`RESOURCE_CRASHES`), which says nothing about the builder."""
        lowered = detail.lower()
        return self.crash_catches and not any(m in lowered for m in RESOURCE_CRASHES)


RESOURCE_CRASHES = ("out of memory",)
"""Phrases of a crash report (lower case) that blame the machine, not the builder: a CUDA
or host allocation that failed (a verifier that kept too much alive crashed the
flashinfer row this way at dc4032f, and the row was counted as caught)."""


PROCESS_MUTANTS: tuple[ProcessMutant, ...] = (
    ProcessMutant(
        "fa3_without_schedule_refresh", WithoutScheduleRefresh, Check.STEP_METADATA,
        SCHEDULE_FIELD,
        "FA3's scheduler metadata not refreshed between fused draft steps (the seed PR's "
        "headline bug)", crash_catches=False),
    ProcessMutant(
        "flashinfer_fixed_plan_without_refresh", WithoutRefresh, Check.STEP_METADATA,
        "paged_kv",
        "the fixed-plan FlashInfer builder's page-table refresh removed: fused replays read "
        "the capture's page tables", crash_catches=True),
    ProcessMutant(
        "flashinfer_fixed_plan_split_kv", SplitKVFixedPlan, Check.VS_FP32_REFERENCE, "",
        "a FlashInfer plan made once with split KV on: its KV chunking stays the "
        "capture's", crash_catches=True),
    ProcessMutant(
        "flashinfer_without_replan", WithoutReplan, Check.STEP_METADATA, "paged_kv",
        "FlashInfer's re-plan before each preplanned replay removed: the draft steps attend "
        "with the page tables planned for an earlier batch", crash_catches=True),
)

