"""A pass's inputs written into the speculator's persistent index buffers, in one kernel on
CUDA.

Before a pass over a batch (the first pass, or a DFlash block's context) every index buffer
is reset (so no stale index of an earlier, larger batch can point out of bounds) and the
batch's block-table rows, seeds, lengths, positions, token ids and token-to-request map are
written from their staged device copies, with the slot mapping of the pass's tokens. In
tensor ops that is about twenty launches per call (eleven resets, then the copies and fills,
then the slot mapping); here it is one, which reads the batch's sizes from the staged
copy too, so that the whole-propose graph can begin with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import IntEnum

import numpy as np
import torch
import triton
import triton.language as tl

from speccheck.speculator.kv_cache import PAD_SLOT_CONSTEXPR, compute_slot_mapping, table_slot
from speccheck.speculator.model_kernels import use_kernels
from speccheck.speculator.staging import HostStaging, StagedArrays


@dataclass(frozen=True)
class IndexBuffers:
    """The speculator's persistent index buffers (whole buffers, not views of a batch).

    Per request (``[R]``): ``seeds`` (int64; never reset: only live requests' are read),
    ``seq_lens`` (int32), ``is_real_req`` (bool); ``query_start_loc`` ``[R + 1]`` (int32);
    ``block_table`` ``[R, max_blocks]`` (int32, rows contiguous); per token (``[T]``):
    ``positions``, ``input_ids``, ``token_request``, ``slot_mapping`` (int64),
    ``is_real_token`` (bool); ``draft_tokens`` ``[R, K]`` (int64, contiguous),
    ``current_step`` and ``num_reqs`` (int64 scalars: the draft step, and the requests the
    last pass wrote, which the decode lanes read on the device)."""

    block_table: torch.Tensor
    seeds: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    is_real_req: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor
    token_request: torch.Tensor
    slot_mapping: torch.Tensor
    is_real_token: torch.Tensor
    draft_tokens: torch.Tensor
    current_step: torch.Tensor
    num_reqs: torch.Tensor

    def reset(self) -> None:
        """Zero every buffer but ``seeds`` (tensor ops; also inside capture)."""
        for field in fields(self):
            if field.name != "seeds":
                getattr(self, field.name).zero_()


class PassInput(IntEnum):
    """The order of a pass's arrays in its :class:`~speccheck.speculator.staging.
    StagedArrays`, which packs them end to end from offset 0: ``HEADER`` (``[r, t, width,
    uniform_width]``: the sizes, which the kernel reads on the device instead of taking
    them as launch arguments, so that a graph can hold its launch), ``TABLE`` ``[r,
    width]`` (each request's block-table row, zero past its end), ``SEEDS`` and
    ``SEQ_LENS`` (``[r]``), ``POSITIONS``, ``INPUT_IDS`` and ``TOKEN_REQUEST`` (``[t]``,
    the pass's real tokens); anything staged after them is the caller's."""

    HEADER = 0
    TABLE = 1
    SEEDS = 2
    SEQ_LENS = 3
    POSITIONS = 4
    INPUT_IDS = 5
    TOKEN_REQUEST = 6


HEADER_SIZE = 4
"""Entries of :attr:`PassInput.HEADER`."""


def stage_pass_inputs(
    staging: HostStaging, table: np.ndarray, seeds: np.ndarray, seq_lens: np.ndarray,
    positions: np.ndarray, input_ids: np.ndarray, token_request: np.ndarray,
    uniform_width: int, extra: Sequence[np.ndarray] = (),
) -> PassInputs:
    """A pass's host arrays (see :class:`PassInput`), their header and ``extra`` sent to the
    device in one :meth:`~speccheck.speculator.staging.HostStaging.stage` copy. Host work."""
    r, width = table.shape
    header = np.array([r, positions.shape[0], width, uniform_width], dtype=np.int64)
    return PassInputs(staging.stage(
        [header, table, seeds, seq_lens, positions, input_ids, token_request, *extra]),
        uniform_width)


@dataclass(frozen=True)
class PassInputs:
    """A batch's inputs as staged on the device (int64, in :class:`PassInput` order): the
    kernel reads them from the one staging buffer at their offsets, so no view of them is
    made on the host."""

    staged: StagedArrays
    uniform_width: int
    """Tokens per request of a pass padded over its bucket (its query offsets are written
    with the inputs), else 0."""

    @property
    def num_reqs(self) -> int:
        return self.staged.shapes[PassInput.TABLE][0]

    @property
    def width(self) -> int:
        return self.staged.shapes[PassInput.TABLE][1]

    @property
    def num_tokens(self) -> int:
        return self.staged.shapes[PassInput.POSITIONS][0]

    def tensor(self, which: PassInput) -> torch.Tensor:
        """A device view of one array (the tensor-op form's way in)."""
        return self.staged[which]

    def extra(self) -> list[torch.Tensor]:
        """Device views of what the caller staged after the pass's arrays."""
        return self.staged[len(PassInput):]


@triton.jit
def _scatter_pass_inputs_kernel(
    staged_ptr, block_size,
    block_table_ptr, table_row_stride, table_rows, table_cols,
    seeds_ptr, seq_lens_ptr, query_start_loc_ptr, is_real_req_ptr,
    positions_ptr, input_ids_ptr, token_request_ptr, slot_mapping_ptr, is_real_token_ptr,
    max_tokens, draft_tokens_ptr, draft_size, current_step_ptr, num_reqs_ptr,
    HEADER: tl.constexpr, BLOCK: tl.constexpr,
):
    # The sizes, from the staged header; every array follows it, end to end.
    num_reqs = tl.load(staged_ptr)
    num_tokens = tl.load(staged_ptr + 1)
    table_width = tl.load(staged_ptr + 2)
    uniform_width = tl.load(staged_ptr + 3)
    table_at = HEADER
    seeds_at = table_at + num_reqs * table_width
    lens_at = seeds_at + num_reqs
    positions_at = lens_at + num_reqs
    ids_at = positions_at + num_tokens
    requests_at = ids_at + num_tokens
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    table_ptr = staged_ptr + table_at
    # The block table, flattened: live rows and columns from the staged rows, the rest 0.
    row = idx // table_cols
    col = idx % table_cols
    in_table = idx < table_rows * table_cols
    live = in_table & (row < num_reqs) & (col < table_width)
    block = tl.load(table_ptr + row * table_width + col, mask=live, other=0)
    tl.store(block_table_ptr + row * table_row_stride + col,
             block.to(block_table_ptr.dtype.element_ty), mask=in_table)
    # Per request.
    in_reqs = idx < table_rows
    real_req = idx < num_reqs
    tl.store(seeds_ptr + idx, tl.load(staged_ptr + seeds_at + idx, mask=real_req, other=0),
             mask=real_req)
    length = tl.load(staged_ptr + lens_at + idx, mask=real_req, other=0)
    tl.store(seq_lens_ptr + idx, length.to(seq_lens_ptr.dtype.element_ty), mask=in_reqs)
    tl.store(is_real_req_ptr + idx, real_req, mask=in_reqs)
    tl.store(query_start_loc_ptr + idx, (tl.minimum(idx, num_reqs) * uniform_width).to(
        query_start_loc_ptr.dtype.element_ty), mask=idx < table_rows + 1)
    # Per token.
    in_tokens = idx < max_tokens
    real_token = idx < num_tokens
    position = tl.load(staged_ptr + positions_at + idx, mask=real_token, other=0)
    request = tl.load(staged_ptr + requests_at + idx, mask=real_token, other=0)
    tl.store(positions_ptr + idx, position, mask=in_tokens)
    tl.store(input_ids_ptr + idx, tl.load(staged_ptr + ids_at + idx, mask=real_token, other=0),
             mask=in_tokens)
    tl.store(token_request_ptr + idx, request, mask=in_tokens)
    # The slot mapping, looked up in the staged rows: other programs are writing the block
    # table buffer in this launch. An entry outside them reads 0, as the reset buffer holds.
    staged = (request < num_reqs) & (position // block_size < table_width)
    slot = table_slot(table_ptr, table_width, request, position, block_size, real_token,
                      staged, PAD_SLOT_CONSTEXPR)
    tl.store(slot_mapping_ptr + idx, slot, mask=in_tokens)
    tl.store(is_real_token_ptr + idx, real_token, mask=in_tokens)
    tl.store(draft_tokens_ptr + idx, tl.zeros_like(idx).to(tl.int64), mask=idx < draft_size)
    tl.store(current_step_ptr + idx, tl.zeros_like(idx).to(tl.int64), mask=idx < 1)
    tl.store(num_reqs_ptr + idx, tl.zeros_like(idx).to(tl.int64) + num_reqs, mask=idx < 1)


_SCATTER_BLOCK = 1024


def scatter_pass_inputs(buffers: IndexBuffers, inputs: PassInputs, block_size: int, *,
                        kernel: bool | None = None) -> None:
    """:meth:`IndexBuffers.reset`, then ``inputs`` written into the head of each buffer:
    the first ``r`` rows of the block table (``width`` columns), seeds, lengths and
    ``is_real_req``; the first ``t`` positions, token ids, token-to-request entries and
    ``is_real_token``; ``num_reqs`` set to ``r``; the query offsets
    ``query_start_loc[i] = min(i, r) * uniform_width`` (a pass padded over its bucket: what
    its metadata build would write; 0 otherwise, for the build to write); and the slot
    mapping of every token lane, final for the pass: the first ``t`` (real) lanes as
    :func:`~speccheck.speculator.kv_cache.compute_slot_mapping` maps them through the
    written block table with ``block_size`` (``table[req, pos // block_size] * block_size
    + pos % block_size``), every other lane the sink slot (the reset's 0). Each real
    token's request and block must lie inside the block-table buffer (the speculator
    validates batches so); entries past the staged rows are the reset's block 0.

    Device work only, every write in place. One Triton kernel on CUDA
    (:func:`scatter_staged_pass_inputs`; ``kernel`` forces or avoids it), tensor ops
    elsewhere, which take the sizes from the host and so run outside graphs only."""
    r, width, t = inputs.num_reqs, inputs.width, inputs.num_tokens
    if scatters_by_kernel(buffers, kernel):
        scatter_staged_pass_inputs(buffers, inputs.staged.buffer, block_size)
        return
    buffers.reset()
    buffers.block_table[:r, :width].copy_(inputs.tensor(PassInput.TABLE))
    buffers.seeds[:r].copy_(inputs.tensor(PassInput.SEEDS))
    buffers.seq_lens[:r].copy_(inputs.tensor(PassInput.SEQ_LENS))
    buffers.positions[:t].copy_(inputs.tensor(PassInput.POSITIONS))
    buffers.input_ids[:t].copy_(inputs.tensor(PassInput.INPUT_IDS))
    buffers.token_request[:t].copy_(inputs.tensor(PassInput.TOKEN_REQUEST))
    buffers.is_real_token[:t] = True
    buffers.is_real_req[:r] = True
    buffers.num_reqs.fill_(r)
    rows = buffers.query_start_loc.shape[0]
    buffers.query_start_loc.copy_(
        torch.arange(rows, device=buffers.query_start_loc.device).clamp_(max=r)
        * inputs.uniform_width)
    compute_slot_mapping(buffers.positions[:t], buffers.token_request[:t],
                         buffers.block_table, buffers.is_real_token[:t], block_size,
                         out=buffers.slot_mapping[:t], kernel=False)


def scatters_by_kernel(buffers: IndexBuffers, kernel: bool | None) -> bool:
    """Whether :func:`scatter_pass_inputs` into ``buffers`` runs as the one Triton kernel
    (:func:`scatter_staged_pass_inputs`, which a graph can hold): on CUDA unless ``kernel``
    says otherwise."""
    return use_kernels(buffers.positions) if kernel is None else kernel


def scatter_staged_pass_inputs(buffers: IndexBuffers, staged_buffer: torch.Tensor,
                               block_size: int) -> None:
    """:func:`scatter_pass_inputs` in one Triton kernel from the pass's inputs as
    :func:`stage_pass_inputs` left them in ``staged_buffer`` (the staging's persistent
    device buffer), sizes included. Capture-safe: nothing of the batch is a launch
    argument, so a graph that holds this launch scatters whatever was staged before its
    replay."""
    rows, cols = buffers.block_table.shape
    max_tokens = buffers.positions.shape[0]
    size = max(rows * cols, rows + 1, max_tokens, buffers.draft_tokens.numel(), 1)
    _scatter_pass_inputs_kernel[(triton.cdiv(size, _SCATTER_BLOCK),)](
        staged_buffer, block_size,
        buffers.block_table, buffers.block_table.stride(0), rows, cols,
        buffers.seeds, buffers.seq_lens, buffers.query_start_loc, buffers.is_real_req,
        buffers.positions, buffers.input_ids, buffers.token_request, buffers.slot_mapping,
        buffers.is_real_token, max_tokens, buffers.draft_tokens, buffers.draft_tokens.numel(),
        buffers.current_step, buffers.num_reqs, HEADER=HEADER_SIZE, BLOCK=_SCATTER_BLOCK)
