"""``speccheck verify --backend triton_mla`` end to end, at small MLA shapes (the CPU tier
runs the kernel under the Triton interpreter): fused at ``dcp_world_size == 1``, per step
only at 2 (the matrix forbids fusing), and the known-bad builder that caches its DCP-local
lengths caught by ``step_metadata`` naming the field when a matrix claims fused at DCP 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from speccheck.checks.api import verify
from speccheck.checks.selftest.latent_mutants import (
    DCP_LOCAL_FIELD,
    StaleDcpLocalLens,
    claiming_matrix,
)
from speccheck.contract.matrix_loader import load_matrix
from tests.fixtures.catch import CATCH

SMALL_MLA = {"kv_lora_rank": 32, "qk_rope_head_dim": 16, "head_size": 16, "num_heads": 2,
             "max_model_len": 32}


@pytest.mark.parametrize(("dcp", "fused"), [(1, True), (2, False)])
def test_triton_mla_passes(dcp: int, fused: bool) -> None:
    report = verify("triton_mla", config={**SMALL_MLA, "dcp_world_size": dcp}, examples=8)
    (backend,) = report.backends
    assert report.passed, backend.failures
    assert backend.fused_allowed is fused
    assert backend.checks["vs_fp32_reference"].passed > 0
    assert backend.checks["declared_fields"].failed == 0


def test_cached_dcp_local_lengths_are_caught_naming_the_field(tmp_path: Path) -> None:
    matrix = tmp_path / "claims_fused_at_dcp2.yaml"
    matrix.write_text(yaml.safe_dump(claiming_matrix(load_matrix(None)).model_dump(mode="json")))
    # The config is pinned (DCP 2, small MLA shapes), so the runtime config alone
    # (no cells); the first failure names the field, so the search may end there.
    report = verify(StaleDcpLocalLens, matrix=matrix,
                    config={**SMALL_MLA, "dcp_world_size": 2}, examples=12, cells=False,
                    **CATCH)
    (backend,) = report.backends
    assert backend.fused_allowed and not report.passed
    stale = [f for f in backend.failures if f.check == "step_metadata"]
    assert stale, backend.failures
    assert stale[0].field == f"triton_mla.metadata.{DCP_LOCAL_FIELD}"
    assert stale[0].step == 2
    assert "differs from a fresh eager build" in stale[0].diagnosis
    assert backend.reproduced is True, backend.reproduce
