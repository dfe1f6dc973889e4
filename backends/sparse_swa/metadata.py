"""The ``sparse_swa`` backend's metadata record and split-KV scratch, and the tile sizes its
kernels and schedule share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_TILE = 16
"""Window positions per attention tile and per schedule work unit; compiled ``tl.dot``
needs at least 16."""
HEAD_BLOCK = 16
"""Query heads per attention program (``BLOCK_H``); compiled ``tl.dot`` needs at least 16
rows, so fewer heads are masked."""
SCHEDULE_FIELDS = 5
"""Entries per row of the tile schedule: first token, first tile, last token, end tile,
first partial."""


@dataclass(frozen=True)
class PartialScratch:
    """The builder's split-KV workspace (fp32, allocated once, never resized): per partial
    result and head, the running maximum (log2 domain), the softmax denominator and the
    weighted latent sum (``[rows, num_heads]``, ``[rows, num_heads]``, ``[rows, num_heads,
    kv_lora_rank]``). A schedule over ``T`` tokens writes at most ``T + num_parts - 1``
    partials, so ``max_num_tokens + num_parts`` rows always suffice. Every forward writes
    the partials it merges before merging them: contents are meaningless between calls."""

    part_max: torch.Tensor
    part_sum: torch.Tensor
    part_acc: torch.Tensor


@dataclass
class SparseSWAMetadata:
    """One attention call: views of the speculator's persistent buffers (``query_start_loc``,
    ``seq_lens``, ``block_table``, ``slot_mapping``), views of the builder's persistent
    buffers (the step-dependent fields the matrix entry declares), and the scratch."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    swa_indices: torch.Tensor
    """``[T, W]`` int32: KV slot of each window position, oldest first; ``-1`` past the
    token's window length and in padding rows."""
    swa_lens: torch.Tensor
    """``[T]`` int32: window length of each token (0 for padding)."""
    tile_scheduler_metadata: torch.Tensor
    """``[num_parts, 5]`` int32: each attention program's run of KV tiles."""
    split_offsets: torch.Tensor
    """``[T + 1]`` int32, cumulative: token ``t``'s partial results are
    ``split_offsets[t] .. split_offsets[t + 1] - 1``."""
    sparse_index_cache: torch.Tensor
    """``[T, W]`` int64: latent-cache element offset of each window entry (``-1``: none);
    meaningful only while ``sparse_index_cache_valid`` is set."""
    sparse_index_cache_valid: torch.Tensor
    """``[1]`` int32: set by the first layer that fills the cache, cleared by build and
    refresh."""
    scratch: PartialScratch
