"""docs/verification/README.md is generated from the evidence folders
(``scripts/render_evidence.py``) and kept up to date."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "render_evidence.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_evidence", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_readme_is_up_to_date() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_check_finds_a_folder_the_readme_leaves_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    module = _script()
    evidence = tmp_path / "docs" / "verification"
    run = evidence / "some-run"
    run.mkdir(parents=True)
    (run / "about.txt").write_text("What ran.\n")
    (run / "bench.json").write_text(json.dumps({"rows": []}))  # not a verify report: no table
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "EVIDENCE", evidence)
    assert module.main(["--check"]) == 1
    assert capsys.readouterr().err.strip() == (
        "docs/verification/README.md is out of date: run python scripts/render_evidence.py")
    assert module.main([]) == 0
    readme = (evidence / "README.md").read_text()
    assert "## `some-run/`" in readme and "What ran." in readme
    assert module.main(["--check"]) == 0
    (run / "about.txt").write_text("What ran, corrected.\n")
    assert module.main(["--check"]) == 1
