"""Metadata builder and impl of the reference backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from speccheck.backends.dcp import DcpLocalShare, HoldsDcpShare, merge_across_ranks
from speccheck.backends.kv_cache_write import write_kv_cache, write_latent_cache
from speccheck.backends.reference.attention import (
    paged_attention_reference,
    paged_attention_reference_partial,
)
from speccheck.contract.builder import (
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    BufferAllocator,
    BuilderLimits,
    zeros_allocator,
)
from speccheck.contract.dcp import DcpRank
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig


@dataclass
class ReferenceMetadata:
    """Views of the speculator's persistent buffers; without decode context parallelism
    nothing is derived, so nothing needs refreshing.

    Under DCP (a builder given a :class:`~speccheck.contract.dcp.DcpRank` of more than one
    rank) ``slot_mapping`` and ``dcp_local_seq_lens`` are views of the builder's
    :class:`~speccheck.backends.dcp.DcpLocalShare` instead: this rank's local KV slots and
    local lengths, step dependent, recomputed by the refresh from ``seq_lens`` and
    ``positions``.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    """Where each token writes its KV in the cache this process holds."""
    num_actual_tokens: int
    causal: bool
    dcp_local_seq_lens: torch.Tensor
    """``[num_reqs]`` int32: positions of each request this rank's cache holds; without DCP
    ``seq_lens`` itself (the same tensor)."""
    positions: torch.Tensor | None = None
    """The tokens' global positions (a view of the speculator's buffer)."""


class ReferenceAttentionImpl(AttentionImpl[ReferenceMetadata]):
    """fp32 attention for both cache layouts of :class:`AttentionLayerSpec`: grouped-query
    over keys and values (``NHD``), or multi-query over the MLA latent cache (``latent``:
    keys are whole latent entries, values their first ``kv_lora_rank`` channels), honouring
    the layer's ``sliding_window``. Capture-safe: an in-place cache scatter and fixed-shape
    tensor ops.

    With ``dcp`` (more than one rank) the cache holds this rank's interleaved share only:
    the impl computes its partial attention and log-sum-exp
    (:func:`~speccheck.backends.reference.attention.paged_attention_reference_partial`,
    bounded by ``dcp_local_seq_lens``) and writes the merge of every rank's partials
    (:func:`~speccheck.backends.dcp.merge_across_ranks`, a collective), so every rank
    returns the attention over the whole context.
    """

    def __init__(self, layer: AttentionLayerSpec, scale: float, dcp: DcpRank | None = None) -> None:
        super().__init__(layer, scale)
        self.dcp = dcp if dcp is not None and dcp.world_size > 1 else None

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
            # Tensor ops even on CUDA: the oracle shares no kernel with the backends it judges.
            write_kv_cache(key[:n], value[:n], key_cache, value_cache, metadata.slot_mapping,
                           kernel=False)
        if self.dcp is None:
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
            return
        out, lse = paged_attention_reference_partial(
            query[:n], key_cache, value_cache, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_table, self.scale, metadata.causal, self.layer.sliding_window,
            dcp_rank=self.dcp.rank, dcp_world=self.dcp.world_size,
            local_seq_lens=metadata.dcp_local_seq_lens,
        )
        output[:n] = merge_across_ranks(out, lse, self.dcp).to(output.dtype)


class ReferenceMetadataBuilder(HoldsDcpShare[ReferenceMetadata], AttentionMetadataBuilder[ReferenceMetadata]):
    """Refresh strategy ``none_needed`` without DCP: every step-dependent field is a view of
    a persistent input buffer that the speculator advances in place.

    With ``dcp`` (a :class:`~speccheck.contract.dcp.DcpRank` of more than one rank, which
    must match ``config.dcp_world_size``) this process is one DCP rank: the builder owns a
    :class:`~speccheck.backends.dcp.DcpLocalShare` (persistent ``dcp_local_seq_lens`` and
    ``dcp_slot_mapping``, zeroed tails), written by :meth:`build` and recomputed in place by
    :meth:`update_draft_decode_metadata` (``in_graph``). Without ``dcp`` a config's
    ``dcp_world_size`` is a configuration value only: the cache holds every position.
    """

    backend_name = "reference"
    impl_cls: ClassVar[type[ReferenceAttentionImpl]] = ReferenceAttentionImpl

    def __init__(
        self,
        layer: AttentionLayerSpec,
        config: RuntimeConfig,
        device: torch.device,
        limits: BuilderLimits,
        *,
        supports_draft_decode_metadata_update: bool = False,
        buffer_allocator: BufferAllocator = zeros_allocator,
        dcp: DcpRank | None = None,
    ) -> None:
        super().__init__(
            layer, config, device, limits,
            supports_draft_decode_metadata_update=supports_draft_decode_metadata_update,
            buffer_allocator=buffer_allocator,
        )
        self.dcp_share = DcpLocalShare.for_builder(self, dcp)

    def build(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        slots, local = common.slot_mapping, common.seq_lens
        if self.dcp_share is not None:
            local, slots = self.dcp_share.bind(common)
        return ReferenceMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=slots,
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
            positions=common.positions,
            dcp_local_seq_lens=local,
        )

    def make_impl(self, scale: float) -> ReferenceAttentionImpl:
        """The impl, given this builder's DCP rank (it all-gathers the partials)."""
        dcp = self.dcp_share.dcp if self.dcp_share is not None else None
        return self.impl_cls(self.layer, scale, dcp)
