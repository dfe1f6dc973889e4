"""``sparse_swa`` through the verifier, and ``rocm_sparse_swa``'s refusal.

The CPU tier verifies the shipped adapter end to end (a worker process, the Triton
interpreter, small MLA shapes); each known-bad builder of
:mod:`speccheck.checks.selftest.swa_mutants` is caught with its check, and with the step
and the field (or buffer) it breaks. On a GPU the same runs capture real graphs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import speccheck
from speccheck.backends.availability import BackendUnavailable
from speccheck.backends.rocm_sparse_swa.builder import REFUSAL, RocmSparseSWAMetadataBuilder
from speccheck.backends.sparse_swa.builder import SparseSWAMetadataBuilder
from speccheck.backends.sparse_swa.metadata import SparseSWAMetadata
from speccheck.checks.selftest.run import verify_at_defaults
from speccheck.checks.selftest.swa_mutants import SWA_MUTANTS, SWAMutant
from speccheck.checks.verify.vocabulary import Check, Status
from speccheck.contract.builder import AttentionLayerSpec, BuilderLimits
from speccheck.contract.constraints import ConstraintViolation, enforce_layer_constraints
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import KvLayout
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL_MLA: dict[str, Any] = {"kv_lora_rank": 16, "qk_rope_head_dim": 16, "head_size": 16,
                             "num_heads": 2, "sliding_window": 6, "block_size": 4,
                             "max_model_len": 16}
"""MLA shapes the interpreter runs quickly: a 6-position window crosses 4-token blocks and
is shorter than most lengths up to 16."""


def test_cpu_tier_verifies_sparse_swa() -> None:
    report = speccheck.verify("sparse_swa", config=SMALL_MLA, examples=3)
    backend = report.backend("sparse_swa")
    assert report.passed, report.summary_lines()
    assert backend.fused_allowed and backend.examples == 3
    verdicts = {v.check: v.status for v in report.verdicts("sparse_swa")}
    for check in (Check.STEP_METADATA, Check.DECLARED_FIELDS, Check.ZERO_TAILS,
                  Check.VS_FP32_REFERENCE, Check.IN_PLACE, Check.HOST_SYNC):
        assert verdicts[check] is Status.PASSED, check


@pytest.mark.parametrize("mutant", SWA_MUTANTS, ids=lambda m: m.name)
def test_known_bad_builder_is_caught(mutant: SWAMutant) -> None:
    """The first example (K = 4) already fails: the finding names the refresh's first step
    and the field, or the buffer whose tail is stale. A stale cache or stale indices also
    change the drafts (the logits of the step after the refresh); a stale tail does not,
    as no kernel reads past the live rows."""
    report = verify_at_defaults("sparse_swa", mutant.builder, DEVICE, load_matrix(None),
                                config_changes={"dtype": "float32", "num_kv_heads": 1,
                                                **SMALL_MLA},
                                examples=1, steps=(4,), shrink_seconds=0)
    assert report.status is Status.FAILED
    hits = [f for f in report.failures if f.check is mutant.check]
    assert hits, [(f.check, f.diagnosis) for f in report.failures]
    if mutant.check is Check.STEP_METADATA:
        assert (hits[0].step, hits[0].field) == (2, mutant.names), hits[0].diagnosis
        assert "before draft step 2" in hits[0].diagnosis
        assert any(f.check is Check.LOGITS for f in report.failures)
    else:
        assert f"persistent buffer {mutant.names!r}" in hits[0].diagnosis
        assert all(f.check is Check.ZERO_TAILS for f in report.failures)


class BlockTableSnapshot(SparseSWAMetadataBuilder):
    """Copies the block table at build instead of viewing the speculator's buffer: a graph
    replay reads the copy its capture made (the dummy lanes' sink blocks)."""

    def build(self, common: CommonAttentionMetadata) -> SparseSWAMetadata:
        return dataclasses.replace(super().build(common), block_table=common.block_table.clone())


def test_a_field_copied_at_build_is_caught_on_the_cpu_tier() -> None:
    """sparse_swa refreshes in place (no ``refresh_rebuilds``): its eager fused candidate
    runs on metadata built for capture before the call's inputs exist, as a replay does,
    so a copy made at build holds the capture's dummy values at step 1."""
    report = verify_at_defaults("sparse_swa", BlockTableSnapshot, DEVICE, load_matrix(None),
                                config_changes={"dtype": "float32", **SMALL_MLA},
                                examples=1, shrink_seconds=0)
    assert report.status is Status.FAILED
    named = [(f.check, f.step, f.field) for f in report.failures if f.field]
    assert (Check.STEP_METADATA, 1, "sparse_swa.metadata.block_table") in named, named
    assert (Check.FIELD_MEANINGS, 1, "sparse_swa.metadata.block_table") in named, named


class ContinuationsRestartTheirToken(SparseSWAMetadataBuilder):
    """Gives every part its first token's first partial, forgetting that a part continuing
    a token split over several parts owns a later one: the parts of a split token write the
    same partial. Capture-safe (a gather on the device)."""

    def build_schedule(self, metadata: SparseSWAMetadata) -> None:
        super().build_schedule(metadata)
        rows = metadata.tile_scheduler_metadata
        rows[:, 4] = metadata.split_offsets[rows[:, 0].long()]


def test_a_schedule_breaking_its_meaning_is_caught_naming_the_schedule() -> None:
    """At the defaults (a 24-position window: two tiles for a token past position 15) the
    parts split tokens, and the schedule's rule (``kv_split_schedule``) names the field."""
    report = verify_at_defaults("sparse_swa", ContinuationsRestartTheirToken, DEVICE,
                                load_matrix(None), shrink_seconds=0)
    assert report.status is Status.FAILED
    named = [(f.check, f.field) for f in report.failures if f.field]
    schedule = "sparse_swa.metadata.tile_scheduler_metadata"
    assert (Check.FIELD_MEANINGS, schedule) in named, named


def test_rocm_sparse_swa_is_skipped_for_its_platform() -> None:
    report = speccheck.verify("rocm_sparse_swa", examples=1)
    backend = report.backend("rocm_sparse_swa")
    assert backend.status is Status.SKIPPED
    assert backend.detail.startswith("rocm_sparse_swa runs on rocm; this machine offers ")


def test_rocm_sparse_swa_refuses_to_build() -> None:
    layer = AttentionLayerSpec(4, 1, 16, torch.float32, 4, 16, kv_layout=KvLayout.LATENT,
                               kv_lora_rank=16, qk_rope_head_dim=16, sliding_window=6)
    with pytest.raises(BackendUnavailable) as raised:
        RocmSparseSWAMetadataBuilder(layer, RuntimeConfig(platform="rocm"), DEVICE,
                                     BuilderLimits(max_num_reqs=2, max_num_tokens=4))
    assert str(raised.value) == f"rocm_sparse_swa: {REFUSAL}"


def test_sparse_swa_needs_a_window() -> None:
    entry = load_matrix(None).backend("sparse_swa")
    layer = AttentionLayerSpec(4, 1, 16, torch.float32, 4, 16, kv_layout=KvLayout.LATENT,
                               kv_lora_rank=16, qk_rope_head_dim=16)
    with pytest.raises(ConstraintViolation, match="requires sliding_window > 0"):
        enforce_layer_constraints(entry, RuntimeConfig(platform="cpu"), layer)
