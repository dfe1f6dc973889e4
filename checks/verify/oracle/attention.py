"""Dense attention of a chunk of requests over their keys and values, gathered from the
paged cache into contiguous tensors: a plain masked softmax in fp64."""

from __future__ import annotations

import torch

from speccheck.checks.verify.oracle.chunks import AttentionChunk
from speccheck.contract.builder import blocks_for


def gather_requests(cache: torch.Tensor, block_table: torch.Tensor, requests: torch.Tensor,
                    length: int) -> torch.Tensor:
    """Positions ``0 .. length - 1`` of each of ``requests`` from ``cache`` (``[blocks,
    block_size, heads, width]``) through its block-table row: ``[n, length, heads,
    width]``, position ``p`` of request ``r`` from slot ``p % block_size`` of block
    ``block_table[r, p // block_size]`` (past a request's own length: whatever its row
    points at, for the caller to mask)."""
    block_size = cache.shape[1]
    pages = block_table.index_select(0, requests)[:, : blocks_for(length, block_size)]
    gathered = cache.index_select(0, pages.flatten().long())
    return gathered.view(len(requests), -1, *cache.shape[2:])[:, :length]


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk: AttentionChunk,
    scale: float,
    causal: bool,
    window: int,
) -> torch.Tensor:
    """Attention of ``chunk``'s query cells (``query`` ``[n, width, heads, D]``) over
    their requests' ``keys`` (``[n, length, kv_heads, D]``) and ``values`` (``[n, length,
    kv_heads, Dv]``), in fp64: query head ``h`` reads KV head ``h // (heads // kv_heads)``
    (grouped-query attention); the cell at position ``p`` of a request of length ``L``
    sees the positions ``j < L`` with ``j <= p`` when ``causal`` and ``j > p - window``
    when ``window > 0``. Every cell sees its own position, so no row is empty. Returns
    ``[n, width, heads, Dv]`` fp64."""
    n, width, heads, head_size = query.shape
    kv_heads = keys.shape[2]
    grouped = query.double().view(n, width, kv_heads, heads // kv_heads, head_size)
    scores = torch.einsum("nwkgd,nlkd->nwkgl", grouped, keys.double()) * scale
    key_pos = torch.arange(chunk.length, device=query.device)
    cell_pos = chunk.cell_positions[:, :, None]
    visible = (key_pos < chunk.seq_lens[:, None, None]).expand(n, width, chunk.length)
    if causal:
        visible = visible & (key_pos <= cell_pos)
    if window > 0:
        visible = visible & (key_pos > cell_pos - window)
    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    out = torch.einsum("nwkgl,nlkd->nwkgd", torch.softmax(scores, dim=-1), values.double())
    return out.reshape(n, width, heads, values.shape[-1])
