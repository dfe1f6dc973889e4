"""Every verifier check can fail: known-bad builders, written here, must be caught by the
matching check with the expected diagnosis — on the CPU tier (eager fused loop vs eager
per-step) and, where CUDA exists, with real graphs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from speccheck.backends.reference.builder import (
    ReferenceAttentionImpl,
    ReferenceMetadata,
    ReferenceMetadataBuilder,
)
from speccheck.checks.verify_engine import BackendVerifier, VerifySettings, decode_example, encode_example
from speccheck.checks.verify_report import BackendReport
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig

CPU_CONFIG = RuntimeConfig(platform="cpu", cudagraph_mode="none", block_size=4, max_model_len=32,
                           dtype="float32", head_size=16, num_heads=2, num_kv_heads=1)
GPU_CONFIG = CPU_CONFIG.model_copy(update={"platform": "cuda", "cudagraph_mode": "full"})
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)]


@dataclass
class DerivedMetadata(ReferenceMetadata):
    kv_lens_plus_one: torch.Tensor | None = None


class _DerivedBuilder(ReferenceMetadataBuilder):
    """Derives ``kv_lens_plus_one`` from ``seq_lens`` into a persistent buffer."""

    step_dependent_fields = ("kv_lens_plus_one",)

    def setup(self) -> None:
        self.derived = self.allocate_persistent("derived", (self.limits.max_num_reqs,), torch.int32)

    def build(self, common: CommonAttentionMetadata) -> DerivedMetadata:
        base = super().build(common)
        n = common.num_reqs
        self.derived[:n].copy_(common.seq_lens + 1)
        self.derived[n:].zero_()
        return DerivedMetadata(**vars(base), kv_lens_plus_one=self.derived[:n])

    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
        torch.add(metadata.seq_lens, 1, out=metadata.kv_lens_plus_one)

    def persistent_buffer_extents(self, metadata: DerivedMetadata) -> dict[str, int]:
        return {"derived": metadata.kv_lens_plus_one.shape[0]}


class StaleRefresh(_DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
        """Forgets to recompute the derived lengths."""


class UndeclaredField(_DerivedBuilder):
    step_dependent_fields = ()


class AllocatingRefresh(_DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
        metadata.kv_lens_plus_one = metadata.seq_lens + 1


class SyncingRefresh(_DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
        if int(metadata.seq_lens.max().item()) > 0:
            torch.add(metadata.seq_lens, 1, out=metadata.kv_lens_plus_one)


class DirtyTail(_DerivedBuilder):
    def build(self, common: CommonAttentionMetadata) -> DerivedMetadata:
        """Leaves stale entries past the live rows (as if from an earlier, larger batch)."""
        md = super().build(common)
        self.derived[common.num_reqs :].fill_(7)
        return md


class Overrun(_DerivedBuilder):
    def update_draft_decode_metadata(self, metadata: DerivedMetadata) -> None:
        """Writes one row past the end of its persistent buffer (what a kernel with a
        wrong bound does)."""
        super().update_draft_decode_metadata(metadata)
        n = self.derived.shape[0]
        torch.as_strided(self.derived, (n + 1,), (1,))[n:].fill_(1)


class _PaddingWritesLiveImpl(ReferenceAttentionImpl):
    """Sends padding tokens' KV to the first request's slot instead of the sink."""

    def forward(self, query, key, value, key_cache, value_cache, metadata, output) -> None:
        slots = metadata.slot_mapping
        real = metadata.query_start_loc[-1]
        lanes = torch.arange(slots.shape[0], device=slots.device)
        patched = torch.where(lanes >= real, slots[0].expand_as(slots) + 1, slots)
        metadata = ReferenceMetadata(**{**vars(metadata), "slot_mapping": patched})
        super().forward(query, key, value, key_cache, value_cache, metadata, output)


class PaddingWritesLive(ReferenceMetadataBuilder):
    impl_cls = _PaddingWritesLiveImpl


def _verify(builder: type, device: str = "cpu", examples: int = 12) -> BackendReport:
    config = GPU_CONFIG if device == "cuda" else CPU_CONFIG
    settings = VerifySettings("reference", config, examples=examples, steps=(4,), capture_sizes=(2, 4),
                              vocab_size=64, builder_overrides=(("reference", builder),))
    report = BackendReport("reference", device, "passed")
    BackendVerifier(settings, torch.device(device)).run(report, lambda i, e: None)
    return report


@pytest.mark.parametrize("device", DEVICES)
def test_a_correct_derived_field_passes(device: str) -> None:
    report = _verify(_DerivedBuilder, device)
    assert report.status == "passed", report.failures
    assert report.checks["step_metadata"].passed > 0


MUTANTS = [
    (StaleRefresh, "step_metadata", "kv_lens_plus_one differs from a fresh eager build"),
    (UndeclaredField, "declared_fields", "does not declare it"),
    (AllocatingRefresh, "in_place", "kv_lens_plus_one"),
    (PaddingWritesLive, "kv_cache", "outside the expected"),
    (DirtyTail, "zero_tails", "unused tail"),
    (Overrun, "guard_bands", "derived"),
]


@pytest.mark.parametrize(
    ("device", "builder", "check", "diagnosis"),
    [("cpu", *m) for m in MUTANTS]
    + [("cpu", SyncingRefresh, "host_sync", "item")]
    + [pytest.param("cuda", *m, marks=pytest.mark.cuda) for m in MUTANTS]
    + [pytest.param("cuda", SyncingRefresh, "capture", "capturing the draft-decode graphs failed",
                    marks=pytest.mark.cuda)],
)
def test_each_check_catches_its_mutant(device: str, builder: type, check: str, diagnosis: str) -> None:
    report = _verify(builder, device)
    assert report.status == "failed"
    matching = [f for f in report.failures if f.check == check]
    assert matching, f"{check} did not fail; failures: {report.failures}"
    assert diagnosis in matching[0].diagnosis
    assert report.minimal_example is not None


def test_failures_shrink_to_a_small_reproducible_example() -> None:
    report = _verify(StaleRefresh)
    example = report.minimal_example
    assert example is not None and len(example["context_lens"]) == 1
    k = example["num_speculative_steps"]
    from speccheck.checks.verify_engine import example_from_json

    blob = encode_example(example_from_json(example))
    assert decode_example(blob)[0] == k
