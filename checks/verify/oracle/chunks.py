"""How the oracle groups one call's requests: requests of similar length attended together,
each padded to the group's longest length and widest query, so a call costs a few batched
operations rather than a few per request, with the keys a group gathers bounded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speccheck.checks.verify.oracle.spans import RequestSpan
from speccheck.contract.host_copy import int64_on

GATHER_BYTES = 256 * 2**20
"""Most bytes of fp64 keys one chunk gathers (as much again for its values): a chunk takes
requests, shortest first, only while its padded gather fits (at least one request)."""


@dataclass(frozen=True)
class AttentionChunk:
    """Requests attended together: ``n`` requests, each with ``width`` query cells (a
    request with fewer query tokens repeats its last one in the rest) over ``length``
    gathered positions (its longest request's). Device tensors, int64."""

    requests: torch.Tensor
    """``[n]``: the requests, by their row of the block table."""
    length: int
    width: int
    cell_tokens: torch.Tensor
    """``[n, width]``: the call's query row each cell reads."""
    cell_positions: torch.Tensor
    """``[n, width]``: each cell's position (its token's)."""
    seq_lens: torch.Tensor
    """``[n]``: each request's length (the positions it sees are below it)."""
    real_cells: torch.Tensor
    """``[m]``: the cells (flat, row-major) that are the requests' own tokens, each once;
    ``cell_tokens`` flat at them are the call's rows they fill."""


SIMILAR_LENGTHS = 1024
"""Lengths up to which requests are attended together whatever their spread: past it a
chunk takes a request only up to twice its shortest one's length, so that padding at most
doubles a chunk's work (one request of 33 000 keys among short ones would otherwise pad
them all to it)."""


def plan_chunks(spans: Sequence[RequestSpan], row_bytes: int,
                device: torch.device) -> tuple[AttentionChunk, ...]:
    """``spans`` in chunks, shortest requests first, each as many as fit
    :data:`GATHER_BYTES` at ``row_bytes`` per gathered position (one request at least) and
    are of similar length (:data:`SIMILAR_LENGTHS`)."""
    chunks: list[list[RequestSpan]] = []
    for span in sorted(spans, key=lambda s: s.seq_len):
        if (chunks and (len(chunks[-1]) + 1) * span.seq_len * row_bytes <= GATHER_BYTES
                and span.seq_len <= max(SIMILAR_LENGTHS, 2 * chunks[-1][0].seq_len)):
            chunks[-1].append(span)
        else:
            chunks.append([span])
    return tuple(_chunk(members, device) for members in chunks)


def _chunk(spans: list[RequestSpan], device: torch.device) -> AttentionChunk:
    width = max(s.query_len for s in spans)
    requests, tokens, positions, lengths, real = [], [], [], [], []
    for i, span in enumerate(spans):
        requests.append(span.request)
        lengths.append(span.seq_len)
        for j in range(width):
            offset = min(j, span.query_len - 1)
            tokens.append(span.first_token + offset)
            positions.append(span.first_position + offset)
            if j < span.query_len:
                real.append(i * width + j)
    n, cells = len(spans), len(spans) * width
    request_t, token_t, position_t, length_t, real_t = int64_on(
        requests + tokens + positions + lengths + real, device).split(
            [n, cells, cells, n, len(real)])
    return AttentionChunk(request_t, max(lengths), width, token_t.view(n, width),
                          position_t.view(n, width), length_t, real_t)
