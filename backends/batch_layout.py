"""Where each token of a flattened batch belongs (shared by the adapters)."""

from __future__ import annotations

import torch


def token_request_index(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Request index of each of ``num_tokens`` tokens (``num_reqs`` for tokens past the last
    real query offset, i.e. padding tokens). Capture-safe: one ``searchsorted`` of fixed
    shape, no host values."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)


def padding_tokens(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` bool: the tokens past the last real query offset
    (``query_start_loc[-1]``), i.e. FULL-mode padding, which belong to no request.
    Capture-safe: fixed shape, the offset read on the device."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device)
    return tokens >= query_start_loc[-1]
