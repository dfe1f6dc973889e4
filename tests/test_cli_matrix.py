"""The `speccheck matrix`, `docs` and `schema` commands: output, exit codes, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from speccheck.checks.cli.app import app
from speccheck.checks.docgen.capabilities import render_capability_docs
from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import render_matrix_json_schema

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "matrix"
INVALID = sorted((FIXTURES / "invalid").glob("*.yaml"))


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def flat(text: str) -> str:
    """``text`` without rich's box drawing and line wrapping."""
    return " ".join(text.translate({ord(char): " " for char in "│╭╮╰╯─"}).split())


def test_matrix_json_lists_every_backend() -> None:
    result = invoke("matrix", "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert [item["name"] for item in payload] == list(load_matrix().names)
    for item in payload:
        assert {"name", "fused_multi_step", "refresh_strategy", "reason"} <= set(item)
        assert isinstance(item["fused_multi_step"], bool)


def test_matrix_json_applies_runtime_options() -> None:
    result = invoke(
        "matrix", "--json", "--dcp-world-size", "2", "--block-size", "4096",
        "--max-model-len", "4096", "--platform", "cuda", "--compute-capability", "90",
    )
    assert result.exit_code == 0, result.stderr
    by_name = {item["name"]: item for item in json.loads(result.stdout)}
    assert by_name["fa3"]["fused_multi_step"] is False
    assert by_name["fa3"]["reason"].startswith(
        "requires dcp_world_size == 1, but dcp_world_size is 2"
    )
    assert by_name["sparse_swa"]["fused_multi_step"] is False
    assert by_name["sparse_swa"]["reason"].startswith(
        "requires sliding_window > 0, but sliding_window is 0"
    )
    result = invoke("matrix", "--json", "--block-size", "4096", "--max-model-len", "4096")
    assert {item["name"]: item for item in json.loads(result.stdout)}["fa3"]["fused_multi_step"]


def test_matrix_json_with_rocm_and_no_advance() -> None:
    result = invoke("matrix", "--json", "--platform", "rocm", "--no-advance-draft-positions",
                    "--cudagraph-mode", "piecewise", "--num-speculative-steps", "2",
                    "--dtype", "float16", "--dp-size", "2")
    assert result.exit_code == 0, result.stderr
    assert not any(item["fused_multi_step"] for item in json.loads(result.stdout))


def test_matrix_table_names_backends_and_verdicts() -> None:
    result = invoke("matrix", "--dcp-world-size", "2")
    assert result.exit_code == 0, result.stderr
    for name in load_matrix().names:
        assert name in result.stdout
    assert "yes" in result.stdout and "no" in result.stdout
    assert "dcp_world_size=2" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--dcp-world-size", "0"), "--dcp-world-size should be greater than or equal to 1, got 0"),
        (("--platform", "tpu"), "--platform"),
        (("--block-size", "x"), "--block-size"),
    ],
)
def test_bad_runtime_options_exit_2(args: tuple[str, ...], fragment: str) -> None:
    result = invoke("matrix", *args)
    assert result.exit_code == 2
    assert fragment in flat(result.stderr)
    assert "Traceback" not in result.output


@pytest.mark.parametrize("path", INVALID, ids=[path.stem for path in INVALID])
@pytest.mark.parametrize("command", ["matrix", "docs"])
def test_bad_matrix_exits_2_with_one_line_per_problem(
    path: Path, command: str, tmp_path: Path
) -> None:
    expected = [
        f"{path}:{line}"
        for line in path.with_suffix(".expected").read_text(encoding="utf-8").splitlines()
    ]
    args = ["--output", str(tmp_path / "out.md")] if command == "docs" else ["--json"]
    result = invoke(command, "--matrix", str(path), *args)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == expected
    assert result.stdout == ""
    assert "Traceback" not in result.output
    assert not (tmp_path / "out.md").exists()


def test_missing_matrix_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    result = invoke("matrix", "--matrix", str(missing))
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"{missing}: cannot read the matrix file: No such file or directory"
    ]
    assert "Traceback" not in result.output


def test_docs_writes_and_checks(tmp_path: Path) -> None:
    output = tmp_path / "docs" / "capabilities.md"
    no_status = ("--status", str(tmp_path / "status"))  # every backend "not verified"
    (tmp_path / "status").mkdir()
    result = invoke("docs", "--output", str(output), *no_status)
    assert result.exit_code == 0, result.stderr
    text = output.read_text(encoding="utf-8")
    assert text == render_capability_docs(load_matrix())
    assert invoke("docs", "--check", "--output", str(output), *no_status).exit_code == 0
    output.write_text(text + "edited by hand\n", encoding="utf-8")
    result = invoke("docs", "--check", "--output", str(output), *no_status)
    assert result.exit_code == 1
    assert f"{output} is stale" in result.stderr
    assert "speccheck docs" in result.stderr
    result = invoke("docs", "--check", "--output", str(tmp_path / "absent.md"), *no_status)
    assert result.exit_code == 1
    assert "cannot be read" in result.stderr


def test_docs_content() -> None:
    text = render_capability_docs(load_matrix())
    assert "- `block_size=16384`, `max_model_len=16384` (`verify_defaults`: `speccheck verify " \
        "--backend fa3` uses these" in text
    assert text.startswith("<!-- Generated by `speccheck docs` from matrix.yaml and docs/status/.")
    assert "| [`fa3`](#fa3) | cuda | 9.0 | `always` | when `dcp_world_size` is 1 | `in_graph` " \
        "| `fa3-fwd` |" in text
    assert 'install with `pip install "speccheck[fa3]"`' in text
    assert "- Requires that `block_size` equals `max_model_len` (`block_size == max_model_len`)" \
        in text
    assert "- Refreshed fields: `swa_indices`, `swa_lens`, `tile_scheduler_metadata`, " \
        "`split_offsets`" in text
    assert "- Invalidated caches: `sparse_index_cache`, `sparse_index_cache_valid`" in text
    assert "- Variant of: [`sparse_swa`](#sparse_swa)" in text
    for name in load_matrix().names:
        assert f"\n## {name}\n" in text
    matrix = load_matrix()
    unshipped = matrix.replacing(
        matrix.backend("sparse_swa").model_copy(update={"implementation": None}))
    text = render_capability_docs(unshipped)
    assert "- Implementation: none; no adapter shipped yet: the claims below are declared, unverified." in text
    assert "| declared, unverified |" in text


def test_committed_docs_are_current() -> None:
    result = invoke("docs", "--check", "--output", str(REPO_ROOT / "docs" / "capabilities.md"))
    assert result.exit_code == 0, result.stderr


def test_schema_prints_stable_json() -> None:
    result = invoke("schema")
    assert result.exit_code == 0
    assert result.stdout == render_matrix_json_schema()
    assert json.loads(result.stdout)["title"].startswith("speccheck capability matrix")


def test_schema_check(tmp_path: Path) -> None:
    assert invoke("schema", "--check").exit_code == 0
    copy = tmp_path / "matrix.schema.json"
    assert invoke("schema", "--output", str(copy)).exit_code == 0
    assert invoke("schema", "--check", "--output", str(copy)).exit_code == 0
    copy.write_text(copy.read_text(encoding="utf-8").replace('"title"', '"titel"', 1))
    result = invoke("schema", "--check", "--output", str(copy))
    assert result.exit_code == 1
    assert "is stale" in result.stderr


def test_verbose_flag_is_accepted() -> None:
    result = invoke("--verbose", "matrix", "--json")
    assert result.exit_code == 0
    json.loads(result.stdout)


@pytest.mark.skipif(shutil.which("speccheck", path=str(Path(sys.executable).parent)) is None,
                    reason="console script not installed")
def test_console_script_end_to_end() -> None:
    script = shutil.which("speccheck", path=str(Path(sys.executable).parent))
    assert script is not None
    ok = subprocess.run([script, "matrix", "--json"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)[0]["name"] == "reference"
    bad = INVALID[0]
    failed = subprocess.run([script, "matrix", "--matrix", str(bad)], capture_output=True,
                            text=True, check=False)
    assert failed.returncode == 2
    assert failed.stdout == ""
    assert "Traceback" not in failed.stderr
    assert failed.stderr.startswith(f"{bad}:")


@pytest.mark.parametrize("command", [["matrix", "--json"], ["schema"], ["docs"], ["docs", "--checks"]])
def test_torch_free_commands_start_without_importing_torch(command: list[str]) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c",
         "from speccheck.checks.cli.app import main; main()", *command],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "triton" not in imported


def test_matrix_table_shows_every_reason_in_full_at_80_columns(tmp_path: Path) -> None:
    """In an 80-column log (no terminal), a "declared, unverified" row squeezes nothing:
    each reason is printed whole, on a line of its own, under the table."""
    shipped = load_matrix()
    typo = shipped.replacing(shipped.backend("sparse_swa").model_copy(update={
        "implementation": "speccheck.backends.sparse_swa.builder:SparseSWABuildr"}))
    import yaml

    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(typo.model_dump(mode="json", exclude_none=True),
                                   sort_keys=False))
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("speccheck")), "matrix", "--matrix", str(path),
         "--sliding-window", "8"],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"},
        check=False)
    assert proc.returncode == 0, proc.stderr
    from speccheck.contract.resolution import resolve_matrix
    from speccheck.contract.runtime_config import RuntimeConfig

    lines = proc.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines if line.startswith(("┃", "│", "┏", "└")))
    for resolution in resolve_matrix(typo, RuntimeConfig(sliding_window=8)):
        assert f"{resolution.name}: {resolution.reason}" in lines
    assert any("declared, unverified" in line for line in lines)
    row = next(line for line in lines if line.startswith("│ sparse_swa "))
    assert "declared," in row and " yes " not in row
