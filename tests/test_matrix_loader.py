"""Loading matrix files: positions, problems as PATH:LINE lines, and robustness."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from speccheck.contract.matrix_loader import MatrixError, MatrixProblem, load_matrix, parse_matrix
from speccheck.contract.matrix_model import Matrix
from speccheck.contract.yaml_positions import load_yaml_with_positions

FIXTURES = Path(__file__).parent / "fixtures" / "matrix"
VALID = sorted((FIXTURES / "valid").glob("*.yaml"))
INVALID = sorted((FIXTURES / "invalid").glob("*.yaml"))
REAL_MATRIX = (Path(__file__).resolve().parents[1] / "matrix.yaml").read_text(encoding="utf-8")
PROBLEM_LINE = re.compile(
    r"^(?P<path>[^:\n]+)(:(?P<line>\d+))?: "
    r"((backend '(?P<backend>[a-z][a-z0-9_]*)', )?field '(?P<field>[^'\n]+)': )?"
    r"(?P<message>[^\n]+)$"
)


@pytest.mark.parametrize("path", VALID, ids=[path.stem for path in VALID])
def test_valid_examples_load(path: Path) -> None:
    assert isinstance(load_matrix(path), Matrix)


@pytest.mark.parametrize("path", INVALID, ids=[path.stem for path in INVALID])
def test_invalid_examples_report_every_problem_on_its_own_line(path: Path) -> None:
    """Each ``invalid/NAME.yaml`` has ``NAME.expected``: its problems as ``LINE: ...``."""
    expected = [
        f"{path}:{line}"
        for line in path.with_suffix(".expected").read_text(encoding="utf-8").splitlines()
    ]
    with pytest.raises(MatrixError) as excinfo:
        load_matrix(path)
    assert str(excinfo.value).splitlines() == expected
    for problem in excinfo.value.problems:
        assert PROBLEM_LINE.match(problem.render()), problem.render()


def test_missing_file_is_a_matrix_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(MatrixError) as excinfo:
        load_matrix(missing)
    assert str(excinfo.value) == (
        f"{missing}: cannot read the matrix file: No such file or directory"
    )


def test_a_directory_is_a_matrix_error(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match="cannot read the matrix file"):
        load_matrix(tmp_path)


def test_problem_rendering_leaves_out_absent_parts() -> None:
    assert MatrixProblem("m.yaml", 3, "fa3", "draft_decode.reason", "x").render() == (
        "m.yaml:3: backend 'fa3', field 'draft_decode.reason': x"
    )
    assert MatrixProblem("m.yaml", 1, None, "version", "x").render() == (
        "m.yaml:1: field 'version': x"
    )
    assert MatrixProblem("m.yaml", 2, None, None, "x").render() == "m.yaml:2: x"
    assert MatrixProblem("m.yaml", None, None, None, "x").render() == "m.yaml: x"


def test_matrix_error_needs_problems() -> None:
    with pytest.raises(ValueError):
        MatrixError([])


def test_positions_record_keys_values_and_items() -> None:
    loaded = load_yaml_with_positions("a: 1\nb:\n  - x\n  - y: 2\n    z: 3\nwhen: 2024-01-01\n")
    assert loaded.data == {"a": 1, "b": ["x", {"y": 2, "z": 3}], "when": "2024-01-01"}
    assert loaded.positions[("a",)].key_line == 1
    assert loaded.positions[("b",)].key_line == 2
    assert loaded.positions[("b",)].value_line == 3
    assert loaded.positions[("b", 1)].key_line is None
    assert loaded.positions[("b", 1)].value_line == 4
    assert loaded.positions[("b", 1, "z")].line == 5
    assert loaded.duplicate_keys == ()


def test_duplicate_keys_are_reported_with_both_lines() -> None:
    loaded = load_yaml_with_positions("a: 1\nb: {c: 1, c: 2}\na: 3\n")
    found = {(duplicate.path, duplicate.line, duplicate.first_line)
             for duplicate in loaded.duplicate_keys}
    assert found == {(("b", "c"), 2, 2), (("a",), 3, 1)}
    assert loaded.data == {"a": 3, "b": {"c": 2}}


def test_merge_keys_and_aliases_are_not_duplicates() -> None:
    loaded = load_yaml_with_positions("base: &b {x: 1}\nuse:\n  <<: *b\n  x: 2\nagain: *b\n")
    assert loaded.duplicate_keys == ()
    assert loaded.data["use"] == {"x": 2}


def test_recursive_alias_does_not_hang() -> None:
    with pytest.raises(MatrixError):
        parse_matrix("version: 1\nbackends: &a [*a]\n", path="m.yaml")


def test_a_missing_field_points_at_its_parent_key() -> None:
    refreshed = "      refreshed_fields: [scheduler_metadata]\n"
    text = REAL_MATRIX.replace("      refresh_strategy: in_graph\n" + refreshed, refreshed)
    with pytest.raises(MatrixError) as excinfo:
        parse_matrix(text, path="matrix.yaml")
    (problem,) = excinfo.value.problems
    lines = text.splitlines()
    parent_line = lines.index("    draft_decode:", lines.index("  - name: fa3")) + 1
    assert problem.render() == (
        f"matrix.yaml:{parent_line}: backend 'fa3', field 'draft_decode.refresh_strategy': "
        "is required but missing"
    )


def test_problems_in_entries_without_a_valid_name_use_the_index() -> None:
    with pytest.raises(MatrixError) as excinfo:
        parse_matrix("version: 1\nbackends:\n  - name: Not Valid\n", path="m.yaml")
    rendered = str(excinfo.value).splitlines()
    assert "m.yaml:3: field 'backends[0].name': should match pattern" in rendered[0]
    assert all(line.startswith("m.yaml:3: field 'backends[0].") for line in rendered)


# --- robustness: nothing but MatrixError, whatever the input ------------------------------

REAL_LINES = REAL_MATRIX.splitlines(keepends=True)


@st.composite
def mutated_matrix(draw: st.DrawFn) -> bytes:
    """The real matrix.yaml with 1-4 random edits: deleted, duplicated or swapped lines,
    swapped values, replaced values, truncation, or inserted random bytes.

    Shrinks towards fewer edits of earlier lines.
    """
    lines = list(REAL_LINES)
    for _ in range(draw(st.integers(1, 4))):
        index = draw(st.integers(0, len(lines) - 1))
        other = draw(st.integers(0, len(lines) - 1))
        kind = draw(st.sampled_from(
            ["delete", "duplicate", "swap_lines", "swap_values", "replace_value", "truncate",
             "insert_bytes", "dedent"]
        ))
        if kind == "delete" and len(lines) > 1:
            del lines[index]
        elif kind == "duplicate":
            lines.insert(index, lines[index])
        elif kind == "swap_lines":
            lines[index], lines[other] = lines[other], lines[index]
        elif kind == "swap_values" and ":" in lines[index] and ":" in lines[other]:
            key_a, _, value_a = lines[index].partition(":")
            key_b, _, value_b = lines[other].partition(":")
            lines[index], lines[other] = f"{key_a}:{value_b}", f"{key_b}:{value_a}"
        elif kind == "replace_value" and ":" in lines[index]:
            key, _, _ = lines[index].partition(":")
            value = draw(st.one_of(
                st.sampled_from(["", " null", " []", " {}", " 0", " -1", " true", " 'x'", " [",
                                 " dcp_world_size ==", " &a x", " *a", " !!binary aGk=",
                                 " 2024-01-01", " .nan", " {multiple_of: 0}"]),
                st.text(max_size=12).map(lambda text: " " + text),
            ))
            lines[index] = f"{key}:{value}\n"
        elif kind == "truncate":
            lines = lines[: index + 1]
        elif kind == "insert_bytes":
            inserted = draw(st.binary(min_size=1, max_size=8))
            return ("".join(lines[:index])).encode() + inserted + "".join(lines[index:]).encode()
        elif kind == "dedent":
            lines[index] = lines[index].lstrip(" ")
    return "".join(lines).encode()


def assert_only_matrix_errors(source: str | bytes) -> None:
    try:
        matrix = parse_matrix(source, path="fuzz.yaml")
    except MatrixError as exc:
        assert exc.problems
        for problem in exc.problems:
            rendered = problem.render()
            assert "\n" not in rendered
            assert rendered.startswith("fuzz.yaml")
            assert problem.line is None or problem.line >= 1
            assert PROBLEM_LINE.match(rendered), rendered
    else:
        assert isinstance(matrix, Matrix)


FUZZ_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@FUZZ_SETTINGS
@given(mutated_matrix())
@example(REAL_MATRIX.encode())
@example(REAL_MATRIX.replace("version: 1", "version: 1\nversion: 1").encode())
@example(b"\xff\xfe\x00")
def test_mutated_real_matrix_raises_only_matrix_error(source: bytes) -> None:
    assert_only_matrix_errors(source)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
@example("a: !!python/object:os.system x")
@example("? [a, b]\n: 1")
@example("[[[[[[[[[[[[]]]]]]]]]]]]")
@example("version: 1\nbackends:\n  - {? {a: 1} : 2}")
@example("version: 1\nbackends:\n  - 1: x\n    null: y\n    'a\\nb': z\n")
@example("version: 1\nbackends: [{name: x, draft_decode: {supported: '" + "(" * 300 + "'}}]")
def test_random_text_raises_only_matrix_error(source: str | bytes) -> None:
    assert_only_matrix_errors(source)


@settings(max_examples=60, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
        lambda children: st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=10), children, max_size=4),
        max_leaves=20,
    )
)
def test_random_yaml_documents_raise_only_matrix_error(document: object) -> None:
    assert_only_matrix_errors(yaml.safe_dump({"version": 1, "backends": [document]}))
