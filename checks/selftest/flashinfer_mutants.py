"""Known-bad builders of the FlashInfer backends: each breaks one premise of a draft-step
plan (the ``flashinfer_fixed_plan`` in-graph refresh, the ``flashinfer`` re-plan before a
preplanned replay), and ``speccheck verify`` at its default settings must not pass it.
CUDA and FlashInfer only: :mod:`~speccheck.checks.selftest.process_mutants` runs them
through verify's worker processes, since they can fault the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from speccheck.backends.flashinfer.builder import FlashInferMetadata, FlashInferMetadataBuilder
from speccheck.backends.flashinfer.fixed_plan import FlashInferFixedPlanMetadataBuilder


class WithoutRefresh(FlashInferFixedPlanMetadataBuilder):
    """Builds write the page table; the in-graph refresh does nothing. Every replay of the
    fused propose then attends with the capture's page tables (vLLM's FlashInfer builder
    without a draft-step refresh, fused anyway)."""

    def update_draft_decode_metadata(self, metadata: FlashInferMetadata) -> None:
        """The refresh, removed."""


class SplitKVFixedPlan(FlashInferFixedPlanMetadataBuilder):
    """Plans once per query layout and refreshes the page tables on the device, as the
    shipped builder does, but leaves FlashInfer's split KV on: the plan's KV chunking then
    depends on the lengths it was made for (the capture's), which no refresh touches (the
    FlashInfer analogue of FA3's missing schedule refresh)."""

    split_kv = True


class WithoutReplan(FlashInferMetadataBuilder):
    """Plans every draft step ahead for capture and for eager runs, but re-plans nothing
    before a replay of the preplanned graph: every replay's draft steps attend with the
    page tables and schedules of whichever batch was planned last."""

    def replan_draft_steps(
        self, metadata_per_step: Sequence[FlashInferMetadata], seq_lens_per_step: np.ndarray
    ) -> None:
        """The re-plan, removed."""
