"""One typed run: a :class:`VerifyRun` is built once (by the command, the API or the pytest
plugin), survives JSON unchanged, and reaches every worker process as it was built; a new
field is all a new option needs to get there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from speccheck.checks.api import VerifyInputError, checked_run, plan_verification
from speccheck.checks.verify.run import VerifyRun, WorkerTask
from speccheck.contract.matrix_model import KvLayout
from speccheck.speculator.drafter_kind import DrafterKind
from tests.fixtures.checkout_copy import ROOT, copy_of_checkout

EVERY_FIELD = VerifyRun(
    backend="all", config={"dcp_world_size": 2, "dtype": "float16"},
    matrix=Path("some/matrix.yaml"), examples=7, seed=11, steps=(2, 5), capture_sizes=(4, 1, 2),
    max_new_tokens=9, reproduce="@blob.txt", audit_claims=True, example_timeout=12.5,
    shrink_seconds=0.0, fail_fast=True, jobs=3, json_path=Path("out/r.json"),
    junit_path=Path("out/r.xml"), kv_layout=KvLayout.LATENT, drafter=DrafterKind.DFLASH,
    cells=False)
"""A run whose every field differs from its default."""

GATE_OPTIONS = {"examples": 1, "seed": 5, "config": {"num_speculative_steps": 2},
                "capture_sizes": [2, 1], "max_new_tokens": 2, "shrink_seconds": 0.0}
"""What the equal-inputs test gives the command, the API and the plugin (each its own way)."""


def test_every_field_differs_from_its_default_in_the_sample() -> None:
    """The round trips below cover every field: a field added later without a sample value
    here fails this test first."""
    default = VerifyRun()
    assert [name for name in VerifyRun.model_fields
            if getattr(EVERY_FIELD, name) == getattr(default, name)] == []


def test_a_run_and_a_task_survive_json_unchanged() -> None:
    assert VerifyRun.model_validate_json(EVERY_FIELD.model_dump_json()) == EVERY_FIELD
    task = WorkerTask(run=EVERY_FIELD, backend="reference", examples=3, seed=12,
                      claim_fused=True, reproduce="QUJD")
    assert WorkerTask.model_validate_json(task.model_dump_json()) == task
    assert EVERY_FIELD.capture_sizes == (1, 2, 4)  # kept distinct and ascending


def test_a_run_is_frozen_and_takes_only_its_fields() -> None:
    with pytest.raises(ValidationError, match="frozen"):
        EVERY_FIELD.examples = 3  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        VerifyRun.model_validate_json('{"examples": 3, "exmaples": 4}')
    with pytest.raises(VerifyInputError, match="^example_timeout should be greater than 0"):
        checked_run("reference", example_timeout=0)


def test_a_verify_run_is_what_the_api_plans_and_hands_to_its_workers() -> None:
    """``speccheck.verify`` / ``plan_verification`` take a ``VerifyRun`` as well as keyword
    arguments: the same run either way, kept unchanged by the plan and in every task."""
    run = checked_run("reference", examples=4, seed=2, jobs=2)
    plan = plan_verification(run)
    assert plan.verify_run is run
    assert plan_verification("reference", examples=4, seed=2, jobs=2).verify_run == run
    assert [task.run for task in plan.shard_tasks("reference")] == [run, run]
    with pytest.raises(VerifyInputError, match="give a VerifyRun or options, not both"):
        plan_verification(run, examples=3)


def test_the_command_the_api_and_the_plugin_build_equal_runs(tmp_path: Path) -> None:
    """Equal input, three ways in: flags, keyword arguments, a pytest marker. The command's
    run is the one its JSON report records (and its worker received)."""
    api = checked_run("reference", **GATE_OPTIONS)

    out = tmp_path / "report.json"
    command = subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", "verify",
         "--backend", "reference",
         "--examples", "1", "--seed", "5", "--num-speculative-steps", "2",
         "--capture-sizes", "2,1", "--max-new-tokens", "2", "--shrink-seconds", "0",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert command.returncode == 0, command.stdout + command.stderr
    written = json.loads(out.read_text())
    from_command = VerifyRun.model_validate(written["run"])
    assert from_command.json_path == out
    assert from_command.model_copy(update={"json_path": None}) == api
    (backend,) = written["backends"]
    assert WorkerTask.model_validate(backend["worker_task"]).run == from_command

    (tmp_path / "test_gate.py").write_text(textwrap.dedent(f"""
        import pytest

        @pytest.mark.speccheck("reference", **{GATE_OPTIONS!r})
        def test_gate() -> None: ...
    """))
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        def pytest_collection_finish(session):
            gates = {item.parent for item in session.items}
            for gate in gates:
                print("RUN " + gate.plan.verify_run.model_dump_json())
    """))
    plugin = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-s",
         "test_gate.py"], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert plugin.returncode == 0, plugin.stdout + plugin.stderr
    (line,) = [line for line in plugin.stdout.splitlines() if line.startswith("RUN ")]
    assert VerifyRun.model_validate_json(line.removeprefix("RUN ")) == api


NEW_FIELD = '''
    arrival_note: str = ""
    """A field this test adds: nothing reads it but the test."""
'''


def test_a_new_field_arrives_in_the_worker_process(tmp_path: Path) -> None:
    """Adding an option is adding a field: a copy of this checkout whose ``VerifyRun`` has one
    more field, given through the API, reaches the worker process (the real one, which reads
    its task from JSON and echoes it in its report) with no other change."""
    other = copy_of_checkout(tmp_path)
    source = other / "checks" / "verify" / "run.py"
    anchor = '    """Where the command writes the JUnit XML report (``--junit``)."""\n'
    text = source.read_text()
    assert anchor in text
    source.write_text(text.replace(anchor, anchor + NEW_FIELD, 1))
    (tmp_path / "speccheck").symlink_to(other)
    script = textwrap.dedent("""
        import json
        from speccheck.checks.api import verify
        report = verify("reference", examples=1, shrink_seconds=0, arrival_note="it arrived")
        (backend,) = report.backends
        print(json.dumps({"status": backend.status.value, "task": backend.worker_task}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["status"] == "passed"
    assert result["task"]["run"]["arrival_note"] == "it arrived"
    assert result["task"]["backend"] == "reference" and result["task"]["examples"] == 1
