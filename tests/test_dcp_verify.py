"""``speccheck verify --dcp-world-size N`` over real DCP ranks (two gloo ranks on the CPU):
reference and triton_attn pass; the stale-local-lengths reference builder is caught by the
command at its default settings, with the rank and ``dcp_local_seq_lens`` named; bad input
is one line. (Both stale builders are also caught, field named, by ``speccheck selftest``:
``test_verifier_mutants.test_selftest_command_reports_every_mutant_caught``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from speccheck.backends.dcp import group_capturable
from speccheck.checks.api import MAX_DCP_RANKS, VerifyInputError, plan_verification
from speccheck.checks.selftest import dcp_mutants
from speccheck.checks.verify.comparisons import expected_slots
from speccheck.checks.verify.kv_share import KvShare, whole_cache_start
from speccheck.contract.matrix_loader import load_matrix
from speccheck.speculator.batch import DraftBatch
from tests.fixtures.catch import CATCH_ARGS

ROOT = Path(__file__).resolve().parents[1]
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU tier (gloo ranks)")


def _verify(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``speccheck verify ARGS`` from a shell as a user's: without the suite's
    ``TRITON_INTERPRET`` (the command must set it for its ranks itself)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", "verify", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


@CPU_ONLY
def test_reference_passes_on_two_dcp_ranks_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "dcp.json"
    proc = _verify("--backend", "reference", "--dcp-world-size", "2",
                   "--num-speculative-steps", "3", "--examples", "3", "--capture-sizes", "1,2",
                   "--max-new-tokens", "2", "--no-cells", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("reference: decode context parallelism on 2 real ranks, each holding its "
            "interleaved share of the KV cache") in proc.stdout
    assert "reference: DCP: 2 real ranks over a " in proc.stdout
    (backend,) = json.loads(out.read_text())["backends"]
    assert (backend["status"], backend["examples"], backend["fused_allowed"]) == ("passed", 3, True)
    assert backend["candidates"] == ["fused_eager"]
    checks = backend["checks"]
    for check in ("step_metadata", "kv_cache", "declared_fields", "vs_fp32_reference",
                  "draft_tokens", "host_sync", "zero_tails"):
        assert checks[check]["passed"] > 0, check
        assert checks[check]["failed"] == 0, check


@CPU_ONLY
def test_triton_attn_passes_on_two_dcp_ranks_from_the_command_line(tmp_path: Path) -> None:
    """Its ranks run Triton kernels: they must be interpreted although the shell did not
    ask (they crashed with "0 active drivers" where only the workers set it)."""
    out = tmp_path / "dcp.json"
    proc = _verify("--backend", "triton_attn", "--dcp-world-size", "2",
                   "--num-speculative-steps", "3", "--examples", "2", "--capture-sizes", "2",
                   "--max-new-tokens", "2", "--no-cells", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (backend,) = json.loads(out.read_text())["backends"]
    assert (backend["status"], backend["examples"]) == ("passed", 2)
    assert "2 real ranks" in backend["detail"]
    for check in ("step_metadata", "vs_fp32_reference"):
        assert backend["checks"][check]["passed"] > 0, check


@CPU_ONLY
@pytest.mark.slow
def test_stale_reference_builder_is_caught_by_the_command_at_its_defaults(tmp_path: Path) -> None:
    """The matrix its author would ship, and nothing but ``--dcp-world-size 2`` (and
    ``--fail-fast``: the search up to its first failure is the default search): the default
    examples, seed and step counts catch it, and the failure names the rank and field."""
    matrix = tmp_path / "stale.yaml"
    claimed = dcp_mutants.claiming_matrix(load_matrix(None), "reference")
    matrix.write_text(yaml.safe_dump(claimed.model_dump(mode="json")))
    out = tmp_path / "stale.json"
    proc = _verify("--backend", "reference", "--matrix", str(matrix), "--dcp-world-size", "2",
                   *CATCH_ARGS, "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL reference step_metadata step " in proc.stdout
    assert "field reference.metadata.dcp_local_seq_lens: DCP rank " in proc.stdout
    (backend,) = json.loads(out.read_text())["backends"]
    assert backend["status"] == "failed"
    named = [f for f in backend["failures"] if f["check"] == "step_metadata"
             and f["field"] == "reference.metadata.dcp_local_seq_lens"]
    assert named and named[0]["diagnosis"].startswith("DCP rank ")
    assert "--dcp-world-size 2 --reproduce " in backend["reproduce"]


def test_dcp_with_data_parallelism_is_one_line_of_bad_input() -> None:
    proc = _verify("--backend", "reference", "--dcp-world-size", "2", "--dp-size", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == ("--dcp-world-size 2 runs reference on real DCP ranks, which cannot be "
                    "combined with --dp-size 2 (data parallelism runs the DFlash drafter "
                    "without DCP)")


def test_too_many_dcp_ranks_is_bad_input_and_a_backend_without_a_share_runs_alone() -> None:
    with pytest.raises(VerifyInputError, match=f"at most {MAX_DCP_RANKS}$"):
        plan_verification("triton_attn", config={"dcp_world_size": MAX_DCP_RANKS + 1})
    plan = plan_verification("sparse_swa", config={"dcp_world_size": 2})
    assert plan.dcp_ranks("sparse_swa") == 1
    assert plan.dcp_note("sparse_swa").startswith("dcp_world_size=2 is a configuration value only")
    simulated = plan_verification("triton_mla", config={"dcp_world_size": 2})
    assert simulated.dcp_ranks("triton_mla") == 1
    assert "simulated in one process" in (simulated.dcp_note("triton_mla") or "")


def test_a_gloo_group_cannot_be_captured() -> None:
    assert group_capturable(None)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert not group_capturable(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_a_dcp_rank_expects_its_local_slots_and_the_whole_cache_is_reassembled() -> None:
    """Rank 1 of 2 holds positions 1, 3, 5, ... at local positions 0, 1, 2, ...; the
    single-process reference's start holds each context position where its rank keeps it."""
    batch = DraftBatch(context_lens=(5,), new_tokens=((7, 8),), block_table=((3, 6),),
                       seeds=(0,))
    share = KvShare(1, 2)
    # positions 5, 6 (new), then 7 (one decode step, K = 2); rank 1 holds 5 and 7
    assert expected_slots(batch, 2, 4, 64, share=share) == {3 * 4 + 2, 3 * 4 + 3}
    keys = torch.arange(7 * 4, dtype=torch.float32).reshape(7, 4, 1)
    (whole, _), = whole_cache_start([(keys, torch.empty(0))], batch, 4, 2)
    local = {p: int(keys.flatten()[3 * 4 + p // 2]) for p in range(5)}  # same noise on each rank
    assert [int(whole.flatten()[3 * 4 + p]) for p in range(4)] == [local[p] for p in range(4)]
    assert int(whole.flatten()[6 * 4 + 0]) == local[4]
