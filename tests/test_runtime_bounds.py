"""Runtime fields have one set of bounds, declared on :class:`RuntimeConfig`: a value past a
bound is the same one-line error on the command line (naming the flag, exit 2) as in a
matrix file's ``verify_defaults`` (naming the file, line, backend and field)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from speccheck.checks.cli.app import app
from speccheck.checks.cli.runtime_options import option_flag
from speccheck.contract.matrix_loader import MatrixError, load_matrix
from speccheck.contract.matrix_model import VERIFIABLE_FIELDS
from speccheck.contract.runtime_config import RuntimeConfig

BOUNDED = [(name, bound) for name, info in RuntimeConfig.model_fields.items()
           for bound in [next((getattr(m, "le") for m in info.metadata if hasattr(m, "le")), None)]
           if bound is not None]

FRAGMENT = """version: 1
backends:
  - name: alpha
    display_name: Alpha
    description: A test backend.
    implementation: null
    platforms: [cuda]
    package:
      distribution: torch
      import_name: torch
    cudagraph_support: always
    draft_decode:
      supported: true
      refresh_strategy: none_needed
    verify_defaults:
      {field}: {value}
"""


def test_every_integer_field_has_an_upper_bound() -> None:
    integers = {name for name, info in RuntimeConfig.model_fields.items() if info.annotation is int}
    assert integers == {name for name, _ in BOUNDED}


@pytest.mark.parametrize(("field", "bound"), BOUNDED)
def test_a_value_past_the_bound_is_refused_on_the_command_line(field: str, bound: int) -> None:
    huge = str(10**40)
    for value in (str(bound + 2), huge):
        result = CliRunner().invoke(app, ["matrix", option_flag(field), value])
        assert result.exit_code == 2, result.output
        assert f"{option_flag(field)} should be less than or equal to {bound}" in result.output
    assert CliRunner().invoke(app, ["matrix", option_flag(field), str(bound)]).exit_code in (0, 2)


@pytest.mark.parametrize(("field", "bound"), [(f, b) for f, b in BOUNDED if f in VERIFIABLE_FIELDS])
def test_the_same_bound_holds_in_a_matrix_file(tmp_path: Path, field: str, bound: int) -> None:
    path = tmp_path / "matrix.yaml"
    path.write_text(FRAGMENT.format(field=field, value=bound + 2))
    with pytest.raises(MatrixError) as raised:
        load_matrix(path)
    (problem,) = raised.value.problems
    line = problem.render()
    assert line.startswith(f"{path}:16:")
    assert f"backend 'alpha', field 'verify_defaults.{field}'" in line
    assert f"less than or equal to {bound}" in line
