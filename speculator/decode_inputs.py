"""The decode lanes' inputs after the first pass, written in place in one kernel on CUDA.

After the first pass has stored draft token 0 of each request, the ``n`` decode lanes of
the bucket are reset for step 1: lane ``i < r`` (request ``i``) feeds back its draft token 0
at its first draft position and gets that position's slot, padding lanes get position and
length 0 and the sink slot, and the query offsets take the decode layout (one token per
real request). That is every input of step 1's attention metadata the speculator owns, so
a fused graph needs no host build before its first step. ``r`` and each request's length
after the pass are read on the device, where the pass's scatter left them, so the lanes
need no host value but ``n`` and can run inside the first pass's graph. In tensor ops that
is a dozen small kernels per propose call; here it is one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from speccheck.speculator.kv_cache import PAD_SLOT_CONSTEXPR, compute_slot_mapping, table_slot
from speccheck.speculator.model_kernels import use_kernels


@dataclass(frozen=True)
class DecodeLaneBuffers:
    """The persistent buffers a decode step reads its lanes from (views of the first
    ``n`` lanes): ``positions``, ``seq_lens``, ``input_ids``, ``token_request``,
    ``is_real_req``, ``is_real_token``, ``slot_mapping`` (int64), ``query_start_loc``
    (``[n + 1]``, int32), and ``draft_tokens`` (``[n, K]``, column 0 written by the first
    pass) and ``current_step`` (a device scalar); ``block_table`` is the whole block table
    (``[R, max_blocks]``, ``R >= n``, rows contiguous) and ``num_reqs`` (an int64 device
    scalar: the pass's requests), only read."""

    positions: torch.Tensor
    seq_lens: torch.Tensor
    input_ids: torch.Tensor
    token_request: torch.Tensor
    is_real_req: torch.Tensor
    is_real_token: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    draft_tokens: torch.Tensor
    current_step: torch.Tensor
    num_reqs: torch.Tensor


@triton.jit(do_not_specialize=("num_lanes",))
def _prepare_decode_lanes_kernel(num_reqs_ptr, positions_ptr, seq_lens_ptr, input_ids_ptr,
                                 token_request_ptr, is_real_req_ptr, is_real_token_ptr,
                                 slot_mapping_ptr, query_start_loc_ptr, block_table_ptr,
                                 table_row_stride, draft_tokens_ptr, current_step_ptr,
                                 draft_row_stride, num_lanes, max_model_len, block_size,
                                 BLOCK: tl.constexpr):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = lanes < num_lanes
    num_reqs = tl.load(num_reqs_ptr).to(tl.int32)
    real = lanes < num_reqs
    tl.store(query_start_loc_ptr + lanes,
             tl.minimum(lanes, num_reqs).to(query_start_loc_ptr.dtype.element_ty),
             mask=lanes <= num_lanes)
    # Each lane reads its own length before writing it (one program element per lane).
    base = tl.load(seq_lens_ptr + lanes, mask=real, other=0).to(tl.int64)
    token = tl.load(draft_tokens_ptr + lanes * draft_row_stride, mask=real, other=0)
    position = tl.where(real, tl.minimum(base, max_model_len - 1), 0)
    tl.store(positions_ptr + lanes, position, mask=in_range)
    tl.store(slot_mapping_ptr + lanes,
             table_slot(block_table_ptr, table_row_stride, lanes, position, block_size,
                        real, in_range, PAD_SLOT_CONSTEXPR),
             mask=in_range)
    length = tl.where(real, tl.minimum(base + 1, max_model_len), 0)
    tl.store(seq_lens_ptr + lanes, length.to(seq_lens_ptr.dtype.element_ty), mask=in_range)
    tl.store(input_ids_ptr + lanes, tl.where(real, token, 0), mask=in_range)
    tl.store(token_request_ptr + lanes, lanes.to(tl.int64), mask=in_range)
    tl.store(is_real_req_ptr + lanes, real, mask=in_range)
    tl.store(is_real_token_ptr + lanes, real, mask=in_range)
    tl.store(current_step_ptr, 1, mask=tl.program_id(0) == 0)


_LANE_BLOCK = 256


def prepare_decode_lanes(lanes: DecodeLaneBuffers, max_model_len: int, block_size: int, *,
                         kernel: bool | None = None) -> None:
    """Lanes ``0 .. n - 1`` (``n = len(lanes.positions)``) for decode step 1, from the
    pass's ``r = lanes.num_reqs`` requests and their lengths after it (``base``, what
    ``lanes.seq_lens[:r]`` holds on entry): position ``min(base, max_model_len - 1)``,
    length ``min(base + 1, max_model_len)``, input draft token 0, token ``i`` of request
    ``i``, and step 1's slot
    ``block_table[i, position // block_size] * block_size + position % block_size``;
    padding lanes (``i >= r``) position, length and input 0, not real, and the sink slot;
    query offsets ``query_start_loc[i] = min(i, r)`` for ``i <= n`` (what
    :func:`~speccheck.contract.token_count.build_uniform_attention_metadata` writes for
    one token per request); ``current_step`` 1. The slot mapping is what
    :func:`~speccheck.speculator.kv_cache.compute_slot_mapping` writes for these lanes
    (``is_real_token`` picks the formula or the sink), final before step 1's metadata is
    built.

    One Triton kernel on CUDA (``kernel`` forces or avoids it), tensor ops elsewhere.
    Capture-safe: no host values but ``n``, ``max_model_len`` and ``block_size``, every
    write in place."""
    n = lanes.positions.shape[0]
    if not (use_kernels(lanes.positions) if kernel is None else kernel):
        index = torch.arange(n, device=lanes.positions.device)
        real = index < lanes.num_reqs
        base = torch.where(real, lanes.seq_lens.long(), 0)
        lanes.positions.copy_(torch.where(real, base.clamp(max=max_model_len - 1), 0))
        lanes.seq_lens.copy_(torch.where(real, (base + 1).clamp(max=max_model_len), 0))
        lanes.input_ids.copy_(torch.where(real, lanes.draft_tokens[:, 0], 0))
        lanes.token_request.copy_(index)
        lanes.is_real_req.copy_(real)
        lanes.is_real_token.copy_(real)
        lanes.query_start_loc.copy_(
            torch.minimum(torch.arange(n + 1, device=index.device), lanes.num_reqs))
        compute_slot_mapping(lanes.positions, lanes.token_request, lanes.block_table,
                             lanes.is_real_token, block_size, out=lanes.slot_mapping,
                             kernel=False)
        lanes.current_step.fill_(1)
        return
    _prepare_decode_lanes_kernel[(triton.cdiv(n + 1, _LANE_BLOCK),)](
        lanes.num_reqs, lanes.positions, lanes.seq_lens, lanes.input_ids, lanes.token_request,
        lanes.is_real_req, lanes.is_real_token, lanes.slot_mapping, lanes.query_start_loc,
        lanes.block_table, lanes.block_table.stride(0), lanes.draft_tokens, lanes.current_step,
        lanes.draft_tokens.stride(0), n, max_model_len, block_size, BLOCK=_LANE_BLOCK)
