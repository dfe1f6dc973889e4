"""``--json -`` (issue 43, item 6): every command with ``--json`` writes its JSON report to
stdout, and nothing else goes there (tables and progress go to stderr); exit statuses are
those of a run that writes a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FORWARD_SYNC = ROOT / "tests" / "fixtures" / "adapters" / "forward_sync.yaml"


def _speccheck(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def _stdout_json(proc: subprocess.CompletedProcess[str]) -> Any:
    """stdout parsed as one JSON document (fails on anything else there)."""
    return json.loads(proc.stdout)


def test_verify_json_dash_writes_the_report_alone_to_stdout() -> None:
    proc = _speccheck("verify", "--backend", "reference", "--examples", "2", "--no-cells",
                      "--json", "-")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = _stdout_json(proc)
    (backend,) = report["backends"]
    assert backend["backend"] == "reference" and backend["status"] == "passed"
    assert "speccheck verify" in proc.stderr and "checks: capture" in proc.stderr


def test_verify_json_dash_keeps_the_failing_exit_status() -> None:
    proc = _speccheck("verify", "--backend", "item_in_forward", "--matrix", str(FORWARD_SYNC),
                      "--examples", "2", "--shrink-seconds", "0", "--no-cells", "--fail-fast",
                      "--json", "-")
    assert proc.returncode == 1, proc.stderr[-2000:]
    (backend,) = _stdout_json(proc)["backends"]
    assert backend["status"] == "failed"
    assert "FAIL item_in_forward host_sync" in proc.stderr


def test_selftest_json_dash_writes_the_rows_alone_to_stdout() -> None:
    proc = _speccheck("selftest", "--only", "control", "--json", "-")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = _stdout_json(proc)
    assert row["name"].startswith("control") and row["outcome"] == "caught"
    assert "speccheck selftest" in proc.stderr


def test_bench_json_dash_writes_the_report_alone_to_stdout() -> None:
    proc = _speccheck("bench", "--backend", "reference", "--steps", "2", "--batches", "1",
                      "--repeats", "1", "--json", "-")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = _stdout_json(proc)
    assert report["backend"] == "reference" and report["rows"]
    assert "wrote -" not in proc.stderr and "runtime config: " in proc.stderr


def test_status_json_dash_writes_the_records_it_wrote_to_stdout(tmp_path: Path) -> None:
    proc = _speccheck("status", "--backend", "reference", "--examples", "1", "--no-selftest",
                      "--no-bench", "--out", str(tmp_path), "--bench-page",
                      str(tmp_path / "absent.md"), "--json", "-")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record,) = _stdout_json(proc)
    assert record == json.loads((tmp_path / "reference.json").read_text())
    assert record["tiers"]["cpu"]["verdict"] == "passed"
    assert '"backend": "reference"' in proc.stderr  # the status lines, on stderr


def test_status_json_with_render_is_bad_input(tmp_path: Path) -> None:
    proc = _speccheck("status", "--render", "--out", str(tmp_path), "--json", "-")
    assert proc.returncode == 2
    assert proc.stderr.startswith("--json: --render and --check write no records")
    assert proc.stdout == ""
