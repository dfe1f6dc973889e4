"""An adapter with two independent bugs (``tests/fixtures/adapters/two_bugs.py``: a stale
lengths field, and a wrong slot at a block's last row that only the fp32 reference sees),
gated by the pytest plugin at the defaults: both checks fail, each with its own minimal
example and a reproduce command checked in a fresh worker; with ``fail_fast`` the run
stops at its first failure and no check it cut short reads as passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "tests" / "fixtures" / "adapters" / "two_bugs.yaml"
BACKEND = "two_bugs"
CHECKED = "reproduce (checked: fails the same way in a fresh worker): speccheck verify"


def _gate(tmp_path: Path) -> tuple[str, dict[str, dict[str, str]]]:
    """Two gates of the adapter, by default (shrinking each failure for 2 s, not 120) and
    with ``fail_fast`` (unshrunk: ``tests/fixtures/catch.py``), in one pytest run: its
    output and, by gate, each JUnit case's outcome (``passed``, ``skipped`` or
    ``failure: MESSAGE TEXT``)."""
    for name, options in (("test_default", ", shrink_seconds=2.0"),
                          ("test_fail_fast", ", fail_fast=True, shrink_seconds=0.0")):
        (tmp_path / f"{name}.py").write_text(
            "import pytest\n\n\n"
            f"@pytest.mark.speccheck(backend={BACKEND!r}, matrix={str(MATRIX)!r}{options})\n"
            "def test_gate() -> None: ...\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
         f"--junitxml={tmp_path / 'gate.xml'}", "test_default.py", "test_fail_fast.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    cases: dict[str, dict[str, str]] = {}
    for case in ElementTree.parse(tmp_path / "gate.xml").iter("testcase"):
        outcome = next(iter(case), None)
        gate = cases.setdefault(case.get("classname", "").split(".")[0], {})
        gate[case.get("name", "")] = "passed" if outcome is None else (
            f"failure: {outcome.get('message', '')}\n{outcome.text or ''}"
            if outcome.tag == "failure" else outcome.tag)
    return run.stdout, cases


def test_both_bugs_fail_their_checks_and_fail_fast_passes_nothing_it_cut_short(
    tmp_path: Path,
) -> None:
    output, cases = _gate(tmp_path)
    default, fast = cases["test_default"], cases["test_fail_fast"]

    assert default[f"run[{BACKEND}]"] == "passed", output
    metadata = default[f"step_metadata[{BACKEND}]"]
    reference = default[f"vs_fp32_reference[{BACKEND}]"]
    assert metadata.startswith("failure: ") and reference.startswith("failure: "), output
    assert "stale (equals the previous step's value)" in metadata
    commands = [next(line for line in message.splitlines() if line.startswith(CHECKED))
                for message in (metadata, reference)]
    assert commands[0] != commands[1]  # each failure its own example and command
    logits = default[f"logits[{BACKEND}]"]
    assert "follows from the step_metadata failure at step" in logits

    failed = {name for name, outcome in fast.items() if outcome.startswith("failure: ")}
    assert failed and failed <= {f"{check}[{BACKEND}]" for check in (
        "step_metadata", "vs_fp32_reference", "logits", "draft_tokens", "kv_cache")}
    assert [name for name, outcome in fast.items() if outcome == "passed"] == [
        f"run[{BACKEND}]"], output
    assert fast[f"capture[{BACKEND}]"] == "skipped"
    assert "the run stopped at example" in output
