"""benchmarks/bench_ab.py benches two checkouts in alternating rounds: run on the CPU tier
against a copy of this checkout, in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.checkout_copy import ROOT, copy_of_checkout

pytestmark = pytest.mark.slow
"""A benchmark tool's test: run by the whole suite (CI), left out by ``-m "not slow"``."""


def test_both_checkouts_are_benched_in_alternating_rounds(tmp_path: Path) -> None:
    other = copy_of_checkout(tmp_path)
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_ab.py"), "--against", str(other),
         "--backend", "reference", "--steps", "2", "--batches", "1,2", "--repeats", "1",
         "--rounds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = json.loads(out.read_text())["reports"]
    assert len(reports["this"]) == len(reports["against"]) == 2
    rounds = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("round")]
    # the order within a round alternates
    assert rounds == ["round 1 this", "round 1 against", "round 2 against", "round 2 this"]
    cases = {(r["path"], r["k"], r["batch"]) for r in reports["this"][0]["rows"]}
    assert cases == {(path, 2, batch) for path in ("per_step", "fused") for batch in (1, 2)}
    for path, k, batch in cases:
        assert f"path={path} k={k} batch={batch}" in proc.stdout
    # on the CPU only the wall time and its ratio are measured, each against the other side
    assert proc.stdout.count("wall_ms ") == proc.stdout.count("wall_ratio ") == 4
    assert proc.stdout.count("this/against") == 8
    assert "host_ms" not in proc.stdout and "step_gpu_ms" not in proc.stdout


def test_another_folder_than_a_checkout_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for script in ("bench_ab.py", "verify_speed.py"):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script), "--against", str(tmp_path)],
            capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2, script
        last = proc.stderr.strip().splitlines()[-1]
        assert last.endswith(f"--against {tmp_path}: not a speccheck checkout (no checks/cli)")
        assert "Traceback" not in proc.stderr
