"""The batch strategy draws what the verifier promises: valid, disjoint, block-crossing and
clamp-hitting batches."""

from __future__ import annotations

import pytest
from hypothesis import find, given, settings

from speccheck.checks.verify.strategies import BatchLimits, draft_batches

LIMITS = BatchLimits(max_num_reqs=4, block_size=4, max_model_len=40, num_blocks=48,
                     extra_positions=3, vocab_size=64)


@settings(max_examples=200)
@given(batch=draft_batches(LIMITS))
def test_every_batch_is_servable(batch) -> None:
    batch.validate(max_model_len=40, block_size=4, num_blocks=48, extra_positions=3, max_num_reqs=4)
    assert all(0 <= t < 64 for row in batch.new_tokens for t in row)


def test_draws_cross_block_boundaries_during_the_draft_steps() -> None:
    def crosses(batch) -> bool:
        ctx, new = batch.context_lens[0], len(batch.new_tokens[0])
        first, last = ctx + new - 1, ctx + new - 1 + LIMITS.extra_positions
        return last < LIMITS.max_model_len and first // 4 != last // 4

    find(draft_batches(LIMITS), crosses)


def test_draws_reach_the_max_model_len_clamp() -> None:
    find(draft_batches(LIMITS),
         lambda b: b.context_lens[0] + len(b.new_tokens[0]) + LIMITS.extra_positions > LIMITS.max_model_len)


def test_draws_fewer_requests_than_the_largest_bucket_and_shuffled_tables() -> None:
    find(draft_batches(LIMITS), lambda b: b.num_reqs == 3)
    find(draft_batches(LIMITS), lambda b: any(list(r) != sorted(r) for r in b.block_table))


def test_too_few_blocks_is_a_clear_error() -> None:
    small = BatchLimits(2, 4, 40, 5, 3, 64)
    with pytest.raises(ValueError, match="cannot hold one full request row"):
        find(draft_batches(small), lambda b: True)
