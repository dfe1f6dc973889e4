"""Draft-token sampling: argmax, or Gumbel-max with per-request seeds.

The Gumbel noise is a counter-based hash of (seed, position, vocab index) computed with
integer ops: deterministic, identical on every path (eager, per-step graph, fused graph),
and capture-safe (no generator state advanced on the host). On CUDA, Gumbel-max
(:func:`gumbel_argmax`: hash, noise, add and argmax per row) is two Triton kernels, and so
is the whole end of a decode step (:func:`finish_decode_step`: sample, store, feed back,
advance); elsewhere the same math in tensor ops.

Both kernel pairs split each row's vocabulary: phase 1, a grid ``(rows, splits)``, scans
one contiguous chunk per program (storing its fp32 logits, in the decode step) and writes
the chunk's best score and the index of its first maximum to scratch ``[rows, splits]``
tensors; phase 2, one program per row, takes the first chunk holding the greatest score,
so the result is exactly ``torch.argmax``'s first maximum, and does the stores. ``splits``
is a function of the vocabulary size alone (:func:`_split_plan`).

At the end of a decode step whose LM head runs as the tensor-core kernel of
:mod:`~speccheck.speculator.projection_kernels` (given its logits unprojected), phase 1 is
that kernel's epilogue instead: each program rounds its tile of logits to the model's
dtype, as the LM head's own kernel stores them, stores them in fp32 and writes the tile's
partials for every row. ``splits`` is then the kernel's tile count (500 at vocabulary
32000, 2004 at 128256), and tokens and logits are those of the separate kernels.

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
    runs_skinny,
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


@triton.jit(do_not_specialize=("rows",))
def _lm_head_argmax_kernel(
    x_ptr, w_ptr, rows, n, k, x_stride, seeds_ptr, positions_ptr, step_ptr, draft_logits_ptr,
    part_best_ptr, part_index_ptr, draft_logits_row_stride, draft_logits_step_stride,
    GUMBEL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Phase 1 in the LM head's epilogue, program ``tile`` of
    :func:`~speccheck.speculator.projection_kernels.launch_skinny`'s grid: the logits of
    entries ``[tile * BLOCK_N, (tile + 1) * BLOCK_N)`` of every row, rounded to the hidden
    rows' dtype as :func:`~speccheck.speculator.projection_kernels.linear` stores them, are
    stored in fp32 at ``draft_logits[row, step]``; the tile's best score (the logits, plus
    the row's Gumbel noise with ``GUMBEL``) and the index of its first maximum at
    ``[row, tile]`` of the partials (``[rows, tiles]``, fp32 and int64). The same stores
    and scores as :func:`_chunk_argmax_kernel`'s over the same logits."""
    tile = tl.program_id(0)
    release_dependents(PDL)
    r = tl.arange(0, ROWS)
    rmask = r < rows
    start = tile * BLOCK_N
    cols = start + tl.arange(0, BLOCK_N)
    nmask = cols < n
    await_predecessor(PDL)
    acc = skinny_tile(x_ptr, w_ptr, r, rmask, cols, nmask, k, x_stride, ROWS, BLOCK_N, BLOCK_K)
    x = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    out_logits = draft_logits_ptr + tl.load(step_ptr) * draft_logits_step_stride
    tl.store(out_logits + r[:, None] * draft_logits_row_stride + cols[None, :], x,
             mask=rmask[:, None] & nmask[None, :])
    score = x
    if GUMBEL:
        key = _row_key(tl.load(seeds_ptr + r, mask=rmask, other=0).to(tl.int64),
                       tl.load(positions_ptr + r, mask=rmask, other=0).to(tl.int64))
        score = _gumbel_score(x, key[:, None], cols[None, :])
    score = tl.where(nmask[None, :], score, -float("inf"))
    best, best_index = _running_argmax(score, start, -float("inf"), start, 1)
    part = r * tl.num_programs(0) + tile
    tl.store(part_best_ptr + part, best, mask=rmask)
    tl.store(part_index_ptr + part, best_index, mask=rmask)


@triton.jit
def _partials_argmax(part_best_ptr, part_index_ptr, row, splits, SPLITS: tl.constexpr):
    """Phase 2: the row's first maximum from its ``splits`` chunk partials (``SPLITS``, a
    power of two, at least ``splits``). The chunks are in vocabulary order, so the first
    chunk holding the greatest score, found as :func:`_running_argmax` finds it within a
    block, holds the row's first maximum: the one ``torch.argmax`` returns. (A row of
    ``-inf`` gives chunk 0's index, 0, as it does.)"""
    offs = tl.arange(0, SPLITS)
    mask = offs < splits
    scores = tl.load(part_best_ptr + row * splits + offs, mask=mask, other=-float("inf"))
    indices = tl.load(part_index_ptr + row * splits + offs, mask=mask, other=0)
    _, split = _running_argmax(scores, 0, -float("inf"), 0, 0)
    return tl.sum(tl.where(offs == split, indices, 0), axis=0)


@triton.jit
def _store_argmax_kernel(part_best_ptr, part_index_ptr, out_ptr, splits,
                         SPLITS: tl.constexpr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, _partials_argmax(part_best_ptr, part_index_ptr, row, splits, SPLITS))


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


def _lm_head_argmax(head: UnprojectedLogits, seeds: torch.Tensor, positions: torch.Tensor, *,
                    gumbel: bool, step: torch.Tensor, draft_logits: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Launch the LM head with phase 1 in its epilogue over ``head`` (at least one row): the
    partials, one per tensor-core tile of the vocabulary (new tensors, from the graph pool
    under capture), and their count per row; the fp32 logits stored at
    ``draft_logits[:, step]``."""
    tiles = skinny_tiles(head.weight)
    rows, device = head.rows.shape[0], head.rows.device
    part_best = torch.empty(rows, tiles, dtype=torch.float32, device=device)
    part_index = torch.empty(rows, tiles, dtype=torch.int64, device=device)
    launch_skinny(_lm_head_argmax_kernel, head.rows, head.weight, seeds, positions, step,
                  draft_logits, part_best, part_index, *draft_logits.stride()[:2],
                  GUMBEL=gumbel)
    return part_best, part_index, tiles


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
                                      SPLITS=triton.next_power_of_2(splits))
    return out


@triton.jit
def _decode_step_finish_kernel(
    part_best_ptr, part_index_ptr, positions_ptr, seq_lens_ptr, is_real_ptr, step_ptr,
    done_ptr, tokens_ptr, input_ids_ptr, tokens_row_stride, splits, max_model_len,
    ADVANCE: tl.constexpr, MOVE_ON: tl.constexpr, ONE_LANE: tl.constexpr, SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``row`` (grid ``(lanes,)``): the lane's token from its partials, stored and
    fed back, and its advance. With ``MOVE_ON``, every program counts itself done in
    ``done`` (acquire-release) after it has read the step; the last one stores ``step + 1``
    and clears ``done``, so no program can read the step after it moved on. A grid of
    ``ONE_LANE`` has no other program to wait for: it stores ``step + 1`` itself, without
    the count (an atomic's round trip less at batch 1)."""
    row = tl.program_id(0)
    release_dependents(PDL)
    await_predecessor(PDL)
    step = tl.load(step_ptr)
    token = _partials_argmax(part_best_ptr, part_index_ptr, row, splits, SPLITS)
    tl.store(tokens_ptr + row * tokens_row_stride + step, token)
    tl.store(input_ids_ptr + row, token)
    if ADVANCE:
        position = tl.load(positions_ptr + row)
        real = tl.load(is_real_ptr + row).to(position.dtype)
        tl.store(positions_ptr + row, tl.minimum(position + real, max_model_len - 1))
        seq_len = tl.load(seq_lens_ptr + row)
        tl.store(seq_lens_ptr + row, tl.minimum(seq_len + real.to(seq_len.dtype), max_model_len))
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
    lanes_done: torch.Tensor | None = None,
    kernel: bool | None = None,
) -> None:
    """The end of a decode step over the ``R`` lanes, in place: sample each lane's token
    from ``logits`` (``[R, vocab]``, the model's dtype) as :func:`sample_tokens` does, store
    it at column ``step`` (a device scalar) of ``draft_tokens`` (``[R, K]``) and the logits,
    in fp32, at ``draft_logits[:, step]`` (``[R, K, vocab]``), and feed it back as
    ``input_ids``. With ``advance``, real lanes (``is_real``) move one position on
    (``positions`` clamped at ``max_model_len - 1``, ``seq_lens`` at ``max_model_len``);
    padding lanes stay. Sampling reads the positions before they advance. Given
    ``lanes_done`` (an int32 device scalar the caller owns, zero between calls, left zero),
    ``step`` moves on by one at the end, inside the last kernel; otherwise it is left to the
    caller. Nothing else is written.

    ``logits`` may be :class:`~speccheck.speculator.projection_kernels.UnprojectedLogits`
    (the LM head over ``R`` hidden rows), projected here with the same ``kernel`` choice and
    the same numbers as its ``project``: where
    :func:`~speccheck.speculator.projection_kernels.runs_skinny` says so, by the LM head's
    tensor-core kernel with phase 1 in its epilogue (one kernel less), else by ``project``
    first.

    On CUDA (``kernel`` forces or avoids it) two Triton kernels: several programs per lane
    scan its vocabulary in chunks or tiles (sampling partials, fp32 logits stored), then one
    program per lane picks the token and does the stores and the advance (and the last
    one to finish moves the step on). ``logits`` rows
    and the vocabulary dimension of ``draft_logits`` must be contiguous. Tensor ops
    elsewhere. Capture-safe: no host values or synchronisation, the scratch partials from
    the graph pool under capture, every write to the buffers in place."""
    if isinstance(logits, UnprojectedLogits) and not runs_skinny(*logits, kernel):
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
        if lanes_done is not None:
            step.add_(1)
        return
    n = input_ids.shape[0]
    if not n and lanes_done is not None:
        step.add_(1)
    if n:
        gumbel = method == "gumbel"
        part_best, part_index, splits = (
            _chunk_argmax(logits, seeds, positions, gumbel=gumbel, step=step,
                          draft_logits=draft_logits)
            if isinstance(logits, torch.Tensor) else
            _lm_head_argmax(logits, seeds, positions, gumbel=gumbel, step=step,
                            draft_logits=draft_logits))
        _decode_step_finish_kernel[(n,)](
            part_best, part_index, positions, seq_lens, is_real, step, lanes_done, draft_tokens,
            input_ids, draft_tokens.stride(0), splits, max_model_len, ADVANCE=advance,
            MOVE_ON=lanes_done is not None, ONE_LANE=n == 1,
            SPLITS=triton.next_power_of_2(splits), **dependent_launch(input_ids))


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
