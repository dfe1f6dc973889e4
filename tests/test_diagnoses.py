"""Diagnoses that separate cause from effect (issue 43 item 4): ``step_metadata`` says
whether a value is stale or wrong, output and KV failures of a candidate that failed
``step_metadata`` say they follow from it, and a stray KV write names the lane that wrote
it, in the first pass too."""

from __future__ import annotations

import numpy as np
import torch

from speccheck.checks.verify.comparisons import (
    FirstPassSnapshot,
    Outcome,
    compare_steps,
    kv_untouched,
    mark_consequences,
)
from speccheck.checks.verify.step_recorder import StepSnapshots
from speccheck.checks.verify.vocabulary import Check, Result
from speccheck.speculator.batch import DraftBatch

FIELD = "b.metadata.kv_lens"
ORACLE = StepSnapshots({1: {FIELD: torch.tensor([5, 9])}, 2: {FIELD: torch.tensor([6, 10])}})


def test_a_value_left_from_the_previous_step_is_stale() -> None:
    cand = StepSnapshots({1: {FIELD: torch.tensor([5, 9])}, 2: {FIELD: torch.tensor([5, 9])}})
    (outcome,) = compare_steps(ORACLE, cand, "fused_eager")
    assert (outcome.result, outcome.step, outcome.field) == (Result.FAILED, 2, FIELD)
    assert outcome.diagnosis.endswith(
        "— stale (equals the previous step's value): the refresh does not recompute it")


def test_a_value_that_is_neither_this_steps_nor_the_previous_is_wrong() -> None:
    cand = StepSnapshots({1: {FIELD: torch.tensor([5, 9])}, 2: {FIELD: torch.tensor([7, 11])}})
    (outcome,) = compare_steps(ORACLE, cand, "fused_eager")
    assert outcome.diagnosis.endswith(
        "— wrong (neither this step's nor the previous): the refresh recomputes it wrongly")


def test_a_host_value_left_from_the_previous_step_is_stale() -> None:
    host = {1: {"b.metadata.max_seq_len": np.array(9)}, 2: {"b.metadata.max_seq_len": np.array(10)}}
    oracle = StepSnapshots({1: {}, 2: {}}, host)
    cand = StepSnapshots({1: {}, 2: {}}, {1: host[1], 2: host[1]})
    (outcome,) = compare_steps(oracle, cand, "fused_graph")
    assert "— stale (equals the previous step's value)" in outcome.diagnosis


def test_output_and_kv_failures_of_a_candidate_that_failed_step_metadata_follow_from_it() -> None:
    outcomes = [
        Outcome(Check.LOGITS, Result.FAILED, "fused_eager: logits differ", "fused_eager", 2),
        Outcome(Check.KV_CACHE, Result.FAILED, "fused_eager: keys differ", "fused_eager"),
        Outcome(Check.STEP_METADATA, Result.FAILED, "stale", "fused_eager", 2, FIELD),
        Outcome(Check.KV_CACHE, Result.FAILED, "oracle: stray write", "oracle"),
        Outcome(Check.ZERO_TAILS, Result.FAILED, "fused_eager: tail", "fused_eager"),
    ]
    marked = mark_consequences(outcomes)
    assert marked == outcomes[:2]
    follows = f" (follows from the step_metadata failure at step 2, {FIELD})"
    assert outcomes[0].diagnosis == "fused_eager: logits differ" + follows
    assert outcomes[1].diagnosis == "fused_eager: keys differ" + follows
    assert outcomes[3].diagnosis == "oracle: stray write"  # another run: no metadata failure
    assert outcomes[4].diagnosis == "fused_eager: tail"  # not an effect of wrong metadata


def test_a_stray_write_of_the_first_pass_names_the_lane_and_the_slot_it_landed_in() -> None:
    bs = 4
    batch = DraftBatch((2,), ((7,),), ((1,),), (0,))  # request 0 writes position 2: slot 6
    start = [(torch.zeros(4, bs, 1, 2), torch.zeros(4, bs, 1, 2))]
    after = [(start[0][0].clone(), start[0][1].clone())]
    after[0][0][2, 1] = 1.0  # slot 9 (block 2), which no request owns
    first_pass = FirstPassSnapshot(
        StepSnapshots({0: {"b.metadata.slot_mapping": torch.tensor([9, 0])}}), 1)
    (outcome,) = kv_untouched(batch, {6}, bs, start, after, "oracle", StepSnapshots(),
                              first_pass)
    assert outcome.result is Result.FAILED
    assert ("slot 9 (block 2, owned by no request of the batch), written there by lane 0 "
            "(request 0 token 0) in the padded first pass") in outcome.diagnosis
