"""Known-bad builders of the ``flashinfer_fixed_plan`` backend: each breaks one premise of
its in-graph refresh, and ``speccheck verify`` at its default settings must not pass it.
CUDA and FlashInfer only: :mod:`~speccheck.checks.selftest.process_mutants` runs them
through verify's worker processes, since they can fault the device.
"""

from __future__ import annotations

from speccheck.backends.flashinfer.builder import FlashInferMetadata
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
