"""The matrices a verification runs against, loaded once and passed explicitly to every
layer (no function falls back to loading a matrix of its own)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import Matrix
from speccheck.contract.plugins import load_matrix_with_plugins


@dataclass(frozen=True)
class MatrixContext:
    """``matrix`` declares the backends under verification (``path``: the file it came
    from; ``None`` for the one shipped with speccheck merged with every installed plug-in's
    fragment, see :mod:`speccheck.contract.plugins`); ``shipped`` is speccheck's own matrix,
    which the fp32 ``reference`` oracle always comes from."""

    matrix: Matrix
    path: Path | None
    shipped: Matrix

    @classmethod
    def load(cls, path: str | Path | None) -> MatrixContext:
        """Load both matrices: ``path`` alone when given (no plug-ins), else the shipped
        matrix and the plug-ins' fragments. Raises
        :class:`~speccheck.contract.matrix_loader.MatrixError`."""
        return cls(load_matrix_with_plugins(path), None if path is None else Path(path),
                   load_matrix(None))

    @property
    def flag(self) -> str:
        """`` --matrix PATH`` for commands that must load the same matrix, else empty."""
        return f" --matrix {shlex.quote(str(self.path))}" if self.path is not None else ""
