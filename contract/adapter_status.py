"""Whether a matrix entry's implementation exists here, found without importing it.

A declaration with nothing behind it is a claim nobody verified: resolution reports such an
entry as "declared, unverified" instead of "fused: yes". The lookup walks the module path
with :class:`importlib.machinery.PathFinder` and executes no module (importing an adapter
imports torch, which ``speccheck matrix``, ``docs`` and ``schema`` do not need); where the
module is Python source, its syntax tree must bind the class name at top level (a class
statement, an assignment or an import), so a typo in the class part of ``module:Class`` is
"not found" too. Whether the module really imports and the class is a builder is the
verify pre-flight's question.
"""

from __future__ import annotations

import ast
import difflib
import enum
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

from speccheck.contract.matrix_model import BackendEntry


def implementation_path(cls: type) -> str:
    """The ``module:Class`` path by which a matrix entry's ``implementation`` names
    ``cls`` (what the verify worker imports)."""
    return f"{cls.__module__}:{cls.__qualname__}"


class AdapterStatus(enum.Enum):
    """What stands behind an entry's ``implementation``."""

    FOUND = "found"
    """The module of ``implementation`` exists on the import path."""
    NOT_SHIPPED = "not shipped"
    """``implementation`` is null: the entry declares capabilities only."""
    NOT_FOUND = "not found"
    """``implementation`` names a module that is not on the import path."""
    CLASS_NOT_FOUND = "class not found"
    """The module exists, but its source binds no such name at top level."""


def _module_file(dotted: str) -> Path | None | bool:
    """The source file of module ``dotted`` (a package's ``__init__.py``); ``True`` when it
    exists without Python source to read (an extension, a namespace package); ``False``
    when it cannot be located. Executes neither it nor its parents (packages already
    imported are used as they are; a folder without ``__init__.py`` is a namespace
    package)."""
    parts = dotted.split(".")
    search: list[str] = []
    for depth, part in enumerate(parts, start=1):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name)
        if loaded is not None:
            search = list(getattr(loaded, "__path__", None) or [])
        elif depth == 1:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                return False
            if spec is None:
                return False
            search = list(spec.submodule_search_locations or [])
            if depth == len(parts):
                origin = Path(spec.origin) if spec.origin else None
                return origin if origin is not None and origin.suffix == ".py" else True
        else:
            folders = [Path(d) / part for d in search if (Path(d) / part).is_dir()]
            files = [Path(d) / (part + suffix) for d in search
                     for suffix in importlib.machinery.all_suffixes()]
            if depth == len(parts):
                return _located(folders, [f for f in files if f.is_file()])
            search = [str(f) for f in folders]
        if depth < len(parts) and not search:
            return False  # a plain module has no submodules
    loaded = sys.modules.get(dotted)
    origin = getattr(getattr(loaded, "__spec__", None), "origin", None)
    return Path(origin) if origin and str(origin).endswith(".py") else True


def _located(folders: list[Path], files: list[Path]) -> Path | bool:
    for folder in folders:
        init = folder / "__init__.py"
        return init if init.is_file() else True
    for file in files:
        return file if file.suffix == ".py" else True
    return False


def top_level_names(source: Path) -> set[str] | None:
    """The names ``source`` binds at top level (classes, functions, assignments, imports);
    ``None`` when it cannot be read or parsed (the import will say why)."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def missing_class(implementation: str) -> str | None:
    """Why the class part of ``module:Class`` is missing from the module's source, with the
    closest top-level name as a suggestion; ``None`` when it is there or cannot be told
    without importing."""
    module, _, qualname = implementation.partition(":")
    found = _module_file(module)
    if not isinstance(found, Path) or not qualname:
        return None
    names = top_level_names(found)
    first = qualname.split(".")[0]
    if names is None or first in names:
        return None
    close = difflib.get_close_matches(first, sorted(names), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{found} defines no {first!r} at top level{hint}"


def adapter_status(entry: BackendEntry) -> AdapterStatus:
    """:class:`AdapterStatus` of ``entry``'s implementation (a file-system lookup)."""
    if entry.implementation is None:
        return AdapterStatus.NOT_SHIPPED
    module, _, _ = entry.implementation.partition(":")
    if _module_file(module) is False:
        return AdapterStatus.NOT_FOUND
    if missing_class(entry.implementation) is not None:
        return AdapterStatus.CLASS_NOT_FOUND
    return AdapterStatus.FOUND
