"""Known-bad builders of the ``sparse_swa`` backend: each re-creates one way the sparse SWA
refresh of the seed PR goes wrong, and the verifier must name the step and field (or the
buffer) it breaks.

They run under the shipped ``sparse_swa`` matrix entry (which declares what the correct
builder refreshes) through :func:`~speccheck.checks.selftest.run.verify_at_defaults`; the
correct builder,
:class:`~speccheck.backends.sparse_swa.builder.SparseSWAMetadataBuilder`, is the control.
"""

from __future__ import annotations

from dataclasses import dataclass

from speccheck.backends.sparse_swa.builder import SparseSWAMetadataBuilder
from speccheck.backends.sparse_swa.metadata import SparseSWAMetadata
from speccheck.checks.verify.vocabulary import Check
from speccheck.contract.metadata import CommonAttentionMetadata

BACKEND = SparseSWAMetadataBuilder.backend_name


class UnclearedIndexCache(SparseSWAMetadataBuilder):
    def update_draft_decode_metadata(self, metadata: SparseSWAMetadata) -> None:
        """Recomputes indices, lengths and schedule but leaves the sparse index cache valid:
        the next step's first layer skips the fill and every layer attends the previous
        step's windows (the review finding of the seed PR)."""
        self.compute_indices(metadata)
        self.build_schedule(metadata)


class StaleIndices(SparseSWAMetadataBuilder):
    def update_draft_decode_metadata(self, metadata: SparseSWAMetadata) -> None:
        """Rebuilds the schedule and clears the cache, but never relaunches the index kernel:
        indices and lengths stay those of the first draft step."""
        self.build_schedule(metadata)
        self.clear_index_cache(metadata)


class LensTailNotZeroed(SparseSWAMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> SparseSWAMetadata:
        """Leaves the window lengths past the live rows as an earlier, larger batch left
        them (full windows), as the seed PR's refresh leaves ``decode_swa_lens``."""
        metadata = super().build(common)
        self.lens[metadata.num_actual_tokens :].fill_(self.layer.sliding_window)
        return metadata


@dataclass(frozen=True)
class SWAMutant:
    """A known-bad ``sparse_swa`` builder, the check that must catch it, and what the
    catching finding must name."""

    name: str
    builder: type[SparseSWAMetadataBuilder]
    check: Check
    names: str
    """The metadata path (``step_metadata``: with the step) or persistent buffer
    (``zero_tails``) the finding names."""
    recreates: str


SWA_MUTANTS: tuple[SWAMutant, ...] = (
    SWAMutant("swa_index_cache_not_cleared", UnclearedIndexCache, Check.STEP_METADATA,
              f"{BACKEND}.metadata.sparse_index_cache",
              "the sparse index cache filled in the forward pass and not cleared by the "
              "refresh: later draft steps reuse the first step's indices (seed PR review)"),
    SWAMutant("swa_indices_not_recomputed", StaleIndices, Check.STEP_METADATA,
              f"{BACKEND}.metadata.swa_indices",
              "window indices and lengths not recomputed between fused draft steps"),
    SWAMutant("swa_lens_tail_not_zeroed", LensTailNotZeroed, Check.ZERO_TAILS,
              "decode_swa_lens",
              "window lengths past the live tokens left from an earlier, larger batch (the "
              "seed PR's refresh does not re-zero decode_swa_lens)"),
)
