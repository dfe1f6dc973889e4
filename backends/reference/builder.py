"""Metadata builder and impl of the reference backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speccheck.backends.kv_cache_write import write_kv_cache, write_latent_cache
from speccheck.backends.reference.attention import paged_attention_reference
from speccheck.contract.builder import AttentionImpl, AttentionMetadataBuilder
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import CommonAttentionMetadata


@dataclass
class ReferenceMetadata:
    """Views of the speculator's persistent buffers; nothing derived, so nothing to refresh."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    causal: bool


class ReferenceAttentionImpl(AttentionImpl[ReferenceMetadata]):
    """fp32 attention for both cache layouts of :class:`AttentionLayerSpec`: grouped-query
    over keys and values (``NHD``), or multi-query over the MLA latent cache (``latent``:
    keys are whole latent entries, values their first ``kv_lora_rank`` channels), honouring
    the layer's ``sliding_window``. Capture-safe: an in-place cache scatter and fixed-shape
    tensor ops."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: ReferenceMetadata,
        output: torch.Tensor,
    ) -> None:
        n = metadata.num_actual_tokens
        if self.layer.kv_layout is KvLayout.LATENT:
            write_latent_cache(key[:n], key_cache, metadata.slot_mapping)
            value_cache = key_cache[..., : self.layer.kv_lora_rank]
        else:
            write_kv_cache(key[:n], value[:n], key_cache, value_cache, metadata.slot_mapping)
        output[:n] = paged_attention_reference(
            query[:n],
            key_cache,
            value_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            self.scale,
            metadata.causal,
            self.layer.sliding_window,
        )


class ReferenceMetadataBuilder(AttentionMetadataBuilder[ReferenceMetadata]):
    """Refresh strategy ``none_needed``: every step-dependent field is a view of a persistent
    input buffer that the speculator advances in place."""

    backend_name = "reference"
    impl_cls = ReferenceAttentionImpl

    def build(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        return ReferenceMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
        )

    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        """Nothing to do: lengths, slots and offsets are persistent views already advanced."""
