"""Whether a matrix entry's implementation exists here, found without importing it.

A declaration with nothing behind it is a claim nobody verified: resolution reports such an
entry as "declared, unverified" instead of "fused: yes". The lookup walks the module path
with :class:`importlib.machinery.PathFinder` and executes no module (importing an adapter
imports torch, which ``speccheck matrix``, ``docs`` and ``schema`` do not need). Whether
the module really imports and holds a builder class is the verify pre-flight's question.
"""

from __future__ import annotations

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


def _module_exists(dotted: str) -> bool:
    """Whether the module ``dotted`` can be located, without executing it or its parents
    (packages already imported are used as they are; a folder without ``__init__.py`` counts
    as a namespace package)."""
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
        else:
            folders = [Path(d) / part for d in search if (Path(d) / part).is_dir()]
            files = [Path(d) / (part + suffix) for d in search
                     for suffix in importlib.machinery.all_suffixes()]
            if depth == len(parts):
                return bool(folders) or any(f.is_file() for f in files)
            search = [str(f) for f in folders]
        if depth < len(parts) and not search:
            return False  # a plain module has no submodules
    return True


def adapter_status(entry: BackendEntry) -> AdapterStatus:
    """:class:`AdapterStatus` of ``entry``'s implementation (a file-system lookup)."""
    if entry.implementation is None:
        return AdapterStatus.NOT_SHIPPED
    module, _, _ = entry.implementation.partition(":")
    return AdapterStatus.FOUND if _module_exists(module) else AdapterStatus.NOT_FOUND
