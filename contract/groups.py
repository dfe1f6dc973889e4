"""Attention groups: layers that share one backend and one metadata object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_model import CudaGraphSupport
from speccheck.contract.metadata import CommonAttentionMetadata


@dataclass
class AttentionGroup:
    """Layers ``layer_indices`` run ``backend_name`` through one builder.

    The group passes the builder's capability through and routes the refresh call to it,
    so the speculator never needs to know which backend a group uses.
    """

    backend_name: str
    builder: AttentionMetadataBuilder[Any]
    layer_indices: tuple[int, ...]
    refresh_strategy: str = "none_needed"
    """The matrix's draft-decode refresh strategy for this backend: ``in_graph``,
    ``none_needed`` or ``host_preplanned``."""
    cudagraph_support: CudaGraphSupport = CudaGraphSupport.ALWAYS
    """The matrix's ``cudagraph_support`` for this backend: which batches its attention may
    be captured for."""

    @property
    def supports_draft_decode_metadata_update(self) -> bool:
        return self.builder.supports_draft_decode_metadata_update

    def build(self, common: CommonAttentionMetadata) -> Any:
        return self.builder.build(common)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> Any:
        return self.builder.build_for_cudagraph_capture(common)

    def update_draft_decode_metadata(self, metadata: Any) -> None:
        self.builder.update_draft_decode_metadata(metadata)
