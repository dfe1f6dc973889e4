"""Which modules a backend's mutants are made of: its adapter as the matrix names it.

From the matrix entry's ``implementation`` (``module:Class``): the builder class's module;
the module defining the refresh (``update_draft_decode_metadata``) the class inherits or
defines, and the one defining its attention call (``impl_cls``'s ``forward``), wherever they
live, except in ``speccheck.contract`` (the protocol's defaults are not the adapter's); and
every module of the builder's own package (the backend's helpers). For ``reference`` that is
``backends/reference/*.py`` and ``backends/dcp.py`` (the refresh of its DCP share).

Each target knows its top-level package (``speccheck`` for the shipped backends, the
adapter's package for a plug-in): the folder a mutant's run copies to shadow the installed
one.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTRACT_PACKAGE = "speccheck.contract"
"""Where the builder protocol's defaults live: never a target."""


class TargetError(ValueError):
    """A backend or module that cannot be mutated; the message is one line for the user."""


class Role(enum.StrEnum):
    """Why a module is a target."""

    BUILDER = "builder"
    REFRESH = "refresh"
    ATTENTION = "attention"
    HELPER = "helper"
    """Another module of the builder's package."""
    CHOSEN = "chosen"
    """Named with ``--module``."""


@dataclass(frozen=True)
class TargetModule:
    """One module to mutate, with the top-level package a mutant's run shadows."""

    path: Path
    """The module's source file (absolute, resolved)."""
    package: str
    """Its top-level package's import name (``speccheck``)."""
    package_dir: Path
    """That package's folder (resolved): what a mutant's run copies."""
    role: Role

    @property
    def relative(self) -> Path:
        """The module's path inside its package's folder."""
        return self.path.relative_to(self.package_dir)

    @property
    def shown(self) -> str:
        """How reports name it: relative to the working directory where it lies under it
        (``backends/reference/builder.py`` from a checkout), else ``package/relative``."""
        try:
            return str(self.path.relative_to(Path.cwd().resolve()))
        except ValueError:
            return f"{self.package}/{self.relative}"


def backend_targets(implementation: str) -> list[TargetModule]:
    """The target modules of the adapter whose builder is ``implementation``
    (``module:Class``), builder first, each once. Raises :class:`TargetError` when the class
    cannot be imported."""
    module_name, _, class_name = implementation.partition(":")
    try:
        builder = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise TargetError(f"cannot import the builder {implementation}: {exc}") from None
    found: dict[Path, TargetModule] = {}

    def add(module_name: str, role: Role) -> None:
        if module_name == CONTRACT_PACKAGE or module_name.startswith(CONTRACT_PACKAGE + "."):
            return
        target = _target(sys.modules[module_name], role)
        found.setdefault(target.path, target)

    add(builder.__module__, Role.BUILDER)
    refresh = _defining_module(builder, "update_draft_decode_metadata")
    if refresh is not None:
        add(refresh, Role.REFRESH)
    impl = getattr(builder, "impl_cls", None)
    attention = _defining_module(impl, "forward") if isinstance(impl, type) else None
    if attention is not None:
        add(attention, Role.ATTENTION)
    home = _target(sys.modules[builder.__module__], Role.HELPER)
    parent = sys.modules.get(builder.__module__.rpartition(".")[0])
    if parent is not None:
        for path in sorted(Path(inspect.getfile(parent)).resolve().parent.rglob("*.py")):
            if "__pycache__" not in path.parts:
                found.setdefault(path, TargetModule(path, home.package, home.package_dir,
                                                    Role.HELPER))
    return list(found.values())


def _defining_module(cls: type[Any], method: str) -> str | None:
    """The module of the first class in ``cls``'s MRO that defines ``method``."""
    for klass in cls.__mro__:
        if method in vars(klass):
            return klass.__module__
    return None


def _target(module: Any, role: Role) -> TargetModule:
    top = module.__name__.partition(".")[0]
    package_file = getattr(sys.modules[top], "__file__", None)
    if package_file is None:
        raise TargetError(f"{top} is a namespace package: mutate needs a regular package")
    package_dir = Path(package_file).resolve().parent
    return TargetModule(Path(inspect.getfile(module)).resolve(), top, package_dir, role)


def chosen_targets(paths: list[Path], known: list[TargetModule]) -> list[TargetModule]:
    """The modules ``--module`` names (source files), each in the top-level package of a
    ``known`` target that holds it, or else in the package found by walking up its
    ``__init__.py`` files. Raises :class:`TargetError` for a file that is not a Python
    module of a package."""
    chosen: dict[Path, TargetModule] = {}
    for given in paths:
        path = given.resolve()
        if path.suffix != ".py" or not path.is_file():
            raise TargetError(f"--module: {given} is not a Python source file")
        holder = next((t for t in known if path.is_relative_to(t.package_dir)), None)
        if holder is not None:
            chosen.setdefault(path, TargetModule(path, holder.package, holder.package_dir,
                                                 Role.CHOSEN))
            continue
        package_dir = path.parent
        if not (package_dir / "__init__.py").is_file():
            raise TargetError(f"--module: {given} is not inside a Python package")
        while (package_dir.parent / "__init__.py").is_file():
            package_dir = package_dir.parent
        chosen.setdefault(path, TargetModule(path, package_dir.name, package_dir, Role.CHOSEN))
    return list(chosen.values())
