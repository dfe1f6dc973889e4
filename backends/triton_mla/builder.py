"""Metadata builder and impl of the ``triton_mla`` backend.

Under ``dcp_world_size == 1`` the metadata holds only views of the speculator's persistent
input buffers and of this builder's split-KV scratch, and the kernel reads lengths, offsets
and block ids from them at run time: a draft step that advances ``seq_lens`` /
``slot_mapping`` in place is seen by the next replay without any refresh work.

Under decode context parallelism (``dcp_world_size`` N > 1, simulated in one process) the
token at position ``t`` lives on rank ``t % N``, and the kernel bounds each rank's share by
``dcp_local_seq_lens``: derived from ``seq_lens`` at build time into a persistent buffer, as
vLLM's MLA builders derive them. Nothing advances them between draft steps, so they are the
step-dependent field that keeps fused draft decode to ``dcp_world_size == 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton

from speccheck.backends.dcp import dcp_local_length_table
from speccheck.backends.kv_cache_write import write_latent_cache
from speccheck.backends.triton_attn.builder import SplitKVScratch, default_num_kv_splits
from speccheck.backends.triton_attn.kernels import LOG2E
from speccheck.backends.triton_mla.kernels import mla_split_kernel
from speccheck.contract.builder import (
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    BuilderLimits,
)
from speccheck.contract.metadata import CommonAttentionMetadata

BLOCK_H = 16
"""Query heads per program (``tl.dot`` needs at least 16 rows; fewer heads are masked)."""
KV_TILE = 16
"""Latent entries per inner-loop tile (``BLOCK_N``); at least 16, as ``tl.dot`` requires."""


def num_kv_splits(layer: AttentionLayerSpec, limits: BuilderLimits, dcp_world_size: int) -> int:
    """Splits per DCP rank: ``triton_attn``'s split count for a ``kv_lora_rank``-wide
    accumulator (sized at ``max_model_len`` and the scratch budget), shared among the ranks,
    at least one each."""
    total = default_num_kv_splits(layer, limits, width=layer.kv_lora_rank)
    return max(1, total // dcp_world_size)


@dataclass
class TritonMLAMetadata:
    """Views of the speculator's persistent buffers and the builder's scratch, plus
    ``dcp_local_seq_lens``.

    ``dcp_local_seq_lens``: ``[num_reqs, dcp_world_size]`` int32, the entries of each
    request that each DCP rank holds. At ``dcp_world_size == 1`` it is ``seq_lens`` viewed
    as a column (advanced by the speculator); above, rows of the builder's persistent
    buffer, written by :meth:`TritonMLAMetadataBuilder.build` and step dependent.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    dcp_local_seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    causal: bool
    scratch: SplitKVScratch


class TritonMLAImpl(AttentionImpl[TritonMLAMetadata]):
    """Absorbed MLA attention over the latent cache in two Triton launches (split partials,
    then ``triton_attn``'s reduction).

    Capture-safe: one in-place cache scatter and two kernel launches whose grids depend on
    shapes only; no allocation, no host synchronisation. Takes the latent layout of
    :class:`~speccheck.contract.builder.AttentionLayerSpec`: ``query`` ``[T, H, rank +
    rope]``, ``key`` the latent entries ``[T, 1, rank + rope]`` (``value`` and the empty
    ``value_cache`` are unused), ``output`` ``[T, H, rank]``.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TritonMLAMetadata,
        output: torch.Tensor,
    ) -> None:
        del value, value_cache
        n = metadata.num_actual_tokens
        scratch = metadata.scratch
        if n > scratch.max_num_tokens:
            raise ValueError(
                f"{n} tokens exceed the split-KV scratch sized for {scratch.max_num_tokens}"
            )
        if any(t.stride(-1) != 1 for t in (query, output, key_cache)):
            raise ValueError("query, output and the latent cache need a contiguous last dimension")
        write_latent_cache(key[:n], key_cache, metadata.slot_mapping)
        if n == 0:
            return

        num_heads = query.shape[1]
        rank, rope = self.layer.kv_lora_rank, self.layer.qk_rope_head_dim
        local = metadata.dcp_local_seq_lens
        num_reqs, dcp = local.shape
        num_parts = scratch.num_splits
        if num_reqs > 0:
            grid = (n, triton.cdiv(num_heads, BLOCK_H), num_parts)
            mla_split_kernel[grid](
                query,
                key_cache,
                metadata.block_table,
                metadata.seq_lens,
                local,
                metadata.query_start_loc,
                scratch.part_max,
                scratch.part_sum,
                scratch.part_acc,
                self.scale * LOG2E,
                num_reqs,
                query.stride(0),
                query.stride(1),
                key_cache.stride(0),
                key_cache.stride(1),
                metadata.block_table.stride(0),
                local.stride(0),
                NUM_HEADS=num_heads,
                BLOCK_H=BLOCK_H,
                RANK=rank,
                ROPE=rope,
                BLOCK_SIZE=key_cache.shape[1],
                BLOCK_N=KV_TILE,
                NUM_SPLITS=num_parts // dcp,
                DCP=dcp,
                CAUSAL=metadata.causal,
                UPCAST=query.device.type != "cuda",
            )
        scratch.reduce_into(output, metadata.query_start_loc, num_reqs, n)


class TritonMLAMetadataBuilder(AttentionMetadataBuilder[TritonMLAMetadata]):
    """Builder of the ``triton_mla`` backend.

    Persistent state: the split-KV scratch (``dcp_world_size * splits`` partials per token
    and head, ``kv_lora_rank`` wide, for ``limits.max_num_tokens`` tokens; a workspace), and
    under DCP the ``dcp_local_seq_lens`` buffer ``[max_num_reqs, dcp_world_size]``, whose
    rows past the batch's requests :meth:`build` zeroes.

    Refresh: nothing to do at ``dcp_world_size == 1`` (every field is a view the speculator
    advances). Above, :meth:`update_draft_decode_metadata` refuses: the local lengths are
    not advanced between draft steps, which is why the matrix allows fused draft decode only
    at ``dcp_world_size == 1``. What the kernel needs of the layer (latent layout, power-of-
    two ``kv_lora_rank`` and ``qk_rope_head_dim`` of at least 16, no sliding window) is
    stated as the matrix entry's constraints and enforced from there.
    """

    backend_name = "triton_mla"
    impl_cls = TritonMLAImpl

    def setup(self) -> None:
        dcp = self.config.dcp_world_size
        splits = dcp * num_kv_splits(self.layer, self.limits, dcp)
        self.scratch = SplitKVScratch.allocate(
            self.limits.max_num_tokens, self.layer.num_heads, splits, self.layer.kv_lora_rank,
            self.device,
        )
        self.local_seq_lens = (
            self.allocate_persistent(
                "dcp_local_seq_lens", (self.limits.max_num_reqs, dcp), torch.int32
            )
            if dcp > 1 else None
        )

    def build(self, common: CommonAttentionMetadata) -> TritonMLAMetadata:
        if self.local_seq_lens is None:
            local = common.seq_lens.unsqueeze(1)
        else:
            n = common.num_reqs
            self.local_seq_lens[:n].copy_(
                dcp_local_length_table(common.seq_lens, self.config.dcp_world_size)
            )
            self.local_seq_lens[n:].zero_()
            local = self.local_seq_lens[:n]
        return TritonMLAMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            dcp_local_seq_lens=local,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
            scratch=self.scratch,
        )

    def update_draft_decode_metadata(self, metadata: TritonMLAMetadata) -> None:
        """Nothing to do at ``dcp_world_size == 1``: every field is a view of a persistent
        buffer that the speculator advances in place. Under DCP, raises
        ``NotImplementedError``: ``dcp_local_seq_lens`` is derived at build time and not
        advanced between draft steps."""
        if self.local_seq_lens is not None:
            raise NotImplementedError(
                "triton_mla does not advance dcp_local_seq_lens between draft steps; fused "
                "draft decode needs dcp_world_size == 1"
            )

    def persistent_buffer_extents(self, metadata: TritonMLAMetadata) -> Mapping[str, int]:
        """Under DCP: the rows of ``dcp_local_seq_lens`` the batch uses."""
        if self.local_seq_lens is None:
            return {}
        return {"dcp_local_seq_lens": metadata.dcp_local_seq_lens.shape[0]}

    def workspace_buffers(self) -> Mapping[str, torch.Tensor]:
        """The split-KV scratch: allocated once, rewritten by every forward."""
        return self.scratch.as_workspace()
