"""A runtime option is declared once, as a ``RuntimeConfig`` field, and reaches the command
line, the config and the generated docs from there."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from speccheck.checks.cli.app import app
from speccheck.checks.cli.runtime_options import build_runtime_config, with_runtime_options
from speccheck.checks.cli.verify import VERIFY_FIELDS
from speccheck.checks.docgen.capabilities import render_capability_docs
from speccheck.checks.verify.run import option_flag, runtime_flags
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.runtime_config import RuntimeConfig


def _help(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return re.sub(r"\s+", " ", result.output)


def test_every_field_is_an_option_of_matrix_and_a_row_of_the_docs() -> None:
    help_text = _help("matrix")
    docs = render_capability_docs(load_matrix())
    for field in RuntimeConfig.model_fields:
        assert option_flag(field) in help_text, field
        assert f"| `{field}` |" in docs, field


def test_verify_takes_its_fields_and_shows_the_tier_defaults() -> None:
    help_text = _help("verify")
    for field in VERIFY_FIELDS:
        assert option_flag(field) in help_text, field
    assert "GPU tier 128, CPU tier 32" in help_text  # --head-size


def test_a_new_field_reaches_a_command_without_touching_it() -> None:
    seen: dict[str, object] = {}
    probe = typer.Typer()

    @probe.command()
    @with_runtime_options(("dcp_world_size", "advance_draft_positions"))
    def show(*, runtime: dict[str, object]) -> None:
        seen.update(runtime)

    result = CliRunner().invoke(probe, ["--dcp-world-size", "2", "--no-advance-draft-positions"])
    assert result.exit_code == 0, result.output
    assert seen == {"dcp_world_size": 2, "advance_draft_positions": False}
    assert runtime_flags(seen) == "--dcp-world-size 2 --no-advance-draft-positions"
    assert build_runtime_config(seen).dcp_world_size == 2


def test_unknown_fields_and_commands_without_runtime_are_programming_errors() -> None:
    with pytest.raises(ValueError, match="not RuntimeConfig fields: nope"):
        with_runtime_options(("nope",))
    with pytest.raises(TypeError, match="keyword-only 'runtime'"):
        with_runtime_options()(lambda: None)


def test_a_rejected_value_names_the_flag() -> None:
    result = CliRunner().invoke(app, ["matrix", "--dcp-world-size", "0"])
    assert result.exit_code == 2
    assert "--dcp-world-size" in result.output
