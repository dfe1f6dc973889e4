"""A complete speccheck adapter: paged attention whose kernel reads the KV lengths from a
buffer of its own, refreshed in place between draft steps.

Real kernels derive step-dependent state from the lengths (FA3's scheduler tiles, a
sliding window's first block, split-KV partition counts). This template keeps the
derivation trivial, a copy of the KV lengths in a persistent buffer, so that what matters
stands out: the buffer is allocated once, ``build`` fills it on the host, and
``update_draft_decode_metadata`` rewrites it in place with capture-safe GPU work after the
speculator advances ``seq_lens`` between draft steps. Remove that refresh and a captured
graph replays stale lengths: speccheck's ``step_metadata`` check fails.

The matrix entry for this builder is ``matrix.yaml`` beside this file; the package
registers it through the ``speccheck.backends`` entry point (see ``pyproject.toml``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from speccheck.backends.kv_cache_write import write_kv_cache
from speccheck.backends.reference.attention import paged_attention_reference
from speccheck.contract.builder import AttentionImpl, AttentionMetadataBuilder
from speccheck.contract.metadata import CommonAttentionMetadata


@dataclass
class TemplateMetadata:
    """What one attention call reads. Every tensor lives in storage that outlives the call:
    views of the speculator's input buffers (advanced in place by the speculator) or of this
    backend's persistent buffer."""

    query_start_loc: torch.Tensor
    """``[num_reqs + 1]`` int32: cumulative query offsets (a view of the speculator's)."""
    seq_lens: torch.Tensor
    """``[num_reqs]`` int32: KV length of each request (a view of the speculator's)."""
    block_table: torch.Tensor
    """``[num_reqs, max_blocks_per_req]`` int32: physical KV blocks of each request."""
    slot_mapping: torch.Tensor
    """``[num_actual_tokens]`` int64: the KV-cache slot each new token is written to."""
    num_actual_tokens: int
    causal: bool
    kv_lens: torch.Tensor
    """``[num_reqs]`` int32: the kernel's KV lengths, a view of the persistent ``kv_lens``
    buffer. Derived and step-dependent: declared in ``draft_decode.refreshed_fields``."""


class TemplateAttentionImpl(AttentionImpl[TemplateMetadata]):
    """The device side: write the new keys and values, then attend over the paged cache
    with the lengths in ``kv_lens``. Capture-safe: fixed shapes, no host synchronisation."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TemplateMetadata,
        output: torch.Tensor,
    ) -> None:
        n = metadata.num_actual_tokens
        write_kv_cache(key[:n], value[:n], key_cache, value_cache, metadata.slot_mapping)
        output[:n] = paged_attention_reference(
            query[:n], key_cache, value_cache, metadata.query_start_loc, metadata.kv_lens,
            metadata.block_table, self.scale, metadata.causal,
        )


class TemplateMetadataBuilder(AttentionMetadataBuilder[TemplateMetadata]):
    """The host side. ``backend_name`` is the matrix entry's name; the entry's
    ``implementation`` names this class (``speccheck_adapter_template.attention:
    TemplateMetadataBuilder``), which is how speccheck's worker processes import it."""

    backend_name = "template_attn"
    impl_cls = TemplateAttentionImpl

    def setup(self) -> None:
        """One persistent buffer, sized for the largest batch; graphs read it by address."""
        self.kv_lens = self.allocate_persistent("kv_lens", (self.limits.max_num_reqs,),
                                                torch.int32)

    def build(self, common: CommonAttentionMetadata) -> TemplateMetadata:
        """Host work (never captured): fill the used rows, zero the tail."""
        n = common.num_reqs
        self.kv_lens[:n].copy_(common.seq_lens)
        self.kv_lens[n:].zero_()
        return TemplateMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
            kv_lens=self.kv_lens[:n],
        )

    def update_draft_decode_metadata(self, metadata: TemplateMetadata) -> None:
        """Runs inside the captured fused graph between draft steps, after the speculator
        advanced ``seq_lens`` in place: rewrite the derived buffer in place."""
        metadata.kv_lens.copy_(metadata.seq_lens)  # the in-graph refresh

    def persistent_buffer_extents(self, metadata: TemplateMetadata) -> Mapping[str, int]:
        """Rows of ``kv_lens`` in use; speccheck checks the rest stay zero."""
        return {"kv_lens": metadata.kv_lens.shape[0]}
