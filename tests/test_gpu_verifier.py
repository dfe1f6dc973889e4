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
from speccheck.checks.selftest.process_mutants import PROCESS_MUTANTS, ProcessMutant
from speccheck.checks.selftest.run import Outcome, verify_process_mutant
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


@pytest.mark.slow
def test_fa3_without_its_refresh_is_caught_at_default_settings() -> None:
    """The seed PR's headline bug, at the settings ``speccheck verify --backend fa3`` uses
    (its matrix entry's verify_defaults, the GPU tier's scale, K range, example count and
    workers: each worker's share of the examples from its own seed), ten seeds; breakpoint
    discovery must aim the draft steps across FA3's own schedule thresholds. Shrinking is
    cut: catching is the point here."""
    pytest.importorskip("fa3_fwd_interface")
    from speccheck.checks.selftest.fa3_mutants import SCHEDULE_FIELD, WithoutScheduleRefresh

    caught: list[int] = []
    for seed in range(10):
        workers_caught = []
        for worker in plan_verification("fa3", seed=seed).shard_settings("fa3"):
            settings = dataclasses.replace(worker, shrink_seconds=0.0,
                                           builder_overrides=(("fa3", WithoutScheduleRefresh),))
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
                                  and stale[0].field == SCHEDULE_FIELD)
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



KERNEL_MODULES = {"fa3": "fa3_fwd_interface", "flashinfer_fixed_plan": "flashinfer",
                  "flashinfer": "flashinfer"}
"""The kernel package each CUDA-only mutant's backend imports."""


@pytest.mark.parametrize("mutant", PROCESS_MUTANTS, ids=lambda m: m.name)
def test_the_selftest_catches_each_cuda_only_mutant(mutant: ProcessMutant) -> None:
    """``speccheck selftest``'s run of each CUDA-only known-bad builder: verify at its
    defaults, in worker processes, under the shipped matrix naming it, must fail it with
    its check, or, where stale metadata addresses memory, crash a worker. (Without the
    fixed-plan refresh, the graphs read the page tables the verifier poisoned before the
    example: on the H200 the worker then faults. With split KV, the fp32 reference catches
    the attention output.)"""
    pytest.importorskip(KERNEL_MODULES[mutant.backend])
    result = verify_process_mutant(mutant, shrink_seconds=10.0)
    print(f"{mutant.name}: {result.outcome}: {result.detail}")
    assert result.outcome is Outcome.CAUGHT, result.detail
