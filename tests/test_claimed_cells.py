"""A PASS covers what the matrix claims (issue 44, items 1 and 6): the configuration cells an
entry claims fused support for are derived, narrowed by the options given, spread over the
default examples and each reported; every run draws the batch classes the entry's
CUDA-graph claim covers, K >= 2 in most examples; and two known-bad builders that only such
shapes expose are caught at the defaults."""

from __future__ import annotations

import dataclasses
import json
import shlex
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from typer.testing import CliRunner

from speccheck.backends.triton_attn.builder import MIN_KV_PER_SPLIT
from speccheck.checks.api import plan_verification, verify
from speccheck.checks.cli.app import app
from speccheck.checks.verify.cells import (
    HEADS_FIELDS,
    INT16_MAX,
    BatchClass,
    Cell,
    CellAxis,
    claimed_batch_classes,
    example_shares,
)
from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.examples import Example
from speccheck.checks.verify.report import BackendReport, CellReport, write_junit
from speccheck.checks.verify.search import (
    Coverage,
    ExampleRun,
    SearchBudget,
    record_failure,
    search_all,
)
from speccheck.checks.verify.strategies import (
    FIRST_REFRESHED_K,
    BatchLimits,
    draft_batches,
    draft_step_counts,
    draw_values,
    has_shape,
    of_shape,
)
from speccheck.checks.verify.vocabulary import Check, Result, Status, Tier
from speccheck.contract.matrix_model import CudaGraphSupport, KvLayout
from speccheck.speculator.drafter_kind import DrafterKind
from tests.fixtures.catch import CATCH

ROOT = Path(__file__).resolve().parents[1]
SHAPE_BAD = ROOT / "tests" / "fixtures" / "adapters" / "shape_bad.yaml"
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU tier's defaults")


def _axes(cells: tuple[Cell, ...]) -> list[CellAxis]:
    return [cell.axis for cell in cells]


@CPU_ONLY
def test_reference_claims_dcp_on_real_ranks_the_latent_layout_and_long_lengths() -> None:
    plan = plan_verification("reference")
    cells = plan.cells("reference")
    assert cells[0].axis is CellAxis.BASE
    assert {CellAxis.DCP, CellAxis.LONG} <= set(_axes(cells))
    changed = {key: {cell.config[key] for cell in cells if key in cell.config}
               for key in ("sliding_window", "block_size", "dtype")}
    assert changed["sliding_window"] and 8 in changed["block_size"]
    assert changed["dtype"] == {"bfloat16", "float16"}  # each dtype the entry allows
    (heads,) = [cell for cell in cells if "num_heads" in cell.config]
    config = plan.for_cell(heads, 5).config_for("reference")
    assert (config.num_heads, config.num_kv_heads) == (24, 8)
    (dcp,) = [cell for cell in cells if cell.axis is CellAxis.DCP]
    assert plan.for_cell(dcp, 5).dcp_ranks("reference") == 2
    (layout,) = [cell for cell in cells if cell.kv_layout is not None]
    assert plan.for_cell(layout, 5).settings_for("reference").kv_layout is KvLayout.LATENT
    # the window runs in the NHD layout too: a latent cache's one KV head hides head grouping
    assert "sliding_window" not in layout.config
    # the DFlash drafter (non-causal blocks), without and with the window the entry claims
    assert [cell.name for cell in cells if cell.axis is CellAxis.DATA_PARALLEL] == [
        "dp_size=2", "dp_size=2, sliding_window=16"]
    # ... and on the DCP ranks, where no causal bound clips a rank's share
    (blocks,) = [cell for cell in cells if cell.axis is CellAxis.DCP_BLOCKS]
    assert blocks.name == "dcp_world_size=2, drafter=dflash"
    on_ranks = plan.for_cell(blocks, 5)
    assert on_ranks.drafter is DrafterKind.DFLASH and on_ranks.dcp_ranks("reference") == 2
    assert len(cells) <= 8  # single-rank axes packed: each cell costs a worker's start-up
    (long,) = [cell for cell in cells if cell.axis is CellAxis.LONG]
    assert long.config["max_model_len"] > INT16_MAX + 1


@CPU_ONLY
def test_options_given_narrow_the_cells() -> None:
    at_dcp_1 = plan_verification("reference", config={"dcp_world_size": 1}).cells("reference")
    assert not {CellAxis.DCP, CellAxis.DCP_BLOCKS} & set(_axes(at_dcp_1))
    assert any(cell.kv_layout is KvLayout.LATENT for cell in at_dcp_1)
    latent = plan_verification("reference", kv_layout="latent").cells("reference")
    assert all(cell.kv_layout is None for cell in latent) and CellAxis.DCP in _axes(latent)
    assert any("sliding_window" in cell.config for cell in latent)  # the rest of its cell
    assert len(plan_verification("reference", cells=False).cells("reference")) == 1
    narrowed = plan_verification("reference", config={"dp_size": 1}).cells("reference")
    assert CellAxis.DATA_PARALLEL not in _axes(narrowed)
    # a window given: the one data-parallel cell left runs at it
    windowed = plan_verification("reference", config={"sliding_window": 8}).cells("reference")
    assert [c.name for c in windowed if c.axis is CellAxis.DATA_PARALLEL] == ["dp_size=2"]
    # either head count given: the heads change keeps neither (6 KV heads do not divide 24)
    for given in ({"num_kv_heads": 6, "num_heads": 12}, {"num_heads": 8}):
        cells = plan_verification("reference", config=given).cells("reference")
        assert not any(HEADS_FIELDS & set(cell.config) for cell in cells), cells


@CPU_ONLY
def test_an_interpreted_backends_bfloat16_cell_is_not_run_with_its_reason() -> None:
    cells = plan_verification("triton_attn").cells("triton_attn")
    (bf16,) = [cell for cell in cells if cell.config.get("dtype") == "bfloat16"]
    assert bf16.not_run is not None and "interpreter" in bf16.not_run
    assert CellAxis.LAYOUT not in _axes(cells)  # its entry claims the NHD layout only


@CPU_ONLY
@pytest.mark.parametrize("backend", ["triton_attn", "triton_mla", "sparse_swa"])
def test_an_interpreted_backend_runs_a_length_cell_where_its_long_cell_is_not_run(
    backend: str,
) -> None:
    """The long cell is listed as not run, and a cell of its own runs a ``max_model_len``
    long enough for a split-KV kernel's second split (triton_attn and triton_mla cut it into
    runs of 512 positions), which no other CPU cell reaches."""
    cells = plan_verification(backend).cells(backend)
    (long,) = [cell for cell in cells if cell.axis is CellAxis.LONG]
    assert long.not_run is not None and "interpreter" in long.not_run
    (length,) = [cell for cell in cells if cell.axis is CellAxis.LENGTH]
    assert length.not_run is None and length.config == {"max_model_len": 1024}
    assert length.config["max_model_len"] > 2 * MIN_KV_PER_SPLIT - 1
    # given, the length is the run's own: no length cell
    given = plan_verification(backend, config={"max_model_len": 256}).cells(backend)
    assert CellAxis.LENGTH not in _axes(given)


@CPU_ONLY
def test_a_backend_that_runs_its_long_cell_gets_no_length_cell() -> None:
    assert CellAxis.LENGTH not in _axes(plan_verification("reference").cells("reference"))


@CPU_ONLY
def test_a_causal_only_entry_claims_no_data_parallel_cell() -> None:
    """sparse_swa refuses non-causal passes (``constraints.causal_only``): no DFlash drafter
    runs on it; triton_mla serves them and gets the cell, one only (it claims no window)."""
    assert CellAxis.DATA_PARALLEL not in _axes(plan_verification("sparse_swa").cells("sparse_swa"))
    mla = plan_verification("triton_mla").cells("triton_mla")
    assert [c.name for c in mla if c.axis is CellAxis.DATA_PARALLEL] == ["dp_size=2"]
    # its DCP is simulated in one process: no DFlash drafter on DCP ranks
    assert CellAxis.DCP in _axes(mla) and CellAxis.DCP_BLOCKS not in _axes(mla)


def test_a_backend_not_allowed_to_fuse_claims_no_further_cell() -> None:
    plan = plan_verification("flashinfer")
    assert _axes(plan.cells("flashinfer")) == [CellAxis.BASE]


def test_examples_are_spread_over_the_cells_base_first() -> None:
    assert example_shares(50, 8) == [7, 7, 6, 6, 6, 6, 6, 6]
    assert example_shares(3, 5) == [1, 1, 1, 0, 0]


def test_cells_travel_in_the_json_and_junit_reports(tmp_path: Path) -> None:
    report = BackendReport("reference", Tier.CPU, Status.FAILED, cells=[
        CellReport("base", Status.PASSED, examples=7),
        CellReport("max_model_len=33024", Status.FAILED, examples=6, detail="x",
                   reproduce="speccheck verify ..."),
        CellReport("dtype=bfloat16", Status.SKIPPED, run=False, detail="the interpreter")])
    assert BackendReport.from_json(report.to_json()) == report
    path = tmp_path / "junit.xml"
    write_junit([report], path)
    cases = {case.get("name"): case for case in ElementTree.parse(path).iter("testcase")}
    assert cases["cell[base][cpu]"].find("failure") is None
    assert cases["cell[max_model_len=33024][cpu]"].find("failure") is not None
    assert cases["cell[dtype=bfloat16][cpu]"].find("skipped") is not None


def test_the_claimed_batch_classes_follow_the_cudagraph_support() -> None:
    assert claimed_batch_classes(CudaGraphSupport.ALWAYS) == tuple(BatchClass)
    assert claimed_batch_classes(CudaGraphSupport.UNIFORM_BATCH) == (
        BatchClass.SINGLE_TOKEN_DECODE, BatchClass.UNIFORM_PADDED, BatchClass.FULL)
    assert claimed_batch_classes(CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE) == (
        BatchClass.SINGLE_TOKEN_DECODE,)


LIMITS = BatchLimits(max_num_reqs=8, block_size=4, max_model_len=64, num_blocks=129,
                     extra_positions=3, vocab_size=64,
                     batch_classes=claimed_batch_classes(CudaGraphSupport.ALWAYS),
                     capture_sizes=(1, 2, 4, 8))


def _uniform_padded(batch) -> bool:  # type: ignore[no-untyped-def]
    widths = {len(row) for row in batch.new_tokens}
    return batch.num_reqs >= 2 and len(widths) == 1 and batch.num_reqs not in (1, 2, 4, 8)


def _shapes_run(examples: int, seed_value: int, failing: BatchClass | None) -> set[BatchClass]:
    """The batch classes a search of ``examples`` examples over :data:`LIMITS` ran (any
    example, a shrink candidate's too), where only batches of ``failing`` fail a check."""
    ran: set[BatchClass] = set()
    classes = LIMITS.batch_classes

    def of(limits: BatchLimits) -> st.SearchStrategy[Example]:
        return st.tuples(st.just(3), draft_batches(limits))

    def run(example: Example) -> ExampleRun:
        shapes = {c for c in classes if has_shape(c, example[1], LIMITS)}
        ran.update(shapes)
        result = Result.FAILED if failing in shapes else Result.PASSED
        return ExampleRun([Outcome(Check.KV_CACHE, result, "stray write")], 0)

    coverage = [Coverage(c, lambda k: LIMITS, of(of_shape(LIMITS, c))) for c in classes]
    report = BackendReport("b", Tier.CPU, Status.PASSED)
    search_all(of(LIMITS), SearchBudget(examples, seed_value, 5.0), run, report,
               lambda index, example: None,
               lambda r, example, outcomes, found_at, known: record_failure(
                   r, example, outcomes, lambda e: "", found_at, known),
               coverage)
    assert report.examples == examples
    if failing is not None:
        assert [f.check for f in report.failures] == [Check.KV_CACHE]
    return ran


@pytest.mark.parametrize("examples", [4, 5, 10, 50])
def test_every_run_includes_every_claimed_batch_class(examples: int) -> None:
    """Whatever the draw favours (hypothesis' draws are clumpy: one seed's 50 examples held
    one uniform batch with padding lanes, another's four full batches), the examples a
    cell is given hold every claimed class, and a class that fails is found."""
    for seed_value in range(3):
        assert _shapes_run(examples, seed_value, None) == set(LIMITS.batch_classes)
        assert BatchClass.FULL in _shapes_run(examples, seed_value, BatchClass.FULL)


def test_a_uniform_batch_with_padding_lanes_is_several_tokens_wide() -> None:
    """One token per request is the single-token decode class (and every padded decode
    step): the uniform class a run must include is two tokens wide or more, as the
    drafter's padded uniform first passes are (1 and 2 here, so 2)."""
    padded = dataclasses.replace(LIMITS, padded_widths=(1, 2))
    assert padded.padded_widths_drawn == (1, 2) and padded.uniform_widths == (2,)
    uniform = of_shape(padded, BatchClass.UNIFORM_PADDED)
    drawn = draw_values(draft_batches(uniform), 40, 0)
    assert {len(b.new_tokens[0]) for b in drawn} == {1, 2}  # the draw keeps both
    for batch in drawn:
        assert has_shape(BatchClass.UNIFORM_PADDED, batch, padded) == (
            len(batch.new_tokens[0]) == 2)
    covering = Coverage(BatchClass.UNIFORM_PADDED, lambda k: padded,
                        st.tuples(st.just(3), draft_batches(uniform)))
    for seed_value in range(3):
        (example,) = draw_values(covering.examples, 1, seed_value)
        assert {len(tokens) for tokens in example[1].new_tokens} == {2}


def test_full_batches_fill_the_prefill_budget_where_few_blocks_are_live() -> None:
    """A full batch (the largest bucket's requests, each of the most new tokens: a first
    pass of ``max_num_prefill_tokens``, past one 16-token chunk) keeps every request where
    the live blocks hold only two full rows: earlier requests leave later ones their
    blocks, and no batch takes more blocks than are live."""
    tight = dataclasses.replace(LIMITS, num_blocks=2 * 16 + 1)
    for limits in (LIMITS, tight):
        for seed_value in range(3):
            full = draw_values(draft_batches(of_shape(limits, BatchClass.FULL)), 20, seed_value)
            assert all(has_shape(BatchClass.FULL, b, limits) for b in full)
            for batch in full + draw_values(draft_batches(limits), 50, seed_value):
                assert sum(map(len, batch.block_table)) <= limits.num_blocks - 1


def test_k_of_two_or_more_is_drawn_in_most_examples() -> None:
    """Drawn beside a batch, as the engine draws it (alone, eight values would exhaust
    hypothesis' search)."""
    for seed_value in range(3):
        drawn = draw_values(st.tuples(draft_step_counts(range(1, 9)), draft_batches(LIMITS)),
                            50, seed_value)
        assert sum(k >= 2 for k, _ in drawn) >= 35


def test_the_first_draw_of_k_runs_a_refresh() -> None:
    """A cell given one example still refreshes: hypothesis' first draw is the smallest K
    with a refresh between two decode steps, for every seed."""
    for seed_value in range(3):
        drawn = draw_values(st.tuples(draft_step_counts(range(1, 9)), draft_batches(LIMITS)),
                            1, seed_value)
        assert drawn[0][0] == FIRST_REFRESHED_K == 3


def test_the_first_request_of_a_long_cell_batch_is_past_int16() -> None:
    long = BatchLimits(max_num_reqs=8, block_size=256, max_model_len=33024, num_blocks=257,
                       extra_positions=3, vocab_size=64)
    for batch in draw_values(draft_batches(long), 30, 0):
        assert batch.context_lens[0] + len(batch.new_tokens[0]) > INT16_MAX


@CPU_ONLY
@pytest.mark.parametrize(("backend", "cell"), [("padded_lanes_as_real", None),
                                               ("int16_lengths", CellAxis.LONG),
                                               ("chunk_offset_lost", None),
                                               ("full_pass_last_token_lost", None),
                                               ("first_head_block_only", CellAxis.HEADS),
                                               ("group_rounded_to_power_of_two",
                                                CellAxis.HEADS)])
def test_a_builder_wrong_only_on_a_claimed_shape_is_caught_at_the_defaults(
    backend: str, cell: CellAxis | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything at the defaults (cells, examples, K range, seed) but the shrink budget,
    which does not change what the search finds, and ``fail_fast`` (each cell's search up
    to its first failure is the default search). The workers import the fixtures from the
    repository root."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    report = verify(backend, matrix=SHAPE_BAD, **CATCH).backend(backend)
    assert report.status is Status.FAILED, report.cells
    assert any(f.check == "vs_fp32_reference" for f in report.failures), report.failures
    failed = [c.name for c in report.cells if c.status is Status.FAILED]
    assert failed, report.cells
    if cell is CellAxis.LONG:
        assert all("max_model_len=33024" in name for name in failed), failed
    if cell is CellAxis.HEADS:
        assert all("num_heads=24, num_kv_heads=8" in name for name in failed), failed


@CPU_ONLY
def test_an_impl_that_writes_padding_rows_is_caught_at_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Padding rows of the attention output reach no draft token, logit or KV slot: only
    the padding-rows count sees them, in the oracle and in every candidate, with the
    candidate and the layers named."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    report = verify("padding_rows_overrun", matrix=SHAPE_BAD, **CATCH).backend(
        "padding_rows_overrun")
    assert report.status is Status.FAILED, report.cells
    assert {f.check for f in report.failures} == {"padding_rows"}, report.failures
    assert report.checks[Check.PADDING_ROWS].failed
    assert report.checks[Check.VS_FP32_REFERENCE].failed == 0
    assert "oracle" in {f.candidate for f in report.failures}, report.failures
    for failure in report.failures:
        assert failure.candidate is not None
        who = "padded run" if failure.candidate.startswith("dp") else failure.candidate
        assert f"{who}: the attention output of padding tokens" in failure.diagnosis, failure
        assert "layer 0: " in failure.diagnosis and "layer 1: " in failure.diagnosis


@CPU_ONLY
def test_a_dp_rank_that_writes_padding_rows_fails_padding_rows_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A data-parallel rank's padded pass is where FULL-mode padding is widest: its
    padding rows are counted like an autoregressive run's."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    report = verify("padding_rows_overrun", matrix=SHAPE_BAD, config={"dp_size": 2}, cells=False,
                    **CATCH).backend("padding_rows_overrun")
    assert report.status is Status.FAILED, report.detail
    assert {f.check for f in report.failures} == {"padding_rows"}, report.failures
    assert report.checks[Check.DP_MATCHES_SINGLE_RANK].failed == 0
    assert "padded run: the attention output of padding tokens" in report.failures[0].diagnosis


@CPU_ONLY
@pytest.mark.parametrize(("backend", "cell", "options", "check"), [
    ("blocks_attended_causally", "dcp_world_size=2, drafter=dflash",
     "--dcp-world-size 2 --no-cells --drafter dflash", Check.DCP_BLOCKS_VS_FP32_REFERENCE),
    ("window_only_when_causal", "dp_size=2, sliding_window=16",
     "--dp-size 2 --sliding-window 16 --no-cells", Check.DP_VS_FP32_REFERENCE),
    ("dcp_share_read_one_past", "dcp_world_size=2, drafter=dflash",
     "--dcp-world-size 2 --no-cells --drafter dflash", Check.DCP_BLOCKS_VS_FP32_REFERENCE),
])
def test_a_builder_wrong_only_on_non_causal_passes_is_caught_at_the_defaults(
    backend: str, cell: str, options: str, check: Check, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No autoregressive pass is non-causal: the first cell with the DFlash drafter (on DCP
    ranks) runs the bug, and its fp32 drafter over the oracle's attention sees it. A bug of
    non-causal passes under a window only is left to the second data-parallel cell (the
    first runs no window, the window cell no non-causal pass); one of a DCP rank's
    non-causal passes to the DCP-blocks cell alone (the DCP cell's steps are causal, the
    data-parallel cells run no DCP)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    report = verify(backend, matrix=SHAPE_BAD, **CATCH).backend(backend)
    assert report.status is Status.FAILED, report.cells
    assert {f.check for f in report.failures} == {check}, report.failures
    assert [c.name for c in report.cells if c.status is Status.FAILED] == [cell]
    (row,) = [c for c in report.cells if c.name == cell]
    assert "the DFlash drafter (blocks of 1 + K tokens, attended non-causally)" in row.detail
    assert row.reproduce is not None and f" {options} --examples " in row.reproduce
    again = CliRunner().invoke(app, [*shlex.split(row.reproduce)[1:], "--json", "-"])
    assert again.exit_code == 1, again.output
    (rerun,) = json.loads(again.stdout)["backends"]
    assert rerun["examples"] == row.examples and rerun["status"] == "failed"
    assert [f["diagnosis"] for f in rerun["failures"]] == [f.diagnosis for f in report.failures]


def test_the_k1_harness_poisons_its_builders_zero_tail_buffers() -> None:
    """K = 1 runs no decode step, so its zero-tail buffers are found from the warm-up's
    padded first pass: every K = 1 example starts with them poisoned, as every other K's
    does, and a shrunk K = 1 example reproduces in a fresh worker."""
    from speccheck.checks.selftest.mutants import DerivedBuilder, declaring_matrix
    from speccheck.checks.selftest.run import settings_at_defaults
    from speccheck.checks.verify.harness import HarnessSet
    from speccheck.contract.matrix_loader import load_matrix
    from speccheck.speculator.batch import DraftBatch

    device = torch.device("cpu")
    settings = settings_at_defaults("reference", DerivedBuilder, device,
                                    declaring_matrix(load_matrix(None), ("kv_lens_plus_one",)))
    harnesses = HarnessSet(settings, device)
    h = harnesses.harness(1)
    example = (1, DraftBatch((3,), ((5,),), ((1, 2),), (0,)))
    harnesses.start_state(h, example)
    assert h.tail_buffers, "no zero-tail buffer found for K = 1"
    (derived,) = h.tail_buffers
    assert not bool((derived == 0).any()), "the K = 1 harness left its buffer unpoisoned"


@CPU_ONLY
def test_an_entry_simulating_dcp_gets_a_dcp_cell_on_its_per_step_path() -> None:
    """triton_mla claims fused decoding at DCP 1 only, but runs at DCP 2 (every rank's
    share in one process): its DCP build and kernel branch are verified per-step there."""
    plan = plan_verification("triton_mla")
    (dcp,) = [cell for cell in plan.cells("triton_mla") if cell.axis is CellAxis.DCP]
    assert plan.for_cell(dcp, 5).config_for("triton_mla").dcp_world_size == 2
    assert CellAxis.DCP not in _axes(plan_verification("sparse_swa").cells("sparse_swa"))


@pytest.mark.parametrize("examples", [4, 10])
def test_the_dcp_ranks_draw_holds_every_claimed_batch_class(examples: int) -> None:
    """The examples drawn once for every DCP rank hold each claimed class too."""
    from speccheck.checks.verify.dcp_ranks import draw_examples
    from speccheck.checks.verify.engine import BackendVerifier

    settings = plan_verification("reference", examples=examples).settings_for("reference")
    limits = BackendVerifier(settings, torch.device("cpu")).limits
    drawn = draw_examples(settings)
    assert len(drawn) == examples
    classes = limits(settings.steps[0]).batch_classes
    assert len(classes) == 4
    for shape in classes:
        assert any(has_shape(shape, batch, limits(k)) for k, batch in drawn), shape
