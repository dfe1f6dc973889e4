"""``speccheck status``: records per tier that overwrite only their own tier, pages rendered
from the records alone, a real status run of a backend on the CPU tier, and the committed
``docs/status/`` in step with the pages generated from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from speccheck.checks.cli.app import app
from speccheck.checks.docgen.capabilities import render_capability_docs
from speccheck.checks.status.record import (
    BackendStatus,
    BenchRatio,
    MutationRecord,
    Provenance,
    StatusFileError,
    TierStatus,
    Verdict,
    read_statuses,
    write_mutation,
    write_tier_status,
)
from speccheck.checks.status.render import (
    BENCH_BEGIN,
    BENCH_END,
    MissingMarkers,
    last_verified,
    render_status_readme,
    selftest_cell,
    with_bench_table,
)
from speccheck.contract.matrix_loader import load_matrix

ROOT = Path(__file__).resolve().parents[1]


def _record(tier: str, verdict: Verdict = Verdict.PASSED, index: int | None = 10,
            bench: list[BenchRatio] | None = None) -> TierStatus:
    return TierStatus(
        tier=tier, verdict=verdict,
        provenance=Provenance(commit="abcdef1234567", commit_index=index, tree_dirty=False,
                              date="2026-12-05", device="NVIDIA H200" if tier == "gpu" else "CPU",
                              versions={"torch": "2.11.0"}),
        verify_command="speccheck verify --backend reference --examples 3", examples=3,
        examples_asked=3, fused_allowed=True, fused_reason="", candidates=["fused_eager"],
        runtime_config={}, checks=[], failures=[], selftest=[], bench=bench)


def test_a_tier_overwrites_only_its_own_record(tmp_path: Path) -> None:
    write_tier_status(tmp_path, "reference", _record("gpu"))
    write_tier_status(tmp_path, "reference", _record("cpu", Verdict.FAILED))
    write_tier_status(tmp_path, "reference", _record("cpu"))
    status = read_statuses(tmp_path)["reference"]
    assert set(status.tiers) == {"cpu", "gpu"}
    assert status.tiers["cpu"].verdict is Verdict.PASSED
    assert status.tiers["gpu"].provenance.device == "NVIDIA H200"


def test_a_file_that_is_no_status_is_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "fa3.json").write_text('{"backend": "fa3", "tiers": {"cpu": 1}}')
    with pytest.raises(StatusFileError, match=r"fa3\.json: not a status file: tiers\.cpu"):
        read_statuses(tmp_path)
    (tmp_path / "fa3.json").write_text(
        BackendStatus(backend="triton_attn", tiers={}).model_dump_json())
    with pytest.raises(StatusFileError, match="holds the status of 'triton_attn'"):
        read_statuses(tmp_path)


def test_lag_is_counted_from_the_records_alone() -> None:
    newest = BackendStatus(backend="a", tiers={"gpu": _record("gpu", index=12)})
    older = BackendStatus(backend="b", tiers={"cpu": _record("cpu", index=9)})
    text = render_status_readme({"a": newest, "b": older})
    assert "3 commits behind the newest status" in text
    assert "at the newest status" in text
    assert last_verified(None, 12) == "not verified"
    unknown = BackendStatus(backend="c", tiers={"cpu": _record("cpu", index=None)})
    assert "commit distance unknown" in last_verified(unknown, 12)
    skipped = BackendStatus(backend="d", tiers={"cpu": _record("cpu", Verdict.SKIPPED)})
    assert last_verified(skipped, 12) == "not verified (cpu: skipped)"


def test_the_bench_table_replaces_only_its_region() -> None:
    ratio = BenchRatio(path="fused", k=4, batch=64, wall=0.5, host=0.25, gpu=1.0,
                       per_step_wall_ms=2.0)
    statuses = {"fa3": BackendStatus(backend="fa3", tiers={"gpu": _record("gpu", bench=[ratio])})}
    page = f"# Method\n\n{BENCH_BEGIN}\nold\n{BENCH_END}\n\nafter\n"
    rendered = with_bench_table(page, statuses)
    assert rendered.startswith("# Method\n\n") and rendered.endswith("\n\nafter\n")
    assert "old" not in rendered
    assert "| `fa3` | fused | 4 | 64 | 2.000 | 0.50 | 0.25 | 1.00 |" in rendered
    assert with_bench_table(rendered, statuses) == rendered
    with pytest.raises(MissingMarkers):
        with_bench_table("# no markers\n", statuses)


def test_capability_docs_say_not_verified_without_a_status() -> None:
    matrix = load_matrix(None)
    statuses = {"reference": BackendStatus(backend="reference", tiers={"cpu": _record("cpu")})}
    text = render_capability_docs(matrix, statuses)
    row = next(line for line in text.splitlines() if line.startswith("| [`reference`]"))
    assert "cpu: passed at `abcdef1234`" in row
    rocm = next(line for line in text.splitlines() if line.startswith("| [`rocm_sparse_swa`]"))
    assert rocm.endswith("| not verified |")


def test_render_and_check(tmp_path: Path) -> None:
    write_tier_status(tmp_path, "reference", _record("cpu"))
    page = tmp_path / "bench.md"
    page.write_text(f"{BENCH_BEGIN}\n{BENCH_END}\n")
    runner = CliRunner()
    args = ["status", "--out", str(tmp_path), "--bench-page", str(page)]
    stale = runner.invoke(app, [*args, "--check"])
    assert stale.exit_code == 1 and "is stale" in stale.output
    assert runner.invoke(app, [*args, "--render"]).exit_code == 0
    assert runner.invoke(app, [*args, "--check"]).exit_code == 0
    assert "| `reference` | cpu | passed |" in (tmp_path / "README.md").read_text()


def test_bad_input_is_exit_2_before_any_run(tmp_path: Path) -> None:
    runner = CliRunner()
    unknown = runner.invoke(app, ["status", "--backend", "no_such", "--out", str(tmp_path)])
    assert unknown.exit_code == 2 and "not a shipped backend with an adapter" in unknown.output
    (tmp_path / "reference.json").write_text("{")
    corrupt = runner.invoke(app, ["status", "--backend", "reference", "--out", str(tmp_path)])
    assert corrupt.exit_code == 2 and "reference.json: not a status file" in corrupt.output
    (tmp_path / "reference.json").unlink()
    page = tmp_path / "bench.md"
    page.write_text("# no markers\n")
    unmarked = runner.invoke(app, ["status", "--backend", "reference", "--out", str(tmp_path),
                                   "--bench-page", str(page)])
    assert unmarked.exit_code == 2 and "bench.md: the page has no" in unmarked.output
    assert not (tmp_path / "reference.json").exists()
    bench_alone = runner.invoke(app, ["status", "--backend", "reference", "--bench-only",
                                      "--out", str(tmp_path), "--bench-page",
                                      str(tmp_path / "absent.md")])
    assert bench_alone.exit_code == 2 and "--bench-only: " in bench_alone.output
    rows_alone = runner.invoke(app, ["status", "--backend", "reference", "--selftest-only",
                                     "--out", str(tmp_path), "--bench-page",
                                     str(tmp_path / "absent.md")])
    assert rows_alone.exit_code == 2 and "--selftest-only: " in rows_alone.output
    assert "run `speccheck status --backend reference --no-selftest` first" in rows_alone.output
    both = runner.invoke(app, ["status", "--backend", "reference", "--selftest-only",
                               "--bench-only", "--out", str(tmp_path)])
    assert both.exit_code == 2 and "--bench-only and --selftest-only" in both.output


def test_selftest_only_completes_the_record_of_this_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--selftest-only`` runs the backend's rows alone and puts them into the record a
    ``--no-selftest`` run wrote at this commit, leaving the rest of it as it was."""
    from speccheck.checks.selftest.run import Outcome, SelftestResult, SelftestRow
    from speccheck.checks.status import collect

    monkeypatch.setenv("SPECCHECK_COMMIT", "abcdef1234567")
    tier = "gpu" if torch.cuda.is_available() else "cpu"
    write_tier_status(tmp_path, "reference", _record(tier))
    result = SelftestResult("stale_row", "step_metadata", Outcome.CAUGHT, "caught it", "a bug")
    monkeypatch.setattr(collect, "selftest_rows", lambda device: [
        SelftestRow("stale_row", "reference", lambda: result),
        SelftestRow("other_row", "triton_attn", lambda: pytest.fail("another backend's row"))])
    done = CliRunner().invoke(app, ["status", "--backend", "reference", "--selftest-only",
                                    "--out", str(tmp_path), "--bench-page",
                                    str(tmp_path / "absent.md")])
    assert done.exit_code == 0, done.output
    record = read_statuses(tmp_path)["reference"].tiers[tier]
    assert [(r.name, r.outcome, r.detail) for r in record.selftest] == [
        ("stale_row", "caught", "caught it")]
    assert record.verify_command == _record(tier).verify_command


def test_a_status_run_records_what_verify_found(tmp_path: Path) -> None:
    """A real run of the command (workers and all) on the CPU tier: the record names the
    verdict, the examples, every check and the machine."""
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("speccheck")), "status", "--backend", "reference",
         "--examples", "2", "--no-selftest", "--out", str(tmp_path),
         "--bench-page", str(tmp_path / "absent.md")],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = read_statuses(tmp_path)["reference"].tiers["cpu"]
    assert record.verdict is Verdict.PASSED and record.examples == 2
    assert record.verify_seconds is not None and record.verify_seconds > 0
    assert record.selftest is None and selftest_cell(record) == "not run"  # rows left out
    assert selftest_cell(record.model_copy(update={"selftest": []})) == "none"
    # two examples reach the first two configuration cells; the rest are listed as not run
    assert [(c.name, c.verdict) for c in record.cells[:2]] == [
        ("base", "passed"), ("dcp_world_size=2", "passed")]
    assert all(c.verdict.startswith("not run: ") for c in record.cells[2:]) and record.cells[2:]
    assert {check.check for check in record.checks} >= {"draft_tokens", "step_metadata"}
    assert record.provenance.versions["torch"]
    assert json.loads(proc.stdout.splitlines()[-1])["backend"] == "reference"


def test_the_committed_status_is_rendered_in_step() -> None:
    """``docs/status/README.md`` and the benchmarks page's table are what the committed
    records render to (``speccheck status --check``), and every shipped backend with an
    adapter has a record."""
    result = CliRunner().invoke(app, ["status", "--check", "--out", str(ROOT / "docs/status"),
                                      "--bench-page", str(ROOT / "docs/benchmarks/README.md")])
    assert result.exit_code == 0, result.output
    from speccheck.contract.adapter_status import AdapterStatus, adapter_status

    shipped = {entry.name for entry in load_matrix(None).backends
               if adapter_status(entry) is AdapterStatus.FOUND}
    assert shipped <= set(read_statuses(ROOT / "docs/status"))


MUTATE_REPORT = {
    "generated": 445, "score": 0.75, "seconds": 1436.7,
    "counts": {"killed": 3, "killed_by_crash": 9, "survived": 4, "invalid": 0, "not_run": 0},
    "kills_by_kind": {"named_field_check": 0, "other_check": 3, "vs_fp32_reference_only": 0,
                      "crash": 9},
    "mutants": [{"file": "backends/dcp.py", "line": 224, "operator": "statement_deleted",
                 "outcome": "survived", "survivor": "uncaught",
                 "diff": {"-": "    dcp.check_group()\n", "+": "    pass\n"}},
                {"file": "backends/dcp.py", "line": 171, "operator": "statement_deleted",
                 "outcome": "killed_by_crash", "survivor": None,
                 "diff": {"-": "x\n", "+": "pass\n"}}],
}
"""The fields of a ``speccheck mutate --json`` report a mutation record reads."""


def test_a_mutation_score_joins_its_tier_record_and_survives_a_rewrite(tmp_path: Path) -> None:
    mutation = MutationRecord.from_report(MUTATE_REPORT, command="speccheck mutate",
                                          commit="abc", date="2026-12-05")
    assert (mutation.valid, mutation.killed, mutation.score) == (16, 12, 0.75)
    assert mutation.survivors == [
        "backends/dcp.py:224 statement_deleted (uncaught): - dcp.check_group() / + pass"]
    with pytest.raises(StatusFileError, match="no cpu record of 'reference'; run `speccheck status"):
        write_mutation(tmp_path, "reference", "cpu", mutation)
    write_tier_status(tmp_path, "reference", _record("cpu"))
    write_mutation(tmp_path, "reference", "cpu", mutation)
    write_tier_status(tmp_path, "reference", _record("cpu", Verdict.FAILED))
    status = read_statuses(tmp_path)["reference"]
    assert status.tiers["cpu"].verdict is Verdict.FAILED
    assert status.tiers["cpu"].mutation == mutation
    page = render_status_readme(read_statuses(tmp_path))
    assert "| `reference` | cpu | 75% | 12 / 16 (445) | other_check 3, crash 9 |" in page
    argued = MutationRecord.from_report({**MUTATE_REPORT, "score": 0.8, "argued_equivalent": 1},
                                        command="speccheck mutate", commit="abc",
                                        date="2026-12-05")
    write_mutation(tmp_path, "reference", "cpu", argued)
    page = render_status_readme(read_statuses(tmp_path))
    assert ("| `reference` | cpu | 80% | 12 / 15, 1 argued equivalent (445) | other_check 3, "
            "crash 9 |") in page
    kinds = {"named_field_check": 2, "other_check": 1, "crash": 0}
    by_role = MutationRecord.from_report(
        {**MUTATE_REPORT, "kills_by_role": {"builder": kinds, "refresh": kinds,
                                            "attention": {"crash": 9}}},
        command="speccheck mutate", commit="abc", date="2026-12-05")
    write_mutation(tmp_path, "reference", "cpu", by_role)
    page = render_status_readme(read_statuses(tmp_path))
    assert "crash 9; named field 4 of 6 builder/refresh kills |" in page
    by_phase = MutationRecord.from_report(
        {**MUTATE_REPORT, "kills_by_role": {"builder": kinds},
         "kills_by_phase": {"metadata": {"named_field_check": 3, "crash": 1},
                            "attention": {"crash": 8}}},
        command="speccheck mutate", commit="abc", date="2026-12-05")
    write_mutation(tmp_path, "reference", "cpu", by_phase)
    page = render_status_readme(read_statuses(tmp_path))
    assert "crash 9; named field 3 of 4 metadata-code kills |" in page  # phases, not modules
    parts = [{"commit": "def4567890ab", "ran": ran, "seconds": 1.0, "shard": shard,
              "rejudged": rejudged} for ran, shard, rejudged in ((5, "1/2", 1), (4, "2/2", 0))]
    resumed = MutationRecord.from_report(
        {**MUTATE_REPORT, "resumed": [{**parts[0], "commit": "0123456789ab"}, *parts]},
        command="speccheck mutate", commit="abc", date="2026-12-05")
    write_mutation(tmp_path, "reference", "cpu", resumed)
    page = render_status_readme(read_statuses(tmp_path))
    assert ("| `abc`, 5 resumed at `0123456789` (1 survivor judged again), 9 resumed at "
            "`def4567890` (1 survivor judged again) |") in page  # one entry per commit


def test_a_row_that_raises_is_an_error_row_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row whose verification raises (a device out of memory: the GPU run of 66d2bd0,
    several backends side by side on an H100) is recorded as an error, the run goes on to
    the next row, and the command exits 1."""
    from speccheck.checks.selftest.run import Outcome, SelftestResult, SelftestRow
    from speccheck.checks.status import collect

    def exhausted() -> SelftestResult:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB.\nmore")

    monkeypatch.setenv("SPECCHECK_COMMIT", "abcdef1234567")
    tier = "gpu" if torch.cuda.is_available() else "cpu"
    write_tier_status(tmp_path, "reference", _record(tier))
    caught = SelftestResult("next_row", "step_metadata", Outcome.CAUGHT, "caught it", "a bug")
    monkeypatch.setattr(collect, "selftest_rows", lambda device: [
        SelftestRow("control", "reference", exhausted),
        SelftestRow("next_row", "reference", lambda: caught)])
    done = CliRunner().invoke(app, ["status", "--backend", "reference", "--selftest-only",
                                    "--out", str(tmp_path), "--bench-page",
                                    str(tmp_path / "absent.md")])
    assert done.exit_code == 1 and "Traceback" not in done.output, done.output
    record = read_statuses(tmp_path)["reference"].tiers[tier]
    assert [(r.name, r.outcome, r.detail) for r in record.selftest] == [
        ("control", "error", "raised OutOfMemoryError: CUDA out of memory. Tried to allocate "
         "64.00 MiB."),
        ("next_row", "caught", "caught it")]
    assert record.selftest_caught == (1, 2)


def test_a_failed_record_is_listed_with_its_reproduce_command(tmp_path: Path) -> None:
    """A failure in a committed record can be run again without the run's console: the
    record keeps the first failure's reproduce command (and each failed cell's), and the
    page lists it beside the diagnosis."""
    from speccheck.checks.status.record import CellRecord, FailureRecord

    command = "speccheck verify --backend reference --seed 0 --reproduce eAE="
    record = _record("gpu", Verdict.FAILED).model_copy(update={
        "failures": [FailureRecord(check="padding_rows", diagnosis="oracle: written")],
        "reproduce": command,
        "cells": [CellRecord(name="base", verdict="failed", examples=3, reproduce=command)]})
    write_tier_status(tmp_path, "reference", record)
    again = read_statuses(tmp_path)["reference"].tiers["gpu"]
    assert again.reproduce == command and again.cells[0].reproduce == command
    page = render_status_readme({"reference": BackendStatus(backend="reference",
                                                            tiers={"gpu": again})})
    listed = page.split("## Not passed\n\n")[1].splitlines()[0]
    assert listed == ("- `reference` (gpu): failed: padding_rows: oracle: written; "
                      f"reproduce: `{command}`")


def test_a_selftest_row_not_caught_is_listed_with_its_cause() -> None:
    """The table counts an error row apart from a miss, and the page lists every row that
    was not caught (nor skipped) with the first line of its detail."""
    from speccheck.checks.status.record import SelftestRecord

    record = _record("gpu").model_copy(update={"selftest": [
        SelftestRecord(name="control", expected_check="-", outcome="caught", detail="passed"),
        SelftestRecord(name="dcp_row", expected_check="step_metadata", outcome="error",
                       detail="the verification crashed: DCP DP rank 1 of 2 failed: "
                              "OutOfMemoryError\n--- traceback ---"),
        SelftestRecord(name="fa3_row", expected_check="step_metadata", outcome="skipped",
                       detail="needs CUDA"),
        SelftestRecord(name="missed_row", expected_check="kv_cache", outcome="missed",
                       detail="not caught")]})
    page = render_status_readme({"reference": BackendStatus(backend="reference",
                                                            tiers={"gpu": record})})
    assert "| 1/3 (1 error, 1 skipped) |" in page
    listed = page.split("## Self-test rows not caught\n\n")[1].splitlines()
    assert listed == [
        "- `reference` (gpu): `dcp_row` error: the verification crashed: DCP DP rank 1 of 2 "
        "failed: OutOfMemoryError",
        "- `reference` (gpu): `missed_row` missed: not caught"]
