"""Draft comparisons: per request, step by step until the first divergence; logits within
a tolerance scaled for large logits, tokens exactly, near ties indeterminate."""

from __future__ import annotations

import pytest
import torch

from speccheck.checks.verify.comparisons import (
    Outcome,
    changed_slots,
    compare_drafts,
    expected_slots,
    first_divergence,
)
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.speculator.batch import DraftBatch, DraftResult

TOL = 1e-4


def _oracle() -> DraftResult:
    """Two requests, three steps, vocabulary 3: request 1 step 1 is a near tie."""
    logits = torch.tensor([
        [[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 4.0]],
        [[0.0, 5.0, 1.0], [2.0, 2.0 + 1e-5, 0.0], [0.0, 0.0, 1.0]],
    ])
    return DraftResult(logits.argmax(-1), logits)


def _results(outcomes: list[Outcome]) -> list[tuple[Check, Result, int | None]]:
    return [(o.check, o.result, o.step) for o in outcomes]


def test_agreement_is_one_logit_and_one_token_pass_per_step() -> None:
    oracle = _oracle()
    cand = DraftResult(oracle.draft_tokens.clone(), oracle.logits + TOL / 2)
    outcomes = compare_drafts(oracle, cand, "c", TOL)
    assert _results(outcomes) == [(Check.LOGITS, Result.PASSED, None),
                                  (Check.DRAFT_TOKENS, Result.PASSED, None)] * 6
    assert first_divergence(oracle, cand, 3) == [2, 2]


def test_a_request_stops_at_its_first_divergence() -> None:
    oracle = _oracle()
    logits = oracle.logits.clone()
    logits[0, 1, 0] += 0.5  # request 0, step 1: logits beyond the tolerance
    tokens = oracle.draft_tokens.clone()
    tokens[1, 1] = 0  # request 1, step 1: another token at a near tie
    tokens[1, 2] = 0  # ... and a later step that is no longer compared
    outcomes = compare_drafts(oracle, DraftResult(tokens, logits), "c", TOL)
    assert _results(outcomes) == [
        (Check.LOGITS, Result.PASSED, None), (Check.DRAFT_TOKENS, Result.PASSED, None),
        (Check.LOGITS, Result.FAILED, 1),
        (Check.LOGITS, Result.PASSED, None), (Check.DRAFT_TOKENS, Result.PASSED, None),
        (Check.LOGITS, Result.PASSED, None), (Check.DRAFT_TOKENS, Result.INDETERMINATE, 1),
    ]
    assert outcomes[2].diagnosis == "c: request 0 step 1: logits differ by 0.5 (tolerance 0.0001)"
    assert first_divergence(oracle, DraftResult(tokens, logits), 3) == [2, 1]


def test_a_token_that_is_no_near_tie_fails_with_the_gap_and_large_logits_scale_the_bound() -> None:
    oracle = _oracle()
    tokens = oracle.draft_tokens.clone()
    tokens[0, 0] = 1
    logits = oracle.logits.clone()
    logits[1] *= 1000  # request 1: |logits| of 1000 to 5000, bounds 0.01 to 0.05
    oracle = DraftResult(oracle.draft_tokens, logits)
    cand_logits = logits.clone()
    cand_logits[1] += 0.009  # within the scaled bound (at least 0.01), 90 times TOL
    cand = DraftResult(tokens, cand_logits)
    outcomes = compare_drafts(oracle, cand, "c", TOL)
    assert outcomes[1].result is Result.FAILED
    assert outcomes[1].diagnosis == (
        "c: request 0 step 0: draft token 1, oracle 0 (oracle top-2 gap 2)")
    assert [o.result for o in outcomes[2:]] == [Result.PASSED] * 6


def test_candidates_of_another_shape_are_refused() -> None:
    oracle = _oracle()
    with pytest.raises(ValueError, match="shapes"):
        compare_drafts(oracle, DraftResult(oracle.draft_tokens[:, :2], oracle.logits[:, :2]),
                       "c", TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entry", [(2, 3), (4, 8), (1, 1)])
def test_changed_slots_sees_every_bit_and_only_changed_slots(
    dtype: torch.dtype, entry: tuple[int, ...]
) -> None:
    """A cache tensor ``[blocks, block_size, *entry]``: rewritten slots are found, whatever
    word width the entry's bytes allow, including writes an element-wise ``!=`` misses
    (``-0.0`` over ``0.0``) or invents (a NaN left as it was)."""
    gen = torch.Generator().manual_seed(0)
    before = torch.randn(6, 4, *entry, generator=gen).to(dtype)
    before.view(24, -1)[3, 0] = 0.0
    before.view(24, -1)[11, -1] = float("nan")
    after = before.clone()
    after.view(24, -1)[3, 0] = -0.0
    after.view(24, -1)[17, -1] += 1
    assert changed_slots(before, after).nonzero().flatten().tolist() == [3, 17]
    assert not changed_slots(before, before.clone()).any()


def test_changed_slots_of_an_empty_entry_is_all_false() -> None:
    """An MLA layer's second cache tensor holds nothing per slot."""
    empty = torch.empty(3, 4, 0)
    assert changed_slots(empty, empty).tolist() == [False] * 12


def test_changed_slots_of_views_at_any_offset_and_stride() -> None:
    """Cache tensors that are views (at an element offset no word divides, or strided)
    compare as well as whole tensors do: the word follows the offset too."""
    gen = torch.Generator().manual_seed(1)
    whole = torch.randn(5, 3, 4, generator=gen).to(torch.bfloat16)  # 8-byte entries
    odd = torch.zeros(1 + whole.numel(), dtype=torch.bfloat16)[1:].view(5, 3, 4)  # 2-byte offset
    odd.copy_(whole)
    strided = torch.zeros(5, 3, 8, dtype=torch.bfloat16)[:, :, ::2]
    strided.copy_(whole)
    after = odd.clone()
    after[4, 2, 1] += 1
    assert changed_slots(odd, after).nonzero().flatten().tolist() == [14]
    assert changed_slots(strided, after).nonzero().flatten().tolist() == [14]
    assert not changed_slots(whole, odd).any()


def test_agreed_slots_leave_out_the_clamped_position_a_diverged_step_writes_again() -> None:
    """At ``max_model_len`` every further decode step writes the last position again. A
    candidate that diverged (a near tie) after step 1 rewrote it with other tokens than the
    oracle's, so the agreed slots must not include it; a request that diverges before the
    clamp, or not at all, keeps every slot its agreed steps write."""
    bs, mml, k = 4, 16, 5
    near_clamp = DraftBatch((13,), ((7, 8),), ((0, 1, 2, 3),), (0,))  # base 15 = mml - 1
    far = DraftBatch((2,), ((7,),), ((0, 1, 2, 3),), (0,))  # base 3: steps write 3 to 6
    assert expected_slots(near_clamp, k, bs, mml) == {3 * bs + 1, 3 * bs + 2, 3 * bs + 3}
    assert expected_slots(near_clamp, k, bs, mml, [1]) == {3 * bs + 1, 3 * bs + 2}
    assert expected_slots(near_clamp, k, bs, mml, [k - 1]) == {3 * bs + 1, 3 * bs + 2, 3 * bs + 3}
    assert expected_slots(far, k, bs, mml, [1]) == {2, 3}
