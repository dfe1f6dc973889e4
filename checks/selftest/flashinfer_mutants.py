"""Known-bad builders of the ``flashinfer_fixed_plan`` backend: each breaks one premise of
its in-graph refresh, and ``speccheck verify`` at its default settings must not pass it.

They run under the shipped matrix with the entry's ``implementation`` pointed at them
(:func:`naming_matrix`), as the author of such an adapter would ship it. CUDA and
FlashInfer only: the ``speccheck selftest`` on a CPU tier cannot build them, so they are
exercised by the GPU test suite (``tests/test_gpu_verifier.py``), through the real
``speccheck verify`` worker processes, since the second one can fault the device.
"""

from __future__ import annotations

from speccheck.backends.flashinfer.builder import FlashInferMetadata
from speccheck.backends.flashinfer.fixed_plan import FlashInferFixedPlanMetadataBuilder
from speccheck.contract.adapter_status import implementation_path
from speccheck.contract.matrix_model import Matrix

BACKEND = FlashInferFixedPlanMetadataBuilder.backend_name


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


MUTANTS: dict[str, type[FlashInferFixedPlanMetadataBuilder]] = {
    "without_refresh": WithoutRefresh,
    "split_kv": SplitKVFixedPlan,
}


def naming_matrix(shipped: Matrix, builder: type[FlashInferFixedPlanMetadataBuilder]) -> Matrix:
    """``shipped`` with the ``flashinfer_fixed_plan`` entry's implementation set to
    ``builder`` (everything it claims unchanged)."""
    entry = shipped.backend(BACKEND).model_copy(
        update={"implementation": implementation_path(builder)})
    return shipped.replacing(entry)
