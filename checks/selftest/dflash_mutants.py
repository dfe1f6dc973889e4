"""Known-bad builders that only a drafter with non-causal passes exposes (the DFlash
drafter of ``speccheck verify``'s ``dp_size=2`` and ``dcp_world_size=2, drafter=dflash``
cells): every autoregressive pass is causal, so a builder that loses the metadata's
``causal`` flag agrees with the oracle on every other cell, and a DCP rank that attends one
local position past its share is clipped by every autoregressive step's causal bound. The
self-test verifies each as ``speccheck verify --backend B --matrix M`` does by default
(:func:`~speccheck.checks.selftest.run.verify_process_mutant`), under the shipped matrix
naming it."""

from __future__ import annotations

import dataclasses

from typing import ClassVar

import torch

from speccheck.backends.reference.builder import (
    ReferenceAttentionImpl,
    ReferenceMetadata,
    ReferenceMetadataBuilder,
)
from speccheck.checks.selftest.process_mutants import ProcessMutant
from speccheck.checks.verify.vocabulary import Check
from speccheck.contract.metadata import CommonAttentionMetadata


class BlocksAttendedCausally(ReferenceMetadataBuilder):
    """The reference builder that drops ``common.causal``: a DFlash block's mask tokens do
    not see the ones after them."""

    def build(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        return dataclasses.replace(super().build(common), causal=True)


class _LocalShareReadOnePastImpl(ReferenceAttentionImpl):
    """The reference attention whose DCP rank reads one local position past its length
    (the local-length mask's ``<`` written ``<=``)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: ReferenceMetadata, output: torch.Tensor) -> None:
        wider = dataclasses.replace(metadata,
                                    dcp_local_seq_lens=metadata.dcp_local_seq_lens + 1)
        super().forward(query, key, value, key_cache, value_cache, wider, output)


class LocalShareReadOnePast(ReferenceMetadataBuilder):
    """The reference builder whose attention, on a DCP rank, also attends the local position
    just past the rank's share: a key no request holds yet. Every autoregressive step's
    causal bound hides it; a DFlash block's non-causal pass reads it. Its metadata is right
    (``field_meanings`` passes it)."""

    impl_cls: ClassVar[type[ReferenceAttentionImpl]] = _LocalShareReadOnePastImpl


DFLASH_MUTANTS: tuple[ProcessMutant, ...] = (
    ProcessMutant(
        "reference_blocks_attended_causally", BlocksAttendedCausally,
        Check.DP_VS_FP32_REFERENCE, "single-rank run vs fp32 reference",
        "the metadata's causal flag dropped: DFlash blocks attended causally, which padded "
        "and single-rank runs agree on", crash_catches=False),
    ProcessMutant(
        "reference_dcp_share_read_one_past", LocalShareReadOnePast,
        Check.DCP_BLOCKS_VS_FP32_REFERENCE, "vs fp32 reference over the whole cache",
        "a DCP rank's attention reads one local position past its length (the mask's < as "
        "<=), which every causal step clips: only DFlash blocks on DCP ranks see it",
        crash_catches=False),
)
"""The rows, in the self-test's order."""
