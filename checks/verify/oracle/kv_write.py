"""The oracle's KV write: each real token's key and value into the cache slot of its
position, computed from the block table (never from a backend's or the speculator's slot
mapping)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speccheck.checks.verify.oracle.spans import RequestSpan
from speccheck.contract.host_copy import int64_on


def token_slots(
    spans: Sequence[RequestSpan], block_table: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, slots)``, int64 on ``block_table``'s device: every query token of
    ``spans`` and the slot its position ``p`` occupies in request ``r``'s pages,
    ``block_table[r, p // block_size] * block_size + p % block_size``. Padding tokens are
    in no span, so they write nothing."""
    tokens: list[int] = []
    requests: list[int] = []
    positions: list[int] = []
    for span in spans:
        tokens.extend(range(span.tokens.start, span.tokens.stop))
        requests.extend([span.request] * span.query_len)
        positions.extend(range(span.first_position, span.seq_len))
    n = len(tokens)
    token_index, request_index, position = int64_on(
        tokens + requests + positions, block_table.device).split([n, n, n])
    pages = block_table[request_index, position // block_size].long()
    return token_index, pages * block_size + position % block_size


def write_tokens(
    rows: torch.Tensor, cache: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor
) -> None:
    """``rows[tokens]`` (``[T, heads, width]``) into ``cache`` (``[blocks, block_size,
    heads, width]``, contiguous) at ``slots``, in the cache's dtype, in place."""
    cache.view(-1, *cache.shape[2:])[slots] = rows[tokens].to(cache.dtype)
