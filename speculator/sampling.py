"""Draft-token sampling: argmax, or Gumbel-max with per-request seeds.

The Gumbel noise is a counter-based hash of (seed, position, vocab index) computed with
integer ops: deterministic, identical on every path (eager, per-step graph, fused graph),
and capture-safe (no generator state advanced on the host). On CUDA, Gumbel-max is one
Triton kernel (hash, noise, add and argmax per row); elsewhere the same math in tensor ops.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

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
def _gumbel_argmax_kernel(logits_ptr, seeds_ptr, positions_ptr, out_ptr, row_stride, vocab,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    position = tl.load(positions_ptr + row).to(tl.int64)
    h = _mix_kernel((seed & 0x7FFFFFFF) ^ 0x5BD1E995)
    h = _mix_kernel((h + position * 0x3C6EF35F) & 0x7FFFFFFF)
    best = -float("inf")
    best_index = 0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        noise_hash = _mix_kernel((h + cols.to(tl.int64) * 0x61C88647) & 0x7FFFFFFF)
        u = (noise_hash.to(tl.float32) + 0.5) / 2147483648.0
        x = tl.load(logits_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        score = tl.where(mask, x - tl.log(-tl.log(u)), -float("inf"))
        block_best = tl.max(score, axis=0)
        block_index = tl.argmax(score, axis=0) + start
        better = block_best > best  # strict: the first maximum wins, as torch.argmax
        best_index = tl.where(better, block_index, best_index)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, best_index)  # stored as the int64 it points to


_GUMBEL_BLOCK = 1024


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *,
                  kernel: bool | None = None) -> torch.Tensor:
    """``argmax(logits + gumbel_noise(seeds, positions))`` per row, int64 ``[R]``: one
    Triton kernel on CUDA (``kernel`` forces or avoids it), tensor ops elsewhere. Rows of
    ``logits`` must be contiguous."""
    if not (logits.is_cuda if kernel is None else kernel):
        return (logits + gumbel_noise(seeds, positions, logits.shape[-1])).argmax(dim=-1)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](logits, seeds, positions, out, logits.stride(0), vocab,
                                       BLOCK=min(_GUMBEL_BLOCK, triton.next_power_of_2(vocab)))
    return out


def sample_tokens(
    logits: torch.Tensor,
    method: SamplingMethod,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Token ids ``[R]`` (int64) from ``logits`` ``[R, vocab]`` (the model's dtype; the
    Gumbel noise is fp32, so the noisy argmax is taken in fp32)."""
    if method == "argmax":
        return logits.argmax(dim=-1)
    return gumbel_argmax(logits, seeds, positions)
