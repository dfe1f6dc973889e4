"""The folder layout is the architecture: dependencies point one way
(contract <- backends <- speculator <- checks), and every package says what it owns."""

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
