"""The oracle's metadata builder and attention impl, for the verifier's fp32 reference
speculator (installed over the shipped matrix's ``reference`` entry by
:class:`~speccheck.checks.verify.harness.HarnessSet`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from speccheck.checks.verify.oracle.attention import dense_attention, gather_request
from speccheck.checks.verify.oracle.kv_write import token_slots, write_tokens
from speccheck.checks.verify.oracle.spans import RequestSpan, request_spans
from speccheck.contract.builder import AttentionImpl, AttentionMetadataBuilder
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class OracleMetadata:
    """One eager attention call as the oracle sees it: exact for the call it was built for,
    never refreshed."""

    spans: tuple[RequestSpan, ...]
    """The requests with query tokens (:func:`~.spans.request_spans`)."""
    block_table: torch.Tensor
    """``[num_reqs, max_blocks_per_req]`` int32: each request's pages."""
    kv_tokens: torch.Tensor
    """``[n]`` int64: the tokens whose keys and values the call writes (every query token)."""
    kv_slots: torch.Tensor
    """``[n]`` int64: where each writes (:func:`~.kv_write.token_slots`)."""
    causal: bool


class OracleAttentionImpl(AttentionImpl[OracleMetadata]):
    """Writes the call's keys and values (:func:`~.kv_write.write_tokens`), then attends
    each request densely (:func:`~.attention.dense_attention`) over its whole context,
    gathered from the cache. ``NHD``: grouped-query keys and values; ``latent`` (MLA): the
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
        for span in metadata.spans:
            row = metadata.block_table[span.request]
            keys = gather_request(key_cache, row, span.seq_len)
            values = gather_request(value_cache, row, span.seq_len)
            output[span.tokens] = dense_attention(
                query[span.tokens], keys, values, span, self.scale, metadata.causal,
                self.layer.sliding_window).to(output.dtype)


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
        return OracleMetadata(tuple(spans), common.block_table, tokens, slots, common.causal)
