"""Draft-token sampling: argmax, or Gumbel-max with per-request seeds.

The Gumbel noise is a counter-based hash of (seed, position, vocab index) computed with
integer ops: deterministic, identical on every path (eager, per-step graph, fused graph),
and capture-safe (no generator state advanced on the host). On CUDA, Gumbel-max is one
Triton kernel (hash, noise, add and argmax per row), and so is the whole end of a decode
step (:func:`finish_decode_step`: sample, store, feed back, advance); elsewhere the same math
in tensor ops.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from speccheck.speculator.model_kernels import use_kernels

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
def _running_argmax(score, start, best, best_index):
    """The row's best score and its index so far, after the block of ``score`` that starts
    at vocabulary entry ``start``; strict, so the first maximum wins, as ``torch.argmax``."""
    block_best = tl.max(score, axis=0)
    block_index = tl.argmax(score, axis=0) + start
    better = block_best > best
    return tl.where(better, block_best, best), tl.where(better, block_index, best_index)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, seeds_ptr, positions_ptr, out_ptr, row_stride, vocab,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = _row_key(tl.load(seeds_ptr + row).to(tl.int64),
                   tl.load(positions_ptr + row).to(tl.int64))
    best = -float("inf")
    best_index = 0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        score = tl.where(mask, _gumbel_score(x, key, cols), -float("inf"))
        best, best_index = _running_argmax(score, start, best, best_index)
    tl.store(out_ptr + row, best_index)  # stored as the int64 it points to


_GUMBEL_BLOCK = 1024


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *,
                  kernel: bool | None = None) -> torch.Tensor:
    """``argmax(logits + gumbel_noise(seeds, positions))`` per row, int64 ``[R]``: one
    Triton kernel on CUDA (``kernel`` forces or avoids it), tensor ops elsewhere. Rows of
    ``logits`` must be contiguous."""
    if not (use_kernels(logits) if kernel is None else kernel):
        return (logits + gumbel_noise(seeds, positions, logits.shape[-1])).argmax(dim=-1)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](logits, seeds, positions, out, logits.stride(0), vocab,
                                       BLOCK=min(_GUMBEL_BLOCK, triton.next_power_of_2(vocab)))
    return out


@triton.jit
def _decode_step_epilogue_kernel(
    logits_ptr, seeds_ptr, positions_ptr, seq_lens_ptr, is_real_ptr, step_ptr, tokens_ptr,
    draft_logits_ptr, input_ids_ptr, logits_row_stride, tokens_row_stride,
    draft_logits_row_stride, draft_logits_step_stride, vocab, max_model_len,
    GUMBEL: tl.constexpr, ADVANCE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    step = tl.load(step_ptr)
    position = tl.load(positions_ptr + row)
    key = 0
    if GUMBEL:
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), position.to(tl.int64))
    out_logits = draft_logits_ptr + row * draft_logits_row_stride + step * draft_logits_step_stride
    best = -float("inf")
    best_index = 0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=mask, other=0.0)
        x = x.to(tl.float32)
        tl.store(out_logits + cols, x, mask=mask)
        score = x
        if GUMBEL:
            score = _gumbel_score(x, key, cols)
        score = tl.where(mask, score, -float("inf"))
        best, best_index = _running_argmax(score, start, best, best_index)
    tl.store(tokens_ptr + row * tokens_row_stride + step, best_index)
    tl.store(input_ids_ptr + row, best_index)
    if ADVANCE:
        real = tl.load(is_real_ptr + row).to(position.dtype)
        tl.store(positions_ptr + row, tl.minimum(position + real, max_model_len - 1))
        seq_len = tl.load(seq_lens_ptr + row)
        tl.store(seq_lens_ptr + row, tl.minimum(seq_len + real.to(seq_len.dtype), max_model_len))


def finish_decode_step(
    logits: torch.Tensor,
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
    kernel: bool | None = None,
) -> None:
    """The end of a decode step over the ``R = len(logits)`` lanes, in place: sample each
    lane's token from ``logits`` (``[R, vocab]``, the model's dtype) as
    :func:`sample_tokens` does, store it at column ``step`` (a device scalar) of
    ``draft_tokens`` (``[R, K]``) and the logits, in fp32, at ``draft_logits[:, step]``
    (``[R, K, vocab]``), and feed it back as ``input_ids``. With ``advance``, real lanes
    (``is_real``) move one position on (``positions`` clamped at ``max_model_len - 1``,
    ``seq_lens`` at ``max_model_len``); padding lanes stay. Sampling reads the positions
    before they advance. ``step`` itself is left to the caller.

    One Triton kernel on CUDA (``kernel`` forces or avoids it), tensor ops elsewhere.
    Capture-safe: no host values, every write in place."""
    n = logits.shape[0]
    if not (use_kernels(logits) if kernel is None else kernel):
        tokens = sample_tokens(logits, method, seeds, positions, kernel=False)
        at_step = step.view(1)
        draft_tokens.index_copy_(1, at_step, tokens.unsqueeze(1))
        draft_logits.index_copy_(1, at_step, logits.unsqueeze(1).float())
        input_ids.copy_(tokens)
        if advance:
            positions.add_(is_real).clamp_(max=max_model_len - 1)
            seq_lens.add_(is_real).clamp_(max=max_model_len)
        return
    if n:
        vocab = logits.shape[1]
        _decode_step_epilogue_kernel[(n,)](
            logits, seeds, positions, seq_lens, is_real, step, draft_tokens, draft_logits,
            input_ids, logits.stride(0), draft_tokens.stride(0), draft_logits.stride(0),
            draft_logits.stride(1), vocab, max_model_len, GUMBEL=method == "gumbel",
            ADVANCE=advance, BLOCK=min(_GUMBEL_BLOCK, triton.next_power_of_2(vocab)))


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
