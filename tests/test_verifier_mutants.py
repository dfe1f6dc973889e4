"""Every verifier check can fail: the shipped mutants (known-bad builders) must each be
caught by the check meant for it, with the expected diagnosis — on the CPU tier and, where
CUDA exists, with real graphs — at the settings a user gets by default (nothing pinned), and
``speccheck selftest`` must say so."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from speccheck.checks.cli.app import app
from speccheck.checks.selftest.mutants import (
    MUTANTS,
    DerivedBuilder,
    Mutant,
    StaleRefresh,
    naming_matrix,
)
from speccheck.checks.selftest.dflash_mutants import DFLASH_MUTANTS
from speccheck.checks.selftest.process_mutants import PROCESS_MUTANTS, ProcessMutant
from speccheck.checks.selftest.run import CONTROL_RESULT, Outcome, mutant_result, verify_builder
from speccheck.checks.selftest.swa_mutants import SWA_MUTANTS
from speccheck.checks.verify.examples import decode_example, encode_example, example_from_json
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.vocabulary import Status, Tier
from speccheck.contract.adapter_status import implementation_path
from speccheck.contract.matrix_loader import load_matrix
from tests.fixtures.selftest_catalogue import SelftestRun

@pytest.mark.skipif(torch.cuda.is_available(), reason="reads the CPU tier's self-test")
def test_the_correct_builder_passes_on_the_cpu_tier(selftest_catalogue: SelftestRun) -> None:
    """The self-test's control row: the correct builder at the defaults passes, every
    example compared step by step."""
    row = selftest_catalogue.row(CONTROL_RESULT)
    assert row["outcome"] == "caught" and not row["failures"], row
    assert row["checks"]["step_metadata"]["passed"] > 0, row["checks"]


@pytest.mark.cuda
def test_the_correct_builder_passes_with_real_graphs() -> None:
    """Shrinking is cut to 10 s, as for the mutants, and a failure is printed as soon as
    it is known: a false positive then shows within a GPU run's time limit, even in a run
    killed at that limit before pytest's summary."""
    report = verify_builder(DerivedBuilder, torch.device("cuda"), shrink_seconds=10.0)
    if report.failures:
        example = report.minimal_example
        blob = encode_example(example_from_json(example)) if example else None
        print(f"the correct builder failed on cuda: {report.failures}\n"
              f"minimal example (blob): {blob}", flush=True)
    assert report.status == "passed", report.failures
    assert report.checks["step_metadata"].passed > 0


@pytest.mark.cuda
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_check_catches_its_mutant_with_real_graphs(mutant: Mutant) -> None:
    """At the GPU tier's defaults (the CPU tier: the ten-seed test); shrinking is cut to 10 s,
    which bounds the run at serving scale without changing what the search finds."""
    check, phrase = mutant.expected(gpu=True)
    report = verify_builder(mutant.builder, torch.device("cuda"), shrink_seconds=10.0,
                            declares=mutant.declares, rebuilds=mutant.rebuilds)
    assert report.status == "failed"
    matching = [f for f in report.failures if f.check == check]
    assert matching, f"{check} did not fail; failures: {report.failures}"
    assert phrase in matching[0].diagnosis
    assert report.minimal_example is not None


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU tier's defaults")
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_is_caught_at_default_settings_for_ten_seeds(
    mutant: Mutant, selftest_catalogue: SelftestRun,
) -> None:
    """What ``speccheck verify`` does by default on the CPU tier (its runtime config, batch
    scale, K range and example count), for hypothesis seeds 0..9: every seed catches the
    mutant with the check meant for it. Seed 0 is the self-test's own run (its row in
    ``selftest_catalogue``); seeds 1..9 run here with only the shrink budget cut, which
    does not change what the search finds."""
    check, phrase = mutant.expected(gpu=False)
    row = selftest_catalogue.row(mutant.name)
    assert row["minimal_example"] is not None, row
    found = {0: [(f["check"], f["diagnosis"]) for f in row["failures"]]}
    for seed in range(1, 10):
        report = verify_builder(mutant.builder, torch.device("cpu"), seed=seed,
                                shrink_seconds=0.0, declares=mutant.declares,
                                rebuilds=mutant.rebuilds)
        assert report.status == "failed" and report.minimal_example is not None
        found[seed] = [(f.check, f.diagnosis) for f in report.failures]
    missed = {seed: failures for seed, failures in found.items()
              if not any(c == check and phrase in diagnosis for c, diagnosis in failures)}
    assert not missed, missed


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads the CPU tier's self-test")
def test_failures_shrink_to_a_small_reproducible_example(selftest_catalogue: SelftestRun) -> None:
    """The self-test's stale_refresh row, shrunk for the default budget: one request."""
    example = selftest_catalogue.caught("stale_refresh")["minimal_example"]
    assert len(example["context_lens"]) == 1
    blob = encode_example(example_from_json(example))
    assert decode_example(blob) == example_from_json(example)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU tier's table")
def test_selftest_command_reports_every_mutant_caught(selftest_catalogue: SelftestRun) -> None:
    """``speccheck selftest --json FILE`` at its defaults: the one run of the catalogue
    (``selftest_catalogue``) the other tests of known-bad builders read too."""
    assert selftest_catalogue.exit_code == 0, selftest_catalogue.output
    assert "MISSED" not in selftest_catalogue.output
    rows = list(selftest_catalogue.rows)
    assert [r["name"] for r in rows[1:]] == [
        *(m.name for m in MUTANTS), *(m.name for m in SWA_MUTANTS), "mla_stale_dcp_local_lens",
        "reference_stale_dcp_local_lens", "triton_attn_stale_dcp_local_lens",
        *(m.name for m in DFLASH_MUTANTS), *(m.name for m in PROCESS_MUTANTS)]
    cpu_rows = rows[: len(rows) - len(PROCESS_MUTANTS)]
    assert all(r["outcome"] == "caught" for r in cpu_rows), cpu_rows
    # The CUDA-only backends' mutants are listed, skipped, each with the reason.
    for row in rows[len(cpu_rows):]:
        assert row["outcome"] == "skipped" and "CUDA" in row["detail"], row
        assert f"skipped {row['name']}: " in selftest_catalogue.output


def test_selftest_only_runs_the_named_rows_in_table_order(tmp_path) -> None:
    """``--only`` runs the rows it names and no other (the control included only when
    named), in the table's order whatever the order of the options."""
    out = tmp_path / "selftest.json"
    last, first = PROCESS_MUTANTS[0].name, MUTANTS[0].name
    result = CliRunner().invoke(app, ["selftest", "--only", last, "--only", first,
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == [first, last]
    assert rows[0]["outcome"] == "caught" and rows[1]["outcome"] != "missed", rows


def test_a_process_mutant_runs_under_the_shipped_matrix_naming_it() -> None:
    """Each CUDA-only mutant's matrix is the shipped one with only its entry's
    implementation changed, to the mutant: what its author would ship."""
    shipped = load_matrix(None)
    for mutant in PROCESS_MUTANTS:
        matrix = naming_matrix(shipped, mutant.builder)
        entry = matrix.backend(mutant.backend)
        assert entry.implementation == implementation_path(mutant.builder)
        assert entry.model_copy(update={"implementation": None}) == \
            shipped.backend(mutant.backend).model_copy(update={"implementation": None})
        assert [matrix.backend(n) for n in matrix.names if n != mutant.backend] == \
            [shipped.backend(n) for n in shipped.names if n != mutant.backend]


def test_a_spent_shrink_budget_keeps_the_failure_found() -> None:
    report = verify_builder(StaleRefresh, torch.device("cpu"), shrink_seconds=0.0)
    assert report.status == "failed"
    assert any(f.check == "step_metadata" for f in report.failures)
    assert report.minimal_example is not None


def test_a_verifier_that_caught_a_mutant_is_freed_between_runs() -> None:
    """The self-test runs a verifier per mutant in one process. One that found a failure
    stays in reference cycles (hypothesis keeps the failing example's traceback, whose
    frames hold the verifier) until :func:`release_device_memory` collects them; on the
    GPU its caches and graph pools are gigabytes."""
    import gc
    import weakref

    from speccheck.checks.device_memory import release_device_memory
    from speccheck.checks.selftest.run import declaring_matrix, settings_at_defaults
    from speccheck.checks.verify.engine import BackendVerifier
    from speccheck.checks.verify.report import BackendReport
    from speccheck.contract.matrix_loader import load_matrix

    cpu, mutant = torch.device("cpu"), MUTANTS[0]
    matrix = declaring_matrix(load_matrix(None), mutant.declares, rebuilds=mutant.rebuilds)
    settings = settings_at_defaults("reference", mutant.builder, cpu, matrix,
                                    shrink_seconds=0.0, examples=5)
    gc.disable()
    try:
        verifier = BackendVerifier(settings, cpu)
        report = BackendReport("reference", "cpu", "passed")
        verifier.run(report, lambda i, e: None)
        assert report.status == "failed"
        held = weakref.ref(verifier)
        del verifier
        assert held() is not None  # the cycles: why the helper exists
        release_device_memory(cpu)
        assert held() is None
    finally:
        gc.enable()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_process_mutant_the_worker_cannot_run_is_skipped(monkeypatch) -> None:
    """Past the self-test's own platform check, verify's worker decides: on a machine
    that cannot build the backend it reports it skipped, and the self-test lists the
    mutant skipped with the worker's reason rather than missed or caught."""
    import speccheck.checks.selftest.run as selftest_run

    monkeypatch.setattr(selftest_run, "unrunnable_reason", lambda *args: None)
    result = selftest_run.verify_process_mutant(PROCESS_MUTANTS[0])
    assert result.outcome == "skipped", result
    assert "CUDA" in result.detail or "cuda" in result.detail, result.detail


@pytest.mark.parametrize("mutant", PROCESS_MUTANTS, ids=lambda m: m.name)
def test_a_crash_catches_a_process_mutant_only_where_allowed_and_never_by_running_out_of_memory(
    mutant: ProcessMutant,
) -> None:
    fault = "worker crashed: CUDA error: an illegal memory access was encountered"
    oom = ("worker crashed: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
           "1.00 GiB")
    assert mutant.caught_by_crash(fault) is mutant.crash_catches
    assert mutant.caught_by_crash(oom) is False


def test_a_row_whose_verification_crashed_is_an_error_not_a_miss() -> None:
    """A DCP row whose rank process died has no failures; it says nothing of the builder,
    so the row is an error naming the crash, not "missed: not caught" (as the H100 status
    run of 3d97ff5 reported reference_stale_dcp_local_lens)."""
    died = "DCP rank 1 of 2 failed: ProcessExited: exit code 1"
    crashed = BackendReport("reference", Tier.GPU, Status.CRASHED, detail=died)
    result = mutant_result("row", "step_metadata", "recreates", crashed, "dcp_local_seq_lens")
    assert (result.outcome, result.detail) == (Outcome.ERROR, f"the verification crashed: {died}")
    passed = BackendReport("reference", Tier.GPU, Status.PASSED)
    missed = mutant_result("row", "step_metadata", "recreates", passed, "dcp_local_seq_lens")
    assert (missed.outcome, missed.detail) == (Outcome.MISSED, "not caught")


def test_an_isolated_row_runs_in_a_process_of_its_own() -> None:
    """On CUDA a row whose verification runs in the calling process gets a process of its
    own (a failed capture's graph pool, an illegal memory access, must not outlive it): the
    result is the in-process one's, and a row the process cannot run is an error naming
    why, not a traceback."""
    import dataclasses

    from speccheck.checks.selftest.run import SelftestRow, selftest_rows

    rows = {row.name: row for row in selftest_rows(torch.device("cpu"), shrink_seconds=0.0)}
    row = rows[MUTANTS[0].name]
    assert not row.isolated  # on the CPU tier nothing outlives a row: no process needed
    here = row.result()
    # the rebuilt row runs in the child; this run, if called here, fails the test
    isolated = dataclasses.replace(row, isolated=True, run=lambda: pytest.fail("ran here"))
    there = isolated.result()
    assert here.outcome is Outcome.CAUGHT
    assert (there.name, there.outcome, there.expected_check, there.recreates) == \
        (here.name, here.outcome, here.expected_check, here.recreates)
    unknown = SelftestRow("no_such_row", "reference", lambda: pytest.fail("ran here"),
                          isolated=True).result()
    assert (unknown.outcome, unknown.detail) == \
        (Outcome.ERROR, "raised UnknownSelftestRow: no self-test row 'no_such_row' on cpu")
