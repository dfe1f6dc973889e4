"""Draft-token sampling: argmax, or Gumbel-max with per-request seeds.

The Gumbel noise is a counter-based hash of (seed, position, vocab index) computed with
integer tensor ops: deterministic, identical on every path (eager, per-step graph, fused
graph), and capture-safe (no generator state advanced on the host).
"""

from __future__ import annotations

from typing import Literal

import torch

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
    return (logits + gumbel_noise(seeds, positions, logits.shape[-1])).argmax(dim=-1)
