"""Dense attention of one request over its keys and values, gathered from the paged cache
into contiguous tensors: a plain masked softmax in fp64."""

from __future__ import annotations

import torch

from speccheck.checks.verify.oracle.spans import RequestSpan
from speccheck.contract.builder import blocks_for


def gather_request(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions ``0 .. seq_len - 1`` of one request from ``cache`` (``[blocks,
    block_size, heads, width]``) through its block-table row: ``[seq_len, heads, width]``,
    position ``p`` from slot ``p % block_size`` of block ``table_row[p // block_size]``."""
    block_size = cache.shape[1]
    pages = table_row[: blocks_for(seq_len, block_size)].long()
    return cache[pages].flatten(0, 1)[:seq_len]


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    span: RequestSpan,
    scale: float,
    causal: bool,
    window: int,
) -> torch.Tensor:
    """Attention of ``span``'s query tokens (``query`` ``[q, heads, D]``) over its
    positions' ``keys`` (``[seq_len, kv_heads, D]``) and ``values`` (``[seq_len, kv_heads,
    Dv]``), in fp64: query head ``h`` reads KV head ``h // (heads // kv_heads)``
    (grouped-query attention); the token at position ``p`` sees the positions ``j <
    seq_len`` with ``j <= p`` when ``causal`` and ``j > p - window`` when ``window > 0``.
    Every token sees its own position, so no row is empty. Returns ``[q, heads, Dv]``
    fp64."""
    q, heads, head_size = query.shape
    kv_heads = keys.shape[1]
    grouped = query.double().view(q, kv_heads, heads // kv_heads, head_size)
    scores = torch.einsum("qkgd,lkd->qkgl", grouped, keys.double()) * scale
    key_pos = torch.arange(span.seq_len, device=query.device)
    query_pos = torch.arange(span.first_position, span.seq_len, device=query.device)[:, None]
    visible = torch.ones(q, span.seq_len, dtype=torch.bool, device=query.device)
    if causal:
        visible &= key_pos <= query_pos
    if window > 0:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("qkgl,lkd->qkgd", torch.softmax(scores, dim=-1), values.double())
    return out.reshape(q, heads, values.shape[-1])
