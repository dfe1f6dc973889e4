"""``speccheck verify`` end to end, through its real worker processes."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.progress import Progress

from speccheck.checks.verify.run import VerifyRun, WorkerTask
from speccheck.checks.verify.runner import PlainProgress, run_worker
from speccheck.checks.verify.vocabulary import Tier
from speccheck.checks.verify.worker_process import WorkerProcess

ROOT = Path(__file__).resolve().parents[1]
FAULTY_MATRIX = ROOT / "tests" / "fixtures" / "adapters" / "matrix.yaml"


def _verify(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", "verify", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU tier's report")
def test_reference_passes_and_reports_every_check(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    junit = tmp_path / "junit.xml"
    proc = _verify("--backend", "reference", "--examples", "8", "--no-cells", "--json", str(out),
                   "--junit", str(junit))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith("tier: CPU (no CUDA device)")
    assert "progress: reference: started, 8 example(s)" in proc.stdout
    assert "progress: reference (passed): 8/8 examples in " in proc.stdout
    report = json.loads(out.read_text())
    assert report["tier"] == "cpu"
    (backend,) = report["backends"]
    assert backend["status"] == "passed" and backend["examples"] == 8
    assert set(backend["checks"]) >= {"draft_tokens", "logits", "kv_cache", "step_metadata",
                                      "declared_fields", "host_sync", "in_place"}
    assert backend["checks"]["draft_tokens"]["passed"] > 0
    assert "<testsuites" in junit.read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only skips")
def test_gpu_only_backend_is_skipped_and_nothing_verified_exits_3() -> None:
    proc = _verify("--backend", "fa3", "--examples", "2")
    assert proc.returncode == 3, proc.stdout
    assert "fa3: skipped" in proc.stdout
    assert "progress: fa3 (skipped): 0/2 examples in " in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a backend the CPU tier skips")
def test_the_progress_bar_of_a_skipped_backend_ends_where_it_stopped() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    task = WorkerTask(run=VerifyRun(backend="fa3", steps=(2,), example_timeout=60.0),
                      backend="fa3", examples=5, seed=0)
    with Progress(console=console) as progress:
        report = run_worker(task, progress, Tier.CPU)
    (task,) = progress.tasks
    assert report.status == "skipped"
    assert (task.completed, task.total, task.description) == (0, 5, "fa3 (skipped)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a backend the CPU tier skips")
def test_a_worker_started_before_its_request_takes_it_and_the_next_and_is_gone_after() -> None:
    """The command line starts the first worker before it plans; the run hands it a task
    (a line on its input), and another once the first is done (a backend's next cell); when
    it is closed it ends on its own and its process and files are gone."""
    task = WorkerTask(run=VerifyRun(backend="fa3", steps=(2,), example_timeout=60.0),
                      backend="fa3", examples=3, seed=0)
    with WorkerProcess() as early, Progress(console=Console(file=io.StringIO())) as progress:
        first = run_worker(task, progress, Tier.CPU, worker=early)
        assert early.idle and early.tasks == 1
        second = run_worker(task.model_copy(update={"backend": "flashinfer"}), progress,
                            Tier.CPU, worker=early)
        assert early.idle and early.tasks == 2
    assert (first.status, first.backend) == ("skipped", "fa3")
    assert (second.status, second.backend) == ("skipped", "flashinfer")
    assert early.exit_code == 0
    assert not early.folder.exists()


def test_a_worker_never_sent_a_request_is_killed_or_ends_on_its_closed_input() -> None:
    """Planning failed (bad input) or no plain worker ran: closing the early worker ends it
    whatever it was doing, and a worker whose input closes empty exits 0 on its own."""
    waiting = WorkerProcess()
    waiting.close()
    assert waiting.exit_code is not None and not waiting.folder.exists()
    with WorkerProcess() as idle:
        idle.close_input()
        assert idle.wait(timeout=120) == 0
        assert not idle.result.exists()


def test_plain_progress_prints_a_line_per_interval_and_where_it_ended() -> None:
    out = io.StringIO()
    now = [100.0]
    plain = PlainProgress(Console(file=out, width=200), interval=10.0, clock=lambda: now[0])
    task = plain.add_task("reference", total=50)
    for second, done in ((4, 3), (11, 7), (15, 9), (22, 12)):
        now[0] = 100.0 + second
        plain.update(task, completed=done)
    plain.update(task, completed=12, description="reference (failed)")
    plain.stop_task(task)
    assert out.getvalue().splitlines() == [
        "progress: reference: started, 50 example(s)",
        "progress: reference: 7/50 examples, 11s elapsed",
        "progress: reference: 12/50 examples, 22s elapsed",
        "progress: reference (failed): 12/50 examples in 22s (0.55 examples/s)",
    ]


def test_importing_the_verify_command_imports_no_torch() -> None:
    code = ("import sys, speccheck.checks.cli.verify; "
            "print(sorted(m for m in ('torch', 'speccheck.checks.verify.engine') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU tier's report")
def test_jobs_share_the_examples_and_merge_their_reports(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = _verify("--backend", "reference", "--examples", "5", "--jobs", "2", "--no-cells",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "progress: reference [1/2]: started, 3 example(s)" in proc.stdout
    assert "progress: reference [2/2]: started, 2 example(s)" in proc.stdout
    (backend,) = json.loads(out.read_text())["backends"]
    assert backend["status"] == "passed" and backend["examples"] == 5
    assert backend["checks"]["draft_tokens"]["passed"] > 0


def test_a_crashing_job_crashes_the_merged_report_with_its_reproduce_command() -> None:
    proc = _verify("--backend", "dying", "--matrix", str(FAULTY_MATRIX), "--examples", "4",
                   "--jobs", "2", "--no-cells", "--fail-fast")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dying: crashed: worker exited with status 139" in proc.stdout
    assert ("reproduce (checked: fails the same way in a fresh worker): "
            "speccheck verify --backend dying") in proc.stdout


def test_dying_worker_is_a_reported_crash_with_the_last_example() -> None:
    proc = _verify("--backend", "dying", "--matrix", str(FAULTY_MATRIX), "--examples", "3",
                   "--no-cells", "--fail-fast")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dying: crashed: worker exited with status 139" in proc.stdout
    assert ("reproduce (checked: fails the same way in a fresh worker): "
            "speccheck verify --backend dying") in proc.stdout
    assert "--reproduce " in proc.stdout


def test_a_worker_error_is_reported_by_its_root_cause_in_one_line(tmp_path: Path) -> None:
    """An out-of-memory error that hypothesis's re-run did not see again reaches the user as
    the error itself, not as the last lines of hypothesis's exception groups; the JSON
    report holds where it was raised as a field of its own."""
    out = tmp_path / "out.json"
    proc = _verify("--backend", "exhausted", "--matrix", str(FAULTY_MATRIX), "--examples", "3",
                   "--no-cells", "--fail-fast", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("exhausted: crashed: worker exited with status 1: torch.OutOfMemoryError: CUDA out "
            "of memory. Tried to allocate 1.02 GiB. (at ") in proc.stdout
    assert re.search(r"GiB\. \(at \S+faulty\S*\.py:\d+\) \(during example ", proc.stdout), \
        proc.stdout
    (backend,) = json.loads(out.read_text())["backends"]
    assert re.fullmatch(r"at \S+faulty\S*\.py:\d+", backend["raised_at"]), backend["raised_at"]
    assert f"({backend['raised_at']})" in backend["detail"]


def test_a_data_parallel_ranks_crash_is_reported_in_one_line_with_its_site(
    tmp_path: Path,
) -> None:
    """A rank process that raises is the backend's crash: its first line and the site, as a
    worker's is, its traceback left to the log."""
    out = tmp_path / "out.json"
    proc = _verify("--backend", "rank_raising", "--matrix", str(FAULTY_MATRIX), "--dp-size",
                   "2", "--examples", "2", "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (backend,) = json.loads(out.read_text())["backends"]
    assert backend["status"] == "crashed", backend
    assert re.fullmatch(r"at \S+faulty\S*\.py:\d+", backend["raised_at"]), backend["raised_at"]
    assert re.fullmatch(r"DP rank [01] of 2 failed: ValueError: planted failure in a "
                        r"data-parallel rank's build \(at \S+\)", backend["detail"]), backend
    assert "Traceback" not in proc.stdout


def test_stalling_worker_is_killed_after_the_example_timeout() -> None:
    proc = _verify("--backend", "stalling", "--matrix", str(FAULTY_MATRIX), "--examples", "3",
                   "--example-timeout", "4", "--no-cells", "--fail-fast")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("stalling: crashed: no progress for 4s (hang: the example timeout); killed"
            in proc.stdout)


def test_unknown_backend_is_a_clear_error() -> None:
    proc = _verify("--backend", "nope")
    assert proc.returncode == 2
    assert "unknown backend 'nope'" in proc.stderr and proc.stdout == ""


def test_reproduce_runs_exactly_one_example(tmp_path: Path) -> None:
    from speccheck.checks.verify.examples import encode_example
    from speccheck.speculator.batch import DraftBatch

    blob = encode_example((3, DraftBatch((5,), ((1, 2),), ((1, 2, 3),), (7,))))
    out = tmp_path / "out.json"
    proc = _verify("--backend", "reference", "--reproduce", blob, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (backend,) = json.loads(out.read_text())["backends"]
    assert backend["examples"] == 1 and backend["status"] == "passed"


def test_bad_reproduce_blob_is_a_one_line_error() -> None:
    proc = _verify("--backend", "reference", "--reproduce", "not-a-blob")
    assert proc.returncode == 2
    assert "--reproduce:" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU tier's interpreter path")
def test_triton_backend_runs_in_the_interpreter_on_the_cpu_tier(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = _verify("--backend", "triton_attn", "--examples", "2", "--num-speculative-steps", "3",
                   "--no-cells", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (backend,) = json.loads(out.read_text())["backends"]
    assert backend["status"] == "passed" and backend["checks"]["step_metadata"]["passed"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU tier's report")
def test_dp_run_honours_the_step_count_and_records_the_given_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "dp.json"
    env_commit = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("SPECCHECK_COMMIT", env_commit)
    proc = _verify("--backend", "reference", "--dp-size", "2", "--num-speculative-steps", "2",
                   "--examples", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["commit"] == env_commit
    (backend,) = report["backends"]
    assert backend["runtime_config"]["num_speculative_steps"] == 2
    assert backend["checks"]["dp_token_count"]["passed"] > 0
    assert backend["data_parallel"] == {"dp_size": 2, "collectives": "gloo",
                                        "devices": ["cpu", "cpu"]}
    assert "reference: 2 DP ranks on cpu, cpu, collectives gloo" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only skips")
def test_dp_skip_reports_the_machine_tier(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    proc = _verify("--backend", "flashinfer", "--dp-size", "2", "--examples", "2", "--json", str(out))
    assert proc.returncode == 3, proc.stdout
    (backend,) = json.loads(out.read_text())["backends"]
    assert (backend["status"], backend["tier"]) == ("skipped", "cpu")


OUT_OF_TREE = ROOT / "tests" / "fixtures" / "adapters" / "out_of_tree.yaml"


def test_dp_run_verifies_an_out_of_tree_adapter_from_its_own_matrix(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    proc = _verify("--backend", "plus_one", "--matrix", str(OUT_OF_TREE), "--dp-size", "2",
                   "--num-speculative-steps", "2", "--examples", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    (backend,) = json.loads(out.read_text())["backends"]
    assert backend["backend"] == "plus_one" and backend["status"] == "passed"
    assert backend["checks"]["dp_matches_single_rank"]["passed"] > 0


def test_audit_finds_a_claim_too_strict(tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    proc = _verify("--backend", "plus_one", "--matrix", str(OUT_OF_TREE), "--dcp-world-size", "2",
                   "--num-speculative-steps", "3", "--examples", "4", "--audit-claims", "--no-cells",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plus_one: audit: claim too strict: the fused path passed 4 examples" in proc.stdout
    (backend,) = json.loads(out.read_text())["backends"]
    assert backend["fused_allowed"] is False
    assert backend["claim_audit"]["status"] == "passed"


def test_audit_confirms_a_claim_whose_fused_path_fails(tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    proc = _verify("--backend", "no_refresh", "--matrix", str(OUT_OF_TREE),
                   "--num-speculative-steps", "3", "--examples", "3", "--audit-claims", "--no-cells",
                   "--fail-fast",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no_refresh: audit: claim confirmed: the fused path fails (refresh_error:" in proc.stdout
    assert "NotImplementedError" in proc.stdout
    (backend,) = json.loads(out.read_text())["backends"]
    assert backend["claim_audit"]["status"] == "failed"
    assert backend["claim_audit"]["failures"][0]["check"] == "refresh_error"


def test_an_adapter_that_fails_to_import_is_bad_input_before_any_worker() -> None:
    matrix = ROOT / "tests" / "fixtures" / "adapters" / "broken_import.yaml"
    proc = _verify("--backend", "broken_import", "--matrix", str(matrix))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == (f"{matrix}:6: backend 'broken_import', field 'implementation': "
                    "'tests.fixtures.adapters.broken_import:Builder' "
                    "cannot be imported: ImportError: cannot import name 'flash_attn_varlen' "
                    "from 'my_kernels'")


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter stands in for CUDA only where there is none")
def test_the_worker_interprets_tritons_own_functions_without_cuda() -> None:
    """triton.language's own jitted helpers (``tl.cdiv``) are decorated when Triton is
    first imported, so the worker must choose the interpreter before anything imports
    Triton: imported after the speculator's kernels, it left them compiled-only, and
    triton_attn's interpreted kernel crashed at ``tl.cdiv`` ('Cannot call @triton.jit'd
    outside of the scope of a kernel') on the third example of a CPU verify."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = ("import speccheck.checks.verify.worker, triton.language as tl; "
             "print(type(tl.cdiv).__name__)")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == "InterpretedFunction"
