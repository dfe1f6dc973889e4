"""The known-bad builders added for issue 11, one run at a time outside the verifier loop:
each refresh mutant is right where its bug does not reach and wrong where it does; host
values reach ``step_metadata`` with the field, the step and both values, for eager runs and
for replays of a captured body; and a padding lane sent to a slot the batch writes itself is
named by ``kv_cache`` with its step, lane and slot. (``tests/test_verifier_mutants.py``
checks that the verifier catches each at default settings.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from speccheck.checks.selftest.mutants import (
    DERIVED_FIELD,
    BakedMaxSeqLen,
    BoundedMetadata,
    DerivedBuilder,
    FirstRequestRefresh,
    PaddingSharesSlot,
    PaddingWritesLive,
    ShortOnlyRefresh,
    declaring_matrix,
)
from speccheck.checks.verify import step_recorder
from speccheck.checks.verify.comparisons import (
    FirstPassSnapshot,
    Outcome,
    compare_steps,
    expected_slots,
    kv_untouched,
)
from speccheck.checks.verify.step_recorder import StepMetadataRecorder, StepSnapshots
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_loader import load_matrix
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig
from tests.fixtures.configs import CPU_CONFIG

K = 4
CONFIG = CPU_CONFIG.model_copy(update={"num_speculative_steps": K})
BS, MML = CONFIG.block_size, CONFIG.max_model_len
SHIPPED = load_matrix(None)

ONE_SHORT = DraftBatch((5,), ((7, 8),), ((3, 5, 6),), (1,))
"""One request at length 7 after its prefill pass: decode steps 1..3 at lengths 8..10,
writing positions 7, 8, 9 (slots 23, 24, 25); bucket 2, so lane 1 pads."""
TWO_LONG = DraftBatch((20, 3), ((1,), (2, 3)), ((1, 2, 4, 7, 8, 9), (10, 11)), (1, 2))
"""Request 0 from length 21, request 1 from length 5: the second request and a length past
:attr:`ShortOnlyRefresh.refreshed_below`."""


def _speculator(
    builder: type[AttentionMetadataBuilder[Any]], declares: tuple[str, ...] = (DERIVED_FIELD,),
    *, k: int = K, first_pass_query_lens: tuple[int, ...] = (),
) -> tuple[AutoregressiveSpeculator, StepMetadataRecorder]:
    """The self-test's CPU harness for ``builder`` (buckets 2 and 4, padded; K draft
    tokens; the first passes ``first_pass_query_lens`` padded too), with a step recorder
    installed."""
    spec = create_speculator(
        "autoregressive", ["reference"] * 2, CONFIG.model_copy(update={"num_speculative_steps": k}),
        DrafterConfig.for_runtime(CONFIG, vocab_size=64), torch.device("cpu"),
        SpeculatorOptions(capture_sizes=(2, 4), num_blocks=4 * (MML // BS) + 1,
                          pad_to_capture_sizes=True, first_pass_query_lens=first_pass_query_lens),
        matrix=declaring_matrix(SHIPPED, declares), builder_overrides={"reference": builder},
    )
    assert isinstance(spec, AutoregressiveSpeculator)
    recorder = StepMetadataRecorder(spec.groups)
    spec.step_observer = recorder
    return spec, recorder


def _fused_vs_oracle(builder: type[AttentionMetadataBuilder[Any]], batch: DraftBatch) -> Outcome:
    """``step_metadata`` of the eager fused loop against the per-step oracle."""
    spec, recorder = _speculator(builder)
    lanes = spec.bucket_for(batch.num_reqs)
    spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
    oracle = recorder.collect(lanes)
    spec.propose(batch, DecodePath.FUSED, use_graphs=False)
    (outcome,) = compare_steps(oracle, recorder.collect(lanes), "fused_eager")
    return outcome


@pytest.mark.parametrize(("builder", "unreached"), [
    (ShortOnlyRefresh, ONE_SHORT), (FirstRequestRefresh, ONE_SHORT), (DerivedBuilder, TWO_LONG),
], ids=["short_only_refresh", "first_request_refresh", "correct_control"])
def test_refresh_mutants_are_right_until_their_bug_is_reached(
    builder: type[AttentionMetadataBuilder[Any]], unreached: DraftBatch,
) -> None:
    assert _fused_vs_oracle(builder, unreached).result == "passed"
    if builder is not DerivedBuilder:
        reached = _fused_vs_oracle(builder, TWO_LONG)
        assert (reached.result, reached.step) == ("failed", 2)
        assert reached.field == "reference.metadata.kv_lens_plus_one"


def test_a_stale_host_value_is_named_with_its_step_and_both_values() -> None:
    """The eager fused loop runs on its capture build (dummy lanes of length 1), as a replay
    does, so the baked maximum is already wrong at step 1."""
    outcome = _fused_vs_oracle(BakedMaxSeqLen, ONE_SHORT)
    assert (outcome.result, outcome.step, outcome.field) == (
        "failed", 1, "reference.metadata.max_seq_len")
    assert outcome.diagnosis.startswith(
        "fused_eager: before draft step 1, host value reference.metadata.max_seq_len is 1, a "
        "fresh eager build's is 8")


def test_a_replay_reports_the_host_values_its_body_was_captured_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bookkeeping of a FULL-graph candidate, on the CPU: the recorder is called during
    a capture (``capturing`` stands in for the CUDA stream's capture flag) with the capture
    metadata, then not at all while the body replays."""
    spec, recorder = _speculator(BakedMaxSeqLen)
    lanes = spec.bucket_for(ONE_SHORT.num_reqs)
    spec.propose(ONE_SHORT, DecodePath.FUSED, use_graphs=False)  # the warm-up before a capture
    built = recorder.last_metadata
    assert built is not None and isinstance(built[0], BoundedMetadata)
    captured = [dataclasses.replace(md, max_seq_len=1) for md in built]
    monkeypatch.setattr(step_recorder, "capturing", lambda: True)
    for step in range(1, K):
        recorder(lanes, step, captured)
    monkeypatch.undo()

    spec.propose(ONE_SHORT, DecodePath.PER_STEP, use_graphs=False)
    oracle = recorder.collect(lanes)
    assert [int(oracle.host[s]["reference.metadata.max_seq_len"]) for s in (1, 2, 3)] == [8, 9, 10]
    replayed = recorder.collect(lanes)  # nothing observed: a replay of the captured body
    assert [int(replayed.host[s]["reference.metadata.max_seq_len"]) for s in (1, 2, 3)] == [1, 1, 1]
    (outcome,) = compare_steps(oracle, replayed, "fused_graph")
    assert (outcome.step, outcome.field) == (1, "reference.metadata.max_seq_len")
    assert "is 1, a fresh eager build's is 8" in outcome.diagnosis

    spec.propose(ONE_SHORT, DecodePath.FUSED, use_graphs=False)  # on its capture build
    eager = recorder.collect(lanes)
    assert [int(eager.host[s]["reference.metadata.max_seq_len"]) for s in (1, 2, 3)] == [1, 1, 1]


def _oracle_kv_outcome(
    builder: type[AttentionMetadataBuilder[Any]], batch: DraftBatch, declares: tuple[str, ...],
    *, with_steps: bool = True,
) -> Outcome:
    """``kv_cache`` of the per-step oracle run of ``builder`` (a fresh random cache)."""
    spec, recorder = _speculator(builder, declares)
    spec.kv_cache.fill_random_(0)
    start = spec.kv_cache.snapshot()
    spec.propose(batch, DecodePath.PER_STEP, use_graphs=False)
    steps: StepSnapshots | None = recorder.collect(spec.bucket_for(batch.num_reqs))
    expected = expected_slots(batch, K, BS, MML)
    (outcome,) = kv_untouched(batch, expected, BS, start, spec.kv_cache.snapshot(), "oracle",
                              steps if with_steps else None)
    return outcome


def test_a_padding_lane_sent_to_a_slot_the_batch_writes_is_named_with_slot_and_lane() -> None:
    outcome = _oracle_kv_outcome(PaddingSharesSlot, ONE_SHORT, ("slot_mapping",))
    assert (outcome.check, outcome.result, outcome.step) == ("kv_cache", "failed", 1)
    assert outcome.field == "reference.metadata.slot_mapping"
    assert outcome.diagnosis == (
        "oracle: before draft step 1, padding lane 1 (token 1) writes slot 23 (block 5, request 0 "
        "position 7, which request 0 writes itself at draft step 1) instead of the sink block "
        "(reference.metadata.slot_mapping)")
    # without the slot mappings the write is invisible: the slot is one the batch writes
    assert _oracle_kv_outcome(PaddingSharesSlot, ONE_SHORT, ("slot_mapping",),
                              with_steps=False).result == "passed"


def test_a_padding_lane_of_the_padded_first_pass_is_named_with_slot_and_lane() -> None:
    """With the first pass padded over the bucket (uniform batch), the same builder is
    caught there already, before any decode step (K = 1 has none)."""
    spec, _ = _speculator(PaddingSharesSlot, ("slot_mapping",), k=1, first_pass_query_lens=(2,))
    recorder = StepMetadataRecorder(spec.groups)
    spec.first_pass_observer = recorder
    spec.kv_cache.fill_random_(0)
    start = spec.kv_cache.snapshot()
    spec.propose(ONE_SHORT, DecodePath.PER_STEP, use_graphs=False)
    first_pass = FirstPassSnapshot(recorder.collect(2 * 2), 2)
    expected = expected_slots(ONE_SHORT, 1, BS, MML)
    (outcome,) = kv_untouched(ONE_SHORT, expected, BS, start, spec.kv_cache.snapshot(), "oracle",
                              None, first_pass)
    assert (outcome.check, outcome.result, outcome.step) == ("kv_cache", "failed", 0)
    assert outcome.diagnosis == (
        "oracle: in the padded first pass, padding lane 2 (token 2) writes slot 21 (block 5, "
        "request 0 position 5, which request 0 writes itself in its prefill pass) instead of the "
        "sink block (reference.metadata.slot_mapping)")


def test_a_write_that_ignores_the_slot_mapping_is_named_as_such() -> None:
    outcome = _oracle_kv_outcome(PaddingWritesLive, ONE_SHORT, ())
    assert outcome.result == "failed"
    assert outcome.diagnosis == (
        "oracle: layer 0 wrote 1 slot(s) outside the expected ones: slot 26 (block 6, request 0 "
        "position 10, which the batch does not write), where no lane's slot mapping points (the "
        "write ignores the slot mapping) — a padding lane or a stale slot mapping writes a live "
        "block")
