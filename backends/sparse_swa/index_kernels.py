"""Triton kernels that derive the ``sparse_swa`` backend's step-dependent metadata.

All three read lengths, offsets and block ids from device memory and run on grids that
depend only on shapes and compile-time constants, so a captured graph recomputes the right
values on every replay.

- :func:`swa_indices_kernel` (grid ``(T,)``): the sliding-window KV slots and window length
  of every query token, through the block table.
- :func:`tile_schedule_kernel` (grid ``(1,)``): the split-KV work schedule: the KV tiles of
  all tokens cut into ``NUM_PARTS`` equal runs, one per attention program.
- :func:`fill_index_cache_kernel` (grid ``(T,)``): the window slots turned into element
  offsets of the latent cache, unless the cache is already valid.

Token layout: the ``q`` query tokens of request ``r`` are tokens ``query_start_loc[r] ..
query_start_loc[r + 1] - 1``; token ``i`` of them sits at position ``seq_lens[r] - q + i``
(causal). Tokens at or past ``query_start_loc[num_reqs]`` are padding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from speccheck.backends.triton_shared import request_of_token


@triton.jit(do_not_specialize=("num_reqs",))
def swa_indices_kernel(
    indices_ptr,
    lens_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_reqs,
    stride_it,
    stride_bt,
    WINDOW: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Window of one query token: ``lens[t]`` and row ``indices[t, :WINDOW]`` (int32).

    A token at position ``p`` sees positions ``max(0, p - WINDOW + 1) .. p``, oldest first:
    ``lens[t] = clamp(p + 1, 0, WINDOW)`` and ``indices[t, j]`` is the KV slot
    ``block_table[r, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE`` of the ``j``-th
    of them, ``-1`` for ``j >= lens[t]``. Padding tokens get length 0 and a row of ``-1``.
    ``BLOCK_W`` is ``WINDOW`` rounded up to a power of two.
    """
    token = tl.program_id(0)
    window = tl.arange(0, BLOCK_W)
    row = indices_ptr + token.to(tl.int64) * stride_it + window
    in_row = window < WINDOW
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        tl.store(lens_ptr + token, 0)
        tl.store(row, tl.full([BLOCK_W], -1, tl.int32), mask=in_row)
        return
    req = request_of_token(query_start_loc_ptr, token, num_reqs)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    position = tl.load(seq_lens_ptr + req) - q_len + (token - q_start)
    length = tl.minimum(tl.maximum(position + 1, 0), WINDOW)
    kv = position - length + 1 + window
    live = window < length
    page = tl.load(block_table_ptr + req.to(tl.int64) * stride_bt + kv // BLOCK_SIZE,
                   mask=live, other=0)
    slot = tl.where(live, page * BLOCK_SIZE + kv % BLOCK_SIZE, -1)
    tl.store(lens_ptr + token, length)
    tl.store(row, slot, mask=in_row)


@triton.jit(do_not_specialize=("num_tokens",))
def tile_schedule_kernel(
    lens_ptr,
    schedule_ptr,
    split_offsets_ptr,
    num_tokens,
    KV_TILE: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    PARTS_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FIELDS: tl.constexpr,
):
    """Cut the KV tiles of ``num_tokens`` tokens into ``NUM_PARTS`` runs of equal length.

    Token ``t`` has ``w[t] = cdiv(lens[t], KV_TILE)`` tiles; laid end to end in token order
    they are the work units ``0 .. total - 1``. Part ``p`` owns units ``[p * per_part,
    min((p + 1) * per_part, total))`` with ``per_part = max(1, cdiv(total, NUM_PARTS))``, so
    long windows are split over several parts and short ones share a part.

    Writes row ``p`` of ``schedule`` (int32, ``FIELDS`` = 5 per row): ``(first_token,
    first_tile, last_token, end_tile, first_partial)``: the part runs tiles ``first_tile ..`` of ``first_token``, every tile of the
    tokens in between, and tiles ``.. end_tile - 1`` of ``last_token``; an empty part has
    ``last_token = -1``. Each (part, token) pair with tiles writes one partial result;
    ``split_offsets[t] .. split_offsets[t + 1] - 1`` (``[num_tokens + 1]``, cumulative) are
    the partials of token ``t``, and ``first_partial`` is the part's partial of
    ``first_token`` (its later tokens start their own runs, at ``split_offsets[t]``).
    ``PARTS_P`` is ``NUM_PARTS`` rounded up to a power of two.
    """
    offsets = tl.arange(0, BLOCK_T)
    total = tl.zeros([], tl.int32)
    for start in range(0, num_tokens, BLOCK_T):
        token = start + offsets
        lens = tl.load(lens_ptr + token, mask=token < num_tokens, other=0)
        total += tl.sum(tl.cdiv(lens, KV_TILE), 0)
    per_part = tl.maximum(tl.cdiv(total, NUM_PARTS), 1)

    parts = tl.arange(0, PARTS_P)
    begin = parts * per_part
    last = tl.minimum(begin + per_part, total) - 1
    first_token = tl.zeros([PARTS_P], tl.int32)
    first_tile = tl.zeros([PARTS_P], tl.int32)
    first_partial = tl.zeros([PARTS_P], tl.int32)
    last_token = tl.zeros([PARTS_P], tl.int32)
    end_tile = tl.zeros([PARTS_P], tl.int32)
    units_before = tl.zeros([], tl.int32)
    splits_before = tl.zeros([], tl.int32)
    tl.store(split_offsets_ptr, 0)
    for start in range(0, num_tokens, BLOCK_T):
        token = start + offsets
        in_batch = token < num_tokens
        work = tl.cdiv(tl.load(lens_ptr + token, mask=in_batch, other=0), KV_TILE)
        unit_end = tl.cumsum(work, 0) + units_before
        unit_start = unit_end - work
        splits = tl.where(work > 0, (unit_end - 1) // per_part - unit_start // per_part + 1, 0)
        split_end = tl.cumsum(splits, 0) + splits_before
        tl.store(split_offsets_ptr + 1 + token, split_end, mask=in_batch)

        # A part begins (ends) in the one token whose unit range holds its first (last) unit.
        starts = (unit_start[None, :] <= begin[:, None]) & (begin[:, None] < unit_end[None, :])
        first_token += tl.sum(tl.where(starts, token[None, :], 0), 1)
        first_tile += tl.sum(tl.where(starts, begin[:, None] - unit_start[None, :], 0), 1)
        own_split = split_end - splits
        first_partial += tl.sum(
            tl.where(starts, own_split[None, :] + parts[:, None]
                     - unit_start[None, :] // per_part, 0), 1)
        ends = (unit_start[None, :] <= last[:, None]) & (last[:, None] < unit_end[None, :])
        last_token += tl.sum(tl.where(ends, token[None, :], 0), 1)
        end_tile += tl.sum(tl.where(ends, last[:, None] + 1 - unit_start[None, :], 0), 1)
        units_before += tl.sum(work, 0)
        splits_before += tl.sum(splits, 0)

    live = begin < total
    row = schedule_ptr + parts * FIELDS
    in_grid = parts < NUM_PARTS
    tl.store(row + 0, tl.where(live, first_token, 0), mask=in_grid)
    tl.store(row + 1, tl.where(live, first_tile, 0), mask=in_grid)
    tl.store(row + 2, tl.where(live, last_token, -1), mask=in_grid)
    tl.store(row + 3, tl.where(live, end_tile, 0), mask=in_grid)
    tl.store(row + 4, tl.where(live, first_partial, 0), mask=in_grid)


@triton.jit
def fill_index_cache_kernel(
    cache_ptr,
    valid_ptr,
    indices_ptr,
    lens_ptr,
    num_blocks,
    stride_ct,
    stride_it,
    stride_kb,
    stride_ks,
    WINDOW: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Row ``t`` of the sparse index cache, unless ``valid[0]`` is set (then nothing).

    ``cache[t, j]`` (int64) is the element offset ``block * stride_kb + offset *
    stride_ks`` in the latent cache of slot ``indices[t, j]``, for ``j < lens[t]`` and a
    block inside the cache (``< num_blocks``); ``-1`` otherwise. The caller sets
    ``valid[0]`` after this launch: a program may not, or programs that start later would
    skip their rows.
    """
    if tl.load(valid_ptr) != 0:
        return
    token = tl.program_id(0).to(tl.int64)
    window = tl.arange(0, BLOCK_W)
    in_row = window < WINDOW
    slot = tl.load(indices_ptr + token * stride_it + window, mask=in_row, other=-1)
    block = slot // BLOCK_SIZE
    live = (window < tl.load(lens_ptr + token)) & (slot >= 0) & (block < num_blocks)
    offset = block.to(tl.int64) * stride_kb + (slot % BLOCK_SIZE).to(tl.int64) * stride_ks
    tl.store(cache_ptr + token * stride_ct + window, tl.where(live, offset, -1), mask=in_row)
