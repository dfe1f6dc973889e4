"""The DFlash drafter on two real DCP ranks (``verify_dcp_blocks``, the
``dcp_world_size=2, drafter=dflash`` cell): every rank drafts the same batch over its share of
the KV cache, attending each block non-causally, against the fp32 drafter over the oracle's
attention run as one process holding the whole cache.

A rank whose attention reads one local position past its length
(:class:`~speccheck.checks.selftest.dflash_mutants.LocalShareReadOnePast`) is clipped by every
causal step and fails here on every rank."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from speccheck.checks.api import VerifyInputError, plan_verification
from speccheck.checks.cli.app import app
from speccheck.checks.selftest.dflash_mutants import LocalShareReadOnePast
from speccheck.checks.verify.cells import CellAxis
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.data_parallel import (
    CHECK_DCP_VS_FP32_REFERENCE,
    DPVerifyResult,
    RankSplit,
    verify_dcp_blocks,
)
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.vocabulary import Check, Result, Status
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.model import DrafterConfig

MATRICES = MatrixContext.load(None)
DRAFTER = DrafterConfig(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_size=16,
                        intermediate_size=64, seed=5)
CONFIG = RuntimeConfig(platform="cpu", cudagraph_mode="none", num_speculative_steps=3,
                       block_size=4, max_model_len=40, dtype="float32", head_size=16,
                       num_heads=2, num_kv_heads=1, dcp_world_size=2)
ROUNDS = 6


@pytest.fixture(scope="module")
def correct() -> DPVerifyResult:
    return verify_dcp_blocks("reference", CONFIG, examples=ROUNDS, seed=3, drafter=DRAFTER,
                             modes=("none",), timeout_s=240, matrices=MATRICES)


@pytest.fixture(scope="module")
def one_past() -> DPVerifyResult:
    return verify_dcp_blocks("reference", CONFIG, examples=ROUNDS, seed=3, drafter=DRAFTER,
                             modes=("none",), timeout_s=240, matrices=MATRICES,
                             builder_overrides=(("reference", LocalShareReadOnePast),))


def test_every_rank_drafts_the_same_batches_and_agrees_with_the_whole_cache(
    correct: DPVerifyResult,
) -> None:
    assert correct.split is RankSplit.DCP and correct.label == "dcp2"
    assert correct.batches_per_rank[0] == correct.batches_per_rank[1]
    assert correct.passed, [o.diagnosis for o in correct.failures()]
    for rank in (0, 1):
        got = correct.select(rank=rank, check=CHECK_DCP_VS_FP32_REFERENCE)
        assert [o.round for o in got] == list(range(ROUNDS))
        assert {o.result for o in got} <= {Result.PASSED, Result.INDETERMINATE}
        assert any(o.result is Result.PASSED for o in got)
    report = correct.to_report()
    assert report.status is Status.PASSED and report.data_parallel is None
    assert report.candidates == ["dcp2_none"]
    assert "on 2 real DCP ranks over gloo" in report.detail
    assert report.checks[Check.DCP_BLOCKS_VS_FP32_REFERENCE].passed > 0
    assert report.checks[Check.DP_VS_FP32_REFERENCE].passed == 0


def test_a_rank_reading_one_past_its_share_fails_on_every_rank(one_past: DPVerifyResult) -> None:
    failed = [o for o in one_past.select(check=CHECK_DCP_VS_FP32_REFERENCE)
              if o.result is Result.FAILED]
    assert {o.rank for o in failed} == {0, 1}, one_past.outcomes
    report = one_past.to_report()
    assert report.status is Status.FAILED
    (failure,) = report.failures
    assert failure.check is Check.DCP_BLOCKS_VS_FP32_REFERENCE and failure.candidate == "dcp2_none"
    assert "DCP rank 0's run vs fp32 reference over the whole cache: request" in failure.diagnosis
    assert report.minimal_example is not None
    assert report.minimal_example["dcp_world_size"] == 2
    assert BackendReport.from_json(report.to_json()) == report


def test_dcp_blocks_need_two_ranks_and_no_data_parallelism() -> None:
    with pytest.raises(ValueError, match="2 or more DCP ranks"):
        verify_dcp_blocks("reference", CONFIG.model_copy(update={"dcp_world_size": 1}),
                          matrices=MATRICES)
    with pytest.raises(ValueError, match="without data parallelism"):
        verify_dcp_blocks("reference", CONFIG.model_copy(update={"dp_size": 2}),
                          matrices=MATRICES)


def test_the_drafter_option_picks_the_ranks() -> None:
    on_dcp = plan_verification("reference", config={"dcp_world_size": 2}, drafter="dflash")
    assert on_dcp.cells("reference") == on_dcp.cells("reference")[:1]  # the config alone
    assert on_dcp.dcp_ranks("reference") == 2
    alone = plan_verification("reference", drafter="dflash")
    assert alone.drafter == "dflash" and alone.config.dp_size == 1
    assert plan_verification("reference", config={"dp_size": 2}).drafter == "dflash"
    assert plan_verification("reference").drafter == "autoregressive"
    # named, the autoregressive drafter runs no DFlash cell (data-parallel or DCP-blocks)
    axes = {cell.axis for cell in plan_verification("reference").cells("reference")}
    assert {CellAxis.DATA_PARALLEL, CellAxis.DCP_BLOCKS} <= axes
    named = plan_verification("reference", drafter="autoregressive").cells("reference")
    assert not {CellAxis.DATA_PARALLEL, CellAxis.DCP_BLOCKS} & {cell.axis for cell in named}
    assert CellAxis.DCP in {cell.axis for cell in named}


@pytest.mark.parametrize(("args", "line"), [
    (["--drafter", "autoregressive", "--dp-size", "2"],
     "drafter autoregressive cannot run at dp_size 2: data-parallel ranks run the DFlash "
     "drafter"),
    (["--drafter", "dflash", "--reproduce", "AAAA"],
     "--reproduce runs one example in one worker; it cannot be combined with --dp-size or "
     "--drafter dflash (their reproduce commands draw their rounds again)"),
])
def test_a_drafter_that_cannot_run_is_one_line_of_bad_input(args: list[str], line: str) -> None:
    result = CliRunner().invoke(app, ["verify", *args])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [line]
    with pytest.raises(VerifyInputError, match="^drafter autoregressive cannot run"):
        plan_verification("reference", drafter="autoregressive", config={"dp_size": 2})
