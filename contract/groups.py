"""Attention groups: layers that share one backend and one metadata object."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_model import CudaGraphSupport, RefreshStrategy
from speccheck.contract.metadata import CommonAttentionMetadata


@dataclass
class AttentionGroup:
    """Layers ``layer_indices`` run ``backend_name`` through one builder.

    The group carries what the matrix says of its backend (refresh strategy, CUDA-graph
    support, step-dependent fields) next to the builder, and routes the refresh call to it,
    so the speculator never needs to know which backend a group uses.
    """

    backend_name: str
    builder: AttentionMetadataBuilder[Any]
    layer_indices: tuple[int, ...]
    refresh_strategy: RefreshStrategy = RefreshStrategy.NONE_NEEDED
    """The matrix's draft-decode refresh strategy for this backend."""
    cudagraph_support: CudaGraphSupport = CudaGraphSupport.ALWAYS
    """The matrix's ``cudagraph_support`` for this backend: which batches its attention may
    be captured for."""
    step_dependent_fields: tuple[str, ...] = ()
    """The matrix's declaration of the metadata fields that depend on the draft step
    (:attr:`~speccheck.contract.matrix_model.DraftDecode.step_dependent_fields`)."""
    refresh_rebuilds: bool = False
    """The matrix's :attr:`~speccheck.contract.matrix_model.DraftDecode.
    refresh_rebuilds`: the refresh can stand in for a build of any batch of its metadata's
    layout."""

    @property
    def supports_draft_decode_metadata_update(self) -> bool:
        return self.builder.supports_draft_decode_metadata_update

    @property
    def host_preplanned(self) -> bool:
        """Whether the group's refresh strategy is ``host_preplanned``: it plans each draft
        step ahead on the host."""
        return self.refresh_strategy is RefreshStrategy.HOST_PREPLANNED

    def build(self, common: CommonAttentionMetadata) -> Any:
        return self.builder.build(common)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> Any:
        return self.builder.build_for_cudagraph_capture(common)

    def update_draft_decode_metadata(self, metadata: Any) -> None:
        self.builder.update_draft_decode_metadata(metadata)

    def finish_draft_step_plans(self, metadata_per_step: Sequence[Any]) -> None:
        self.builder.finish_draft_step_plans(metadata_per_step)
