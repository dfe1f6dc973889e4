"""The reference paged-attention computation.

Slow and obviously right: every token gathers its request's block-table row and masks what
it must not see. While a CUDA graph is being captured only fixed shapes are used (masks
instead of value-dependent slicing, the whole row, tokens in chunks that bound memory), so
the graph replays with any lengths. Eager calls take the lengths on the host instead and
attend per group of requests of similar length (powers of two in blocks), each group at
once and gathering only as many columns as its longest request needs; each request's
positions are gathered once for all its tokens, not once per token. A pass with several
tokens per request under a sliding window goes request by request, each gathered from
where its window starts.
A decode-context-parallel rank's partial attention (its interleaved share of the cache, with
the log-sum-exp that :func:`~speccheck.backends.dcp.merge_partials` needs) always takes the
fixed-shape path, the whole cache being its one-rank case.
"""

from __future__ import annotations

import itertools

import torch

from speccheck.backends.batch_layout import token_request_index
from speccheck.contract.builder import blocks_for
from speccheck.contract.capture_state import capturing
from speccheck.contract.host_copy import int64_on

GATHER_BYTES = 256 * 2**20
"""Upper bound on the fp32 keys (and as much again for values) gathered at once: tokens (or
requests) are processed in chunks whose gathered cache rows fit it, so memory stays bounded at
serving-scale batches and ``max_model_len``."""


def gather_chunk(kv_len: int, num_kv_heads: int, head_size: int) -> int:
    """Tokens per chunk: as many as fit :data:`GATHER_BYTES` of fp32 keys, at least one.
    A function of shapes only, so a captured graph replays the same chunks."""
    return max(1, GATHER_BYTES // (kv_len * num_kv_heads * head_size * 4))


def gathered_blocks(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> int:
    """Block-table columns each token gathers: all of them while a CUDA graph is being
    captured (a replay may see any length), else only as many as the longest request needs
    right now. The eager case reads ``seq_lens`` on the host (a synchronisation, never
    captured), which keeps the fp32 oracle's memory traffic proportional to the batch's
    real lengths instead of ``max_model_len``."""
    if capturing():
        return block_table.shape[1]
    return _columns_for(int(seq_lens.max()) if seq_lens.numel() else 0, block_table, block_size)


def _columns_for(longest: int, block_table: torch.Tensor, block_size: int) -> int:
    """Block-table columns that hold a request of length ``longest`` (at least one)."""
    return max(1, min(block_table.shape[1], blocks_for(longest, block_size)))


_NOTHING = -(1 << 62)
"""A grid cell's visible end for a padding cell of :func:`_by_length` (below any length:
it sees no position)."""


def _masked_probs(scores: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of ``scores`` leaving out the entries ``hidden``
    marks (``scores`` is overwritten with ``-inf`` there); a row that sees nothing is zeros,
    not NaN."""
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return probs.masked_fill_(hidden.all(dim=-1, keepdim=True), 0.0)


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool,
    window: int = 0,
) -> torch.Tensor:
    """Attention of ``query`` (``[T, H, D]``) over the paged cache, in fp32.

    A token of request ``r`` at query offset ``i`` (query length ``q_r``) sits at absolute
    position ``p = seq_lens[r] - q_r + i`` and sees KV positions ``< seq_lens[r]`` (and
    ``<= p`` when ``causal``; and ``> p - window`` when ``window > 0``, a sliding window).
    Padding tokens and requests with ``seq_lens == 0`` produce zeros.

    Keys are ``key_cache`` (``[blocks, block_size, KVH, D]``) and values ``value_cache``
    (``[blocks, block_size, KVH, Dv]``, any strides): ``Dv`` may differ from ``D``, as
    for a latent MLA cache, whose keys are the whole entry and whose values are its first
    ``kv_lora_rank`` channels (pass ``latent`` and ``latent[..., :kv_lora_rank]``). Returns
    ``[T, H, Dv]`` in ``query.dtype``.
    """
    if query.shape[0] and seq_lens.shape[0] and not capturing():
        # One read-back for both: each is a wait for every launch before it.
        joined = torch.cat((query_start_loc.long(), seq_lens.long())).tolist()
        offsets, lengths = joined[: len(query_start_loc)], joined[len(query_start_loc):]
        if window > 0 and max(b - a for a, b in itertools.pairwise(offsets)) > 1:
            return _per_request(query, key_cache, value_cache, offsets, lengths,
                                block_table, scale, causal, window)
        return _by_length(query, key_cache, value_cache, offsets, lengths, seq_lens,
                          block_table, scale, causal, window)
    out, _ = _masked_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
                               seq_lens, block_table, scale, causal, window, rank=0, world=1,
                               with_lse=False)
    return out.to(query.dtype)


def _length_groups(offsets: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """The requests of a decode batch (at most one query token each) that have a token and
    a length, grouped by the power of two at or above the blocks their length spans."""
    groups: dict[int, list[int]] = {}
    for r, length in enumerate(seq_lens):
        if offsets[r + 1] > offsets[r] and length > 0:
            groups.setdefault((blocks_for(length, block_size) - 1).bit_length(), []).append(r)
    return list(groups.values())


def _by_length(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    offsets: list[int],
    host_seq_lens: list[int],
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
) -> torch.Tensor:
    """:func:`paged_attention_reference` of an eager call (a decode step, or a first pass
    without a window): the requests of each :func:`_length_groups` group at once, their
    tokens padded to the group's most and their positions to the columns its longest
    request needs, in chunks of requests whose gathered keys fit :data:`GATHER_BYTES`.
    Grouping bounds the gather: one pass padded to the batch's longest would gather that
    many columns for every request (at serving lengths, gigabytes per step). Each request's
    positions are gathered once for all its tokens, and a group costs the host one pass of
    launches, not one per request (at serving scale, 64 requests per layer). Lengths and
    positions come from ``seq_lens`` on the device; ``host_seq_lens`` only sizes the work.
    Every index goes to the device in one copy from page-locked memory, so nothing waits
    for the device. Tokens of no request stay zero."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    value_size = value_cache.shape[-1]
    chunks: list[tuple[int, int, int]] = []  # (requests, padded width, columns)
    requests_in_order: list[int] = []
    grid: list[int] = []  # each chunk's [requests, width] token indices (padding: the first)
    ends: list[int] = []  # per grid cell: where its visible positions end, less the length
    real_cells: list[int] = []  # positions in the grids (one after another) of real tokens
    real_tokens: list[int] = []  # the token each of those is
    for requests in _length_groups(offsets, host_seq_lens, block_size):
        columns = _columns_for(max(host_seq_lens[r] for r in requests), block_table, block_size)
        per_chunk = max(1, GATHER_BYTES // (columns * block_size * num_kv_heads * head_size * 4))
        for i in range(0, len(requests), per_chunk):
            chunk = requests[i: i + per_chunk]
            width = max(offsets[r + 1] - offsets[r] for r in chunk)
            for r in chunk:
                q_len = offsets[r + 1] - offsets[r]
                real_cells.extend(range(len(grid), len(grid) + q_len))
                grid.extend(offsets[r] + min(j, q_len - 1) for j in range(width))
                ends.extend((j - q_len + 1 if causal else 0) if j < q_len else _NOTHING
                            for j in range(width))
                real_tokens.extend(range(offsets[r], offsets[r + 1]))
            requests_in_order.extend(chunk)
            chunks.append((len(chunk), width, columns))
    out = torch.zeros(num_tokens, num_kv_heads, group, value_size, device=query.device)
    if not chunks:
        return out.view(num_tokens, num_heads, value_size).to(query.dtype)
    sizes = [len(requests_in_order), len(grid), len(ends), len(real_cells), len(real_tokens)]
    request_index, grid_index, end_index, cells, real = int64_on(
        requests_in_order + grid + ends + real_cells + real_tokens, query.device).split(sizes)
    results = []
    for (n, width, columns), req, tokens, cell_ends in zip(
            chunks, request_index.split([n for n, _, _ in chunks]),
            grid_index.split([n * w for n, w, _ in chunks]),
            end_index.split([n * w for n, w, _ in chunks]), strict=True):
        # a cell (request, query offset j) sees kv_pos < seq_len + its end (its own position
        # and those before it when causal; the whole request otherwise; nothing for padding)
        # and, under a window, kv_pos > its position - window (then every request has one
        # token at most, at position seq_len - 1 = end - 1: the caller sends longer queries
        # under a window to _per_request)
        end = seq_lens[req].long()[:, None] + cell_ends.view(n, width)
        kv_pos = torch.arange(columns * block_size, device=query.device)
        hidden = kv_pos >= end[:, :, None]
        if window > 0:
            hidden |= kv_pos <= end[:, :, None] - 1 - window
        tables = block_table[req, :columns]
        k = key_cache[tables].flatten(1, 2).float()  # [n, L, KVH, D]
        v = value_cache[tables].flatten(1, 2).float()
        q = query[tokens].float().view(n, width, num_kv_heads, group, head_size)
        scores = torch.einsum("nwkgd,nlkd->nwkgl", q, k) * scale
        probs = _masked_probs(scores, hidden[:, :, None, None, :])
        results.append(torch.einsum("nwkgl,nlkd->nwkgd", probs, v).reshape(
            n * width, num_kv_heads, group, value_size))
    out[real] = torch.cat(results)[cells]
    return out.view(num_tokens, num_heads, value_size).to(query.dtype)


def paged_attention_reference_partial(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool,
    window: int = 0,
    *,
    dcp_rank: int,
    dcp_world: int,
    local_seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-context-parallel rank ``dcp_rank`` of ``dcp_world``'s share of
    :func:`paged_attention_reference` (the layout of :mod:`speccheck.backends.dcp`).

    ``key_cache``, ``value_cache`` and ``block_table`` hold only this rank's positions: local
    position ``j`` of a request is its global position ``j * dcp_world + dcp_rank``.
    ``seq_lens`` are the global lengths, ``local_seq_lens`` this rank's (the builder's
    field, stale or not: the attention trusts it). A token sees the local keys
    ``j < local_seq_lens[r]`` that :func:`paged_attention_reference`'s rules (causal,
    window) let it see at their global positions. Queries are replicated on every rank.

    Always the fixed-shape path (every token, masks), so it is capture-safe. Returns ``out``
    ``[T, H, Dv]`` fp32, normalised over the keys this rank saw, and ``lse`` ``[T, H]`` fp32,
    the natural-log log-sum-exp of their scaled scores; a token that saw no key (padding,
    empty request, a share without a visible position) has zeros and ``-inf``. The ranks'
    partials merged by :func:`~speccheck.backends.dcp.merge_partials` are the attention over
    the whole cache.
    """
    out, lse = _masked_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
                                 local_seq_lens, block_table, scale, causal, window,
                                 rank=dcp_rank, world=dcp_world, with_lse=True)
    assert lse is not None
    return out, lse


def _masked_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    local_seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    *,
    rank: int,
    world: int,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fixed-shape path (masks, the whole row while capturing, tokens in chunks) over
    the cache's local positions ``j``, global position ``j * world + rank``: visible are
    ``j < local_seq_lens[r]`` and the global positions the causal and window rules allow
    for the token's global position (from the global ``seq_lens``). ``world == 1`` is the
    whole cache. Returns fp32 ``out`` ``[T, H, Dv]`` and, ``with_lse``, ``lse`` ``[T, H]``
    (zeros and ``-inf`` for a token that sees nothing), else ``None`` (the whole-cache
    attention needs no log-sum-exp, so its hot path does not compute one)."""
    num_tokens, num_heads, head_size = query.shape
    value_size = value_cache.shape[-1]
    num_reqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    if num_tokens == 0 or num_reqs == 0:
        empty = query.new_full((num_tokens, num_heads), float("-inf"), dtype=torch.float32)
        return (query.new_zeros(num_tokens, num_heads, value_size, dtype=torch.float32),
                empty if with_lse else None)
    req = token_request_index(query_start_loc, num_tokens)
    real_token = req < num_reqs
    req = req.clamp(max=num_reqs - 1).long()
    qsl = query_start_loc.long()
    query_len = qsl[req + 1] - qsl[req]
    offset = torch.arange(num_tokens, device=query.device) - qsl[req]
    abs_pos = seq_lens.long()[req] - query_len + offset

    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    kv_len = gathered_blocks(local_seq_lens, block_table, block_size) * block_size
    local_pos = torch.arange(kv_len, device=query.device)
    kv_pos = local_pos * world + rank
    visible = local_pos[None, :] < local_seq_lens.long()[req][:, None]
    if causal:
        visible &= kv_pos[None, :] <= abs_pos[:, None]
    if window > 0:
        visible &= kv_pos[None, :] > abs_pos[:, None] - window
    visible &= real_token[:, None]

    out = torch.empty(num_tokens, num_kv_heads, group, value_size, device=query.device)
    lse = torch.empty(num_tokens, num_kv_heads, group, device=query.device) if with_lse else None
    q = query.float().reshape(num_tokens, num_kv_heads, group, head_size)
    blocks = block_table.long()[req, : kv_len // block_size]  # [T, blocks]
    step = gather_chunk(kv_len, num_kv_heads, head_size)
    for start in range(0, num_tokens, step):
        rows = slice(start, min(num_tokens, start + step))
        k = key_cache[blocks[rows]].flatten(1, 2).float()  # [t, L, KVH, D]
        v = value_cache[blocks[rows]].flatten(1, 2).float()
        scores = torch.einsum("tkgd,tlkd->tkgl", q[rows], k) * scale
        probs = _masked_probs(scores, ~visible[rows][:, None, None, :])
        out[rows] = torch.einsum("tkgl,tlkd->tkgd", probs, v)
        if lse is not None:
            lse[rows] = torch.logsumexp(scores, dim=-1)
    return (out.view(num_tokens, num_heads, value_size),
            None if lse is None else lse.view(num_tokens, num_heads))


def _per_request(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    offsets: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
) -> torch.Tensor:
    """:func:`paged_attention_reference` of an eager call under a sliding window, one
    request at a time from host ``offsets`` (query start locations) and ``seq_lens``: each
    request's visible positions are gathered once for all its tokens, from the first its
    window reaches (:func:`_by_length` serves every other eager call). Same
    semantics, padding tokens and empty requests included (zeros)."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_kv_heads, group, value_cache.shape[-1],
                      device=query.device)
    for r, length in enumerate(seq_lens):
        start, end = offsets[r], offsets[r + 1]
        q_len = end - start
        if q_len == 0 or length == 0:
            continue
        first = 0 if window == 0 else max(0, length - q_len - window + 1)
        b0, b1 = first // block_size, -(-length // block_size)
        rows = slice(first - b0 * block_size, length - b0 * block_size)
        blocks = block_table[r, b0:b1].long()
        k = key_cache[blocks].flatten(0, 1)[rows].float()  # [n, KVH, D]
        v = value_cache[blocks].flatten(0, 1)[rows].float()
        kv_pos = torch.arange(first, length, device=query.device)
        abs_pos = torch.arange(length - q_len, length, device=query.device)
        visible = torch.ones(q_len, kv_pos.shape[0], dtype=torch.bool, device=query.device)
        if causal:
            visible &= kv_pos[None, :] <= abs_pos[:, None]
        if window > 0:
            visible &= kv_pos[None, :] > abs_pos[:, None] - window
        q = query[start:end].float().reshape(q_len, num_kv_heads, group, head_size)
        scores = torch.einsum("tkgd,lkd->tkgl", q, k) * scale
        probs = _masked_probs(scores, ~visible[:, None, None, :])
        out[start:end] = torch.einsum("tkgl,lkd->tkgd", probs, v)
    return out.view(num_tokens, num_heads, -1).to(query.dtype)
