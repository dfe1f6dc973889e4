"""Hypothesis strategies for draft batches that differ from what graphs were captured on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from speccheck.speculator.batch import DraftBatch


@dataclass(frozen=True)
class BatchLimits:
    """What a drafter can hold: the bounds every drawn batch respects."""

    max_num_reqs: int
    block_size: int
    max_model_len: int
    num_blocks: int
    extra_positions: int
    """Positions written past the new tokens (K-1 autoregressive, K for a DFlash block)."""
    vocab_size: int
    max_new_tokens: int = 3
    room_for_block: bool = False
    """Require ``context + new + extra_positions <= max_model_len`` (DFlash blocks)."""


def _context_len(draw: st.DrawFn, limits: BatchLimits, q: int) -> int:
    """A context length of one of three kinds: anywhere, just before a block boundary (so
    the draft steps cross it), or near ``max_model_len`` (so the steps hit the clamp)."""
    top = limits.max_model_len - q - (limits.extra_positions if limits.room_for_block else 0)
    kind = draw(st.sampled_from(["anywhere", "boundary", "clamp"]))
    if kind == "anywhere":
        return draw(st.integers(0, top))
    if kind == "clamp":
        return max(0, top - draw(st.integers(0, 2)))
    bs = limits.block_size
    boundary = draw(st.integers(1, max(1, top // bs))) * bs
    return int(np.clip(boundary - q - draw(st.integers(0, 1)), 0, top))


@st.composite
def draft_batches(draw: st.DrawFn, limits: BatchLimits) -> DraftBatch:
    """A batch of 1..``max_num_reqs`` requests whose block tables are a shuffled, disjoint
    draw from the live blocks.

    Shrinks towards one request, short contexts, one new token, seed 0.
    """
    bs = limits.block_size
    max_blocks = -(-limits.max_model_len // bs)
    budget = limits.num_blocks - 1
    if budget < max_blocks:
        raise ValueError(f"num_blocks={limits.num_blocks} cannot hold one full request row")
    n = draw(st.integers(1, limits.max_num_reqs))
    contexts: list[int] = []
    news: list[tuple[int, ...]] = []
    rows_needed: list[int] = []
    for _ in range(n):
        q = draw(st.integers(1, limits.max_new_tokens))
        ctx = _context_len(draw, limits, q)
        last = min(ctx + q - 1 + limits.extra_positions, limits.max_model_len - 1)
        needed = last // bs + 1
        if sum(rows_needed) + needed > budget:
            break
        contexts.append(ctx)
        news.append(tuple(draw(st.lists(st.integers(0, limits.vocab_size - 1), min_size=q, max_size=q))))
        free = budget - sum(rows_needed)
        rows_needed.append(draw(st.integers(needed, max(needed, min(max_blocks, free)))))
    layout = np.random.default_rng(draw(st.integers(0, 2**16))).permutation(np.arange(1, limits.num_blocks))
    rows, start = [], 0
    for count in rows_needed:
        rows.append(tuple(int(b) for b in layout[start : start + count]))
        start += count
    seeds = tuple(draw(st.integers(0, 2**31 - 1)) for _ in contexts)
    return DraftBatch(tuple(contexts), tuple(news), tuple(rows), seeds)
