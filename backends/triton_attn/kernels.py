"""Triton kernels of the ``triton_attn`` backend: split-KV paged attention and its reduction
(a kernel of its own, or folded into the split kernel).

Both kernels take every length, offset and block id from device memory at run time, so
their grids depend only on tensor *shapes* and compile-time constants. A graph captured once
therefore stays correct when a replay sees new ``seq_lens`` / ``query_start_loc`` /
``block_table`` contents.

Work decomposition
------------------
The query tokens of request ``r`` (``q_r`` of them, starting at ``query_start_loc[r]``) are
cut into query blocks of ``BLOCK_M`` tokens. Request ``r`` owns the program slots
``[query_start_loc[r] // BLOCK_M + r, query_start_loc[r + 1] // BLOCK_M + r + 1)``: at least
``cdiv(q_r, BLOCK_M)`` slots, and the slots of consecutive requests are disjoint and
increasing, so ``num_tokens // BLOCK_M + num_reqs`` slots cover any batch whose offsets end
at or below ``num_tokens``. A slot with no query block behind it exits at once.

:func:`paged_attention_split_kernel` runs on the grid ``(slots, num_kv_heads, NUM_SPLITS)``.
One program handles one query block of one request, the ``GROUP`` query heads that share one
KV head, and one split of the KV range that block may see. Its rows are ``BLOCK_M * GROUP_P``
(token, head) pairs. It writes, for every row it owns, an unnormalised partial result: the
running maximum (log2 domain), the softmax denominator and the weighted value sum, into
``[num_tokens, num_heads, NUM_SPLITS]`` scratch; an empty split writes ``(-inf, 0, 0)``.

:func:`paged_attention_reduce_kernel` runs on ``(num_tokens, num_heads)``, merges the
``NUM_SPLITS`` partials of a token and writes the output row. Tokens at or past
``query_start_loc[num_reqs]`` (padding) get zeros without reading scratch, and a row that saw
no key (``seq_len == 0``, or a causal position before the first key) gets zeros too.

The reduction folded into the split kernel (``REDUCE``, the decode path's one launch): after
storing its partials, a program counts itself in its (slot, KV head)'s arrival counter with
an acquire-release atomic, behind a barrier, so every thread's stores are released with
it. The last of the ``NUM_SPLITS`` to arrive clears the counter and merges the partials of
its rows as the reduction kernel does, reading them past the SM-local cache. The grid then
has one slot more: the slots past the last request's (trailing slot ``j`` takes the
``BLOCK_M`` tokens from ``query_start_loc[num_reqs] + j * BLOCK_M``) zero the padding
tokens' rows, which, with the extra slot, they cover whatever the offsets. Decode context
parallelism keeps the separate reduction (it also writes the log-sum-exp).

Decode context parallelism: the split kernel attends the KV positions of one DCP rank's
share (``dcp_rank`` of ``dcp_world``; the layout of :mod:`speccheck.backends.dcp`): local
position ``j`` of a request, bounded by ``local_lens[r]``, holds global position
``j * dcp_world + dcp_rank``, and the causal rule applies to the global position. With
``dcp_world == 1`` (``local_lens`` is ``seq_lens``) that is the whole cache. With
``WRITE_LSE`` the reduction also writes each row's natural-log log-sum-exp (``-inf`` for a
row that saw no key, padding included), which :func:`~speccheck.backends.dcp.merge_partials`
needs to merge the ranks' partials.

Numerics: scores and accumulators are fp32. With ``UPCAST`` the kernels convert loaded
queries, keys and values to fp32 before any arithmetic; the Triton interpreter (CPU) needs
it, as it computes bf16 arithmetic and bf16 ``tl.dot`` wrongly. Without it (GPU), ``tl.dot``
runs on the cache dtype (tensor cores for fp16/bf16; exact fp32 FMA for fp32, as
``input_precision="ieee"``). Every ``tl.dot`` has ``K = HEAD_SIZE`` or ``K = BLOCK_N``, both
at least 16, which compiled Triton requires.
"""

from __future__ import annotations

import triton
import triton.language as tl

from speccheck.backends.triton_shared import online_softmax_step
from speccheck.contract.dependent_launch import await_predecessor, release_dependents

LOG2E = 1.4426950408889634
"""``log2(e)``: scores are scaled by ``scale * LOG2E`` so the kernels can use ``exp2``."""
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
"""``ln(2)``: turns the log2-domain log-sum-exp into the natural-log one (a constexpr, so
kernels may read it)."""


@triton.jit
def _owning_request(query_start_loc_ptr, slot, num_reqs, BLOCK_M: tl.constexpr):
    """Largest ``r < num_reqs`` with ``query_start_loc[r] // BLOCK_M + r <= slot`` (binary
    search; the left-hand side is strictly increasing in ``r``)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= slot:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=("num_reqs", "num_tokens"))
def paged_attention_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    local_lens_ptr,
    query_start_loc_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    out_ptr,
    arrivals_ptr,
    scale_log2e,
    num_reqs,
    num_tokens,
    dcp_rank,
    dcp_world,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    REDUCE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Partial attention of one (query block, KV head, KV split); see the module docstring.

    Shapes: q ``[T, NUM_HEADS, HEAD_SIZE]``; caches ``[num_blocks, BLOCK_SIZE, num_kv_heads,
    HEAD_SIZE]``; block table ``[num_reqs, *]`` int32; seq_lens (global) and local_lens
    (this DCP rank's share; ``seq_lens`` itself at ``dcp_world == 1``) ``[num_reqs]`` int32;
    query_start_loc ``[num_reqs + 1]`` int32; scratch contiguous ``[T', NUM_HEADS,
    NUM_SPLITS]`` (fp32 max and sum) and ``[T', NUM_HEADS, NUM_SPLITS, HEAD_SIZE]`` (fp32
    acc) with ``T' >= T``. The last dimension of q and of the caches must be contiguous.

    With ``REDUCE`` the kernel also does the reduction (see the module docstring): the grid
    has one more slot, ``out`` (``[T, NUM_HEADS, HEAD_SIZE]``, strides ``stride_ot,
    stride_oh``, last dimension contiguous) receives the rows of the ``num_tokens = T``
    tokens, and ``arrivals`` (int32, one counter per (slot, KV head), zero before the
    launch) is left zero. Without it ``out_ptr`` and ``arrivals_ptr`` are never touched.

    With ``PDL`` it is launched as a programmatic dependent
    (:mod:`~speccheck.contract.dependent_launch`) and waits for the kernel ahead before
    anything else.
    """
    slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    release_dependents(PDL)
    await_predecessor(PDL)

    req = _owning_request(query_start_loc_ptr, slot, num_reqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    block_q0 = (slot - (q_start // BLOCK_M + req)) * BLOCK_M
    if block_q0 >= q_len:
        if REDUCE:
            if split == 0:
                _zero_trailing_block(out_ptr, query_start_loc_ptr, slot, kv_head, num_reqs,
                                     num_tokens, stride_ot, stride_oh, GROUP, GROUP_P,
                                     HEAD_SIZE, BLOCK_M)
        return
    seq_len = tl.load(seq_lens_ptr + req)
    local_len = tl.load(local_lens_ptr + req)

    ROWS: tl.constexpr = BLOCK_M * GROUP_P
    rows = tl.arange(0, ROWS)
    tok = block_q0 + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (tok < q_len) & (rows % GROUP_P < GROUP)
    position = seq_len - q_len + tok

    # Local KV positions this query block may see (those this rank holds below the global
    # causal bound), cut into NUM_SPLITS runs of whole tiles.
    if CAUSAL:
        global_end = seq_len - q_len + tl.minimum(block_q0 + BLOCK_M, q_len)
        held = tl.maximum(global_end - dcp_rank + dcp_world - 1, 0) // dcp_world
        kv_end = tl.minimum(local_len, held)
    else:
        kv_end = local_len
    num_tiles = tl.cdiv(tl.maximum(kv_end, 0), BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    dims = tl.arange(0, HEAD_SIZE)
    token = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_SIZE], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        kv = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = kv < kv_end
        page = tl.load(table_row + kv // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        in_page = kv % BLOCK_SIZE
        k_off = page * stride_kb + in_page * stride_ks + kv_head * stride_kh
        v_off = page * stride_vb + in_page * stride_vs + kv_head * stride_vh
        k = tl.load(k_cache_ptr + k_off[:, None] + dims[None, :], mask=kv_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=kv_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e
        visible = kv_ok[None, :]
        if CAUSAL:
            visible = visible & (kv[None, :] * dcp_world + dcp_rank <= position[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v)

    part = (token * NUM_HEADS + head) * NUM_SPLITS + split
    tl.store(part_max_ptr + part, m_i, mask=row_ok)
    tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    tl.store(
        part_acc_ptr + part[:, None] * HEAD_SIZE + dims[None, :], acc, mask=row_ok[:, None]
    )
    if REDUCE:
        # Every thread's partials are stored before the count is released; the last split
        # to arrive acquires them all, clears the count and merges.
        tl.debug_barrier()
        counter = arrivals_ptr + slot * (NUM_HEADS // GROUP) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == NUM_SPLITS - 1:
            tl.store(counter, 0)
            tl.debug_barrier()
            _merge_splits(out_ptr, token * stride_ot + head * stride_oh, part_max_ptr,
                          part_sum_ptr, part_acc_ptr, (token * NUM_HEADS + head) * NUM_SPLITS,
                          row_ok, HEAD_SIZE, NUM_SPLITS)


@triton.jit
def _merge_splits(out_ptr, out_rows, part_max_ptr, part_sum_ptr, part_acc_ptr, first, row_ok,
                  HEAD_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Merge the ``NUM_SPLITS`` partials of each row, found from ``first`` (the row's first
    partial), into its output row at ``out_ptr + out_rows`` (offsets of the rows' first
    channels), as :func:`paged_attention_reduce_kernel` does; a row that saw no key gets
    zeros. The partials were written by other programs: read past the SM-local cache."""
    dims = tl.arange(0, HEAD_SIZE)
    m = tl.full(row_ok.shape, float("-inf"), tl.float32)
    l = tl.zeros(row_ok.shape, tl.float32)
    acc = tl.zeros([row_ok.shape[0], HEAD_SIZE], tl.float32)
    for s in range(NUM_SPLITS):
        m_s = tl.load(part_max_ptr + first + s, mask=row_ok, other=float("-inf"),
                      cache_modifier=".cg")
        l_s = tl.load(part_sum_ptr + first + s, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(part_acc_ptr + (first + s)[:, None] * HEAD_SIZE + dims[None, :],
                        mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, m_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        beta = tl.exp2(m_s - m_ref)
        l = l * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _zero_trailing_block(out_ptr, query_start_loc_ptr, slot, kv_head, num_reqs, num_tokens,
                         stride_ot, stride_oh, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                         HEAD_SIZE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Zero KV head ``kv_head``'s query heads in the output rows of this slot's share of the
    padding tokens (those at or past ``query_start_loc[num_reqs]``): trailing slot ``j``
    (the ``j``-th past the last request's slots) takes the ``BLOCK_M`` tokens from
    ``query_start_loc[num_reqs] + j * BLOCK_M``, below ``num_tokens``. With one slot more
    than the split grid needs, the trailing slots cover every padding token."""
    end = tl.load(query_start_loc_ptr + num_reqs)
    trailing = slot - (end // BLOCK_M + num_reqs)
    if trailing >= 0:
        lanes = tl.arange(0, GROUP_P)
        heads = kv_head * GROUP + lanes
        dims = tl.arange(0, HEAD_SIZE)
        zeros = tl.zeros([GROUP_P, HEAD_SIZE], tl.float32).to(out_ptr.dtype.element_ty)
        for i in range(BLOCK_M):
            tok = (end + trailing * BLOCK_M + i).to(tl.int64)
            rows = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            tl.store(rows, zeros, mask=(lanes[:, None] < GROUP) & (tok < num_tokens))


@triton.jit(do_not_specialize=("num_reqs",))
def paged_attention_reduce_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    lse_ptr,
    query_start_loc_ptr,
    num_reqs,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Merge the split partials of one (token, head) into ``out`` (``[T, NUM_HEADS,
    HEAD_SIZE]``, last dimension contiguous), or write zeros for a padding token. With
    ``WRITE_LSE`` also the row's natural-log log-sum-exp into ``lse`` (fp32, ``[T,
    NUM_HEADS]`` with strides ``stride_lt, stride_lh``): ``-inf`` where no key was seen;
    without it ``lse_ptr`` is never touched."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_SIZE)
    out_row = out_ptr + token * stride_ot + head * stride_oh + dims
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        tl.store(out_row, tl.zeros([HEAD_SIZE], tl.float32).to(out_ptr.dtype.element_ty))
        if WRITE_LSE:
            tl.store(lse_ptr + token * stride_lt + head * stride_lh, float("-inf"))
        return

    splits = tl.arange(0, SPLITS_P)
    split_ok = splits < NUM_SPLITS
    part = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_SIZE + dims[None, :], mask=split_ok[:, None], other=0.0
    )
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_row, out.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        # log2 of 1, not of 0, where nothing was seen: the interpreter evaluates both
        # branches of the where, and numpy warns on log2(0) in every worker process
        seen = tl.where(total == 0.0, 1.0, total)
        lse = tl.where(total == 0.0, float("-inf"), (m_max + tl.log2(seen)) * LN2)
        tl.store(lse_ptr + token * stride_lt + head * stride_lh, lse)
