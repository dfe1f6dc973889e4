"""Draft-token sampling: argmax, or Gumbel-max with per-request seeds.

The Gumbel noise is a counter-based hash of (seed, position, vocab index) computed with
integer ops: deterministic, identical on every path (eager, per-step graph, fused graph),
and capture-safe (no generator state advanced on the host). On CUDA, Gumbel-max
(:func:`gumbel_argmax`: hash, noise, add and argmax per row) is two Triton kernels, and so
is the whole end of a decode step (:func:`finish_decode_step`: sample, store, feed back,
advance), or one where the LM head samples; elsewhere the same math in tensor ops.

Both kernel pairs split each row's vocabulary: phase 1, a grid ``(rows, splits)``, scans
one contiguous chunk per program (storing its fp32 logits, in the decode step) and writes
the chunk's best score and the index of its first maximum to scratch ``[rows, splits]``
tensors; phase 2, one program per row, takes the first chunk holding the greatest score,
so the result is exactly ``torch.argmax``'s first maximum, and does the stores. ``splits``
is a function of the vocabulary size alone (:func:`_split_plan`).

At the end of a decode step whose LM head runs as the tensor-core kernel of
:mod:`~speccheck.speculator.projection_kernels` (given its logits unprojected), both phases
are that kernel: each program rounds its tile of logits to the model's dtype, as the LM
head's own kernel stores them, stores them in fp32 and writes the tile's partials for every
row; the last program to finish (counted acquire-release) does phase 2 for every row.
``splits`` is then the kernel's tile count (500 at vocabulary 32000, 2004 at 128256), and
tokens and logits are those of the separate kernels.

No host values, no synchronisation; the scratch comes from the graph pool under capture.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from speccheck.contract.dependent_launch import (
    await_predecessor,
    dependent_launch,
    release_dependents,
)
from speccheck.speculator.model_kernels import use_kernels
from speccheck.speculator.projection_kernels import (
    UnprojectedLogits,
    launch_skinny,
    skinny_tile,
    skinny_tiles,
)

SamplingMethod = Literal["argmax", "gumbel"]

_MASK31 = 0x7FFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash round (values stay in ``[0, 2**31)``; no overflow in int64)."""
    x = (x ^ (x >> 15)) & _MASK31
    x = (x * 0x2C1B3C6D) & _MASK31
    x = (x ^ (x >> 12)) & _MASK31
    x = (x * 0x297A2D39) & _MASK31
    return (x ^ (x >> 15)) & _MASK31


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, vocab]`` fp32 Gumbel(0, 1) noise keyed by ``seeds[r]``, ``positions[r]``."""
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix((seeds.long()[:, None] & _MASK31) ^ 0x5BD1E995)
    h = _mix((h + positions.long()[:, None] * 0x3C6EF35F) & _MASK31)
    h = _mix((h + vocab[None, :] * 0x61C88647) & _MASK31)
    u = (h.float() + 0.5) / float(_MASK31 + 1)
    return -torch.log(-torch.log(u))


@triton.jit
def _mix_kernel(x):
    x = (x ^ (x >> 15)) & 0x7FFFFFFF
    x = (x * 0x2C1B3C6D) & 0x7FFFFFFF
    x = (x ^ (x >> 12)) & 0x7FFFFFFF
    x = (x * 0x297A2D39) & 0x7FFFFFFF
    return (x ^ (x >> 15)) & 0x7FFFFFFF


@triton.jit
def _row_key(seed, position):
    """A row's Gumbel hash key from its seed and position (int64), as :func:`gumbel_noise`
    computes it."""
    h = _mix_kernel((seed & 0x7FFFFFFF) ^ 0x5BD1E995)
    return _mix_kernel((h + position * 0x3C6EF35F) & 0x7FFFFFFF)


@triton.jit
def _gumbel_score(x, key, cols):
    """``x`` (fp32) plus the Gumbel noise of vocabulary entries ``cols`` of the row keyed
    ``key``."""
    noise_hash = _mix_kernel((key + cols.to(tl.int64) * 0x61C88647) & 0x7FFFFFFF)
    u = (noise_hash.to(tl.float32) + 0.5) / 2147483648.0
    return x - tl.log(-tl.log(u))


@triton.jit
def _running_argmax(score, start, best, best_index, AXIS: tl.constexpr):
    """The best score and its index so far, after the block of ``score`` whose entries along
    ``AXIS`` (a row's vocabulary) start at entry ``start``; strict, so the first maximum
    wins, as ``torch.argmax``."""
    block_best = tl.max(score, axis=AXIS)
    block_index = tl.argmax(score, axis=AXIS) + start
    better = block_best > best
    return tl.where(better, block_best, best), tl.where(better, block_index, best_index)


# Vocabulary scans are split over several programs per row: one program looping over a
# 32000-entry vocabulary alone is latency-bound (about 20 us at batch 1 on an H200).
_ARGMAX_BLOCK = 1024  # entries per loop iteration of a scan
_MIN_CHUNK_BLOCKS = 2  # blocks each split scans, at least (fewer splits for small vocabularies)
_MAX_SPLITS = 32  # splits per row, at most (larger chunks for large vocabularies)


def _split_plan(vocab: int) -> tuple[int, int, int]:
    """``(BLOCK, chunk, splits)`` for a row of ``vocab`` entries: ``splits`` contiguous
    chunks of ``chunk`` entries (a multiple of ``BLOCK``; the last chunk may be shorter),
    none empty. A plain function of ``vocab``: 32000 gives 16 chunks of 2048, 128256 gives
    32 of 4096, anything up to two blocks one chunk."""
    block = min(_ARGMAX_BLOCK, triton.next_power_of_2(vocab))
    blocks = triton.cdiv(vocab, block)
    chunk_blocks = triton.cdiv(blocks, min(_MAX_SPLITS, triton.cdiv(blocks, _MIN_CHUNK_BLOCKS)))
    return block, chunk_blocks * block, triton.cdiv(blocks, chunk_blocks)


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr, seeds_ptr, positions_ptr, step_ptr, draft_logits_ptr, part_best_ptr,
    part_index_ptr, logits_row_stride, draft_logits_row_stride, draft_logits_step_stride,
    vocab, chunk, GUMBEL: tl.constexpr, STORE_LOGITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Phase 1 of an argmax split over a grid ``(rows, splits)``: the first maximum of the
    fp32 logits (plus the row's Gumbel noise with ``GUMBEL``) over entries
    ``[split * chunk, (split + 1) * chunk)`` of the row, its score and index stored at
    ``[row, split]`` of the partials (``[rows, splits]``, fp32 and int64); with
    ``STORE_LOGITS`` the chunk's fp32 logits stored at ``draft_logits[row, step]`` too."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    key = 0
    if GUMBEL:
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64),
                       tl.load(positions_ptr + row).to(tl.int64))
    out_logits = draft_logits_ptr
    if STORE_LOGITS:
        out_logits += row * draft_logits_row_stride + tl.load(step_ptr) * draft_logits_step_stride
    lo = split * chunk
    best = -float("inf")
    best_index = lo
    for start in range(lo, tl.minimum(lo + chunk, vocab), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=mask, other=0.0)
        x = x.to(tl.float32)
        if STORE_LOGITS:
            tl.store(out_logits + cols, x, mask=mask)
        score = x
        if GUMBEL:
            score = _gumbel_score(x, key, cols)
        score = tl.where(mask, score, -float("inf"))
        best, best_index = _running_argmax(score, start, best, best_index, 0)
    part = row * tl.num_programs(1) + split
    tl.store(part_best_ptr + part, best)
    tl.store(part_index_ptr + part, best_index)


@triton.jit
def _lanes_argmax(part_best_ptr, part_index_ptr, lanes, lmask, splits, BLOCK: tl.constexpr):
    """Phase 2 for the vector of ``lanes`` (on where ``lmask`` is): each lane's first maximum
    from its ``splits`` partials, read ``BLOCK`` at a time (a power of two). The partials
    are in vocabulary order, so the first holding the greatest score, kept as
    :func:`_running_argmax` keeps it, holds the lane's first maximum: the one
    ``torch.argmax`` returns (a lane of ``-inf`` gets index 0, as there). The loads bypass
    L1: the partials may be other programs' of the same kernel
    (:func:`_lm_head_sample_kernel`)."""
    best = tl.full(lanes.shape, -float("inf"), tl.float32)
    best_index = tl.zeros(lanes.shape, tl.int64)
    for start in range(0, splits, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = lmask[:, None] & (offs < splits)[None, :]
        at = lanes[:, None] * splits + offs[None, :]
        scores = tl.load(part_best_ptr + at, mask=m, other=-float("inf"), cache_modifier=".cg")
        indices = tl.load(part_index_ptr + at, mask=m, other=0, cache_modifier=".cg")
        block_best, split = _running_argmax(scores, start, -float("inf"), start, 1)
        block_index = tl.sum(tl.where(offs[None, :] == split[:, None], indices, 0), axis=1)
        better = block_best > best
        best = tl.where(better, block_best, best)
        best_index = tl.where(better, block_index, best_index)
    return best_index


def _partials_block(splits: int) -> int:
    """``BLOCK`` of :func:`_lanes_argmax` for ``splits`` partials per lane: all at once up
    to 128, else 128 at a time (the LM head's 2004 tiles at vocabulary 128256 by 16 lanes
    would not fit in registers)."""
    return min(triton.next_power_of_2(splits), 128)


@triton.jit
def _finish_lanes(part_best_ptr, part_index_ptr, lanes, lmask, splits, step, positions_ptr,
                  seq_lens_ptr, is_real_ptr, tokens_ptr, input_ids_ptr, tokens_row_stride,
                  max_model_len, ADVANCE: tl.constexpr, BLOCK: tl.constexpr):
    """The end of a decode step for the vector of ``lanes`` (on where ``lmask`` is): each
    lane's token from its partials, stored at column ``step`` of the tokens and fed back;
    with ``ADVANCE``, real lanes move one position on (clamped), padding lanes stay."""
    token = _lanes_argmax(part_best_ptr, part_index_ptr, lanes, lmask, splits, BLOCK)
    tl.store(tokens_ptr + lanes * tokens_row_stride + step, token, mask=lmask)
    tl.store(input_ids_ptr + lanes, token, mask=lmask)
    if ADVANCE:
        position = tl.load(positions_ptr + lanes, mask=lmask, other=0)
        real = tl.load(is_real_ptr + lanes, mask=lmask, other=0).to(position.dtype)
        tl.store(positions_ptr + lanes, tl.minimum(position + real, max_model_len - 1),
                 mask=lmask)
        seq_len = tl.load(seq_lens_ptr + lanes, mask=lmask, other=0)
        tl.store(seq_lens_ptr + lanes,
                 tl.minimum(seq_len + real.to(seq_len.dtype), max_model_len), mask=lmask)


# Neither the row count nor the draft step count K (the strides of the tokens and logits)
# specialises the LM head: a batch or a K of one would compile it anew (seconds, where the
# verifier draws K and batches per example).
@triton.jit(do_not_specialize=("rows", "draft_logits_row_stride", "tokens_row_stride",
                               "max_model_len"))
def _lm_head_sample_kernel(
    x_ptr, d_ptr, nw_ptr, w_ptr, rows, n, k, x_stride, d_stride, eps, seeds_ptr,
    positions_ptr, step_ptr, draft_logits_ptr, part_best_ptr, part_index_ptr,
    draft_logits_row_stride, draft_logits_step_stride, seq_lens_ptr, is_real_ptr, done_ptr,
    tokens_ptr, input_ids_ptr, tokens_row_stride, max_model_len, GUMBEL: tl.constexpr,
    ADVANCE: tl.constexpr, MOVE_ON: tl.constexpr, PARTIALS_BLOCK: tl.constexpr,
    PROLOGUE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """The whole end of a decode step in the LM head's kernel, program ``tile`` of
    :func:`~speccheck.speculator.projection_kernels.launch_skinny`'s grid.

    Phase 1 in every program's epilogue: the logits of entries ``[tile * BLOCK_N, (tile +
    1) * BLOCK_N)`` of every row (normalised in the prologue, as ``PROLOGUE`` says), rounded to the hidden rows' dtype as
    :func:`~speccheck.speculator.projection_kernels.linear` stores them, are stored in fp32
    at ``draft_logits[row, step]``; the tile's best score (the logits, plus the row's Gumbel
    noise with ``GUMBEL``) and the index of its first maximum at ``[row, tile]`` of the
    partials (``[rows, tiles]``, fp32 and int64): the same stores and scores as
    :func:`_chunk_argmax_kernel`'s over the same logits.

    Phase 2 in the last program to finish: each program counts itself done in ``done``
    (acquire-release, after a barrier of its threads, so that its partials and its reads of
    the step and the positions come before the count); the one that counts last reads
    every partial, does :func:`_finish_lanes`, moves the step on with ``MOVE_ON`` and
    clears ``done``. No program reads the step or the positions after they moved on, and
    the kernel after the step waits for the whole grid."""
    tile = tl.program_id(0)
    release_dependents(PDL)
    r = tl.arange(0, ROWS)
    rmask = r < rows
    start = tile * BLOCK_N
    cols = start + tl.arange(0, BLOCK_N)
    nmask = cols < n
    await_predecessor(PDL)
    acc = skinny_tile(x_ptr, d_ptr, nw_ptr, w_ptr, r, rmask, cols, nmask, k, x_stride, d_stride,
                      eps, PROLOGUE, ROWS, BLOCK_N, BLOCK_K)
    x = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    step = tl.load(step_ptr)
    out_logits = draft_logits_ptr + step * draft_logits_step_stride
    tl.store(out_logits + r[:, None] * draft_logits_row_stride + cols[None, :], x,
             mask=rmask[:, None] & nmask[None, :])
    score = x
    if GUMBEL:
        key = _row_key(tl.load(seeds_ptr + r, mask=rmask, other=0).to(tl.int64),
                       tl.load(positions_ptr + r, mask=rmask, other=0).to(tl.int64))
        score = _gumbel_score(x, key[:, None], cols[None, :])
    score = tl.where(nmask[None, :], score, -float("inf"))
    best, best_index = _running_argmax(score, start, -float("inf"), start, 1)
    tiles = tl.num_programs(0)
    part = r * tiles + tile
    tl.store(part_best_ptr + part, best, mask=rmask)
    tl.store(part_index_ptr + part, best_index, mask=rmask)
    tl.debug_barrier()
    if tl.atomic_add(done_ptr, 1, sem="acq_rel") == tiles - 1:
        _finish_lanes(part_best_ptr, part_index_ptr, r, rmask, tiles, step, positions_ptr,
                      seq_lens_ptr, is_real_ptr, tokens_ptr, input_ids_ptr, tokens_row_stride,
                      max_model_len, ADVANCE, PARTIALS_BLOCK)
        if MOVE_ON:
            tl.store(step_ptr, step + 1)
        tl.store(done_ptr, 0)


@triton.jit
def _store_argmax_kernel(part_best_ptr, part_index_ptr, out_ptr, splits, BLOCK: tl.constexpr):
    lane = tl.program_id(0) + tl.arange(0, 1)
    tl.store(out_ptr + lane,
             _lanes_argmax(part_best_ptr, part_index_ptr, lane, lane >= 0, splits, BLOCK))


def _chunk_argmax(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *,
                  gumbel: bool, step: torch.Tensor | None = None,
                  draft_logits: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Launch phase 1 over ``logits`` (``[rows, vocab]``, ``rows`` > 0): the partials
    (new tensors, from the graph pool under capture) and their count per row. With
    ``draft_logits``, the fp32 logits are stored at ``draft_logits[:, step]``."""
    rows, vocab = logits.shape
    block, chunk, splits = _split_plan(vocab)
    part_best = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(rows, splits, dtype=torch.int64, device=logits.device)
    row_stride, step_stride = (0, 0) if draft_logits is None else draft_logits.stride()[:2]
    _chunk_argmax_kernel[(rows, splits)](
        logits, seeds, positions, step, draft_logits, part_best, part_index, logits.stride(0),
        row_stride, step_stride, vocab, chunk, GUMBEL=gumbel,
        STORE_LOGITS=draft_logits is not None, BLOCK=block)
    return part_best, part_index, splits


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *,
                  kernel: bool | None = None) -> torch.Tensor:
    """``argmax(logits + gumbel_noise(seeds, positions))`` per row (the first maximum),
    int64 ``[R]``, a new tensor. On CUDA (``kernel`` forces or avoids it) two Triton
    kernels: each row's vocabulary scanned in chunks by several programs, then one program
    per row picks among the chunks' maxima; tensor ops elsewhere. Rows of ``logits`` must
    be contiguous. Capture-safe: no host values, scratch and result from the graph pool
    under capture."""
    if not (use_kernels(logits) if kernel is None else kernel):
        return (logits + gumbel_noise(seeds, positions, logits.shape[-1])).argmax(dim=-1)
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        part_best, part_index, splits = _chunk_argmax(logits, seeds, positions, gumbel=True)
        _store_argmax_kernel[(rows,)](part_best, part_index, out, splits,
                                      BLOCK=_partials_block(splits))
    return out


@triton.jit
def _decode_step_finish_kernel(
    part_best_ptr, part_index_ptr, positions_ptr, seq_lens_ptr, is_real_ptr, step_ptr,
    done_ptr, tokens_ptr, input_ids_ptr, tokens_row_stride, splits, max_model_len,
    ADVANCE: tl.constexpr, MOVE_ON: tl.constexpr, ONE_LANE: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Phase 2 after :func:`_chunk_argmax_kernel`, program ``lane`` (grid ``(lanes,)``):
    :func:`_finish_lanes` for its lane. With ``MOVE_ON``, every program counts itself done
    in ``done`` (acquire-release) after it has read the step; the last one stores ``step +
    1`` and clears ``done``, so no program can read the step after it moved on. A grid of
    ``ONE_LANE`` has no other program to wait for: it stores ``step + 1`` itself, without
    the count (an atomic's round trip less at batch 1)."""
    lane = tl.program_id(0) + tl.arange(0, 1)
    release_dependents(PDL)
    await_predecessor(PDL)
    step = tl.load(step_ptr)
    _finish_lanes(part_best_ptr, part_index_ptr, lane, lane >= 0, splits, step, positions_ptr,
                  seq_lens_ptr, is_real_ptr, tokens_ptr, input_ids_ptr, tokens_row_stride,
                  max_model_len, ADVANCE, PARTIALS_BLOCK)
    if MOVE_ON:
        if ONE_LANE:
            tl.store(step_ptr, step + 1)
        else:
            last = tl.atomic_add(done_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1
            tl.store(step_ptr, step + 1, mask=last)
            tl.store(done_ptr, 0, mask=last)


def finish_decode_step(
    logits: torch.Tensor | UnprojectedLogits,
    method: SamplingMethod,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    is_real: torch.Tensor,
    step: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    advance: bool,
    max_model_len: int,
    done_count: torch.Tensor | None = None,
    kernel: bool | None = None,
) -> None:
    """The end of a decode step over the ``R`` lanes, in place: sample each lane's token
    from ``logits`` (``[R, vocab]``, the model's dtype) as :func:`sample_tokens` does, store
    it at column ``step`` (a device scalar) of ``draft_tokens`` (``[R, K]``) and the logits,
    in fp32, at ``draft_logits[:, step]`` (``[R, K, vocab]``), and feed it back as
    ``input_ids``. With ``advance``, real lanes (``is_real``) move one position on
    (``positions`` clamped at ``max_model_len - 1``, ``seq_lens`` at ``max_model_len``);
    padding lanes stay. Sampling reads the positions before they advance. Given
    ``done_count`` (an int32 device scalar the caller owns, zero between calls, left zero:
    the programs of the step's last kernel count themselves done in it), ``step`` moves on
    by one at the end, inside the last kernel; otherwise it is left to the caller. Nothing
    else is written.

    ``logits`` may be :class:`~speccheck.speculator.projection_kernels.UnprojectedLogits`
    (the LM head over ``R`` hidden rows, perhaps still to normalise), projected here with
    the same ``kernel`` choice and the same numbers as its ``project``: where its
    ``runs_skinny`` says so, the whole end of the step is the LM head's tensor-core kernel
    (:func:`_lm_head_sample_kernel`: the rows normalised in each program's prologue,
    sampling partials in its epilogue, the rest in the last program to finish; without
    ``done_count`` it counts in a zeroed scalar of its own), else ``project`` runs first.

    Projected logits on CUDA (``kernel`` forces or avoids it) take two Triton kernels:
    several programs per lane scan its vocabulary in chunks (sampling partials, fp32 logits
    stored), then one program per lane picks the token and does the stores and the advance
    (and the last one to finish moves the step on). ``logits`` rows and the vocabulary
    dimension of ``draft_logits`` must be contiguous. Tensor ops elsewhere. Capture-safe:
    no host values or synchronisation, the scratch partials from the graph pool under
    capture, every write to the buffers in place."""
    if isinstance(logits, UnprojectedLogits) and not logits.runs_skinny(kernel):
        logits = logits.project(kernel=kernel)
    # logits still unprojected take the kernels (runs_skinny said so)
    if isinstance(logits, torch.Tensor) and not (
            use_kernels(logits) if kernel is None else kernel):
        tokens = sample_tokens(logits, method, seeds, positions, kernel=False)
        at_step = step.view(1)
        draft_tokens.index_copy_(1, at_step, tokens.unsqueeze(1))
        draft_logits.index_copy_(1, at_step, logits.unsqueeze(1).float())
        input_ids.copy_(tokens)
        if advance:
            positions.add_(is_real).clamp_(max=max_model_len - 1)
            seq_lens.add_(is_real).clamp_(max=max_model_len)
        if done_count is not None:
            step.add_(1)
        return
    n = input_ids.shape[0]
    if not n:
        if done_count is not None:
            step.add_(1)
        return
    gumbel = method == "gumbel"
    if isinstance(logits, UnprojectedLogits):
        tiles = skinny_tiles(logits.weight)
        part_best = torch.empty(n, tiles, dtype=torch.float32, device=input_ids.device)
        part_index = torch.empty(n, tiles, dtype=torch.int64, device=input_ids.device)
        count = (torch.zeros((), dtype=torch.int32, device=input_ids.device)
                 if done_count is None else done_count)
        launch_skinny(_lm_head_sample_kernel, logits.rows, logits.weight, seeds, positions,
                      step, draft_logits, part_best, part_index, *draft_logits.stride()[:2],
                      seq_lens, is_real, count, draft_tokens, input_ids,
                      draft_tokens.stride(0), max_model_len, GUMBEL=gumbel, ADVANCE=advance,
                      MOVE_ON=done_count is not None, PARTIALS_BLOCK=_partials_block(tiles))
        return
    part_best, part_index, splits = _chunk_argmax(
        logits, seeds, positions, gumbel=gumbel, step=step, draft_logits=draft_logits)
    pdl = dependent_launch(input_ids)
    _decode_step_finish_kernel[(n,)](
        part_best, part_index, positions, seq_lens, is_real, step, done_count, draft_tokens, input_ids,
        draft_tokens.stride(0), splits, max_model_len, ADVANCE=advance,
        MOVE_ON=done_count is not None, ONE_LANE=n == 1,
        PARTIALS_BLOCK=_partials_block(splits), PDL=pdl, launch_pdl=pdl)


def sample_tokens(
    logits: torch.Tensor,
    method: SamplingMethod,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    kernel: bool | None = None,
) -> torch.Tensor:
    """Token ids ``[R]`` (int64) from ``logits`` ``[R, vocab]`` (the model's dtype; the
    Gumbel noise is fp32, so the noisy argmax is taken in fp32)."""
    if method == "argmax":
        return logits.argmax(dim=-1)
    return gumbel_argmax(logits, seeds, positions, kernel=kernel)
