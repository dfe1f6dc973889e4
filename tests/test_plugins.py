"""Plug-in backends: matrix fragments registered through the ``speccheck.backends`` entry
point, found in distributions on the import path (real ``*.dist-info`` folders written into
a temporary directory), merged with the shipped matrix, validated with PATH:LINE errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speccheck.checks.verify.context import MatrixContext
from speccheck.contract.matrix_loader import MatrixError, load_located_matrix, load_matrix
from speccheck.contract.plugins import ENTRY_POINT_GROUP, load_matrix_with_plugins

ROOT = Path(__file__).resolve().parents[1]

FRAGMENT = """\
version: 1
backends:
  - name: {name}
    display_name: A plug-in backend
    description: Declared by an installed package.
    implementation: {package}.attention:Builder
    platforms: [cuda, cpu]
    package: {{distribution: torch, import_name: torch}}
    cudagraph_support: always
    draft_decode:
      supported: true
      refresh_strategy: none_needed
"""


def install(site: Path, package: str, entry_points: str, *, fragment: str | None = None,
            module: str | None = None) -> Path:
    """A distribution ``package`` in ``site``: its metadata, its ``speccheck.backends``
    entry points, and a package whose ``__init__`` raises (finding a fragment file must not
    import it), holding ``matrix.yaml`` and, optionally, a ``plugin`` module."""
    dist_info = site / f"{package}-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry_points}\n")
    folder = site / package
    folder.mkdir()
    (folder / "__init__.py").write_text("raise RuntimeError('imported')\n")
    if module is not None:
        (site / f"{package}_plugin.py").write_text(module)
    matrix = folder / "matrix.yaml"
    matrix.write_text(fragment if fragment is not None
                      else FRAGMENT.format(name=package, package=package))
    return matrix


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on the import path, for distributions the test installs."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def test_a_fragment_is_merged_after_the_shipped_matrix(site: Path) -> None:
    install(site, "plug_a", "a = plug_a:matrix.yaml")
    merged = load_matrix_with_plugins()
    assert merged.names == (*load_matrix().names, "plug_a")
    context = MatrixContext.load(None)
    assert context.matrix.names == merged.names and context.path is None
    assert "plug_a" not in context.shipped.names


def test_an_explicit_matrix_is_verified_alone(site: Path) -> None:
    install(site, "plug_a", "a = plug_a:matrix.yaml")
    fixture = ROOT / "tests" / "fixtures" / "adapters" / "out_of_tree.yaml"
    assert load_matrix_with_plugins(fixture).names == ("plus_one", "no_refresh")
    assert MatrixContext.load(fixture).matrix.names == ("plus_one", "no_refresh")


def test_a_callable_entry_point_returns_the_path(site: Path) -> None:
    matrix = install(site, "plug_b", "b = plug_b_plugin:fragment",
                     module="from pathlib import Path\n\n"
                            "def fragment():\n"
                            "    return Path(__file__).parent / 'plug_b' / 'matrix.yaml'\n")
    assert load_matrix_with_plugins().names[-1] == "plug_b"
    assert matrix.is_file()


def test_a_name_clash_with_the_shipped_matrix_names_both_files(site: Path) -> None:
    matrix = install(site, "plug_c", "c = plug_c:matrix.yaml",
                     fragment=FRAGMENT.format(name="reference", package="plug_c"))
    with pytest.raises(MatrixError) as caught:
        load_matrix_with_plugins()
    shipped = load_located_matrix(None)
    (problem,) = caught.value.problems
    assert problem.render() == (
        f"{matrix}:3: backend 'reference', field 'name': 'reference' is already declared by "
        f"{shipped.path}:{shipped.name_lines['reference']}; backend names must be unique "
        "across the matrix and its plug-ins")


def test_a_name_clash_between_fragments_names_both_files(site: Path) -> None:
    first = install(site, "plug_d", "d = plug_d:matrix.yaml",
                    fragment=FRAGMENT.format(name="twin", package="plug_d"))
    second = install(site, "plug_e", "e = plug_e:matrix.yaml",
                     fragment=FRAGMENT.format(name="twin", package="plug_e"))
    with pytest.raises(MatrixError) as caught:
        load_matrix_with_plugins()
    (problem,) = caught.value.problems
    assert problem.path == str(second) and problem.line == 3
    assert f"already declared by {first}:3" in problem.message


def test_an_invalid_fragment_reports_its_own_file_and_line(site: Path) -> None:
    broken = FRAGMENT.format(name="plug_f", package="plug_f").replace(
        "cudagraph_support: always", "cudagraph_support: sometimes")
    matrix = install(site, "plug_f", "f = plug_f:matrix.yaml", fragment=broken)
    with pytest.raises(MatrixError) as caught:
        load_matrix_with_plugins()
    (problem,) = caught.value.problems
    assert problem.render().startswith(
        f"{matrix}:9: backend 'plug_f', field 'cudagraph_support': ")


def test_plugins_that_cannot_be_loaded_are_each_one_problem(site: Path) -> None:
    install(site, "plug_g", "g = plug_g_plugin:fragment",
            module="def fragment():\n    raise OSError('no fragment today')\n")
    install(site, "plug_h", "h = plug_h_plugin:fragment", module="def fragment():\n    return 3\n")
    install(site, "plug_i", "i = not_installed_anywhere:matrix.yaml")
    with pytest.raises(MatrixError) as caught:
        load_matrix_with_plugins()
    assert [problem.render() for problem in caught.value.problems] == [
        f"entry point 'g = plug_g_plugin:fragment' (group {ENTRY_POINT_GROUP}, distribution "
        "plug_g): calling it raised OSError: no fragment today",
        f"entry point 'h = plug_h_plugin:fragment' (group {ENTRY_POINT_GROUP}, distribution "
        "plug_h): it returned int, not a path to a matrix fragment (str or os.PathLike)",
        f"entry point 'i = not_installed_anywhere:matrix.yaml' (group {ENTRY_POINT_GROUP}, "
        "distribution plug_i): 'not_installed_anywhere' is not an installed package (no "
        "folder to hold matrix.yaml)",
    ]


def _speccheck(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", "from speccheck.checks.cli.app import main; main()", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )


def test_matrix_and_docs_commands_see_plugins_and_reject_bad_ones(site: Path) -> None:
    install(site, "plug_j", "j = plug_j:matrix.yaml")
    listed = _speccheck(site, "matrix", "--json")
    assert listed.returncode == 0, listed.stderr
    by_name = {item["name"]: item for item in json.loads(listed.stdout)}
    assert by_name["plug_j"]["implementation"] == "plug_j.attention:Builder"
    docs = _speccheck(site, "docs")
    assert docs.returncode == 0 and "[`plug_j`](#plug_j)" in docs.stdout
    alone = _speccheck(site, "matrix", "--json", "--matrix", str(ROOT / "matrix.yaml"))
    assert "plug_j" not in {item["name"] for item in json.loads(alone.stdout)}
    clash = install(site, "plug_k", "k = plug_k:matrix.yaml",
                    fragment=FRAGMENT.format(name="plug_j", package="plug_k"))
    refused = _speccheck(site, "matrix")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        f"{clash}:3: backend 'plug_j', field 'name': 'plug_j' is already declared by "
        f"{site / 'plug_j' / 'matrix.yaml'}:3; backend names must be unique across the "
        "matrix and its plug-ins"]


def test_docs_check_compares_the_shipped_matrix_unless_told_otherwise(site: Path) -> None:
    """An adapter installed into speccheck's own environment does not make the committed
    docs stale: ``docs --check`` reads the shipped matrix alone; ``--plugins`` adds the
    installed fragments (and then the committed file, which lacks them, is stale)."""
    install(site, "plug_m", "m = plug_m:matrix.yaml",
            fragment=FRAGMENT.format(name="plug_m", package="plug_m"))
    committed = str(ROOT / "docs" / "capabilities.md")
    status = str(ROOT / "docs" / "status")
    alone = _speccheck(site, "docs", "--check", "--output", committed, "--status", status)
    assert alone.returncode == 0, alone.stderr
    with_plugins = _speccheck(site, "docs", "--check", "--plugins", "--output", committed,
                              "--status", status)
    assert with_plugins.returncode == 1 and "is stale" in with_plugins.stderr
