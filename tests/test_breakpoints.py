"""Breakpoint discovery finds exactly where a builder's derived metadata changes with a
request's length, ignores what merely follows the length, stays within its build cap, and
never raises for a builder it cannot probe; and the verifier, aiming at those lengths,
catches a refresh that does nothing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from speccheck.backends.reference.builder import ReferenceMetadata, ReferenceMetadataBuilder
from speccheck.checks.selftest.mutants import DerivedBuilder
from speccheck.checks.verify.breakpoints import discover_breakpoints
from speccheck.checks.selftest.mutants import declaring_matrix
from speccheck.checks.verify.context import MatrixContext
from speccheck.contract.matrix_loader import load_matrix
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.vocabulary import Check, Status, Tier
from speccheck.contract.builder import AttentionLayerSpec, AttentionMetadataBuilder, BuilderLimits
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.runtime_config import RuntimeConfig

THRESHOLDS = (100, 169, 300)
"""Lengths at which :class:`SplitBuilder`'s split count changes (none is a multiple of the
block size, and none is near ``max_model_len``)."""

CPU_CONFIG = RuntimeConfig(platform="cpu", cudagraph_mode="none", block_size=16, max_model_len=512,
                           dtype="float32", head_size=16, num_heads=2, num_kv_heads=1)


@dataclass
class SplitMetadata(ReferenceMetadata):
    num_splits: torch.Tensor | None = None


class SplitBuilder(ReferenceMetadataBuilder):
    """The reference backend plus a per-request split count that changes only at the
    builder's own :data:`THRESHOLDS` (as FA3's scheduler metadata does at the kernel's),
    kept in a persistent buffer with a zero tail and recomputed in place between steps."""

    def setup(self) -> None:
        self.splits = self.allocate_persistent("splits", (self.limits.max_num_reqs,), torch.int32)
        self.thresholds = torch.tensor(THRESHOLDS, dtype=torch.int32, device=self.device)

    def build(self, common: CommonAttentionMetadata) -> SplitMetadata:
        base = super().build(common)
        n = common.num_reqs
        self.splits[n:].zero_()
        metadata = SplitMetadata(**vars(base), num_splits=self.splits[:n])
        self._count_splits(metadata)
        return metadata

    def _count_splits(self, metadata: SplitMetadata) -> None:
        assert metadata.num_splits is not None
        torch.bucketize(metadata.seq_lens, self.thresholds, out_int32=True, right=True,
                        out=metadata.num_splits)

    def update_draft_decode_metadata(self, metadata: SplitMetadata) -> None:  # type: ignore[override]
        self._count_splits(metadata)

    def persistent_buffer_extents(self, metadata: SplitMetadata) -> dict[str, int]:  # type: ignore[override]
        assert metadata.num_splits is not None
        return {"splits": metadata.num_splits.shape[0]}


class StaleSplit(SplitBuilder):
    def update_draft_decode_metadata(self, metadata: SplitMetadata) -> None:  # type: ignore[override]
        """Forgets to recompute the split counts: wrong only where a step crosses a threshold."""


@dataclass
class HostMetadata(ReferenceMetadata):
    max_seq_len: int = 0
    tiles: tuple[int, ...] = ()
    batch_tiles: torch.Tensor | None = None


class HostFieldsBuilder(ReferenceMetadataBuilder):
    """Host values: ``max_seq_len`` (follows the length), ``tiles`` (37-token tiles per
    request); and ``batch_tiles``, 128-token tiles over the whole batch, whose breakpoints
    move with the batch size."""

    def build(self, common: CommonAttentionMetadata) -> HostMetadata:
        lens = common.seq_lens_cpu_upper_bound
        return HostMetadata(
            **vars(super().build(common)), max_seq_len=common.max_seq_len,
            tiles=tuple(-(-int(n) // 37) for n in lens),
            batch_tiles=(common.seq_lens.sum() + 127).div(128, rounding_mode="floor").view(1),
        )


class Unbuildable(ReferenceMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        raise ValueError("needs a prefill batch")


def make(cls: type[AttentionMetadataBuilder], max_model_len: int = 512,  # type: ignore[type-arg]
         max_num_reqs: int = 8) -> AttentionMetadataBuilder:  # type: ignore[type-arg]
    layer = AttentionLayerSpec(num_heads=2, num_kv_heads=1, head_size=16, dtype=torch.float32,
                               block_size=16, max_model_len=max_model_len)
    config = CPU_CONFIG.model_copy(update={"max_model_len": max_model_len})
    return cls(layer, config, torch.device("cpu"), BuilderLimits(max_num_reqs, 4 * max_num_reqs))


def changes_of(f, lo: int, hi: int) -> list[int]:  # type: ignore[no-untyped-def]
    return [n for n in range(lo + 1, hi + 1) if f(n) != f(n - 1)]


def test_finds_exactly_the_thresholds_at_every_batch_size() -> None:
    bp = discover_breakpoints(make(SplitBuilder), ("num_splits",))
    assert bp.lengths == THRESHOLDS
    assert bp.field_lengths() == {"num_splits": THRESHOLDS}
    assert [b.batch_size for b in bp.batches] == [1, 2, 8]
    assert all(b.coarse_step == 1 and not b.unresolved for b in bp.batches)  # exhaustive
    assert bp.complete and bp.reason is None
    assert bp.describe() == ("reference: num_splits changes at lengths 100, 169, 300 "
                             "(batch sizes 1, 2, 8; 1536 builds)")
    assert bp.to_json()["fields"] == {"num_splits": [100, 169, 300]}


def test_bisection_finds_them_under_a_small_cap_at_serving_lengths() -> None:
    bp = discover_breakpoints(make(SplitBuilder, max_model_len=32768), ("num_splits",),
                              batch_sizes=(1,), max_builds=400)
    (batch,) = bp.batches
    assert bp.lengths == THRESHOLDS and bp.complete
    assert batch.coarse_step > 1 and batch.builds <= 400


def test_a_cap_too_small_keeps_the_lowest_exact_breakpoints_and_says_so() -> None:
    bp = discover_breakpoints(make(HostFieldsBuilder, max_model_len=32768), batch_sizes=(1,),
                              max_builds=300)
    tiles = bp.field_lengths()["tiles"]
    truth = changes_of(lambda n: -(-n // 37), 1, 32768)
    assert set(tiles) <= set(truth) and tiles[:10] == tuple(truth[:10])
    assert not bp.complete and bp.batches[0].unresolved
    assert "incomplete" in bp.describe()


def test_what_follows_the_length_is_no_breakpoint() -> None:
    bp = discover_breakpoints(make(DerivedBuilder), ("kv_lens_plus_one",))
    assert bp.lengths == () and bp.reason == "no derived field changes with the length"
    assert all(b.tracking == ("kv_lens_plus_one",) for b in bp.batches)
    assert "no breakpoints" in bp.describe()


def test_host_values_are_watched_and_batch_dependent_breakpoints_listed_per_size() -> None:
    bp = discover_breakpoints(make(HostFieldsBuilder), batch_sizes=(1, 2, 8))
    fields = bp.field_lengths()
    assert "max_seq_len" not in fields and "max_seq_len" in bp.batches[0].tracking
    assert fields["tiles"] == tuple(changes_of(lambda n: -(-n // 37), 1, 512))
    for batch in bp.batches:
        others = batch.batch_size - 1  # companions at length 1
        expected = changes_of(lambda n: -(-(n + others) // 128), 1, 512)  # noqa: B023
        assert dict(batch.fields)["batch_tiles"] == tuple(expected)
    assert "with 1 request; " in bp.describe() and "with 8 requests" in bp.describe()


def test_padding_lanes_are_probed_as_the_descriptor_says() -> None:
    buckets = (1, 2, 4, 8)

    def padded(n: int) -> BatchExecutionDescriptor:
        bucket = min(b for b in buckets if b >= n)
        return BatchExecutionDescriptor(CUDAGraphMode.FULL, bucket, bucket, 1)

    bp = discover_breakpoints(make(SplitBuilder), ("num_splits",), batch_sizes=(3,),
                              descriptor_for=padded)
    assert bp.batches[0].lanes == 4 and bp.lengths == THRESHOLDS


def test_a_builder_that_cannot_build_the_batch_gives_an_empty_result_with_the_reason() -> None:
    bp = discover_breakpoints(make(Unbuildable))
    assert bp.lengths == () and not bp.complete
    assert bp.reason == ("the builder cannot build a synthetic decode batch: "
                         "ValueError: needs a prefill batch")
    assert all(b.builds == 1 for b in bp.batches)
    assert discover_breakpoints(make(SplitBuilder), batch_sizes=(9,)).reason == (
        "no batch size in [9] fits 1..8 requests")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_the_verifier_catches_a_stale_threshold_refresh_at_default_settings(seed: int) -> None:
    """Default example count and K range, against a matrix that declares ``num_splits``;
    only the shrink budget is cut (catching is the point here, not the minimal example),
    and the search ends at its first failure (``fail_fast``: up to there it is the default
    search).
    Measured when written: without breakpoints, seeds 2, 7 and 8 of 0..9 pass this builder
    at max_model_len 512 (3 of 10 caught at 4096); with them, every seed is caught within
    10 examples."""
    shipped = load_matrix(None)
    matrices = MatrixContext(declaring_matrix(shipped, ("num_splits",)), None, shipped)
    settings = VerifySettings("reference", CPU_CONFIG, seed=seed, shrink_seconds=0.0,
                              fail_fast=True, builder_overrides=(("reference", StaleSplit),),
                              matrices=matrices)
    report = BackendReport("reference", Tier.CPU, Status.PASSED)
    BackendVerifier(settings, torch.device("cpu")).run(report, lambda i, e: None)
    caught = [f for f in report.failures if f.check is Check.STEP_METADATA]
    assert caught and "num_splits" in caught[0].diagnosis, f"seed {seed}: {report.failures}"
    assert report.breakpoints is not None and report.breakpoints["lengths"]


def test_the_correct_threshold_builder_passes_at_default_settings() -> None:
    shipped = load_matrix(None)
    matrices = MatrixContext(declaring_matrix(shipped, ("num_splits",)), None, shipped)
    settings = VerifySettings("reference", CPU_CONFIG, examples=20,
                              builder_overrides=(("reference", SplitBuilder),), matrices=matrices)
    report = BackendReport("reference", Tier.CPU, Status.PASSED)
    BackendVerifier(settings, torch.device("cpu")).run(report, lambda i, e: None)
    assert report.status is Status.PASSED, report.failures
    assert report.checks[Check.STEP_METADATA].passed > 0
