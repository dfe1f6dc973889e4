"""benchmarks/verify_speed.py times verify workers of two checkouts side by side: run on the
CPU tier against a copy of this checkout, in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.checkout_copy import ROOT, copy_of_checkout

pytestmark = pytest.mark.slow
"""A benchmark tool's test: run by the whole suite (CI), left out by ``-m "not slow"``."""


def test_both_checkouts_report_their_time_draws_and_workload(tmp_path: Path) -> None:
    other = copy_of_checkout(tmp_path)
    out = tmp_path / "speed.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "verify_speed.py"), "--examples", "3",
         "--rounds", "1", "--against", str(other), "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    (this,), (against,) = runs["this"], runs["against"]
    for run in (this, against):
        assert run["status"] == "passed" and run["examples"] == 3
        workload = run["workload"]
        assert workload["requests"] >= 3 and workload["draft_steps"] >= workload["requests"]
        assert workload["new_tokens"] >= workload["requests"]
    # one tree, one seed: the same examples, the same tallies, the same workload
    assert this["drawn"] == against["drawn"] and this["workload"] == against["workload"]
    assert "same examples drawn: True; same check tallies: True" in proc.stdout
    assert proc.stdout.count("workload:") == 2
