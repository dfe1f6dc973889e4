"""The verifier on real CUDA graphs with FlashAttention-3 and FlashInfer (GPU machine only).

A missing FA3 scheduler-metadata refresh does not change attention outputs (measured on the
H200), so only the step-dependent-metadata check can catch it. The FlashInfer fixed-plan
builder's known-bad variants: its refresh removed (the fused graph replays step 1's page
table), and its design with split KV left on (a plan that depends on the lengths, kept
from the capture).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from speccheck.checks.api import plan_verification
from speccheck.checks.device_memory import release_device_memory
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.report import BackendReport
from speccheck.contract.runtime_config import RuntimeConfig

MATRICES = MatrixContext.load(None)
ROOT = Path(__file__).resolve().parents[1]

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



@pytest.mark.parametrize("mutant", ["without_refresh", "split_kv"])
def test_flashinfer_fixed_plan_mutants_do_not_pass_verify(mutant: str, tmp_path: Path) -> None:
    """``speccheck verify --backend flashinfer_fixed_plan`` at its defaults, as a real
    command with its worker processes, under the shipped matrix naming a known-bad builder:
    it exits non-zero and reports the backend failed or crashed (a stale split-KV plan can
    fault the device: a crashed worker is the verdict then, not a crash of the command).
    Without the refresh the graphs read the page tables the verifier poisoned before the
    example (on the H200 the worker then faults: crashed); a failure must name them in
    ``step_metadata``. With split KV the fp32 reference catches the attention output."""
    pytest.importorskip("flashinfer")
    from speccheck.checks.selftest.flashinfer_mutants import BACKEND, MUTANTS, naming_matrix
    from speccheck.contract.matrix_loader import load_matrix

    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(yaml.safe_dump(
        naming_matrix(load_matrix(None), MUTANTS[mutant]).model_dump(mode="json",
                                                                     exclude_none=True),
        sort_keys=False))
    out = tmp_path / "report.json"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", "verify",
         "--backend", BACKEND, "--matrix", str(matrix), "--json", str(out)],
        capture_output=True, text=True, timeout=480, cwd=ROOT, env=env)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    assert proc.returncode != 0, proc.stdout
    assert out.exists(), proc.stdout + proc.stderr
    (backend,) = json.loads(out.read_text())["backends"]
    assert backend["status"] in ("failed", "crashed"), backend["status"]
    if mutant == "without_refresh" and backend["status"] == "failed":
        fields = [f.get("field") or "" for f in backend["failures"]
                  if f["check"] == "step_metadata"]
        assert any("paged_kv" in field for field in fields), backend["failures"]
