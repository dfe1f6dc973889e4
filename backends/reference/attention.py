"""The reference paged-attention computation.

Fixed shapes only (masks instead of value-dependent slicing), so it can be captured in a
CUDA graph and replayed with new lengths. Slow and obviously right: every token gathers its
request's whole block-table row and masks what it must not see.
"""

from __future__ import annotations

import torch


def token_request_index(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Request index of each of ``num_tokens`` tokens (``num_reqs`` for tokens past the last
    real query offset, i.e. padding tokens)."""
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """Attention of ``query`` (``[T, H, D]``) over the paged cache, in fp32.

    A token of request ``r`` at query offset ``i`` (query length ``q_r``) sits at absolute
    position ``seq_lens[r] - q_r + i`` and sees KV positions ``< seq_lens[r]`` (and ``<=``
    its own position when ``causal``). Padding tokens and requests with ``seq_lens == 0``
    produce zeros. Returns ``[T, H, D]`` in ``query.dtype``.
    """
    num_tokens, num_heads, head_size = query.shape
    num_reqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    if num_tokens == 0 or num_reqs == 0:
        return torch.zeros_like(query)
    req = token_request_index(query_start_loc, num_tokens)
    real_token = req < num_reqs
    req = req.clamp(max=num_reqs - 1).long()
    qsl = query_start_loc.long()
    query_len = qsl[req + 1] - qsl[req]
    offset = torch.arange(num_tokens, device=query.device) - qsl[req]
    seq_len = seq_lens.long()[req]
    abs_pos = seq_len - query_len + offset

    blocks = block_table.long()[req]  # [T, MB]
    k = key_cache[blocks].flatten(1, 2).float()  # [T, L, KVH, D]
    v = value_cache[blocks].flatten(1, 2).float()
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=2, output_size=num_heads)
    v = v.repeat_interleave(group, dim=2, output_size=num_heads)

    kv_pos = torch.arange(k.shape[1], device=query.device)
    visible = kv_pos[None, :] < seq_len[:, None]
    if causal:
        visible &= kv_pos[None, :] <= abs_pos[:, None]
    visible &= real_token[:, None]

    scores = torch.einsum("thd,tlhd->thl", query.float(), k) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    any_visible = visible.any(dim=1)[:, None, None]
    probs = torch.where(any_visible, torch.softmax(scores, dim=-1), torch.zeros_like(scores))
    out = torch.einsum("thl,tlhd->thd", probs, v)
    return out.to(query.dtype)
