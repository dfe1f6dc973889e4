"""The verifier on real CUDA graphs with FlashAttention-3 and FlashInfer (GPU machine only).

A missing FA3 scheduler-metadata refresh does not change attention outputs (measured on the
H200), so only the step-dependent-metadata check can catch it. The FlashInfer fixed-plan
builder's known-bad variants: its refresh removed (the fused graph replays step 1's page
table), and its design with split KV left on (a plan that depends on the lengths, kept
from the capture).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speccheck.checks.api import plan_verification
from speccheck.checks.device_memory import release_device_memory
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.report import BackendReport
from speccheck.contract.runtime_config import RuntimeConfig

MATRICES = MatrixContext.load(None)

pytestmark = pytest.mark.cuda

FA3_CONFIG = RuntimeConfig(platform="cuda", cudagraph_mode="full", dtype="bfloat16", head_size=128,
                           num_heads=16, num_kv_heads=4, block_size=512, max_model_len=512)


def _run(settings: VerifySettings) -> tuple[BackendVerifier, BackendReport]:
    verifier = BackendVerifier(settings, torch.device("cuda"))
    report = BackendReport(settings.backend, "gpu", "passed")
    verifier.run(report, lambda i, e: None)
    return verifier, report


def test_fa3_without_its_refresh_is_caught_at_default_settings() -> None:
    """The seed PR's headline bug, at the settings ``speccheck verify --backend fa3`` uses
    (its matrix entry's verify_defaults, the GPU tier's scale, K range, example count and
    workers: each worker's share of the examples from its own seed), ten seeds; breakpoint
    discovery must aim the draft steps across FA3's own schedule thresholds. Shrinking is
    cut: catching is the point here."""
    pytest.importorskip("fa3_fwd_interface")
    from speccheck.backends.fa3.builder import FA3MetadataBuilder

    class WithoutRefresh(FA3MetadataBuilder):
        def update_draft_decode_metadata(self, metadata) -> None:
            """The refresh, removed: the fused graph replays step 1's schedule."""

    caught: list[int] = []
    for seed in range(10):
        workers_caught = []
        for worker in plan_verification("fa3", seed=seed).shard_settings("fa3"):
            settings = dataclasses.replace(worker, shrink_seconds=0.0,
                                           builder_overrides=(("fa3", WithoutRefresh),))
            verifier, report = _run(settings)
            # Each worker's verifier holds a serving-scale KV cache and graph pools: free
            # them before the next one, as the worker process of `speccheck verify` does.
            del verifier
            release_device_memory(torch.device("cuda"))
            print(f"seed {seed} (worker seed {settings.seed}): {report.examples} examples, "
                  f"breakpoints {(report.breakpoints or {}).get('lengths', [])[:8]}, failures "
                  f"{[(f.check, f.field) for f in report.failures]}")
            stale = [f for f in report.failures if f.check == "step_metadata"]
            workers_caught.append(bool(stale)
                                  and stale[0].field == "fa3.metadata.scheduler_metadata")
            assert not [f for f in report.failures if f.check == "draft_tokens"]
        if any(workers_caught):
            caught.append(seed)
    print(f"FA3 without refresh caught at default settings for seeds {caught} of 0..9")
    assert len(caught) >= 9, caught


def test_fa3_under_decode_context_parallelism_is_verified_per_step_only() -> None:
    pytest.importorskip("fa3_fwd_interface")
    config = FA3_CONFIG.model_copy(update={"dcp_world_size": 2})
    verifier, report = _run(VerifySettings("fa3", config, examples=25, matrices=MATRICES))
    assert not verifier.fused_allowed
    assert [c.name for c in verifier.candidates()] == ["per_step_graph"]
    assert report.status == "passed", report.failures


def _fixed_plan_mutants() -> dict[str, type]:
    """Known-bad ``flashinfer_fixed_plan`` builders, by name."""
    from speccheck.backends.flashinfer.builder import FlashInferMetadata
    from speccheck.backends.flashinfer.fixed_plan import FlashInferFixedPlanMetadataBuilder

    class WithoutRefresh(FlashInferFixedPlanMetadataBuilder):
        def update_draft_decode_metadata(self, metadata: FlashInferMetadata) -> None:
            """The refresh, removed: builds still write the page table."""

    class SplitKV(FlashInferFixedPlanMetadataBuilder):
        """Plans once per query layout, as the shipped builder does, but leaves split KV
        on: the plan depends on the lengths it was made for."""

        split_kv = True

    return {"without_refresh": WithoutRefresh, "split_kv": SplitKV}


@pytest.mark.parametrize("mutant", ["without_refresh", "split_kv"])
def test_flashinfer_fixed_plan_mutants_are_caught_at_default_settings(mutant: str) -> None:
    """``speccheck verify --backend flashinfer_fixed_plan``'s default settings (every
    worker's share of the default examples, default seed) with a known-bad builder swapped
    in: the run fails. Without the refresh, ``step_metadata`` names the stale page table;
    with split KV, the outputs are wrong (eager and graphs alike: the fp32 reference)."""
    pytest.importorskip("flashinfer")
    builder = _fixed_plan_mutants()[mutant]
    failures = []
    for worker in plan_verification("flashinfer_fixed_plan").shard_settings(
            "flashinfer_fixed_plan"):
        settings = dataclasses.replace(
            worker, shrink_seconds=0.0,
            builder_overrides=(("flashinfer_fixed_plan", builder),))
        verifier, report = _run(settings)
        del verifier
        release_device_memory(torch.device("cuda"))
        failures += [(f.check, f.field, f.diagnosis[:160]) for f in report.failures]
    print(f"{mutant}: {failures[:4]}")
    assert failures, f"{mutant} passed verify at default settings"
    if mutant == "without_refresh":
        assert any(check == "step_metadata" and "paged_kv" in (field or "")
                   for check, field, _ in failures), failures
