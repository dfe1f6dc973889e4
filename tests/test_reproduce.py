"""Failures reproduce on their own: every example starts from poisoned tails, a printed
reproduce command is re-run in a fresh worker (and says so), an example outside the
harness's limits is bad input, and a disagreement with the fp32 reference is localised."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from rich.progress import Progress
from typer.testing import CliRunner

from speccheck.checks.cli.app import app
from speccheck.checks.selftest.mutants import (
    MUTANTS,
    DerivedBuilder,
    Mutant,
    declaring_matrix,
    mutants_matrix,
)
from speccheck.checks.selftest.run import settings_at_defaults
from speccheck.checks.selftest.swa_mutants import SWA_MUTANTS
from speccheck.checks.verify import runner
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.examples import (
    BadExample,
    Example,
    encode_example,
    example_from_json,
    reproduce_blob,
)
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.run import VerifyRun, WorkerTask
from speccheck.checks.verify.vocabulary import Check, Result, Status, Tier
from speccheck.contract.adapter_status import implementation_path
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import Matrix
from speccheck.speculator.batch import DraftBatch
from tests.fixtures.adapters.known_bad import LeftoverTail
from tests.fixtures.configs import CPU_CONFIG
from tests.fixtures.selftest_catalogue import SelftestRun

ROOT = Path(__file__).resolve().parents[1]
KNOWN_BAD = ROOT / "tests" / "fixtures" / "adapters" / "known_bad.yaml"
CPU = torch.device("cpu")
SMALL = ("--num-speculative-steps", "4", "--max-model-len", "32", "--head-size", "16",
         "--num-heads", "2", "--num-kv-heads", "1", "--capture-sizes", "2,4")
"""The self-test's configuration (``CPU_CONFIG``, K = 4, capture sizes 2 and 4) as options."""


def _speccheck(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


Builder = type[AttentionMetadataBuilder]  # type: ignore[type-arg]


def _settings(builder: Builder, declares: tuple[str, ...], **changes: object) -> VerifySettings:
    """Small settings (12 examples, K = 4, capture sizes 2 and 4, ``CPU_CONFIG``) for the
    reference backend with ``builder`` swapped in, under a matrix declaring ``declares``."""
    shipped = load_matrix(None)
    matrices = MatrixContext(declaring_matrix(shipped, declares), None, shipped)
    settings = VerifySettings("reference", CPU_CONFIG, examples=12, steps=(4,),
                              capture_sizes=(2, 4), vocab_size=64,
                              builder_overrides=(("reference", builder),), matrices=matrices)
    return dataclasses.replace(settings, **changes)


def _failed_checks(verifier: BackendVerifier, example: Example) -> set[Check]:
    return {o.check for o in verifier.run_example(example) if o.result is Result.FAILED}


# --- 1. poisoned tails: a stale tail fails on its own ---------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="re-runs the CPU tier's self-test")
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_a_failure_fails_the_same_way_from_a_fresh_verifier(
    mutant: Mutant, selftest_catalogue: SelftestRun,
) -> None:
    """What ``--reproduce`` does, in process: the failing example the self-test's search
    found for the mutant at the defaults (its row in ``selftest_catalogue``, shrunk) fails
    the same checks in a verifier, at the same settings, that never ran another."""
    row = selftest_catalogue.caught(mutant.name)
    matrix = declaring_matrix(load_matrix(None), mutant.declares, rebuilds=mutant.rebuilds)
    settings = settings_at_defaults("reference", mutant.builder, CPU, matrix)
    example = example_from_json(row["minimal_example"])
    again = _failed_checks(BackendVerifier(settings, CPU), example)
    assert again == {Check.parse(f["check"]) for f in row["failures"]}


def test_a_leftover_tail_fails_the_same_way_from_a_fresh_verifier() -> None:
    """The same for the builder of ``tests/fixtures/adapters/known_bad.py`` that never zeroes
    its tail (no self-test row): the failing example its own search found (shrunk for at
    most a second) fails the same checks in a fresh verifier."""
    settings = _settings(LeftoverTail, ("kv_lens_plus_one",), shrink_seconds=1.0)
    report = BackendReport("reference", Tier.CPU, Status.PASSED)
    BackendVerifier(settings, CPU).run(report, lambda i, e: None)
    assert report.status is Status.FAILED and report.minimal_example is not None
    example = example_from_json(report.minimal_example)
    again = _failed_checks(BackendVerifier(settings, CPU), example)
    assert again == {f.check for f in report.failures}


def test_a_leftover_tail_fails_on_the_first_example_a_correct_builder_passes() -> None:
    """The measured bug: a builder that never zeroes its tail passed a single example in a
    fresh worker (the buffer was still all zero). With the tails poisoned before every
    example it fails there too, while the correct builder, which zeroes its tail, passes."""
    example = (4, DraftBatch((3,), ((5,),), ((7, 8),), (0,)))
    assert Check.ZERO_TAILS in _failed_checks(
        BackendVerifier(_settings(LeftoverTail, ("kv_lens_plus_one",)), CPU), example)
    correct = BackendVerifier(_settings(DerivedBuilder, ("kv_lens_plus_one",)), CPU)
    outcomes = correct.run_example(example)
    assert not [o for o in outcomes if o.result is Result.FAILED]
    assert any(o.check is Check.ZERO_TAILS and o.result is Result.PASSED for o in outcomes)


# --- 2. the printed reproduce command is checked, and reproduces ------------------------

def test_the_printed_reproduce_command_is_checked_in_a_fresh_worker_and_reproduces(
    tmp_path: Path,
) -> None:
    """The measured bug: a failure that depended on an earlier, larger batch's leftovers
    passed when its printed command ran in a fresh worker. One worker at the runtime config
    (``--no-cells``): configuration cells would spread the 6 examples over the entry's
    cells, each worker's progress counting its share, and check each cell's command."""
    out = tmp_path / "r.json"
    proc = _speccheck("verify", "--backend", "leftover_tail", "--matrix", str(KNOWN_BAD),
                      "--examples", "6", "--fail-fast", "--no-cells", *SMALL,
                      "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (report,) = json.loads(out.read_text())["backends"]
    assert report["status"] == "failed" and report["reproduced"] is True
    assert "zero_tails" in {f["check"] for f in report["failures"]}
    assert (f"reproduce (checked: fails the same way in a fresh worker): {report['reproduce']}"
            in proc.stdout.splitlines())
    # without a terminal, progress lines end at what ran, never at N/N
    assert "progress: leftover_tail (failed): 1/6 examples in " in proc.stdout
    assert "progress: leftover_tail reproduce check (failed): 1/1 examples in " in proc.stdout
    command = shlex.split(report["reproduce"])
    assert command[:2] == ["speccheck", "verify"] and "--capture-sizes" in command
    again_out = tmp_path / "again.json"
    again = _speccheck(*command[1:], "--json", str(again_out))
    assert again.returncode == 1, again.stdout + again.stderr
    (backend,) = json.loads(again_out.read_text())["backends"]
    assert backend["examples"] == 1 and backend["reproduced"] is True
    assert {f["check"] for f in backend["failures"]} == {f["check"] for f in report["failures"]}


def test_a_reproduce_run_that_passes_is_reported_as_not_reproduced() -> None:
    """confirm_reproduce compares what the fresh worker did with the failure: here the
    "failure" names an example on which the correct reference backend passes."""
    blob = encode_example((3, DraftBatch((5,), ((1, 2),), ((1, 2, 3),), (7,))))
    small = {"block_size": 4, "max_model_len": 32, "head_size": 16, "num_heads": 2,
             "num_kv_heads": 1}
    task = WorkerTask(run=VerifyRun(config=small, steps=(3,), example_timeout=60.0),
                      backend="reference", examples=4, seed=0)
    report = BackendReport("reference", Tier.CPU, Status.FAILED,
                           reproduce=f"speccheck verify --backend reference --reproduce {blob}")
    with Progress(console=Console(file=io.StringIO())) as progress:
        why = runner.confirm_reproduce(task, report, progress, Tier.CPU)
    assert report.reproduced is False
    assert why == "it passed there"
    assert reproduce_blob(report.reproduce or "") == blob


# --- 3. examples outside the harness's limits are bad input -----------------------------

def _problem(example: Example, **changes: object) -> str | None:
    return BackendVerifier(_settings(DerivedBuilder, (), **changes), CPU).example_problem(example)


def test_examples_outside_the_limits_name_the_limit_and_the_option() -> None:
    long_prefill = (2, DraftBatch((0,), (tuple(range(20)),), ((1, 2, 3, 4, 5, 6),), (0,)))
    problem = _problem(long_prefill)
    assert problem == ("--reproduce: the example has 20 prefill tokens, more than the 12 this "
                       "run's drafter holds (3 per request of its largest capture size); raise "
                       "it with --max-new-tokens or --capture-sizes")
    assert _problem(long_prefill, capture_sizes=(2, 8)) is None
    assert _problem(long_prefill, max_new_tokens=5) is None
    many = (2, DraftBatch((0,) * 5, ((1,),) * 5, tuple((b,) for b in range(1, 6)), (0,) * 5))
    assert "has 5 requests, more than the 4" in (_problem(many) or "")
    too_long = (2, DraftBatch((31,), ((1, 2),), (tuple(range(1, 9)),), (0,)))
    assert _problem(too_long) == (
        "--reproduce: request 0 reaches length 33 (context 31 + 2 new tokens), more than "
        "--max-model-len 32; raise it with --max-model-len")
    wide = (2, DraftBatch((0,), ((1,),), (tuple(range(1, 10)),), (0,)))
    assert "9 blocks, more than the 8 a request holds" in (_problem(wide) or "")
    far_block = (2, DraftBatch((0,), ((1,),), ((999,),), (0,)))
    assert "block id 999 (request 0) is past the 32 live blocks" in (_problem(far_block) or "")
    big_token = (2, DraftBatch((0,), ((64,),), ((1,),), (0,)))
    assert "token id 64 (request 0) is outside the drafter's vocabulary of 64" in (
        _problem(big_token) or "")
    short_row = (4, DraftBatch((3,), ((1,),), ((1,),), (0,)))
    assert (_problem(short_row) or "").startswith(
        "--reproduce: the example does not fit --block-size 4 --max-model-len 32 with K = 4: "
        "request 0: block_table row has 1 blocks, needs 2..8")


def test_a_reproduce_example_outside_the_limits_is_exit_2_before_any_worker() -> None:
    """The issue's shape: one request with a 64-token prefill."""
    blob = encode_example((4, DraftBatch((0,), (tuple(range(64)),), (tuple(range(1, 18)),), (0,))))
    proc = _speccheck("verify", "--backend", "reference", "--reproduce", blob)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line == ("--reproduce: the example has 64 prefill tokens, more than the 24 this run's "
                    "drafter holds (3 per request of its largest capture size); raise it with "
                    "--max-new-tokens or --capture-sizes")


def test_a_reproduce_file_is_read_and_checked_like_an_inline_blob(tmp_path: Path) -> None:
    """``--reproduce @FILE``: the form a report prints for a blob too long for one
    command-line argument."""
    blob = encode_example((4, DraftBatch((0,), (tuple(range(64)),), (tuple(range(1, 18)),), (0,))))
    path = tmp_path / "example.blob"
    path.write_text(blob + "\n")
    proc = _speccheck("verify", "--backend", "reference", "--reproduce", f"@{path}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("--reproduce: the example has 64 prefill tokens")


def test_the_worker_rejects_an_example_outside_the_limits_as_bad_input() -> None:
    """The safety net behind the command line's check: the worker's own."""
    blob = encode_example((4, DraftBatch((60,), ((1, 2, 3, 4, 5),), (tuple(range(1, 17)),), (0,))))
    run = VerifyRun(config={"max_model_len": 64}, steps=(4,), example_timeout=60.0)
    task = WorkerTask(run=run, backend="reference", examples=4, seed=0, reproduce=blob)
    with Progress(console=Console(file=io.StringIO())) as progress:
        with pytest.raises(BadExample, match="reaches length 65 .* raise it with --max-model-len"):
            runner.run_worker(task, progress, Tier.CPU)
        assert progress.tasks[0].completed == 0
        assert progress.tasks[0].description == "reference (bad input)"


@pytest.mark.parametrize(("args", "message"), [
    (["--capture-sizes", "1,x"], "--capture-sizes: expected comma-separated request counts"),
    (["--capture-sizes", "0,2"], "capture_sizes: request counts must lie in 1..1024"),
    (["--capture-sizes", "2," + "9" * 5000], "capture_sizes: request counts must lie in 1..1024"),
    (["--reproduce", "@/nonexistent/x.blob"],
     "--reproduce: cannot read /nonexistent/x.blob: No such file or directory"),
    (["--dp-size", "2", "--reproduce", "eJwDAAAAAAE="],
     "--reproduce runs one example in one worker; it cannot be combined with --dp-size"),
])
def test_bad_verify_options_are_one_line_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["verify", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(message) and len(result.stderr.strip().splitlines()) == 1


# --- 4. a disagreement with the fp32 reference is localised -----------------------------

def _reference_failure(backend: str, example: Example) -> str:
    settings = VerifySettings(backend, CPU_CONFIG, steps=(4,), vocab_size=64,
                              matrices=MatrixContext.load(KNOWN_BAD))
    verifier = BackendVerifier(settings, CPU)
    report = BackendReport(backend, Tier.CPU, Status.PASSED)
    verifier.record_failure(report, example, verifier.run_example(example))
    (failure,) = [f for f in report.failures if f.check is Check.VS_FP32_REFERENCE]
    return failure.diagnosis


def test_a_padding_lane_overwriting_a_slot_the_batch_reads_is_named() -> None:
    """Three requests pad to four lanes; lane 3 writes request 0's previous position, a
    slot the batch itself wrote: no stray slot, graph and eager agree."""
    example = (4, DraftBatch((0, 5, 2), ((3,), (1, 2), (4,)), ((17,), (37, 38, 39), (28, 29)),
                             (0, 1, 2)))
    diagnosis = _reference_failure("padding_overwrites", example)
    assert ("localised: request 0 first leaves the fp32 reference at draft step 1; 2 slot(s) it "
            "reads hold keys or values unlike the reference's, first layer 0 keys at slot 68 "
            "(block 17, request 0 position 0, which request 0 writes itself in its prefill "
            "pass): overwritten at draft step 1 by lane 3 (a padding lane), which the slot "
            "mapping sends to slot 0 (the sink block), where nothing was written: the write "
            "ignores the slot mapping") in diagnosis


def test_a_wrong_attention_output_with_right_kv_writes_is_localised_to_the_output() -> None:
    example = (4, DraftBatch((2,), ((5, 6),), ((9, 10),), (0,)))
    diagnosis = _reference_failure("scaled_output", example)
    assert ("localised: request 0 first leaves the fp32 reference at draft step 0; no KV-cache "
            "slot it reads was written by another lane, and its own layer-0 keys and values "
            "match: only the attention output differs (layer 0 at draft step 0") in diagnosis


CLI_REPRODUCED = ("stale_refresh", "syncing_refresh", "padding_writes_live", "dirty_tail")
"""The reference mutants whose failures the command-line test re-runs: one per kind of state
a failure can hang on (a refresh, a host sync, the KV cache, a buffer's tail). Every
reference mutant's failure is re-run in a fresh verifier in process
(:func:`test_a_failure_fails_the_same_way_from_a_fresh_verifier`); the sparse_swa ones, which
that test does not cover, all run here."""


@pytest.mark.skipif(torch.cuda.is_available(), reason="re-runs the CPU tier's self-test")
def test_selftest_failures_reproduce_alone_in_a_fresh_worker(
    tmp_path: Path, selftest_catalogue: SelftestRun,
) -> None:
    """Known-bad builders of the self-test, run as a user's adapters (a matrix of one entry
    per mutant; sparse_swa's under copies of its shipped entry): the failing example the
    self-test found for each at the CPU tier's defaults (its row in ``selftest_catalogue``),
    given to ``speccheck verify --reproduce`` at the same defaults (the command run in this
    process), runs alone in a fresh worker and fails the same checks, and the report says it
    reproduced. (triton_mla's, which needs DCP 2: see tests/test_triton_mla_verify.py.)"""
    matrix = tmp_path / "mutants.yaml"
    shipped = load_matrix(None)
    swa = shipped.backend("sparse_swa")
    known_bad = tuple(b for b in mutants_matrix(shipped).backends
                      if b.name in CLI_REPRODUCED) + tuple(
        swa.model_copy(update={"name": m.name, "variant_of": None,
                               "implementation": implementation_path(m.builder)})
        for m in SWA_MUTANTS)
    data = Matrix(version=1, backends=known_bad).model_dump(mode="json", exclude_defaults=True)
    matrix.write_text(yaml.safe_dump({"version": 1, **data}, sort_keys=False))
    mutants = [m for m in MUTANTS if m.name in CLI_REPRODUCED] + list(SWA_MUTANTS)
    assert len(mutants) == len(CLI_REPRODUCED) + len(SWA_MUTANTS) == len(known_bad)
    for mutant in mutants:
        row = selftest_catalogue.caught(mutant.name)
        assert mutant.check.value in {f["check"] for f in row["failures"]}, row
        blob = encode_example(example_from_json(row["minimal_example"]))
        out = tmp_path / f"{mutant.name}.json"
        # The command in this process (its worker is a fresh process either way).
        result = CliRunner().invoke(app, ["verify", "--backend", mutant.name, "--matrix",
                                          str(matrix), "--reproduce", blob, "--json", str(out)])
        assert result.exit_code == 1, (mutant.name, result.output)
        (report,) = json.loads(out.read_text())["backends"]
        assert report["examples"] == 1 and report["reproduced"] is True, (mutant.name, report)
        assert {f["check"] for f in report["failures"]} == {
            f["check"] for f in row["failures"]}, (mutant.name, report["failures"], row)
