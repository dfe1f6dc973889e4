"""Known-bad builders that only a drafter with non-causal passes exposes (the DFlash
drafter of ``speccheck verify``'s ``dp_size=2`` cell): every autoregressive pass is causal,
so a builder that loses the metadata's ``causal`` flag agrees with the oracle on every other
cell. The self-test verifies each as ``speccheck verify --backend B --matrix M`` does by
default (:func:`~speccheck.checks.selftest.run.verify_process_mutant`), under the shipped
matrix naming it."""

from __future__ import annotations

import dataclasses

from speccheck.backends.reference.builder import ReferenceMetadata, ReferenceMetadataBuilder
from speccheck.checks.selftest.process_mutants import ProcessMutant
from speccheck.checks.verify.vocabulary import Check
from speccheck.contract.metadata import CommonAttentionMetadata


class BlocksAttendedCausally(ReferenceMetadataBuilder):
    """The reference builder that drops ``common.causal``: a DFlash block's mask tokens do
    not see the ones after them."""

    def build(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        return dataclasses.replace(super().build(common), causal=True)


DFLASH_MUTANTS: tuple[ProcessMutant, ...] = (
    ProcessMutant(
        "reference_blocks_attended_causally", BlocksAttendedCausally,
        Check.DP_VS_FP32_REFERENCE, "single-rank run vs fp32 reference",
        "the metadata's causal flag dropped: DFlash blocks attended causally, which padded "
        "and single-rank runs agree on", crash_catches=False),
)
"""The rows, in the self-test's order."""
