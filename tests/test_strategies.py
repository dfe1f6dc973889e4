"""The batch strategy draws what the verifier promises: valid, disjoint, block-crossing,
clamp-hitting and breakpoint-crossing batches; and the targeting quantity counts what a stale
refresh would get wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import find, given, settings

from speccheck.checks.verify.strategies import (
    BatchLimits,
    derived_step_changes,
    draft_batches,
    target_derived_changes,
)
from speccheck.speculator.batch import DraftBatch

LIMITS = BatchLimits(max_num_reqs=4, block_size=4, max_model_len=40, num_blocks=48,
                     extra_positions=3, vocab_size=64)


@settings(max_examples=200)
@given(batch=draft_batches(LIMITS))
def test_every_batch_is_servable(batch) -> None:
    """Every drawn batch passes validation, whose arrays hold the batch as given: the
    block-table rows zero-padded to the longest."""
    arrays = batch.validate(max_model_len=40, block_size=4, num_blocks=48, extra_positions=3,
                            max_num_reqs=4)
    assert all(0 <= t < 64 for row in batch.new_tokens for t in row)
    width = max(map(len, batch.block_table))
    assert arrays.block_table.tolist() == [list(row) + [0] * (width - len(row))
                                           for row in batch.block_table]
    assert arrays.context_lens.tolist() == list(batch.context_lens)
    assert arrays.query_lens.tolist() == [len(row) for row in batch.new_tokens]
    assert arrays.seeds.tolist() == list(batch.seeds)


def test_draws_cross_block_boundaries_during_the_draft_steps() -> None:
    def crosses(batch) -> bool:
        ctx, new = batch.context_lens[0], len(batch.new_tokens[0])
        first, last = ctx + new - 1, ctx + new - 1 + LIMITS.extra_positions
        return last < LIMITS.max_model_len and first // 4 != last // 4

    find(draft_batches(LIMITS), crosses)


def test_draws_reach_the_max_model_len_clamp() -> None:
    find(draft_batches(LIMITS),
         lambda b: b.context_lens[0] + len(b.new_tokens[0]) + LIMITS.extra_positions > LIMITS.max_model_len)


def test_draws_a_first_pass_of_length_one_beside_a_wider_request() -> None:
    """ContextKind.EMPTY: a request of one new token and no context (its only visible
    position is its own) in a batch with a wider request, which sends a windowed batch down
    the reference's per-request route; without the kind, a reference that skipped requests
    of length 1 there passed `verify --backend reference` at the defaults."""
    seen: list[bool] = []

    @settings(max_examples=300)
    @given(batch=draft_batches(LIMITS))
    def draw(batch: DraftBatch) -> None:
        widths = [len(new) for new in batch.new_tokens]
        seen.append(max(widths) > 1 and any(
            ctx == 0 and width == 1 for ctx, width in zip(batch.context_lens, widths)))

    draw()
    assert len(seen) == 300
    assert sum(seen) >= 15, sum(seen)  # 72 of 300 measured; 4 without the kind


def test_draws_fewer_requests_than_the_largest_bucket_and_shuffled_tables() -> None:
    find(draft_batches(LIMITS), lambda b: b.num_reqs == 3)
    find(draft_batches(LIMITS), lambda b: any(list(r) != sorted(r) for r in b.block_table))


def test_too_few_blocks_is_a_clear_error() -> None:
    small = BatchLimits(2, 4, 40, 5, 3, 64)
    with pytest.raises(ValueError, match="cannot hold one full request row"):
        find(draft_batches(small), lambda b: True)


BREAKPOINTS = (100, 169, 300)
WITH_BREAKPOINTS = BatchLimits(max_num_reqs=4, block_size=16, max_model_len=512, num_blocks=129,
                               extra_positions=5, vocab_size=64, breakpoints=BREAKPOINTS)


def refresh_crossings(batch: DraftBatch, limits: BatchLimits) -> list[int]:
    """Breakpoints some request's refreshes cross: decode step ``s`` of a request runs at
    length ``min(ctx + q + s, max_model_len)``, the metadata is built for step 1 and
    refreshed before steps 2..K-1 (K - 1 = ``extra_positions``)."""
    crossed = []
    for ctx, new in zip(batch.context_lens, batch.new_tokens, strict=True):
        first = ctx + len(new) + 1
        last = min(ctx + len(new) + limits.extra_positions, limits.max_model_len)
        crossed += [b for b in limits.breakpoints if first < b <= last]
    return crossed


def test_breakpoint_batches_are_servable_and_most_cross_a_breakpoint() -> None:
    crossing: list[bool] = []

    @settings(max_examples=300)
    @given(batch=draft_batches(WITH_BREAKPOINTS))
    def draw(batch: DraftBatch) -> None:
        batch.validate(max_model_len=512, block_size=16, num_blocks=129, extra_positions=5,
                       max_num_reqs=4)
        crossing.append(bool(refresh_crossings(batch, WITH_BREAKPOINTS)))

    draw()
    assert len(crossing) == 300
    # 0.24 to 0.53 measured, blind 0.02: hypothesis mixes the integer literals of every
    # loaded module into its draws, so the share moves with what the process imported before
    assert sum(crossing) / len(crossing) > 0.15, sum(crossing)


def test_without_breakpoints_few_batches_cross_them() -> None:
    """The control for the test above: the same limits without breakpoints."""
    crossing: list[bool] = []
    blind = dataclasses.replace(WITH_BREAKPOINTS, breakpoints=())

    @settings(max_examples=300)
    @given(batch=draft_batches(blind))
    def draw(batch: DraftBatch) -> None:
        crossing.append(bool(refresh_crossings(batch, WITH_BREAKPOINTS)))

    draw()
    assert sum(crossing) / len(crossing) < 0.15, sum(crossing)


def test_a_crossing_shrinks_to_the_first_breakpoint_crossed_at_step_two() -> None:
    batch = find(draft_batches(WITH_BREAKPOINTS), lambda b: bool(refresh_crossings(b, WITH_BREAKPOINTS)))
    assert refresh_crossings(batch, WITH_BREAKPOINTS) == [100]
    lengths = [ctx + len(new) for ctx, new in zip(batch.context_lens, batch.new_tokens)]
    assert sorted(lengths) == [1] * (batch.num_reqs - 1) + [98]  # steps 1 and 2 at 99, 100


def test_every_reachable_breakpoint_is_crossed_at_step_two() -> None:
    """The tightest placement: step 1 runs just below the breakpoint, step 2 at it."""
    for b in BREAKPOINTS:
        batch = find(draft_batches(WITH_BREAKPOINTS),
                     lambda x, b=b: x.context_lens[0] + len(x.new_tokens[0]) + 2 == b)  # type: ignore[misc]
        assert refresh_crossings(batch, WITH_BREAKPOINTS)[0] == b


def test_breakpoints_must_be_ascending_positive_lengths() -> None:
    for bad in ((169, 100), (100, 100), (0, 5)):
        with pytest.raises(ValueError, match="ascending positive"):
            dataclasses.replace(WITH_BREAKPOINTS, breakpoints=bad)


def test_derived_step_changes_counts_derived_elements_once_and_skips_inputs() -> None:
    inputs, derived, buffer, grows = 1, 2, 2, 3  # storages; the buffer backs the field
    steps = {
        1: {"be.metadata.seq_lens": torch.tensor([5, 6]), "be.metadata.splits": torch.tensor([2, 2, 1]),
            "be.buffers['splits']": torch.tensor([2, 2, 1, 0]), "be.metadata.pages": torch.tensor([1])},
        2: {"be.metadata.seq_lens": torch.tensor([6, 7]), "be.metadata.splits": torch.tensor([1, 2, 1]),
            "be.buffers['splits']": torch.tensor([1, 2, 1, 0]), "be.metadata.pages": torch.tensor([1, 2])},
        3: {"be.metadata.seq_lens": torch.tensor([7, 8]), "be.metadata.splits": torch.tensor([1, 1, 2]),
            "be.buffers['splits']": torch.tensor([1, 1, 2, 0]), "be.metadata.pages": torch.tensor([1, 2])},
    }
    storage_of = {"be.metadata.seq_lens": inputs, "be.metadata.splits": derived,
                  "be.buffers['splits']": buffer, "be.metadata.pages": grows}
    # splits: 1 element (step 1 -> 2), 2 elements (2 -> 3); pages: shape change, 2 elements.
    assert derived_step_changes(steps, storage_of, {inputs}) == 5
    assert derived_step_changes({1: steps[1]}, storage_of, {inputs}) == 0


@settings(max_examples=5)
@given(batch=draft_batches(WITH_BREAKPOINTS))
def test_the_target_can_be_reported_from_a_given_test(batch: DraftBatch) -> None:
    target_derived_changes(len(refresh_crossings(batch, WITH_BREAKPOINTS)))
