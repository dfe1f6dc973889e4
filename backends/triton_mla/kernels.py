"""Triton kernel of the ``triton_mla`` backend: split-KV attention over an MLA latent cache.

Like the ``triton_attn`` kernels it takes every length, offset and block id from device
memory at run time, so its grid depends only on tensor *shapes* and compile-time constants:
a graph captured once stays correct when a replay sees new ``seq_lens`` /
``query_start_loc`` / ``block_table`` / local-length contents.

Work decomposition
------------------
:func:`mla_split_kernel` runs on the grid ``(num_tokens, cdiv(NUM_HEADS, BLOCK_H),
DCP * NUM_SPLITS)``: one program per query row (token), block of ``BLOCK_H`` query heads and
KV split. Every query head attends over the same latent entries (multi-query attention over
one latent "head"), so a program's score tile is ``[BLOCK_H, BLOCK_N]``.

Decode context parallelism (``DCP`` ranks, simulated in one process): the token at global
position ``g`` belongs to rank ``g % DCP`` and is that rank's local entry ``g // DCP``, and
``local_lens[req, rank]`` says how many local entries a rank holds. The third grid axis is
``rank * NUM_SPLITS + split``: each rank's local range is cut into ``NUM_SPLITS`` runs of
whole tiles, and the reduction merges the partials of every rank and split, as DCP merges
the ranks' partial results by their log-sum-exp. With ``DCP == 1``, ``local_lens`` is the
request's ``seq_lens`` and the decomposition is plain split-KV.

A token of request ``r`` at query offset ``i`` (query length ``q_r``) sits at position
``p = seq_lens[r] - q_r + i``. It sees the local entries ``j < local_lens[r, rank]``, and
when ``CAUSAL`` only those whose global position ``j * DCP + rank`` is at most ``p``. So a
multi-token pass (a prefill of the request's new tokens) is causal within the request.

Partials go to the ``[T', NUM_HEADS, DCP * NUM_SPLITS]`` (max, sum) and ``[..., RANK]``
(acc) scratch in the layout of ``triton_attn``'s reduction kernel,
:func:`~speccheck.backends.triton_attn.kernels.paged_attention_reduce_kernel`, which merges
them (``HEAD_SIZE = RANK``): padding tokens (at or past ``query_start_loc[num_reqs]``) write
nothing here and get zeros there; a row that saw no entry writes ``(-inf, 0, 0)`` and gets
zeros.

Numerics: scores and accumulators are fp32. ``UPCAST`` converts loaded queries and latents
to fp32 first (the interpreter computes bf16 arithmetic wrongly); without it, ``tl.dot``
runs on the cache dtype. Every ``tl.dot`` has ``M = BLOCK_H`` and ``K`` one of ``RANK``,
``ROPE``, ``BLOCK_N``, all at least 16 as compiled Triton requires.
"""

from __future__ import annotations

import triton
import triton.language as tl

from speccheck.backends.triton_shared import online_softmax_step, request_of_token


@triton.jit(do_not_specialize=("num_reqs",))
def mla_split_kernel(
    q_ptr,
    latent_ptr,
    block_table_ptr,
    seq_lens_ptr,
    local_lens_ptr,
    query_start_loc_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    scale_log2e,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_lr,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DCP: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Partial attention of one (token, head block, rank and split); see the module
    docstring.

    Shapes: q ``[T, NUM_HEADS, RANK + ROPE]`` (absorbed no-rope part, then the rope part);
    latent cache ``[num_blocks, BLOCK_SIZE, 1, RANK + ROPE]``; block table ``[num_reqs, *]``
    int32; seq_lens ``[num_reqs]`` int32 (global lengths); local_lens ``[num_reqs, DCP]``
    int32 (row stride ``stride_lr``); query_start_loc ``[num_reqs + 1]`` int32; scratch
    contiguous ``[T', NUM_HEADS, DCP * NUM_SPLITS]`` (fp32 max and sum) and ``[T',
    NUM_HEADS, DCP * NUM_SPLITS, RANK]`` (fp32 acc), ``T' >= T``. The last dimension of q
    and of the cache must be contiguous.
    """
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    part_index = tl.program_id(2)
    rank = part_index // NUM_SPLITS
    split = part_index % NUM_SPLITS

    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # a padding token: the reduction writes its zeros
    req = request_of_token(query_start_loc_ptr, token, num_reqs)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    position = tl.load(seq_lens_ptr + req) - q_len + (token - q_start)
    kv_end = tl.load(local_lens_ptr + req.to(tl.int64) * stride_lr + rank)
    if CAUSAL:
        # local entries j with j * DCP + rank <= position
        kv_end = tl.minimum(kv_end, tl.maximum(position - rank + DCP, 0) // DCP)
    num_tiles = tl.cdiv(tl.maximum(kv_end, 0), BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    nope = tl.arange(0, RANK)
    rope = RANK + tl.arange(0, ROPE)
    q_row = q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + nope[None, :], mask=head_ok[:, None], other=0.0)
    q_pe = tl.load(q_row + rope[None, :], mask=head_ok[:, None], other=0.0)
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        local = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = local < kv_end
        pos = local * DCP + rank
        page = tl.load(table_row + pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        entry = latent_ptr + page * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        kv = tl.load(entry[:, None] + nope[None, :], mask=kv_ok[:, None], other=0.0)
        k_pe = tl.load(entry[:, None] + rope[None, :], mask=kv_ok[:, None], other=0.0)
        if UPCAST:
            kv = kv.to(tl.float32)
            k_pe = k_pe.to(tl.float32)

        scores = tl.dot(q_nope, tl.trans(kv), input_precision="ieee")
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        scores = tl.where(kv_ok[None, :], scores * scale_log2e, float("-inf"))

        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, kv)

    part = (token.to(tl.int64) * NUM_HEADS + heads) * (DCP * NUM_SPLITS) + part_index
    tl.store(part_max_ptr + part, m_i, mask=head_ok)
    tl.store(part_sum_ptr + part, l_i, mask=head_ok)
    tl.store(part_acc_ptr + part[:, None] * RANK + nope[None, :], acc, mask=head_ok[:, None])
