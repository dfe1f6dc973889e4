"""The folder layout is the architecture: dependencies point one way
(contract <- backends <- speculator <- checks, and inside checks/ from the entry points down
to the probes), and every package says what it owns."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("contract", "backends", "speculator", "checks")
ALLOWED = {
    "contract": set(),
    "backends": {"contract"},
    "speculator": {"contract"},
    "checks": {"contract", "backends", "speculator", "checks"},
}
"""Which layers each layer may import (speculator finds backends through the matrix)."""


def _imported_layers(path: Path) -> set[str]:
    layers = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "speccheck" and len(parts) > 1 and parts[1] in LAYERS:
                layers.add(parts[1])
    return layers


@pytest.mark.parametrize("layer", LAYERS)
def test_dependencies_point_one_way(layer: str) -> None:
    for path in sorted((ROOT / layer).rglob("*.py")):
        wrong = _imported_layers(path) - ALLOWED[layer] - {layer}
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


CHECKS_LAYERS: dict[str, int] = {
    "cli": 7, "pytest_plugin": 7,
    "docgen": 6,
    "status": 5,
    "selftest": 4, "bench": 4, "mutate": 4,
    "api": 3,
    "verify": 2,
    "probes": 1,
    "device_memory": 0, "triton_interpreter": 0, "provenance": 0,
}
"""The layers inside ``checks/``, by rank: a module may import its own part and parts of a
lower rank only, never one of its rank or above. From the top: the entry points (the
command line, the pytest plugin); the docs generator, which reads the status records;
``status``, which runs the tools below it; the tools over the API (the self-test, the
benchmark, the mutation runner, which drives ``speccheck verify`` in subprocesses); the
Python API; the verify engine; the capture-safety probes (and the state
walk they share with the engine); leaf helpers that import nothing of ``checks`` (the
machine's tier, the commit and versions a result is measured at). Imports under ``TYPE_CHECKING`` count too: a
type named across layers is a dependency all the same."""


def _checks_part(path: Path) -> str:
    """The part of ``checks/`` a file belongs to: its subpackage, or its module's name."""
    relative = path.relative_to(ROOT / "checks")
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imported_checks_parts(path: Path) -> set[str]:
    """The parts of ``checks/`` that ``path`` imports (anywhere in the file, conditional,
    deferred and ``TYPE_CHECKING`` imports included)."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "speccheck.checks":
            names = [f"speccheck.checks.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            dotted = name.split(".")
            if dotted[:2] == ["speccheck", "checks"] and len(dotted) > 2:
                parts.add(dotted[2])
    return parts


CHECKS_FILES = sorted(p for p in (ROOT / "checks").rglob("*.py") if p.name != "__init__.py"
                      or p.parent != ROOT / "checks")


@pytest.mark.parametrize("path", CHECKS_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_checks_layers_point_down(path: Path) -> None:
    own = _checks_part(path)
    assert own in CHECKS_LAYERS, f"place checks/{own} in CHECKS_LAYERS"
    upward = sorted(part for part in _imported_checks_parts(path) - {own}
                    if CHECKS_LAYERS.get(part, len(CHECKS_LAYERS)) >= CHECKS_LAYERS[own])
    assert not upward, (f"{path.relative_to(ROOT)} (rank {CHECKS_LAYERS[own]}) imports "
                        f"{[(part, CHECKS_LAYERS.get(part)) for part in upward]}")


def test_the_checks_layer_walk_sees_every_import_form(tmp_path: Path) -> None:
    """The walk behind :func:`test_checks_layers_point_down` finds plain, ``from``,
    package-level, deferred and ``TYPE_CHECKING`` imports, and nothing outside checks/."""
    source = tmp_path / "sample.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import speccheck.checks.api\n"
        "from speccheck.checks import cli\n"
        "from speccheck.checks.verify.run import VerifyRun\n"
        "from speccheck.contract import builder\n"
        "if TYPE_CHECKING:\n"
        "    from speccheck.checks.bench.records import BenchReport\n"
        "def later() -> None:\n"
        "    from speccheck.checks.probes import poison_\n")
    assert _imported_checks_parts(source) == {"api", "cli", "verify", "bench", "probes"}


@pytest.mark.parametrize("package", sorted(p.parent for p in (ROOT / "checks").rglob("__init__.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_checks_package_says_what_it_owns(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8")))
    assert docstring and "TODO" not in docstring and len(docstring) > 60, package


def test_every_package_is_listed_for_the_wheel() -> None:
    """pyproject.toml lists packages explicitly (the repository root is the ``speccheck``
    package); a package missing there is missing from a built wheel while an editable
    install still works."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"speccheck." + ".".join(init.parent.relative_to(root).parts)
             for top in ("contract", "backends", "speculator", "checks")
             for init in (root / top).rglob("__init__.py")}
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
