"""The verify pre-flight of a fragment (issue 43, item 3): a typo in the class part of
``implementation``, in ``refreshed_fields``, and a builder named otherwise than its entry
are each one line with the matrix file's ``PATH:LINE``, exit 2, before any example runs;
correct fragments, shipped and fixtures alike, pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from speccheck.backends.reference.builder import ReferenceMetadata, ReferenceMetadataBuilder
from speccheck.checks.api import VerifyInputError, plan_verification
from speccheck.checks.verify.preflight import metadata_type
from speccheck.contract.metadata import CommonAttentionMetadata
from speccheck.contract.plugins import located_matrix_files

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ROOT / "tests" / "fixtures" / "adapters"
MISTAKES = ADAPTERS / "fragment_mistakes.yaml"


@pytest.mark.parametrize(("backend", "line", "field", "message"), [
    ("class_typo", 6, "implementation",
     "'tests.fixtures.adapters.fragment_mistakes:FieldTypoo': "
     f"{ADAPTERS / 'fragment_mistakes.py'} defines no 'FieldTypoo' at top level; did you "
     "mean 'FieldTypo'?"),
    ("field_typo", 26, "draft_decode.refreshed_fields[1]",
     "'kv_len_plus_one' is not a field of PlusOneMetadata, the metadata type "
     "FieldTypo.build() returns; did you mean 'kv_lens_plus_one'? (fields: "),
    ("misnamed", 27, "name",
     "Misnamed.backend_name is 'misnamed_builder', not the entry's name 'misnamed': name "
     "the entry 'misnamed_builder' or set backend_name = 'misnamed'"),
])
def test_each_fragment_mistake_is_one_line_at_its_path_and_line(
    backend: str, line: int, field: str, message: str
) -> None:
    with pytest.raises(VerifyInputError) as caught:
        plan_verification(backend, matrix=MISTAKES)
    text = str(caught.value)
    assert text.startswith(f"{MISTAKES}:{line}: backend '{backend}', field '{field}': {message}")
    assert "\n" not in text


def test_a_fragment_mistake_exits_2_on_one_line_before_any_example() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", "verify",
         "--backend", "field_typo", "--matrix", str(MISTAKES)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"{MISTAKES}:26: backend 'field_typo', field "
                           "'draft_decode.refreshed_fields[1]': 'kv_len_plus_one' is not")


PLANTED = ("fragment_mistakes", "broken_import")
"""Fixture matrices whose entries are mistakes on purpose."""


@pytest.mark.parametrize(
    "matrix", [None, *(m for m in sorted(ADAPTERS.glob("*.yaml")) if m.stem not in PLANTED)],
    ids=lambda m: "shipped" if m is None else m.stem)
def test_correct_fragments_pass_the_preflight(matrix: Path | None) -> None:
    """Every entry of the shipped matrix (and installed plug-ins) and of the fixtures that
    are not planted mistakes plans; builders that inherit a shipped backend's name (the
    fixtures' known-bad and faulty variants of reference) may be declared under any
    entry."""
    for located in located_matrix_files(matrix):
        for name in located.matrix.names:
            plan_verification(name, matrix=matrix)


class _Unannotated(ReferenceMetadataBuilder):
    def build(self, common: CommonAttentionMetadata):  # type: ignore[no-untyped-def]
        return super().build(common)


class _NotADataclass(ReferenceMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> Any:
        return super().build(common)


def test_the_metadata_type_is_what_build_states_as_a_dataclass() -> None:
    assert metadata_type(ReferenceMetadataBuilder) is ReferenceMetadata
    assert metadata_type(_Unannotated) is None and metadata_type(_NotADataclass) is None
