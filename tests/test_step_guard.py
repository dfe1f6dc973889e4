"""Each eager step's metadata is checked before the step runs (``checks/verify/step_guard``):
a builder whose refresh leaves a block table pointing past the cache used to end the run in
the attention's index error (a crash, no field named); it now fails ``field_meanings`` on
the block table before the first step it refreshes runs (the fused candidate's padded
first pass), while the oracle (which
builds each step) passes."""

from __future__ import annotations

import torch

from speccheck.backends.reference.builder import ReferenceMetadata, ReferenceMetadataBuilder
from speccheck.checks.selftest.run import verify_at_defaults
from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.step_guard import StepCheckFailed
from speccheck.checks.verify.vocabulary import Check, Result, Status
from speccheck.contract.matrix_loader import load_matrix

FAR_PAST_THE_CACHE = 1 << 24


class RefreshPointsPastTheCache(ReferenceMetadataBuilder):
    """Its refresh writes a block id far past the KV cache into the block table."""

    def update_draft_decode_metadata(self, metadata: ReferenceMetadata) -> None:
        super().update_draft_decode_metadata(metadata)
        metadata.block_table.fill_(FAR_PAST_THE_CACHE)


def test_a_step_whose_block_table_points_past_the_cache_fails_its_field_before_running() -> None:
    report = verify_at_defaults("reference", RefreshPointsPastTheCache, torch.device("cpu"),
                                load_matrix(None))
    assert report.status is Status.FAILED
    first = report.failures[0]
    assert first.check is Check.FIELD_MEANINGS, report.failures
    assert first.field == "reference.metadata.block_table"
    assert first.candidate == "fused_eager" and first.step is not None
    assert str(FAR_PAST_THE_CACHE) in first.diagnosis
    assert "; the run then raised " in first.diagnosis  # the crash the field explains


def test_a_stop_carries_its_failure_and_a_peer_rank_stop_carries_none() -> None:
    failed = Outcome(Check.FIELD_MEANINGS, Result.FAILED, "x", "fused_eager", 2, "f")
    assert StepCheckFailed(failed).outcomes == [failed]
    assert StepCheckFailed(None).outcomes == []
