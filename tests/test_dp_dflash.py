"""The DFlash drafter under data parallelism on two real gloo ranks (seed 004).

Each rank drafts a different number of requests, pads its model input to the agreed token
count, and must (a) draft what it drafts alone, (b) give attention the rule's token count:
in eager mode the real ``query_start_loc[-1]``, not the padded count, and (c) draft alone
what the fp32 drafter over the oracle's attention drafts.

``PaddedCountDFlash`` re-creates the old bug (eager metadata built with the descriptor's
padded count). On the CPU reference backend its drafts survive (padding tokens belong to no
request), so only the token-count check catches it; on a GPU, FlashInfer raises.

The self-test's ``BlocksAttendedCausally`` attends each block causally: padded and alone
agree, so only (c) catches it.

The ranks import ``PaddedCountDFlash`` from this module by name, so the repository root
goes on ``sys.path`` for the module (``repo_on_path``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from speccheck.checks.selftest.dflash_mutants import BlocksAttendedCausally
from speccheck.checks.verify.data_parallel import (
    CHECK_MATCHES_SINGLE_RANK,
    CHECK_TOKEN_COUNT,
    CHECK_VS_FP32_REFERENCE,
    DPOutcome,
    DPVerifyResult,
    default_options,
    dflash_batch_limits,
    draw_dp_rounds,
    verify_dp,
)
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.vocabulary import Result
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.collectives import Collectives, rank_collectives
from speccheck.speculator.dp_launch import rank_device
from speccheck.speculator.dflash import DFlashSpeculator
from speccheck.speculator.model import DrafterConfig
from speccheck.checks.verify.context import MatrixContext

MATRICES = MatrixContext.load(None)

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = DrafterConfig(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_size=16,
                        intermediate_size=64, seed=5)
CONFIG = RuntimeConfig(platform="cpu", cudagraph_mode="none", num_speculative_steps=3,
                       block_size=4, max_model_len=40, dtype="float32", head_size=16,
                       num_heads=2, num_kv_heads=1)

class PaddedCountDFlash(DFlashSpeculator):
    """The seed-004 bug: the block's attention metadata covers the descriptor's padded token
    count in every mode (eager built as if FULL), while ``query_start_loc`` covers only the
    real tokens."""

    def _build_block_metadata(
        self, desc: BatchExecutionDescriptor, num_reqs: int, seq_lens: np.ndarray,
        capture: bool = False,
    ) -> list[Any]:
        if desc.cg_mode != CUDAGraphMode.FULL:
            desc = replace(desc, cg_mode=CUDAGraphMode.FULL)
        return super()._build_block_metadata(desc, num_reqs, seq_lens, capture)


def fixed_batch(num_reqs: int, seed: int) -> DraftBatch:
    """``num_reqs`` requests with contexts 3, 8, 13, ..., 1-3 new tokens, disjoint blocks."""
    contexts, news, rows, next_block = [], [], [], 1
    for i in range(num_reqs):
        ctx, new = 3 + 5 * i, tuple(range(1 + i, 2 + i + i % 3))
        blocks = (ctx + len(new) - 1 + CONFIG.num_speculative_steps) // CONFIG.block_size + 1
        contexts.append(ctx)
        news.append(new)
        rows.append(tuple(range(next_block, next_block + blocks)))
        next_block += blocks
    return DraftBatch(tuple(contexts), tuple(news), tuple(rows), tuple(seed + i for i in range(num_reqs)))


FIXED = [[fixed_batch(3, 10), fixed_batch(5, 30)], [fixed_batch(5, 20), fixed_batch(3, 40)]]
"""``[rank][round]``: rank 0 drafts 3 then 5 requests, rank 1 5 then 3; with 1 + K = 4
tokens per request that is 12 vs 20 real tokens, agreed 20, so rank 0 pads by 8 first."""


def _rounds() -> list[list[DraftBatch]]:
    """The fixed rounds, then four hypothesis-drawn ones; ``[rank][round]``."""
    limits = dflash_batch_limits(CONFIG, default_options(CONFIG), DRAFTER.vocab_size)
    drawn = draw_dp_rounds(limits, 2, 4, seed_value=7)
    return [FIXED[rank] + drawn[rank] for rank in range(2)]


@pytest.fixture(scope="module")
def repo_on_path() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT))
        yield


@pytest.fixture(scope="module")
def correct(repo_on_path: None) -> DPVerifyResult:
    return verify_dp("reference", CONFIG, 2, _rounds(), drafter=DRAFTER, timeout_s=120, matrices=MATRICES)


@pytest.fixture(scope="module")
def variant(repo_on_path: None) -> DPVerifyResult:
    return verify_dp("reference", CONFIG, 2, _rounds(), drafter=DRAFTER,
                     speculator_cls=PaddedCountDFlash, timeout_s=120, matrices=MATRICES)


def _padding_ranks(result: DPVerifyResult, round_index: int) -> set[int]:
    """Ranks whose real token count in that round is below the agreed (largest) one."""
    sizes = [rank[round_index].num_reqs for rank in result.batches_per_rank]
    return {r for r, n in enumerate(sizes) if n < max(sizes)}


def test_drawn_rounds_give_the_ranks_different_batch_sizes() -> None:
    rounds = _rounds()
    assert [b.num_reqs for b in rounds[0][:2]] == [3, 5] and [b.num_reqs for b in rounds[1][:2]] == [5, 3]
    assert all(a.num_reqs != b.num_reqs for a, b in zip(*rounds))


def test_two_ranks_with_different_batch_sizes_pass_every_check(correct: DPVerifyResult) -> None:
    assert correct.skipped is None and correct.passed, [o.diagnosis for o in correct.failures()]
    rounds = len(correct.batches_per_rank[0])
    for mode in correct.modes:
        for rank in (0, 1):
            for check in (CHECK_TOKEN_COUNT, CHECK_MATCHES_SINGLE_RANK, CHECK_VS_FP32_REFERENCE):
                got = correct.select(rank=rank, mode=mode, check=check)
                assert [o.result for o in got] == ["passed"] * rounds, (mode, rank, check)


def test_padded_count_variant_fails_the_token_count_on_every_padding_rank(
    variant: DPVerifyResult,
) -> None:
    first = variant.select(rank=0, mode="none", check=CHECK_TOKEN_COUNT)[0]
    assert first.result == "failed"
    assert "attention covers 20 tokens but the rule says 12" in first.diagnosis
    for o in variant.select(mode="none", check=CHECK_TOKEN_COUNT):
        padded = o.rank in _padding_ranks(variant, o.round)
        assert o.result == ("failed" if padded else "passed"), o


def test_on_the_reference_backend_only_the_count_check_catches_the_variant(
    variant: DPVerifyResult,
) -> None:
    """Padding tokens lie past ``query_start_loc[-1]``: the reference gives them no request
    and writes their KV to the sink, so the drafts are unchanged."""
    assert {o.result for o in variant.select(check=CHECK_MATCHES_SINGLE_RANK)} == {"passed"}
    assert {o.result for o in variant.select(check=CHECK_VS_FP32_REFERENCE)} == {"passed"}


def test_a_builder_that_attends_blocks_causally_fails_only_against_the_fp32_reference(
    repo_on_path: None,
) -> None:
    """Padded and alone share the bug, so they agree; the fp32 drafter over the oracle's
    attention (non-causal within each block) drafts otherwise, on both ranks."""
    causal = verify_dp("reference", CONFIG, 2, FIXED, ("none",), drafter=DRAFTER,
                       builder_overrides=(("reference", BlocksAttendedCausally),),
                       timeout_s=120, matrices=MATRICES)
    assert {o.result for o in causal.select(check=CHECK_MATCHES_SINGLE_RANK)} == {"passed"}
    versus = causal.select(check=CHECK_VS_FP32_REFERENCE)
    assert {o.rank for o in versus if o.result == "failed"} == {0, 1}, versus
    report = causal.to_report()
    assert report.status == "failed" and report.failures[0].check == CHECK_VS_FP32_REFERENCE
    assert "single-rank run vs fp32 reference: request" in report.failures[0].diagnosis


def test_reports_tally_the_dp_checks(correct: DPVerifyResult, variant: DPVerifyResult) -> None:
    good, bad = correct.to_report(), variant.to_report()
    assert good.status == "passed" and good.checks[CHECK_TOKEN_COUNT].failed == 0
    assert good.checks[CHECK_TOKEN_COUNT].passed == 2 * 6 * len(correct.modes)
    assert bad.status == "failed"
    padding = sum(len(_padding_ranks(variant, i)) for i in range(6))
    assert bad.checks[CHECK_TOKEN_COUNT].failed == padding
    assert bad.failures[0].check == CHECK_TOKEN_COUNT
    assert bad.failures[0].diagnosis.startswith("rank 0, mode none, round 0: attention covers 20")
    assert bad.minimal_example is not None and len(bad.minimal_example["batches_per_rank"]) == 2
    assert BackendReport.from_json(bad.to_json()) == bad


def test_the_result_names_the_collectives_and_every_ranks_device(correct: DPVerifyResult) -> None:
    """Decided once in the parent, as :func:`rank_collectives` says for this machine."""
    assert correct.collectives is rank_collectives(2)
    assert correct.devices == (str(rank_device(0)), str(rank_device(1)))
    report = correct.to_report()
    assert report.data_parallel == {"dp_size": 2, "collectives": correct.collectives.backend,
                                    "devices": list(correct.devices)}
    assert BackendReport.from_json(report.to_json()).data_parallel == report.data_parallel


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_without_cuda_the_ranks_share_the_cpu_over_gloo(correct: DPVerifyResult) -> None:
    assert correct.collectives is Collectives.GLOO and correct.devices == ("cpu", "cpu")
    assert correct.to_report().data_parallel == {"dp_size": 2, "collectives": "gloo",
                                                 "devices": ["cpu", "cpu"]}


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (one DP rank per GPU over NCCL)")
def test_on_two_gpus_each_rank_has_its_own_gpu_over_nccl(correct: DPVerifyResult) -> None:
    assert correct.collectives is Collectives.GLOO_CPU_NCCL_CUDA
    assert correct.devices == ("cuda:0", "cuda:1") and "full" in correct.modes
    assert correct.passed, [o.diagnosis for o in correct.failures()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_full_mode_is_reported_not_run_without_cuda(correct: DPVerifyResult) -> None:
    assert correct.modes == ("none",)
    assert correct.skipped_modes == {"full": "needs a CUDA device"}
    report = correct.to_report()
    assert report.tier == "cpu" and "full: not run (needs a CUDA device)" in report.detail


@pytest.mark.cuda
def test_full_mode_pads_attention_too_on_cuda(correct: DPVerifyResult, variant: DPVerifyResult) -> None:
    """FULL replays a captured padded shape: attention covers the padded count on every rank
    (both ranks share cuda:0 on a one-GPU machine), and the variant only differs in eager."""
    assert "full" in correct.modes and correct.to_report().tier == "gpu"
    for result in (correct, variant):
        assert {o.result for o in result.select(mode="full")} == {"passed"}


@pytest.mark.cuda
def test_padded_count_variant_crashes_flashinfer(repo_on_path: None) -> None:
    pytest.importorskip("flashinfer")
    config = CONFIG.model_copy(update={"platform": "cuda", "dtype": "bfloat16", "head_size": 128})
    drafter = replace(DRAFTER, head_size=128, dtype="bfloat16")
    bad = verify_dp("flashinfer", config, 2, FIXED, ("none",), drafter=drafter,
                    speculator_cls=PaddedCountDFlash, timeout_s=600, matrices=MATRICES)
    crash = bad.select(rank=0, check=CHECK_MATCHES_SINGLE_RANK)[0]
    assert crash.result == "failed"
    assert "raised ValueError" in crash.diagnosis and "does not match qo_indptr" in crash.diagnosis
    good = verify_dp("flashinfer", config, 2, FIXED, ("none",), drafter=drafter, timeout_s=600, matrices=MATRICES)
    assert good.passed, [o.diagnosis for o in good.failures()]



def test_the_drafter_reads_the_layout_the_entry_requires(repo_on_path: None) -> None:
    """triton_mla reads only the latent layout: its DFlash drafter is built of latent layers
    (it was built of NHD ones, and every rank refused it)."""
    config = CONFIG.model_copy(update={"kv_lora_rank": 16, "qk_rope_head_dim": 16})
    result = verify_dp("triton_mla", config, 2, examples=1, modes=("none",), timeout_s=300,
                       matrices=MATRICES)
    assert result.skipped is None and result.passed, [o.diagnosis for o in result.failures()]


def test_a_causal_only_backend_is_skipped_with_the_matrix_reason() -> None:
    """sparse_swa declares ``causal_only``: no rank starts, and the report says why."""
    result = verify_dp("sparse_swa", CONFIG, 2, examples=1, matrices=MATRICES)
    assert result.outcomes == [] and result.skipped is not None
    assert result.skipped.startswith("sparse_swa cannot serve the DFlash drafter: requires "
                                     "causal attention (causal_only)")
    assert "nothing after p" in result.skipped
    assert result.to_report().status == "skipped"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_drafter_agrees_with_the_fp32_reference(
    repo_on_path: None, dtype: str
) -> None:
    """The fp32 reference reads the candidate's KV noise converted, not noise of its own
    drawn in fp32: a correct half-precision drafter passes (tolerance 4x the dtype's)."""
    config = CONFIG.model_copy(update={"dtype": dtype})
    result = verify_dp("reference", config, 2, FIXED, ("none",),
                       drafter=replace(DRAFTER, dtype=dtype), timeout_s=120, matrices=MATRICES)
    assert result.passed, [o.diagnosis for o in result.failures()]
    assert {o.result for o in result.select(check=CHECK_VS_FP32_REFERENCE)} <= {
        "passed", "indeterminate"}


def test_a_failed_check_reads_as_one_line_per_mode_naming_every_failing_round() -> None:
    """A builder wrong everywhere fails each check on every rank and round: the report
    gives one failure per check and mode, the first's diagnosis and each rank's rounds."""
    batch = DraftBatch((3,), ((5,),), ((1, 2),), (0,))
    result = DPVerifyResult("reference", 2, CONFIG, False, "cpu", Collectives.GLOO,
                            ("cpu", "cpu"), ("none", "full"), [[batch] * 6, [batch] * 6])
    result.outcomes = [
        DPOutcome(rank, "none", r, CHECK_VS_FP32_REFERENCE,
                  Result.FAILED if (rank, r) != (1, 3) else Result.PASSED, f"off at {r}")
        for rank in (0, 1) for r in range(6)
    ] + [DPOutcome(0, "full", 2, CHECK_VS_FP32_REFERENCE, Result.FAILED, "off"),
         DPOutcome(1, "none", 4, CHECK_TOKEN_COUNT, Result.FAILED, "attention covers 20")]
    failures = result.to_report().failures
    assert [(f.check, f.candidate) for f in failures] == [
        (CHECK_VS_FP32_REFERENCE, "dp2_none"), (CHECK_VS_FP32_REFERENCE, "dp2_full"),
        (CHECK_TOKEN_COUNT, "dp2_none")]
    assert failures[0].diagnosis == (
        "rank 0, mode none, round 0: off at 0 (11 failures in this mode: "
        "rank 0: rounds 0-5; rank 1: rounds 0-2, 4-5)")
    assert failures[1].diagnosis == "rank 0, mode full, round 2: off"
