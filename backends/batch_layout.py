"""Where each token of a flattened batch belongs, and clearing the tokens that belong to no
request (shared by the adapters)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PADDING_ROW_BLOCK = 1024
"""Elements of a padding row one store of :func:`zero_padding_rows`' kernel clears."""


def token_request_index(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Request index of each of ``num_tokens`` tokens (``num_reqs`` for tokens past the last
    real query offset, i.e. padding tokens). Capture-safe: one ``searchsorted`` of fixed
    shape, no host values."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)


@triton.jit(do_not_specialize=("num_reqs",))
def _zero_padding_rows_kernel(rows_ptr, query_start_loc_ptr, num_reqs, row_stride, width,
                              BLOCK: tl.constexpr):
    """Program ``t`` zeroes row ``t`` (``width`` contiguous elements, rows ``row_stride``
    apart) when it lies at or past ``query_start_loc[num_reqs]``; a real row is not touched."""
    row = tl.program_id(0)
    if row >= tl.load(query_start_loc_ptr + num_reqs):
        base = rows_ptr + row.to(tl.int64) * row_stride
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(base + cols, tl.zeros([BLOCK], rows_ptr.dtype.element_ty), mask=cols < width)


def zero_padding_rows(
    rows: torch.Tensor, query_start_loc: torch.Tensor, *, kernel: bool | None = None
) -> None:
    """Zero, in place, the rows of ``rows`` (``[T, ...]``, token-major) at or past
    ``query_start_loc[-1]``: FULL-mode padding tokens, which belong to no request (an
    attention kernel leaves them undefined; the reference backend gives zeros). The offset
    is read on the device, so a replay with fewer real tokens than its capture is
    deterministic.

    Capture-safe, no host values: on CUDA one Triton kernel (``kernel`` forces or avoids it)
    where each row is one contiguous run; tensor ops elsewhere (four launches)."""
    num_tokens = rows.shape[0]
    if num_tokens == 0:
        return
    flat = rows.view(num_tokens, -1) if rows[0].is_contiguous() else None
    if (rows.is_cuda if kernel is None else kernel) and flat is not None and flat.shape[1]:
        width = flat.shape[1]
        _zero_padding_rows_kernel[(num_tokens,)](
            flat, query_start_loc, query_start_loc.shape[0] - 1, flat.stride(0), width,
            BLOCK=min(PADDING_ROW_BLOCK, triton.next_power_of_2(width)))
        return
    real = torch.arange(num_tokens, device=rows.device) < query_start_loc[-1]
    rows.masked_fill_(~real.view(-1, *[1] * (rows.dim() - 1)), 0)
