"""Metadata builder and impl of the ``sparse_swa`` backend (DeepSeek-style sparse
sliding-window MLA).

Refresh strategy ``in_graph``. What depends on the draft step, and where it lives (every
buffer persistent, allocated once through ``allocate_persistent`` for
``limits.max_num_tokens`` tokens; ``T`` is the call's token count, padding included):

- ``swa_indices`` / ``swa_lens``: rows ``[:T]`` of ``decode_swa_indices`` (int32
  ``[max_num_tokens, W]``) and ``decode_swa_lens`` (int32 ``[max_num_tokens]``), written
  by :func:`~speccheck.backends.sparse_swa.index_kernels.swa_indices_kernel`;
- ``tile_scheduler_metadata`` (int32 ``[num_parts, 5]``) and ``split_offsets`` (rows
  ``[:T + 1]`` of int32 ``[max_num_tokens + 1]``): the split-KV schedule of
  :func:`~speccheck.backends.sparse_swa.index_kernels.tile_schedule_kernel`;
- ``sparse_index_cache`` (rows ``[:T]`` of int64 ``[max_num_tokens, W]``) and its flag
  ``sparse_index_cache_valid`` (int32 ``[1]``): filled lazily by the first layer's forward
  (:func:`~speccheck.backends.sparse_swa.index_kernels.fill_index_cache_kernel` checks the
  flag on the device), reused by later layers.

``build`` zeroes every tail past the live rows, recomputes indices, lengths and schedule and
clears the cache; ``update_draft_decode_metadata`` does the same in place without the tails
(the live rows do not move between draft steps). Clearing the cache is part of the refresh:
forgetting it made later draft steps reuse the first step's indices (the seed PR's review
finding).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton

from speccheck.backends.sparse_swa.impl import SparseSWAImpl
from speccheck.backends.sparse_swa.index_kernels import swa_indices_kernel, tile_schedule_kernel
from speccheck.backends.sparse_swa.metadata import (
    HEAD_BLOCK,
    KV_TILE,
    SCHEDULE_FIELDS,
    PartialScratch,
    SparseSWAMetadata,
)
from speccheck.contract.builder import (
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    BufferAllocator,
    BuilderLimits,
    zeros_allocator,
)
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig

SCHEDULE_TOKEN_BLOCK = 16
"""Tokens per chunk of the one-program schedule kernel, which compares each chunk with
every part (``[parts, chunk]`` tiles): at 132 parts (padded to 256) and
:data:`SCHEDULE_WARPS` warps, 16 fits in registers on sm_90, where 64 at 4 warps spilled
10 KB."""
SCHEDULE_WARPS = 8
"""Warps of the one-program schedule kernel."""
INTERPRETER_PARTS = 3
"""Schedule parts off CUDA (the Triton interpreter runs programs one after another, so more
parts only cost time): more than one keeps windows split, and a count that is not a power
of two, as a GPU's (132 on an H100), makes the schedule kernel mask the parts its
power-of-two axis holds past the last."""


def default_num_parts(layer: AttentionLayerSpec, device: torch.device) -> int:
    """Schedule parts: on CUDA, one attention program per streaming multiprocessor across
    the head blocks; elsewhere :data:`INTERPRETER_PARTS`."""
    if device.type != "cuda":
        return INTERPRETER_PARTS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, sms // triton.cdiv(layer.num_heads, HEAD_BLOCK))


class SparseSWAMetadataBuilder(AttentionMetadataBuilder[SparseSWAMetadata]):
    """Builder of the ``sparse_swa`` backend; refresh strategy ``in_graph`` (see the module
    docstring for its persistent buffers and what build and refresh do).

    What the kernels need of the layer and config (latent KV layout, a sliding window,
    power-of-two latent and rope widths, the cache in the activation dtype) is stated as the
    ``sparse_swa`` matrix entry's constraints and enforced from there before construction.
    """

    backend_name = "sparse_swa"
    impl_cls = SparseSWAImpl

    def __init__(
        self,
        layer: AttentionLayerSpec,
        config: RuntimeConfig,
        device: torch.device,
        limits: BuilderLimits,
        *,
        supports_draft_decode_metadata_update: bool = False,
        buffer_allocator: BufferAllocator = zeros_allocator,
        num_parts: int | None = None,
    ) -> None:
        """``num_parts`` overrides :func:`default_num_parts` (fixed for the builder's
        lifetime, like the buffers it sizes)."""
        if num_parts is not None and num_parts < 1:
            raise ValueError(f"num_parts={num_parts} must be >= 1")
        self.num_parts = num_parts or default_num_parts(layer, device)
        super().__init__(
            layer,
            config,
            device,
            limits,
            supports_draft_decode_metadata_update=supports_draft_decode_metadata_update,
            buffer_allocator=buffer_allocator,
        )

    def setup(self) -> None:
        tokens, window = self.limits.max_num_tokens, self.layer.sliding_window
        self.indices = self.allocate_persistent(
            "decode_swa_indices", (tokens, window), torch.int32)
        self.lens = self.allocate_persistent("decode_swa_lens", (tokens,), torch.int32)
        self.schedule = self.allocate_persistent(
            "tile_scheduler_metadata", (self.num_parts, SCHEDULE_FIELDS), torch.int32)
        self.split_offsets = self.allocate_persistent("split_offsets", (tokens + 1,), torch.int32)
        self.index_cache = self.allocate_persistent(
            "sparse_index_cache", (tokens, window), torch.int64)
        self.index_cache_valid = self.allocate_persistent(
            "sparse_index_cache_valid", (1,), torch.int32)
        heads, rows = self.layer.num_heads, tokens + self.num_parts
        self.scratch = PartialScratch(
            part_max=torch.zeros(rows, heads, dtype=torch.float32, device=self.device),
            part_sum=torch.zeros(rows, heads, dtype=torch.float32, device=self.device),
            part_acc=torch.zeros(rows, heads, self.layer.kv_lora_rank, dtype=torch.float32,
                                 device=self.device),
        )

    def build(self, common: CommonAttentionMetadata) -> SparseSWAMetadata:
        if not common.causal:
            raise ValueError("sparse_swa serves causal attention only (each token's window "
                             "ends at its own position)")
        n = common.num_actual_tokens
        if n > self.limits.max_num_tokens:
            raise ValueError(f"{n} tokens exceed the {self.limits.max_num_tokens} the "
                             "builder's buffers hold")
        metadata = SparseSWAMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            num_actual_tokens=n,
            swa_indices=self.indices[:n],
            swa_lens=self.lens[:n],
            tile_scheduler_metadata=self.schedule,
            split_offsets=self.split_offsets[: n + 1],
            sparse_index_cache=self.index_cache[:n],
            sparse_index_cache_valid=self.index_cache_valid,
            scratch=self.scratch,
        )
        buffers = self.persistent_buffers()
        for name, used in self.persistent_buffer_extents(metadata).items():
            buffers[name][used:].zero_()
        self.compute_indices(metadata)
        self.build_schedule(metadata)
        self.clear_index_cache(metadata)
        return metadata

    def update_draft_decode_metadata(self, metadata: SparseSWAMetadata) -> None:
        """In place, capture-safe: recompute indices and lengths from the advanced
        ``seq_lens``, rebuild the tile schedule from them, clear the sparse index cache."""
        self.compute_indices(metadata)
        self.build_schedule(metadata)
        self.clear_index_cache(metadata)

    def compute_indices(self, metadata: SparseSWAMetadata) -> None:
        """``swa_indices`` and ``swa_lens`` of every token, one kernel launch."""
        n = metadata.num_actual_tokens
        if n == 0:
            return
        window = metadata.swa_indices.shape[1]
        swa_indices_kernel[(n,)](
            metadata.swa_indices,
            metadata.swa_lens,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            metadata.seq_lens.shape[0],
            metadata.swa_indices.stride(0),
            metadata.block_table.stride(0),
            WINDOW=window,
            BLOCK_W=triton.next_power_of_2(window),
            BLOCK_SIZE=self.layer.block_size,
        )

    def build_schedule(self, metadata: SparseSWAMetadata) -> None:
        """``tile_scheduler_metadata`` and ``split_offsets`` from ``swa_lens``, one
        single-program kernel launch."""
        tile_schedule_kernel[(1,)](
            metadata.swa_lens,
            metadata.tile_scheduler_metadata,
            metadata.split_offsets,
            metadata.num_actual_tokens,
            KV_TILE=KV_TILE,
            NUM_PARTS=self.num_parts,
            PARTS_P=triton.next_power_of_2(self.num_parts),
            BLOCK_T=SCHEDULE_TOKEN_BLOCK,
            FIELDS=SCHEDULE_FIELDS,
            num_warps=SCHEDULE_WARPS,
        )

    def clear_index_cache(self, metadata: SparseSWAMetadata) -> None:
        """Empty the sparse index cache: the next forward's first layer refills it."""
        metadata.sparse_index_cache.zero_()
        metadata.sparse_index_cache_valid.zero_()

    def persistent_buffer_extents(self, metadata: SparseSWAMetadata) -> Mapping[str, int]:
        n = metadata.num_actual_tokens
        return {"decode_swa_indices": n, "decode_swa_lens": n, "split_offsets": n + 1,
                "sparse_index_cache": n}

    def workspace_buffers(self) -> Mapping[str, torch.Tensor]:
        """The partial scratch: allocated once, rewritten by every forward."""
        return {
            "part_max": self.scratch.part_max,
            "part_sum": self.scratch.part_sum,
            "part_acc": self.scratch.part_acc,
        }
