"""The oracle's builder and impl (:mod:`speccheck.checks.verify.oracle`) on hand-made
calls, against the shipped reference's paged attention (written separately, sharing no
code with it): grouped-query and latent layouts, sliding windows, several query tokens per
request, padding lanes and padding tokens; and its own KV write lands at the slots of the
tokens' positions."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.reference.attention import paged_attention_reference
from speccheck.checks.verify.oracle.builder import OracleMetadataBuilder
from speccheck.contract.builder import AttentionLayerSpec, BuilderLimits
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import CommonAttentionMetadata
from tests.fixtures.configs import CPU_CONFIG

CPU = torch.device("cpu")
BLOCK_SIZE, MAX_BLOCKS, HEAD_SIZE = 4, 6, 8


def _common(query_lens: list[int], seq_lens: list[int], padding_tokens: int,
            block_table: torch.Tensor, causal: bool) -> CommonAttentionMetadata:
    offsets = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lengths = torch.tensor(seq_lens, dtype=torch.int32)
    tokens = sum(query_lens) + padding_tokens
    return CommonAttentionMetadata(
        query_start_loc=offsets, query_start_loc_cpu=offsets.clone(), seq_lens=lengths,
        seq_lens_cpu_upper_bound=lengths.clone(), block_table=block_table,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.zeros(tokens, dtype=torch.int64), num_reqs=len(seq_lens),
        num_real_reqs=sum(q > 0 for q in query_lens), num_actual_tokens=tokens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        max_model_len=BLOCK_SIZE * MAX_BLOCKS, causal=causal)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), latent=st.booleans(), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), window=st.sampled_from([0, 3]), causal=st.booleans(),
       padding_tokens=st.integers(0, 2))
def test_the_oracle_matches_the_reference_attention_and_writes_its_slots(
    data: st.DataObject, latent: bool, kv_heads: int, group: int, window: int, causal: bool,
    padding_tokens: int,
) -> None:
    kv_heads = 1 if latent else kv_heads
    layer = AttentionLayerSpec(
        num_heads=kv_heads * group, num_kv_heads=kv_heads, head_size=HEAD_SIZE,
        dtype=torch.float32, block_size=BLOCK_SIZE, max_model_len=BLOCK_SIZE * MAX_BLOCKS,
        kv_layout=KvLayout.LATENT if latent else KvLayout.NHD, kv_lora_rank=6,
        qk_rope_head_dim=2, sliding_window=window)
    num_reqs = data.draw(st.integers(1, 4))
    seq_lens = [data.draw(st.integers(1, BLOCK_SIZE * MAX_BLOCKS)) for _ in range(num_reqs)]
    query_lens = [data.draw(st.integers(1, min(s, 3))) for s in seq_lens]
    lane = data.draw(st.integers(0, num_reqs))  # a padding lane: no token, no length
    query_lens.insert(lane, 0)
    seq_lens.insert(lane, 0)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    num_blocks = (num_reqs + 1) * MAX_BLOCKS + 1
    block_table = (torch.randperm(num_blocks - 1, generator=gen)[: (num_reqs + 1) * MAX_BLOCKS]
                   + 1).view(num_reqs + 1, MAX_BLOCKS).int()
    first_shape, second_shape = layer.kv_cache_shapes(num_blocks)
    key_cache = torch.randn(first_shape, generator=gen)
    value_cache = torch.randn(second_shape, generator=gen)
    common = _common(query_lens, seq_lens, padding_tokens, block_table, causal)
    tokens = common.num_actual_tokens
    width = first_shape[-1]
    query = torch.randn(tokens, layer.num_heads, width, generator=gen)
    key = torch.randn(tokens, kv_heads, width, generator=gen)
    value = key[..., : layer.kv_lora_rank] if latent else torch.randn(key.shape, generator=gen)
    scale = 1 / math.sqrt(HEAD_SIZE)

    builder = OracleMetadataBuilder(layer, CPU_CONFIG, CPU, BuilderLimits(8, 32))
    out_width = layer.kv_lora_rank if latent else HEAD_SIZE
    output = torch.zeros(tokens, layer.num_heads, out_width)
    builder.make_impl(scale).forward(query, key, value, key_cache, value_cache,
                                     builder.build(common), output)

    t = 0
    for r, (q_len, length) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for i in range(q_len):
            position = length - q_len + i
            slot = (int(block_table[r, position // BLOCK_SIZE]), position % BLOCK_SIZE)
            assert torch.equal(key_cache[slot], key[t + i])
            if not latent:
                assert torch.equal(value_cache[slot], value[t + i])
        t += q_len
    values = key_cache[..., : layer.kv_lora_rank] if latent else value_cache
    expected = paged_attention_reference(
        query, key_cache, values, common.query_start_loc, common.seq_lens, block_table,
        scale, causal, window)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    assert not output[t:].any(), "padding tokens' rows are left as they arrived"


def test_requests_of_very_different_lengths_are_attended_in_chunks_of_their_own() -> None:
    """Up to :data:`SIMILAR_LENGTHS` requests share a chunk whatever their spread; past it a
    chunk takes a request only up to twice its shortest length, so one long request among
    short ones does not pad them all to its length."""
    from speccheck.checks.verify.oracle.chunks import SIMILAR_LENGTHS, plan_chunks
    from speccheck.checks.verify.oracle.spans import RequestSpan

    lengths = [1, 7, SIMILAR_LENGTHS, 3 * SIMILAR_LENGTHS, 5 * SIMILAR_LENGTHS, 33_000]
    spans = [RequestSpan(r, r, 1, length) for r, length in enumerate(lengths)]
    chunks = plan_chunks(spans[::-1], row_bytes=8, device=CPU)
    assert [chunk.requests.tolist() for chunk in chunks] == [[0, 1, 2], [3, 4], [5]]
    assert [chunk.length for chunk in chunks] == [SIMILAR_LENGTHS, 5 * SIMILAR_LENGTHS, 33_000]
