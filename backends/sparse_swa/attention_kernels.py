"""Triton kernels of the ``sparse_swa`` backend: absorbed-MLA attention over each token's
sliding-window index list, split over KV tiles by the tile schedule, and the merge.

:func:`sparse_mla_split_kernel` runs on ``(NUM_PARTS, head_blocks)``: program ``(p, hb)``
follows row ``p`` of the tile schedule (see
:func:`~speccheck.backends.sparse_swa.index_kernels.tile_schedule_kernel`) for the
``BLOCK_H`` query heads of head block ``hb``. For every token of its run it gathers the
latent entries at the token's sparse-index-cache offsets, ``KV_TILE`` at a time, and writes
one unnormalised partial result (running maximum in the log2 domain, softmax denominator,
weighted latent sum) to the partial scratch. :func:`sparse_mla_combine_kernel` runs on
``(T, head_blocks)`` and merges the partials ``split_offsets[t] .. split_offsets[t + 1] - 1``
of token ``t`` into its output row (zeros for a token with none: padding, or no key).

Attention, absorbed MLA: a query row is ``[RANK + ROPE]`` (the no-rope part already through
``W_UK``, then the rope part), a latent entry ``[RANK + ROPE]`` (compressed KV, then the
rope key); the score is their dot product over all ``RANK + ROPE`` channels times
``scale``, and the value is the entry's first ``RANK`` channels.

Grids depend on shapes only; every length, offset and schedule entry is read from device
memory. Numerics: fp32 scores and accumulators; with ``UPCAST`` (the Triton interpreter,
which computes bf16 arithmetic and bf16 ``tl.dot`` wrongly) loaded queries and latents are
converted to fp32 first. Every ``tl.dot`` contracts over ``RANK``, ``ROPE`` or ``KV_TILE``
and has ``BLOCK_H`` rows, all at least 16, as compiled Triton requires.
"""

from __future__ import annotations

import triton
import triton.language as tl

from speccheck.backends.triton_shared import online_softmax_step


@triton.jit
def sparse_mla_split_kernel(
    q_ptr,
    latent_ptr,
    cache_ptr,
    lens_ptr,
    schedule_ptr,
    split_offsets_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_ct,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_TILE: tl.constexpr,
    FIELDS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Partial attention of one (schedule part, head block); see the module docstring.

    Shapes: q ``[T, NUM_HEADS, RANK + ROPE]`` (last dimension contiguous); latent cache
    addressed by element offsets from the index cache ``[T', W]`` int64 (``-1``: no entry);
    lens ``[T']`` int32; schedule ``[NUM_PARTS, FIELDS]`` int32; split offsets ``[T + 1]``
    int32; scratch contiguous ``[P, NUM_HEADS]`` (fp32 max and sum) and ``[P, NUM_HEADS,
    RANK]`` (fp32 acc), ``P`` at least the schedule's partial count.
    """
    part = tl.program_id(0)
    head_block = tl.program_id(1)
    row = schedule_ptr + part * FIELDS
    first_token = tl.load(row + 0)
    first_tile = tl.load(row + 1)
    last_token = tl.load(row + 2)
    end_tile = tl.load(row + 3)
    first_partial = tl.load(row + 4)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    rank = tl.arange(0, RANK)
    rope = tl.arange(0, ROPE)
    for token in range(first_token, last_token + 1):
        length = tl.load(lens_ptr + token)
        tile_lo = tl.where(token == first_token, first_tile, 0)
        tile_hi = tl.where(token == last_token, end_tile, tl.cdiv(length, KV_TILE))
        q_row = q_ptr + tl.cast(token, tl.int64) * stride_qt + heads[:, None] * stride_qh
        q_nope = tl.load(q_row + rank[None, :], mask=head_ok[:, None], other=0.0)
        q_pe = tl.load(q_row + RANK + rope[None, :], mask=head_ok[:, None], other=0.0)
        if UPCAST:
            q_nope = q_nope.to(tl.float32)
            q_pe = q_pe.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, RANK], tl.float32)
        cache_row = cache_ptr + tl.cast(token, tl.int64) * stride_ct
        for tile in range(tile_lo, tile_hi):
            kv = tile * KV_TILE + tl.arange(0, KV_TILE)
            offset = tl.load(cache_row + kv, mask=kv < length, other=-1)
            live = offset >= 0
            entry = latent_ptr + tl.where(live, offset, 0)
            k_nope = tl.load(entry[:, None] + rank[None, :], mask=live[:, None], other=0.0)
            k_pe = tl.load(entry[:, None] + RANK + rope[None, :], mask=live[:, None], other=0.0)
            if UPCAST:
                k_nope = k_nope.to(tl.float32)
                k_pe = k_pe.to(tl.float32)
            scores = tl.dot(q_nope, tl.trans(k_nope), input_precision="ieee")
            scores += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
            scores = tl.where(live[None, :], scores * scale_log2e, float("-inf"))

            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, k_nope)

        # A token in the middle of the run with no tiles (padding, no key) owns no partial.
        partial = tl.where(token == first_token, first_partial,
                           tl.load(split_offsets_ptr + token)).to(tl.int64)
        store = head_ok & (tile_hi > tile_lo)
        slot = partial * NUM_HEADS + heads
        tl.store(part_max_ptr + slot, m_i, mask=store)
        tl.store(part_sum_ptr + slot, l_i, mask=store)
        tl.store(part_acc_ptr + slot[:, None] * RANK + rank[None, :], acc, mask=store[:, None])


@triton.jit
def sparse_mla_combine_kernel(
    out_ptr,
    split_offsets_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Merge the partials of one (token, head block) into ``out`` (``[T, NUM_HEADS, RANK]``,
    last dimension contiguous); zeros when the token has no partial."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    rank = tl.arange(0, RANK)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    for partial in range(tl.load(split_offsets_ptr + token),
                         tl.load(split_offsets_ptr + token + 1)):
        slot = tl.cast(partial, tl.int64) * NUM_HEADS + heads
        m = tl.load(part_max_ptr + slot, mask=head_ok, other=float("-inf"))
        m_new = tl.maximum(m_i, m)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        beta = tl.exp2(m - m_ref)
        l_i = l_i * alpha + beta * tl.load(part_sum_ptr + slot, mask=head_ok, other=0.0)
        part = tl.load(part_acc_ptr + slot[:, None] * RANK + rank[None, :],
                       mask=head_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + beta[:, None] * part
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_row = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    tl.store(out_row + rank[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
