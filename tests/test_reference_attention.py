"""The reference backend against a per-request loop written independently here."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.reference.attention import paged_attention_reference


def _loop_attention(query, key_cache, value_cache, query_lens, seq_lens, block_table, scale, causal):
    block_size = key_cache.shape[1]
    heads, kv_heads = query.shape[1], key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    t = 0
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        keys = torch.stack([key_cache[block_table[r][p // block_size], p % block_size] for p in range(s_len)]) if s_len else None
        values = torch.stack([value_cache[block_table[r][p // block_size], p % block_size] for p in range(s_len)]) if s_len else None
        for i in range(q_len):
            pos = s_len - q_len + i
            limit = pos + 1 if causal else s_len
            for h in range(heads):
                if limit <= 0:
                    continue
                kh = h // (heads // kv_heads)
                k = keys[:limit, kh].double()
                v = values[:limit, kh].double()
                w = torch.softmax((k @ query[t + i, h].double()) * scale, dim=0)
                out[t + i, h] = w @ v
        t += q_len
    return out


@settings(max_examples=25)
@given(
    data=st.data(),
    num_reqs=st.integers(1, 4),
    block_size=st.sampled_from([1, 4, 8]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    causal=st.booleans(),
)
def test_reference_matches_loop(data, num_reqs, block_size, kv_heads, group, causal):
    head_size, max_blocks = 8, 6
    num_blocks = num_reqs * max_blocks + 1
    seq_lens = [data.draw(st.integers(0, block_size * max_blocks)) for _ in range(num_reqs)]
    query_lens = [data.draw(st.integers(0, min(s, 3))) for s in seq_lens]
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))) + 1
    block_table = perm[: num_reqs * max_blocks].view(num_reqs, max_blocks).int()
    gen = torch.Generator().manual_seed(7)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen)
    total = sum(query_lens)
    query = torch.randn(total + 2, kv_heads * group, head_size, generator=gen)  # 2 padding tokens
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    scale = 1 / math.sqrt(head_size)
    got = paged_attention_reference(
        query, key_cache, value_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), block_table, scale, causal
    )
    want = _loop_attention(query, key_cache, value_cache, query_lens, seq_lens, block_table, scale, causal)
    torch.testing.assert_close(got[:total].double(), want[:total], atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(got[total:]) == 0, "padding tokens must produce zeros"


def _assert_eager_equals_captured(seq_lens, query_lens, block_size, max_blocks, causal, window,
                                  padding, seeds):
    """The fixed-shape path a graph captures (every token, the whole row) and the eager
    path of the same call compute the same attention: ``seq_lens`` and ``query_lens`` per
    request, blocks of ``block_size``, ``padding`` tokens past the last request, the block
    layout and the values drawn from ``seeds``."""
    import speccheck.backends.reference.attention as attention

    num_reqs, kv_heads, group, head_size = len(seq_lens), 2, 2, 8
    num_blocks = num_reqs * max_blocks + 1
    block_table = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seeds[0]))[
        : num_reqs * max_blocks] + 1).view(num_reqs, max_blocks).int()
    gen = torch.Generator().manual_seed(seeds[1])
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen)
    query = torch.randn(sum(query_lens) + padding, kv_heads * group, head_size, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (query, key_cache, value_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32),
            block_table, 0.3, causal, window)
    eager = paged_attention_reference(*args)
    original = attention.capturing
    attention.capturing = lambda: True
    try:
        captured = paged_attention_reference(*args)
    finally:
        attention.capturing = original
    torch.testing.assert_close(eager, captured, atol=1e-5, rtol=1e-5)


@settings(max_examples=25)
@given(data=st.data(), window=st.sampled_from([0, 1, 3, 7]), causal=st.booleans())
def test_captured_and_eager_paths_agree(data, window, causal):
    """The fixed-shape path a graph captures (every token, the whole row) and the eager
    paths (decode: columns bounded by the longest request; several tokens per request: one
    gather per request from where its window starts) compute the same attention."""
    block_size, max_blocks = 4, 5
    seq_lens = [data.draw(st.integers(0, block_size * max_blocks)) for _ in range(3)]
    query_lens = [data.draw(st.integers(0, min(s, 4))) for s in seq_lens]
    _assert_eager_equals_captured(seq_lens, query_lens, block_size, max_blocks, causal, window,
                                  padding=1, seeds=(3, 11))


@settings(max_examples=25)
@given(data=st.data(), window=st.sampled_from([0, 2, 9]), causal=st.booleans())
def test_decode_grouped_by_length_equals_one_padded_pass(data, window, causal):
    """An eager decode batch (one token or none per request) of very different lengths is
    attended group by group (requests of similar length together, each group gathering
    only as far as its longest): the same as the fixed-shape pass over the whole row, with
    zeros for padding tokens, requests without a token and empty requests."""
    seq_lens = [data.draw(st.sampled_from([0, 1, 2, 3, 7, 16, 33, 80])) for _ in range(6)]
    query_lens = [data.draw(st.integers(0, min(s, 1))) for s in seq_lens]
    _assert_eager_equals_captured(seq_lens, query_lens, 2, 40, causal, window, padding=2,
                                  seeds=(5, 13))


@settings(max_examples=25)
@given(data=st.data(), causal=st.booleans(), per_chunk=st.integers(1, 3))
def test_first_pass_grouped_and_chunked_equals_one_padded_pass(data, causal, per_chunk):
    """An eager first pass (several tokens per request) of very different lengths is
    attended group by group, each group's requests at once in chunks whose gathered keys
    fit the gather budget (cut here to a few requests of eight blocks): the same as the
    fixed-shape pass over the whole row, with zeros for padding tokens, requests without a
    token and empty requests."""
    import speccheck.backends.reference.attention as attention

    seq_lens = [data.draw(st.sampled_from([0, 2, 3, 7, 16, 33, 80])) for _ in range(6)]
    query_lens = [data.draw(st.integers(0, min(s, 5))) for s in seq_lens]
    query_lens[0] = max(query_lens[0], min(seq_lens[0], 2))  # several tokens: a first pass
    budget = attention.GATHER_BYTES
    attention.GATHER_BYTES = per_chunk * 8 * 2 * 2 * 8 * 4  # blocks of 2, 2 KV heads of 8
    try:
        _assert_eager_equals_captured(seq_lens, query_lens, 2, 40, causal, 0, padding=2,
                                      seeds=(7, 17))
    finally:
        attention.GATHER_BYTES = budget


def test_decode_lengths_fall_into_power_of_two_block_groups():
    from speccheck.backends.reference.attention import _length_groups

    # block size 4: 1, 4 | 5, 8 | 9 | 17..32 share groups of 1, 2, 3..4, 5..8 blocks; a
    # request without a token (offsets equal) or without a length belongs to none
    offsets = [0, 1, 2, 3, 4, 5, 6, 6, 7]
    lens = [1, 4, 5, 8, 9, 30, 31, 0]
    assert _length_groups(offsets, lens, 4) == [[0, 1], [2, 3], [4], [5]]
