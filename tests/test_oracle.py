"""The fp32 reference's attention oracle (:mod:`speccheck.checks.verify.oracle`) is
independent of the backends it judges, the shipped reference included: it imports nothing
of ``backends/``, and a reference backend with its KV write or its attention output
deleted fails ``verify --backend reference`` at the defaults."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from speccheck.checks import api
from speccheck.checks.selftest.mutants import naming_matrix
from speccheck.checks.verify.vocabulary import Check, Status
from speccheck.contract.builder import AttentionMetadataBuilder
from speccheck.contract.matrix_loader import load_matrix
from tests.fixtures.adapters.broken_reference import NoAttentionOutput, NoKvWrite
from tests.fixtures.catch import CATCH
from tests.fixtures.reference_at_defaults import VerifyCommandRun

ORACLE = Path(__file__).resolve().parents[1] / "checks" / "verify" / "oracle"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (plain, ``from`` and deferred imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _backends_imported(path: Path) -> list[str]:
    return sorted(name for name in _imports(path)
                  if name.split(".")[:2] == ["speccheck", "backends"])


@pytest.mark.parametrize("path", sorted(ORACLE.glob("*.py")), ids=lambda p: p.name)
def test_the_oracle_imports_nothing_of_the_backends(path: Path) -> None:
    assert not _backends_imported(path), f"{path.name} imports {_backends_imported(path)}"


def test_the_import_walk_sees_a_backend_imported_in_any_form(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import speccheck.backends.dcp\n"
                      "def later() -> None:\n"
                      "    from speccheck.backends.reference.attention import capturing\n")
    assert _backends_imported(sample) == ["speccheck.backends.dcp",
                                          "speccheck.backends.reference.attention"]


def _verify_reference(tmp_path: Path,
                      builder: type[AttentionMetadataBuilder],  # type: ignore[type-arg]
                      *, fail_fast: bool = False) -> api.VerifyReport:
    """``verify --backend reference`` at the defaults (``fail_fast``: up to the first
    failure, unshrunk: ``tests/fixtures/catch.py``), with ``builder`` as the reference entry's implementation."""
    matrix = tmp_path / "matrix.yaml"
    named = naming_matrix(load_matrix(None), builder)
    matrix.write_text(yaml.safe_dump(named.model_dump(mode="json", exclude_none=True)))
    return api.verify("reference", matrix=matrix, **(CATCH if fail_fast else {}))


@pytest.mark.parametrize("builder", [NoKvWrite, NoAttentionOutput], ids=lambda b: b.__name__)
def test_a_reference_with_a_deleted_statement_fails_against_the_oracle(
    tmp_path: Path, builder: type[AttentionMetadataBuilder]  # type: ignore[type-arg]
) -> None:
    report = _verify_reference(tmp_path, builder, fail_fast=True)
    verdict = {v.check: v for v in report.verdicts("reference")}[Check.VS_FP32_REFERENCE]
    assert report.backend("reference").status is Status.FAILED, report.summary_lines()
    assert verdict.status is Status.FAILED, verdict
    # fail_fast ends the run at the first failing cell: the cells after it are not run.
    cells = report.backend("reference").cells
    failing = next(i for i, cell in enumerate(cells) if cell.status is Status.FAILED)
    assert failing < len(cells) - 1, cells  # the base cell fails: every example misses a write
    assert all(not cell.run and cell.detail.startswith("fail-fast: the run stopped at the "
                                                       f"{cells[failing].name} cell")
               for cell in cells[failing + 1:]), cells


def test_the_shipped_reference_passes_against_the_oracle(
    reference_at_defaults: VerifyCommandRun,
) -> None:
    """The shipped reference, at its defaults (every cell), against the oracle."""
    run = reference_at_defaults
    assert run.exit_code == 0, run.stdout + run.stderr
    against = run.backend("reference")["checks"][Check.VS_FP32_REFERENCE.value]
    assert against["passed"] > 0 and against["failed"] == 0, against
