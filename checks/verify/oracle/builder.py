"""The oracle's metadata builder and attention impl, for the verifier's fp32 reference
speculator (installed over the shipped matrix's ``reference`` entry by
:class:`~speccheck.checks.verify.harness.HarnessSet`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from speccheck.checks.verify.oracle.attention import dense_attention, gather_requests
from speccheck.checks.verify.oracle.chunks import AttentionChunk, plan_chunks
from speccheck.checks.verify.oracle.kv_write import token_slots, write_tokens
from speccheck.checks.verify.oracle.spans import request_spans
from speccheck.contract.builder import AttentionImpl, AttentionMetadataBuilder
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class OracleMetadata:
    """One eager attention call as the oracle sees it: exact for the call it was built for,
    never refreshed."""

    chunks: tuple[AttentionChunk, ...]
    """The requests with query tokens (:func:`~.spans.request_spans`), in chunks
    (:func:`~.chunks.plan_chunks`)."""
    block_table: torch.Tensor
    """``[num_reqs, max_blocks_per_req]`` int32: each request's pages."""
    kv_tokens: torch.Tensor
    """``[n]`` int64: the tokens whose keys and values the call writes (every query token)."""
    kv_slots: torch.Tensor
    """``[n]`` int64: where each writes (:func:`~.kv_write.token_slots`)."""
    causal: bool


class OracleAttentionImpl(AttentionImpl[OracleMetadata]):
    """Writes the call's keys and values (:func:`~.kv_write.write_tokens`), then attends
    each chunk of requests densely (:func:`~.attention.dense_attention`) over their whole
    contexts, gathered from the cache. ``NHD``: grouped-query keys and values; ``latent`` (MLA): the
    latent entry is written and is the key, its first ``kv_lora_rank`` channels the value.
    Honours the layer's ``sliding_window``. Eager only: its work is shaped by the host
    lengths of its build, so it is never captured. Rows of tokens of no request are left
    as they arrive (zero)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: OracleMetadata,
        output: torch.Tensor,
    ) -> None:
        write_tokens(key, key_cache, metadata.kv_tokens, metadata.kv_slots)
        if self.layer.kv_layout is KvLayout.LATENT:
            value_cache = key_cache[..., : self.layer.kv_lora_rank]
        else:
            write_tokens(value, value_cache, metadata.kv_tokens, metadata.kv_slots)
        for chunk in metadata.chunks:
            keys, values = (gather_requests(cache, metadata.block_table, chunk.requests,
                                            chunk.length) for cache in (key_cache, value_cache))
            out = dense_attention(query[chunk.cell_tokens], keys, values, chunk, self.scale,
                                  metadata.causal, self.layer.sliding_window)
            rows = chunk.cell_tokens.flatten()[chunk.real_cells]
            output[rows] = out.flatten(0, 1)[chunk.real_cells].to(output.dtype)


class OracleMetadataBuilder(AttentionMetadataBuilder[OracleMetadata]):
    """Builds :class:`OracleMetadata` from the common metadata's host offsets and lengths
    (exact for an eager per-step build) and its block table; nothing persistent, no
    refresh (the inherited :meth:`update_draft_decode_metadata` raises). Only for eager
    per-step runs of one process holding the whole cache (no DCP rank)."""

    backend_name = "oracle"
    impl_cls: ClassVar[type[OracleAttentionImpl]] = OracleAttentionImpl

    def build(self, common: CommonAttentionMetadata) -> OracleMetadata:
        spans = request_spans(common.query_start_loc_cpu.tolist(),
                              common.seq_lens_cpu_upper_bound.tolist())
        tokens, slots = token_slots(spans, common.block_table, self.layer.block_size)
        chunks = plan_chunks(spans, self._row_bytes(), self.device)
        return OracleMetadata(chunks, common.block_table, tokens, slots, common.causal)

    def _row_bytes(self) -> int:
        """Bytes of one position's keys in fp64, as :func:`~.attention.dense_attention`
        holds them."""
        (_, _, heads, width), _ = self.layer.kv_cache_shapes(1)
        return heads * width * 8
