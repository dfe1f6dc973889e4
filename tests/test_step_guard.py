"""Each eager step's metadata is guarded (``checks/verify/step_guard``): a builder whose
refresh leaves a block table pointing past the cache used to end the run in the attention's
index error (a crash, no field named). On the CPU the run now fails ``step_metadata`` on
the block table of the first step it refreshed (the fused candidate's padded first pass,
against the oracle's), with the error appended, while the oracle (which builds each step)
passes; with a GPU's
guard (``stop``) the run ends at the first draft step so refreshed, before its forward
reads the block table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from speccheck.backends.reference.builder import ReferenceMetadata, ReferenceMetadataBuilder
from speccheck.backends.sparse_swa.builder import SparseSWAMetadataBuilder
from speccheck.checks.selftest.mutants import DERIVED_FIELD, StaleRefresh
from speccheck.checks.selftest.run import settings_at_defaults, verify_at_defaults, verify_builder
from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify import harness
from speccheck.checks.verify.engine import BackendVerifier, candidates_for
from speccheck.checks.verify.field_meanings import DeclaredMeanings
from speccheck.checks.verify.kv_share import WHOLE_CACHE
from speccheck.checks.verify.step_guard import GuardedRun, StepCheckFailed, StepGuard
from speccheck.checks.verify.step_recorder import StepMetadataRecorder
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.vocabulary import Candidate, Check, Result, Status, Tier
from speccheck.contract.matrix_loader import load_matrix
from speccheck.speculator.autoregressive import AutoregressiveSpeculator, DecodePath
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig
from tests.fixtures.configs import CPU_CONFIG

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
    assert first.check is Check.STEP_METADATA, report.failures
    assert first.field == "reference.metadata.block_table"
    assert first.candidate == "fused_eager" and first.step == 0
    assert str(FAR_PAST_THE_CACHE) in first.diagnosis
    assert "; the run then raised " in first.diagnosis  # the crash the field explains


def test_a_stop_carries_its_failure_and_a_peer_rank_stop_carries_none() -> None:
    failed = Outcome(Check.FIELD_MEANINGS, Result.FAILED, "x", "fused_eager", 2, "f")
    assert StepCheckFailed(failed).outcomes == [failed]
    assert StepCheckFailed(None).outcomes == []


def test_a_stopping_guard_ends_the_run_before_the_step_reads_the_field() -> None:
    """The GPU's guard, on the CPU: the fused run stops at the first draft step whose
    refreshed block table points past the cache, before that step's forward would raise."""
    config = CPU_CONFIG.model_copy(update={"num_speculative_steps": 4})
    matrix = load_matrix(None)
    spec = create_speculator(
        "autoregressive", ["reference"] * 2, config,
        DrafterConfig.for_runtime(config, vocab_size=64), torch.device("cpu"),
        SpeculatorOptions(capture_sizes=(2, 4), num_blocks=4 * (config.max_model_len // config.block_size) + 1,
                          pad_to_capture_sizes=True),
        matrix=matrix, builder_overrides={"reference": RefreshPointsPastTheCache},
    )
    assert isinstance(spec, AutoregressiveSpeculator)
    guard = StepGuard(StepMetadataRecorder(spec.groups), stop=True)
    spec.step_observer = guard
    batch = DraftBatch((5,), ((7, 8),), ((3, 5, 6),), (1,))
    run = GuardedRun(batch, "fused_eager",
                     DeclaredMeanings.of(matrix, spec.groups, config, WHOLE_CACHE))
    with pytest.raises(StepCheckFailed) as stopped, guard.arm(run):
        spec.propose(batch, DecodePath.FUSED, use_graphs=False)
    outcome = stopped.value.outcome
    assert outcome is not None and outcome.check is Check.FIELD_MEANINGS
    assert outcome.field == "reference.metadata.block_table" and outcome.step
    assert outcome.candidate == "fused_eager"
    assert "then raised" not in outcome.diagnosis  # nothing ran on the wrong table


class _EagerThenGraph(BackendVerifier):
    """The GPU's fused candidates, in the GPU's order, on the CPU (where a graph replay
    cannot run: reaching it would raise)."""

    def candidates(self, k: int | None = None) -> list[Candidate]:
        return [] if k == 1 else candidates_for(DecodePath.FUSED, gpu=True)


def test_the_fused_graph_is_not_replayed_on_metadata_its_eager_run_stopped_on() -> None:
    """On the GPU the eager fused run goes first, and a run its guard stopped leaves its
    graph replay out for that example (the replay would run the same refresh's metadata,
    into a device fault: FA3 without its schedule refresh, on H100 and H200)."""
    assert [c.name for c in candidates_for(DecodePath.FUSED, gpu=True)] == [
        "fused_eager", "fused_graph"]
    settings = settings_at_defaults("reference", RefreshPointsPastTheCache, torch.device("cpu"),
                                    load_matrix(None), examples=4, fail_fast=True)
    report = BackendReport("reference", Tier.CPU, Status.PASSED)
    _EagerThenGraph(settings, torch.device("cpu")).run(report, lambda i, e: None)
    assert report.status is Status.FAILED, report.detail
    assert {f.candidate for f in report.failures} == {"fused_eager"}, report.failures
    assert report.failures[0].field == "reference.metadata.block_table"


class _PassBuilder:
    """A builder holding a decode wrapper's indptr the padded first pass does not read."""

    def __init__(self) -> None:
        self.decode_indptr = torch.zeros(5, dtype=torch.int32)

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        return {"decode.indptr": self.decode_indptr}

    def workspace_buffers(self) -> dict[str, torch.Tensor]:
        return {}


@dataclass
class _PassGroup:
    builder: _PassBuilder
    backend_name: str = "fake"


@dataclass
class _PassMetadata:
    seq_lens: torch.Tensor


class _NoMeanings:
    def check_step(self, *args: object) -> None:
        return None


def test_a_first_pass_is_compared_on_what_its_metadata_reaches() -> None:
    """A candidate that builds its step-1 metadata before the pass, from reset buffers
    (the emulated fused run), holds another decode indptr than the oracle at the pass; the
    pass does not read it, and the refresh before step 1 rewrites it (FlashInfer's fixed
    plan failed there on an H100 at a217cd4). A field of the pass's metadata that differs
    still stops the run."""
    builder = _PassBuilder()
    group = _PassGroup(builder)
    oracle_recorder = StepMetadataRecorder([group])  # type: ignore[list-item]
    builder.decode_indptr.copy_(torch.arange(5))
    oracle_recorder(4, 0, [_PassMetadata(torch.tensor([3, 5, 0, 0]))])
    oracle = oracle_recorder.collect(4)
    assert "fake.buffers['decode.indptr']" in oracle[0]
    guard = StepGuard(StepMetadataRecorder([group]), stop=True,  # type: ignore[list-item]
                      first_pass=True)
    batch = DraftBatch((5,), ((7, 8),), ((3, 5, 6),), (1,))
    run = GuardedRun(batch, "fused_eager", _NoMeanings(),  # type: ignore[arg-type]
                     oracle_first_pass=oracle)
    builder.decode_indptr.zero_()
    with guard.arm(run):
        guard(4, 0, [_PassMetadata(torch.tensor([3, 5, 0, 0]))])
    with pytest.raises(StepCheckFailed) as stopped, guard.arm(run):
        guard(4, 0, [_PassMetadata(torch.tensor([3, 6, 0, 0]))])
    assert stopped.value.outcome is not None
    assert stopped.value.outcome.field == "fake.metadata.seq_lens"


def test_an_eager_first_pass_is_compared_with_the_oracles_on_the_cpu_too() -> None:
    """A refresh that forgets a declared field leaves the emulated first pass on the value
    its early build found (the verifier's poison): the CPU names that pass (step 0), as a
    GPU's guard does before its forward, though nothing raised (it used to name step 1
    only)."""
    report = verify_builder(StaleRefresh, torch.device("cpu"), rebuilds=True)
    assert report.status is Status.FAILED
    first = report.failures[0]
    assert (first.check, first.candidate, first.step) == (
        Check.STEP_METADATA, "fused_eager", 0), report.failures
    assert first.field == f"reference.metadata.{DERIVED_FIELD}"


@pytest.mark.parametrize(("backend", "builder"), [
    ("reference", ReferenceMetadataBuilder), ("sparse_swa", SparseSWAMetadataBuilder)])
def test_the_gpus_stopping_guard_passes_a_correct_builder_on_the_cpu(
    backend: str, builder: type[ReferenceMetadataBuilder] | type[SparseSWAMetadataBuilder],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU's guard checks every eager step (first passes included) before its forward;
    the CPU's only after a run or on a raise. Both false positives of the flashinfer GPU
    runs at d46283b and a217cd4 were in that GPU-only path: here it runs on the CPU over
    the shipped builder, which must pass."""
    monkeypatch.setattr(harness, "StepGuard", _stopping_guard)
    settings = settings_at_defaults(backend, builder, torch.device("cpu"), load_matrix(None),
                                    examples=12)
    report = BackendReport(backend, Tier.CPU, Status.PASSED)
    BackendVerifier(settings, torch.device("cpu")).run(report, lambda i, e: None)
    assert report.status is Status.PASSED, report.failures


def _stopping_guard(recorder: StepMetadataRecorder, *, stop: bool, **kwargs: Any) -> StepGuard:
    """A step guard that stops, as a GPU's does, whatever the device."""
    return StepGuard(recorder, stop=True, **kwargs)
