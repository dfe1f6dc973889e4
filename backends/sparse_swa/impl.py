"""The ``sparse_swa`` attention impl: the latent write, the lazy index-cache fill and the
split-KV attention over each token's window."""

from __future__ import annotations

import torch
import triton

from speccheck.backends.kv_cache_write import write_latent_cache
from speccheck.backends.sparse_swa.attention_kernels import (
    sparse_mla_combine_kernel,
    sparse_mla_split_kernel,
)
from speccheck.backends.sparse_swa.index_kernels import fill_index_cache_kernel
from speccheck.backends.sparse_swa.metadata import (
    HEAD_BLOCK,
    KV_TILE,
    SCHEDULE_FIELDS,
    SparseSWAMetadata,
)
from speccheck.backends.triton_attn.kernels import LOG2E
from speccheck.contract.builder import AttentionImpl


class SparseSWAImpl(AttentionImpl[SparseSWAMetadata]):
    """Absorbed-MLA sliding-window attention over the latent cache (see
    :mod:`~speccheck.backends.sparse_swa.attention_kernels`).

    Capture-safe: one in-place cache scatter, the conditional index-cache fill (a kernel
    that reads the device flag, then an in-place flag write), and two kernel launches whose
    grids depend on shapes only; no allocation, no host synchronisation.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: SparseSWAMetadata,
        output: torch.Tensor,
    ) -> None:
        """``key`` is the new latent entry (``[T, 1, kv_lora_rank + qk_rope_head_dim]``),
        written into ``key_cache`` (the latent) before attention; ``value`` and the empty
        ``value_cache`` are not used."""
        del value, value_cache
        if query.stride(-1) != 1 or output.stride(-1) != 1:
            raise ValueError("query and output need a contiguous last dimension")
        if not key_cache.is_contiguous():
            raise ValueError("the latent cache must be contiguous: the sparse index cache holds "
                             "offsets computed with the first layer's strides")
        n = metadata.num_actual_tokens
        write_latent_cache(key[:n], key_cache, metadata.slot_mapping)
        if n == 0:
            return
        fill_index_cache(metadata, key_cache)
        self.attend(query, key_cache, metadata, output)

    def attend(
        self, query: torch.Tensor, latent: torch.Tensor, metadata: SparseSWAMetadata,
        output: torch.Tensor,
    ) -> None:
        """The split kernel over the tile schedule, then the merge into ``output``."""
        layer, scratch = self.layer, metadata.scratch
        head_blocks = triton.cdiv(layer.num_heads, HEAD_BLOCK)
        schedule = metadata.tile_scheduler_metadata
        sparse_mla_split_kernel[(schedule.shape[0], head_blocks)](
            query,
            latent,
            metadata.sparse_index_cache,
            metadata.swa_lens,
            schedule,
            metadata.split_offsets,
            scratch.part_max,
            scratch.part_sum,
            scratch.part_acc,
            self.scale * LOG2E,
            query.stride(0),
            query.stride(1),
            metadata.sparse_index_cache.stride(0),
            NUM_HEADS=layer.num_heads,
            RANK=layer.kv_lora_rank,
            ROPE=layer.qk_rope_head_dim,
            BLOCK_H=HEAD_BLOCK,
            KV_TILE=KV_TILE,
            FIELDS=SCHEDULE_FIELDS,
            UPCAST=query.device.type != "cuda",
        )
        sparse_mla_combine_kernel[(metadata.num_actual_tokens, head_blocks)](
            output,
            metadata.split_offsets,
            scratch.part_max,
            scratch.part_sum,
            scratch.part_acc,
            output.stride(0),
            output.stride(1),
            NUM_HEADS=layer.num_heads,
            RANK=layer.kv_lora_rank,
            BLOCK_H=HEAD_BLOCK,
        )


def fill_index_cache(metadata: SparseSWAMetadata, latent: torch.Tensor) -> None:
    """Fill the sparse index cache from the window indices with ``latent``'s strides unless
    it is valid, then mark it valid: the first layer after a build or refresh converts,
    later layers launch a kernel that reads the flag and returns. Every layer of a group
    has a contiguous latent cache of one shape (the speculator allocates them alike, and
    :meth:`SparseSWAImpl.forward` refuses any other), so the offsets the first layer
    computes hold for all."""
    window = metadata.swa_indices.shape[1]
    fill_index_cache_kernel[(metadata.num_actual_tokens,)](
        metadata.sparse_index_cache,
        metadata.sparse_index_cache_valid,
        metadata.swa_indices,
        metadata.swa_lens,
        latent.shape[0],
        metadata.sparse_index_cache.stride(0),
        metadata.swa_indices.stride(0),
        latent.stride(0),
        latent.stride(1),
        WINDOW=window,
        BLOCK_W=triton.next_power_of_2(window),
        BLOCK_SIZE=latent.shape[1],
    )
    metadata.sparse_index_cache_valid.fill_(1)
