"""FlashInfer's CSR page table: the lengths on the host, the page indices on the device.

FlashInfer describes the KV pages of a batch in CSR form (int32): request ``r`` owns the
physical blocks ``indices[indptr[r]:indptr[r + 1]]``, and ``last_page_len[r]`` entries of
its last one. ``indptr`` and ``last_page_len`` depend only on the KV lengths, which the
host knows, so :func:`paged_kv_lengths` computes them there. ``indices`` are block-table
entries, which live on the device: :func:`write_paged_kv_indices` gathers them there with
one Triton kernel, so planning never copies the block table back to the host. Both also
take the tables of several draft steps at once, one row each (the lengths differ, the block
table is the same): a preplanned replay's tables cost one call and one launch, and
:func:`stage_paged_kv_lengths` writes their lengths straight into the pinned rows they are
copied to the device from.

:func:`write_paged_kv_table` builds the whole table on the device from the device KV
lengths, in one launch: what a builder whose plans do not depend on the lengths
(:mod:`~speccheck.backends.flashinfer.fixed_plan`) refreshes inside a captured graph.

:func:`paged_kv_layout` is the whole table built on the host from a host block table: the
reference the kernels are tested against. The builders never call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

INDEX_BLOCK = 128
"""Block-table columns (and tail entries) one kernel program handles per iteration."""


@dataclass(frozen=True)
class PagedKVLengths:
    """The length-only part of a CSR page table, on the host (int32).

    - ``indptr``: ``[num_reqs + 1]``, request ``r`` owns ``indices[indptr[r]:indptr[r+1]]``;
    - ``last_page_len``: ``[num_reqs]``, entries in each request's last page, in
      ``1 .. page_size`` for a request with pages and 0 for one without (padding lanes:
      FlashInfer's device-side length is 0 whenever a request owns no page).

    Several tables at once (the draft steps of one replay) carry a leading table dimension.
    """

    indptr: torch.Tensor
    last_page_len: torch.Tensor

    @property
    def num_pages(self) -> int:
        """``indptr[-1]``: the used head of the indices (of several tables, the longest)."""
        return int(self.indptr[..., -1].max())


@dataclass(frozen=True)
class PagedKVLayout(PagedKVLengths):
    """A whole CSR page table on the host: :class:`PagedKVLengths` and ``indices``
    (``[indptr[-1]]`` int32, the physical block ids in order)."""

    indices: torch.Tensor


def paged_kv_lengths(
    seq_lens: torch.Tensor | np.ndarray, page_size: int, max_blocks: int
) -> PagedKVLengths:
    """``indptr`` and ``last_page_len`` of requests with KV lengths ``seq_lens``
    (``[num_reqs]``, host) in pages of ``page_size``; raises if a request needs more than
    ``max_blocks`` pages (the block table's width). Given ``[tables, num_reqs]`` lengths
    (the draft steps of one replay), one table per row: ``[tables, num_reqs + 1]`` and
    ``[tables, num_reqs]``. Host arithmetic only."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    if seq.ndim == 0 or seq.ndim > 2:
        raise ValueError(f"sequence lengths of shape {seq.shape}: one row, or one per table")
    indptr = np.zeros((*seq.shape[:-1], seq.shape[-1] + 1), dtype=np.int32)
    last = np.empty(seq.shape, dtype=np.int32)
    _fill_lengths(seq, page_size, max_blocks, indptr, last)
    return PagedKVLengths(indptr=torch.from_numpy(indptr), last_page_len=torch.from_numpy(last))


def stage_paged_kv_lengths(
    seq_lens: np.ndarray, page_size: int, max_blocks: int, rows: np.ndarray
) -> list[int]:
    """:func:`paged_kv_lengths` of ``[tables, num_reqs]`` lengths written straight into
    ``rows`` (``[tables, 2 * num_reqs + 1]`` int32: each table's ``indptr``, then its
    ``last_page_len``; the draft steps' staging layout); returns each table's page count.
    Same checks, no tensor made: host time is what the preplanned path is for."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    if seq.ndim != 2 or rows.shape != (seq.shape[0], 2 * seq.shape[1] + 1):
        raise ValueError(
            f"lengths of shape {seq.shape} do not fit staging rows of shape {rows.shape}"
        )
    n = seq.shape[1]
    rows[:, 0] = 0
    _fill_lengths(seq, page_size, max_blocks, rows[:, : n + 1], rows[:, n + 1 :])
    pages: list[int] = rows[:, n].tolist()
    return pages


def _fill_lengths(
    seq: np.ndarray, page_size: int, max_blocks: int, indptr: np.ndarray, last: np.ndarray
) -> None:
    """Check ``seq`` (int64, ``[..., num_reqs]``) and write its ``indptr[..., 1:]`` (the
    caller zeroes ``indptr[..., 0]``) and ``last_page_len``."""
    if seq.size:
        if int(seq.min()) < 0:
            raise ValueError(f"negative sequence length in {seq.tolist()}")
        longest = int(seq.max())
        if longest > max_blocks * page_size:
            raise ValueError(
                f"a sequence of length {longest} needs {-(-longest // page_size)} pages of "
                f"{page_size} but the block table has {max_blocks} columns"
            )
    pages = seq + (page_size - 1)
    pages //= page_size
    np.cumsum(pages, axis=-1, out=indptr[..., 1:], dtype=np.int32)
    # Entries in the last page; a request without pages has none (max keeps it at 0).
    np.subtract(seq, np.maximum(pages - 1, 0) * page_size, out=last, casting="unsafe")


def paged_kv_layout(
    seq_lens: torch.Tensor | np.ndarray, block_table: torch.Tensor | np.ndarray, page_size: int
) -> PagedKVLayout:
    """The CSR page table of requests with KV lengths ``seq_lens`` (``[num_reqs]``) whose
    blocks are the rows of ``block_table`` (``[num_reqs, max_blocks]``). Host arrays only:
    the reference for :func:`write_paged_kv_indices`."""
    table = np.asarray(block_table)
    num_reqs = np.asarray(seq_lens).reshape(-1).shape[0]
    if table.ndim != 2 or table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table of shape {tuple(table.shape)} does not cover num_reqs={num_reqs}"
        )
    lengths = paged_kv_lengths(seq_lens, page_size, table.shape[1])
    pages = np.diff(lengths.indptr.numpy())
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    indices = np.ascontiguousarray(table[:num_reqs][used], dtype=np.int32)
    return PagedKVLayout(
        indptr=lengths.indptr,
        last_page_len=lengths.last_page_len,
        indices=torch.from_numpy(indices),
    )


@triton.jit
def _write_pages_and_tail(indices_ptr, row, start, pages, used, req, tail_per_program,
                          capacity, BLOCK: tl.constexpr):
    """One program's stores into an indices row: ``indices[start + j] = row[j]`` for ``j <
    pages``, then zeros over ``tail_per_program`` entries from ``used + req *
    tail_per_program``; nothing outside ``indices[0:capacity]``."""
    cols = tl.arange(0, BLOCK)
    for first in range(0, pages, BLOCK):
        col = first + cols
        dst = start + col
        live = (col < pages) & (dst >= 0) & (dst < capacity)
        tl.store(indices_ptr + dst, tl.load(row + col, mask=live, other=0), mask=live)
    tail = used + req * tail_per_program
    for first in range(0, tail_per_program, BLOCK):
        part = first + cols
        dst = tail + part
        stale = (part < tail_per_program) & (dst >= 0) & (dst < capacity)
        tl.store(indices_ptr + dst, tl.zeros([BLOCK], tl.int32), mask=stale)


@triton.jit(do_not_specialize=("num_reqs", "tail_per_program"))
def paged_kv_indices_kernel(
    indices_ptr,
    block_table_ptr,
    indptr_ptr,
    num_reqs,
    max_blocks,
    capacity,
    tail_per_program,
    stride_bt,
    stride_indices,
    stride_indptr,
    BLOCK: tl.constexpr,
):
    """Program ``(r, s)`` (grid ``(num_reqs, tables)``) writes request ``r``'s page indices
    into table ``s`` and zeroes one share of that table's tail.

    Table ``s`` is the row ``indices[s]`` (``capacity`` entries, ``stride_indices`` apart)
    with its own ``indptr[s]`` (``stride_indptr`` apart); every table reads the same block
    table. ``indices[s, indptr[s, r] + j] = block_table[r, j]`` for ``j < indptr[s, r + 1]
    - indptr[s, r]``; then ``indices[s, used + r * tail_per_program ...]``
    (``tail_per_program`` entries, where ``used = indptr[s, num_reqs]``) are set to 0. With
    ``tail_per_program * num_reqs >= capacity`` the programs together zero every entry from
    ``used`` to ``capacity``. No store leaves ``indices[s, 0:capacity]``, whatever
    ``indptr`` holds.
    """
    req = tl.program_id(0)
    table = tl.program_id(1).to(tl.int64)
    indices_ptr += table * stride_indices
    indptr_ptr += table * stride_indptr
    start = tl.load(indptr_ptr + req)
    pages = tl.minimum(tl.load(indptr_ptr + req + 1) - start, max_blocks)
    row = block_table_ptr + req.to(tl.int64) * stride_bt
    _write_pages_and_tail(indices_ptr, row, start, pages, tl.load(indptr_ptr + num_reqs), req,
                          tail_per_program, capacity, BLOCK)


def _check_int32_beside(caller: str, indices: torch.Tensor,
                        tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise unless every named tensor is int32 on ``indices``' device."""
    for name, t in tensors:
        if t.dtype != torch.int32:
            raise ValueError(f"{caller}: {name} must be int32, got {t.dtype}")
        if t.device != indices.device:
            raise ValueError(f"{caller}: {name} is on {t.device}, indices on {indices.device}")


def _check_block_table(caller: str, block_table: torch.Tensor, num_reqs: int) -> None:
    """Raise unless ``block_table`` holds ``num_reqs`` rows with contiguous columns."""
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs or block_table.stride(1) != 1:
        raise ValueError(
            f"{caller}: block_table of shape {tuple(block_table.shape)} does not hold "
            f"{num_reqs} contiguous rows"
        )


def write_paged_kv_indices(
    indices: torch.Tensor, block_table: torch.Tensor, indptr: torch.Tensor, num_reqs: int
) -> None:
    """Fill the persistent ``indices`` buffer (``[capacity]`` int32, device) with the CSR
    page indices of the first ``num_reqs`` requests, and zero the rest of it; or, given
    ``[tables, capacity]`` indices and ``[tables, >= num_reqs + 1]`` indptr, every table
    (row) from its own indptr row, in the same one launch (the draft steps of one replay,
    whose lengths differ while their block table is the same).

    ``indptr`` (``[>= num_reqs + 1]`` int32) and ``block_table`` (``[>= num_reqs,
    max_blocks]`` int32, rows contiguous) are read on the device, where they must already
    hold this batch's values (stream order); ``indptr[num_reqs]`` may not exceed
    ``capacity``. Afterwards ``indices[indptr[r] + j] = block_table[r, j]`` for every
    request ``r`` and ``j < indptr[r + 1] - indptr[r]``, and ``indices[indptr[num_reqs]:]``
    is zero, so no block id of an earlier, larger batch remains.

    Capture-safe: one kernel launch whose grid depends only on ``num_reqs`` and the
    buffers' shapes, no host synchronisation, no allocation; ``indices`` is written in
    place.
    """
    _check_int32_beside("write_paged_kv_indices", indices,
                        (("indices", indices), ("block_table", block_table), ("indptr", indptr)))
    tables = indices.unsqueeze(0) if indices.dim() == 1 else indices
    offsets = indptr.unsqueeze(0) if indptr.dim() == 1 else indptr
    if tables.dim() != 2 or tables.stride(1) != 1 or indices.dim() != indptr.dim():
        raise ValueError(
            "write_paged_kv_indices: indices must be one contiguous row, or rows of them with "
            "one indptr row each"
        )
    _check_block_table("write_paged_kv_indices", block_table, num_reqs)
    if (
        offsets.dim() != 2
        or offsets.shape[0] != tables.shape[0]
        or offsets.shape[1] < num_reqs + 1
        or offsets.stride(1) != 1
    ):
        raise ValueError(
            f"write_paged_kv_indices: indptr of shape {tuple(indptr.shape)} does not cover "
            f"num_reqs={num_reqs} for each of the {tables.shape[0]} index rows"
        )
    capacity = tables.shape[1]
    if num_reqs == 0:
        indices.zero_()
        return
    if capacity == 0 or tables.shape[0] == 0:
        return
    paged_kv_indices_kernel[(num_reqs, tables.shape[0])](
        tables,
        block_table,
        offsets,
        num_reqs,
        block_table.shape[1],
        capacity,
        triton.cdiv(capacity, num_reqs),
        block_table.stride(0),
        tables.stride(0),
        offsets.stride(0),
        BLOCK=INDEX_BLOCK,
        num_warps=1,
    )


REQ_BLOCK = 128
"""Requests one program of :func:`paged_kv_table_kernel` sums the page counts of per
iteration."""


@triton.jit(do_not_specialize=("num_reqs", "tail_per_program"))
def paged_kv_table_kernel(
    indices_ptr,
    indptr_ptr,
    last_page_len_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_reqs,
    page_size,
    max_blocks,
    capacity,
    tail_per_program,
    stride_bt,
    BLOCK: tl.constexpr,
    REQ_BLOCK: tl.constexpr,
):
    """Program ``r`` (grid ``(num_reqs,)``) writes request ``r``'s entries of the CSR page
    table of the KV lengths ``seq_lens[:num_reqs]``: ``indptr[r + 1]`` (and program 0
    ``indptr[0] = 0``), ``last_page_len[r]``, its page indices from block-table row ``r``,
    and one share of the indices' zero tail (as :func:`paged_kv_indices_kernel`).

    Each program sums the page counts of the requests before it (and of all of them, for
    the tail) itself, so no program waits for another: ``num_reqs`` is at most the
    builder's request limit, and the sums are a few hundred loads. A negative length counts
    as 0; a length past the block table's ``max_blocks`` pages is cut to them (the host
    path raises; a device kernel cannot, and writes nothing outside the table)."""
    req = tl.program_id(0)
    lanes = tl.arange(0, REQ_BLOCK)
    before = tl.zeros([REQ_BLOCK], tl.int32)
    every = tl.zeros([REQ_BLOCK], tl.int32)
    for first in range(0, num_reqs, REQ_BLOCK):
        idx = first + lanes
        lens = tl.maximum(tl.load(seq_lens_ptr + idx, mask=idx < num_reqs, other=0), 0)
        pages = tl.minimum((lens + page_size - 1) // page_size, max_blocks)
        before += tl.where(idx < req, pages, 0)
        every += pages
    start = tl.sum(before, axis=0)
    used = tl.sum(every, axis=0)
    own_len = tl.maximum(tl.load(seq_lens_ptr + req), 0)
    own_pages = tl.minimum((own_len + page_size - 1) // page_size, max_blocks)
    last = tl.where(own_pages > 0, tl.minimum(own_len - (own_pages - 1) * page_size, page_size), 0)
    tl.store(last_page_len_ptr + req, last)
    tl.store(indptr_ptr + req + 1, start + own_pages)
    if req == 0:
        tl.store(indptr_ptr, 0)
    row = block_table_ptr + req.to(tl.int64) * stride_bt
    _write_pages_and_tail(indices_ptr, row, start, own_pages, used, req, tail_per_program,
                          capacity, BLOCK)


def write_paged_kv_table(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    *,
    indptr: torch.Tensor,
    last_page_len: torch.Tensor,
    indices: torch.Tensor,
    num_reqs: int,
) -> None:
    """The whole CSR page table of the first ``num_reqs`` requests, on the device, from
    their device KV lengths ``seq_lens`` (``[>= num_reqs]`` int32) and ``block_table``
    (``[>= num_reqs, max_blocks]`` int32, rows contiguous): ``indptr[:num_reqs + 1]``,
    ``last_page_len[:num_reqs]`` and ``indices`` (``[capacity]``), whose tail past the
    used pages is zeroed. Afterwards the three hold what :func:`paged_kv_layout` computes
    on the host for lengths within the table (the entries past ``num_reqs`` are left as
    they are).

    Capture-safe: one kernel launch whose grid depends only on ``num_reqs`` and the
    buffers' shapes, no host synchronisation, no allocation; everything is written in
    place, so a replay rebuilds the table from whatever lengths and block table the
    buffers hold then."""
    _check_int32_beside("write_paged_kv_table", indices,
                        (("seq_lens", seq_lens), ("block_table", block_table), ("indptr", indptr),
                         ("last_page_len", last_page_len), ("indices", indices)))
    for name, t, size in (("seq_lens", seq_lens, num_reqs), ("indptr", indptr, num_reqs + 1),
                          ("last_page_len", last_page_len, num_reqs)):
        if t.dim() != 1 or t.shape[0] < size or (size and t.stride(0) != 1):
            raise ValueError(
                f"write_paged_kv_table: {name} of shape {tuple(t.shape)} does not hold "
                f"{size} contiguous entries"
            )
    if indices.dim() != 1 or indices.stride(0) != 1:
        raise ValueError("write_paged_kv_table: indices must be one contiguous row")
    _check_block_table("write_paged_kv_table", block_table, num_reqs)
    if num_reqs == 0:
        indptr[:1].zero_()
        indices.zero_()
        return
    capacity = indices.shape[0]
    paged_kv_table_kernel[(num_reqs,)](
        indices,
        indptr,
        last_page_len,
        seq_lens,
        block_table,
        num_reqs,
        page_size,
        block_table.shape[1],
        capacity,
        triton.cdiv(capacity, num_reqs),
        block_table.stride(0),
        BLOCK=INDEX_BLOCK,
        REQ_BLOCK=REQ_BLOCK,
        num_warps=1,
    )
