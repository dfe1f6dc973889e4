"""benchmarks/verify_phases.py times a verify worker's phases: run on the CPU tier, in a
process of its own (it wraps the engine's functions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow
"""A benchmark tool's test: run by the whole suite (CI), left out by ``-m "not slow"``."""


def test_the_phase_table_times_and_counts_every_example_and_the_fp32_reference(tmp_path: Path) -> None:
    out = tmp_path / "phases.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "verify_phases.py"), "--backend",
         "triton_attn", "--examples", "2", "--aten", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["status"] == "passed" and result["examples"] == 2
    phases = result["phases"]
    assert phases["examine"]["calls"] == 2
    assert phases["launch reference per_step"]["calls"] == 2  # the fp32 reference
    assert phases["propose triton_attn per_step eager"]["calls"] >= 2  # the oracle
    assert "phase" in proc.stdout and "examine" in proc.stdout and "aten" in proc.stdout
    # aten calls nest like the phases: an example holds its reference's and its oracle's
    reference, example = phases["launch reference per_step"], phases["examine"]
    assert 0 < reference["aten"] < example["aten"]
