"""``examples/adapter_template``, installed as an adapter author installs it (``pip install``,
into a folder of its own rather than into this environment), passes its own gate through
the pytest plugin at its defaults; a copy with its in-graph refresh removed fails it on
``step_metadata`` (its gate with ``fail_fast``: it stops at that failure instead of
searching on).

Both copies are built from temporary copies of the template (the build writes into its
source folder), with ``--no-deps --no-build-isolation``: speccheck, torch and setuptools
come from this environment, and nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "examples" / "adapter_template"
REFRESH = "        metadata.kv_lens.copy_(metadata.seq_lens)  # the in-graph refresh\n"
BACKEND = "template_attn"
GATE_MARK = f'@pytest.mark.speccheck(backend="{BACKEND}", examples=20)'
"""The template's gate. The broken copy's stops at its first failure, unshrunk (``fail_fast``,
``shrink_seconds=0``: ``tests/fixtures/catch.py``): the default search finds that failure the
same way before it searches on."""


def _install(source: Path, work: Path, *, broken: bool) -> tuple[Path, Path]:
    """A copy of the template in ``work/src`` (with ``broken``, its refresh replaced by
    ``pass`` and its gate given ``fail_fast=True, shrink_seconds=0.0``), installed into ``work/site``; returns
    both."""
    copy, site = work / "src", work / "site"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                               "__pycache__", ".pytest_cache"))
    if broken:
        module = copy / "src" / "speccheck_adapter_template" / "attention.py"
        text = module.read_text()
        assert text.count(REFRESH) == 1, "the template's refresh line moved: update REFRESH"
        module.write_text(text.replace(REFRESH, "        pass  # broken copy: no refresh\n"))
        gate = copy / "tests" / "test_speccheck_gate.py"
        text = gate.read_text()
        assert text.count(GATE_MARK) == 1, "the template's gate marker changed: update GATE_MARK"
        gate.write_text(text.replace(GATE_MARK,
                                     GATE_MARK[:-1] + ", fail_fast=True, shrink_seconds=0.0)"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(copy)],
                   check=True, capture_output=True, timeout=120)
    return copy, site


def _env(site: Path) -> dict[str, str]:
    """The environment of the template's commands: ``site`` on the import path, and one
    torch thread unless told otherwise (the CPU tier's tensors are tiny, and two gates run
    at once: more threads only spin against each other)."""
    return {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "200",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _gate(copy: Path, site: Path) -> subprocess.Popen[str]:
    """The template's own test run (its gate), with a JUnit report in ``copy``."""
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         f"--junitxml={copy / 'gate.xml'}"],
        cwd=copy, env=_env(site), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _cases(copy: Path) -> dict[str, str]:
    """Each JUnit case of a gate run: ``passed``, ``failure`` (its message) or ``skipped``."""
    cases = {}
    for case in ElementTree.parse(copy / "gate.xml").iter("testcase"):
        outcome = next(iter(case), None)
        cases[case.get("name", "")] = "passed" if outcome is None else (
            f"failure: {outcome.get('message', '')}\n{outcome.text or ''}"
            if outcome.tag == "failure" else outcome.tag)
    return cases


def test_the_template_passes_its_gate_and_a_broken_copy_fails_it(tmp_path: Path) -> None:
    good, good_site = _install(TEMPLATE, tmp_path / "good", broken=False)
    bad, bad_site = _install(TEMPLATE, tmp_path / "broken", broken=True)
    matrix = subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()",
         "matrix", "--json"], capture_output=True, text=True, env=_env(good_site), timeout=120)
    assert matrix.returncode == 0, matrix.stderr
    entry = {item["name"]: item for item in json.loads(matrix.stdout)}[BACKEND]
    assert (entry["verdict"], entry["adapter"]) == ("yes", "found")

    runs = {copy: _gate(copy, site) for copy, site in ((good, good_site), (bad, bad_site))}
    outputs = {copy: proc.communicate(timeout=300)[0] for copy, proc in runs.items()}

    assert runs[good].returncode == 0, outputs[good]
    cases = _cases(good)
    assert cases[f"run[{BACKEND}]"] == "passed"
    assert cases[f"step_metadata[{BACKEND}]"] == "passed"
    assert cases[f"capture[{BACKEND}]"] in ("skipped", "passed")  # passed on the GPU tier
    assert f"{BACKEND}: passed on the" in outputs[good]

    assert runs[bad].returncode == 1, outputs[bad]
    cases = _cases(bad)
    assert cases[f"run[{BACKEND}]"] == "passed"
    step_metadata = cases[f"step_metadata[{BACKEND}]"]
    assert step_metadata.startswith("failure: ")
    assert f"{BACKEND}.metadata.kv_lens differs from a fresh eager build" in step_metadata
    assert (f"reproduce (checked: fails the same way in a fresh worker): speccheck verify "
            f"--backend {BACKEND} --seed 0 --reproduce ") in step_metadata
    # not failed: cut short by the broken copy's fail_fast, never passed on fewer examples
    assert cases[f"declared_fields[{BACKEND}]"] == "skipped"


def test_bad_gate_arguments_are_one_collection_error_each(tmp_path: Path) -> None:
    (tmp_path / "test_gates.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.speccheck(backend='nope')\n"
        "def test_unknown() -> None: ...\n\n"
        "@pytest.mark.speccheck(backend='reference', exampels=3)\n"
        "def test_misspelt() -> None: ...\n\n"
        "@pytest.mark.speccheck(backend='reference', matrix='missing.yaml')\n"
        "def test_missing_matrix() -> None: ...\n\n"
        "@pytest.mark.speccheck('reference', examples=2)\n"
        "def test_collected() -> None: ...\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
         "test_gates.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout
    assert "@pytest.mark.speccheck: unknown backend 'nope'; valid: reference," in proc.stdout
    assert ("@pytest.mark.speccheck: exampels: not an option of a verification; options: "
            in proc.stdout)
    assert (f"@pytest.mark.speccheck: {tmp_path / 'missing.yaml'}: cannot read the matrix "
            "file: No such file or directory" in proc.stdout)
    assert "test_gates.py::test_collected::step_metadata[reference]" in proc.stdout
    assert "Traceback" not in proc.stdout
