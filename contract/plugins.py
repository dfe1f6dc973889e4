"""Plug-in backends: matrix fragments that installed packages register through the
``speccheck.backends`` entry-point group, merged with the shipped matrix.

An adapter package declares its backends in a matrix file of its own (a *fragment*: a
complete matrix, ``version: 1`` and ``backends:``) and registers it in its
``pyproject.toml``, in one of two forms::

    [project.entry-points."speccheck.backends"]
    my_backend = "my_package:matrix.yaml"            # a file inside the package
    other = "my_package.plugin:matrix_path"          # a callable returning the path

The first form (the value's attribute ends in ``.yaml`` or ``.yml``) names a file in the
package's folder and locates the package without running its ``__init__`` (parent packages
of a dotted name are imported); the second imports the module and calls the function, which
returns a ``str`` or ``os.PathLike`` naming a file. The entry point's name is only a label.

Each fragment is loaded with :func:`~speccheck.contract.matrix_loader.load_located_matrix`,
so its problems are ``PATH:LINE`` lines like any matrix's; a fragment is self-contained (a
``variant_of`` names an entry of the same fragment). A backend name declared twice (by the
shipped matrix and a fragment, or by two fragments) is an error naming both files and lines.
Nothing but :class:`~speccheck.contract.matrix_loader.MatrixError` leaves this module's
loaders, whatever a plug-in does.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from speccheck.contract.matrix_loader import (
    LocatedMatrix,
    MatrixError,
    MatrixProblem,
    load_located_matrix,
    merge_matrices,
)
from speccheck.contract.matrix_model import Matrix

ENTRY_POINT_GROUP = "speccheck.backends"
"""The entry-point group plug-in packages register their matrix fragments in."""

_FILE_SUFFIXES = (".yaml", ".yml")


def load_matrix_with_plugins(path: str | Path | None = None) -> Matrix:
    """The matrix commands work with: for ``None``, the shipped ``matrix.yaml`` merged with
    every installed plug-in fragment (in distribution and entry-point name order); for a
    path, that file alone (no plug-ins: an explicit matrix is exactly what is verified).

    Raises :class:`MatrixError` listing every problem of every file, clashes included.
    """
    return merge_matrices(located_matrix_files(path))


def located_matrix_files(path: str | Path | None = None) -> list[LocatedMatrix]:
    """The files :func:`load_matrix_with_plugins` merges, each loaded with its positions:
    for ``None`` the shipped matrix and every plug-in fragment, else ``path`` alone."""
    if path is not None:
        return [load_located_matrix(path)]
    return [load_located_matrix(None), *plugin_fragments()]


def plugin_fragments() -> list[LocatedMatrix]:
    """Every registered fragment, loaded and validated; all problems of all fragments (a
    plug-in that cannot be located, a callable that raises, an invalid file) are raised
    together as one :class:`MatrixError`."""
    fragments: list[LocatedMatrix] = []
    problems: list[MatrixProblem] = []
    for entry_point in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                              key=_sort_key):
        label = _label(entry_point)
        try:
            fragments.append(load_located_matrix(_fragment_path(entry_point)))
        except MatrixError as exc:
            problems.extend(exc.problems)
        except _PluginProblem as exc:
            problems.append(MatrixProblem(label, None, None, None, str(exc)))
    if problems:
        raise MatrixError(problems)
    return fragments


class _PluginProblem(Exception):
    """A registered plug-in whose fragment cannot be found; the message says why."""


def _sort_key(entry_point: importlib.metadata.EntryPoint) -> tuple[str, str]:
    return (_distribution(entry_point), entry_point.name)


def _distribution(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist
    return dist.metadata["Name"] if dist is not None else "?"


def _label(entry_point: importlib.metadata.EntryPoint) -> str:
    """How problems name a plug-in: its entry point as written, and its distribution."""
    return (f"entry point '{entry_point.name} = {entry_point.value}' "
            f"(group {ENTRY_POINT_GROUP}, distribution {_distribution(entry_point)})")


def _fragment_path(entry_point: importlib.metadata.EntryPoint) -> Path:
    """The fragment file an entry point names (see the module docstring for the forms)."""
    module, attr = entry_point.module, entry_point.attr
    if not attr:
        raise _PluginProblem("the value must be 'package:file.yaml' or 'module:function'")
    if attr.endswith(_FILE_SUFFIXES):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as exc:
            raise _PluginProblem(f"cannot locate package {module!r}: {exc}") from None
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        if not folders:
            raise _PluginProblem(f"{module!r} is not an installed package (no folder to hold "
                                 f"{attr})")
        return Path(folders[0]) / attr
    try:
        function = entry_point.load()
        result = function()
    except Exception as exc:  # a plug-in's own code: any failure is its problem, reported
        raise _PluginProblem(f"calling it raised {type(exc).__name__}: {exc}") from None
    if not isinstance(result, (str, os.PathLike)):
        raise _PluginProblem(f"it returned {type(result).__name__}, not a path to a matrix "
                             "fragment (str or os.PathLike)")
    return Path(result)
