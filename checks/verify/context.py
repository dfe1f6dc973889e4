"""The matrices a verification runs against, loaded once and passed explicitly to every
layer (no function falls back to loading a matrix of its own)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from speccheck.contract.matrix_loader import load_matrix
from speccheck.contract.matrix_model import Matrix


@dataclass(frozen=True)
class MatrixContext:
    """``matrix`` declares the backends under verification (``path``: the file it came
    from, ``None`` for the one shipped with speccheck); ``shipped`` is speccheck's own
    matrix, which the fp32 ``reference`` oracle always comes from."""

    matrix: Matrix
    path: Path | None
    shipped: Matrix

    @classmethod
    def load(cls, path: str | Path | None) -> MatrixContext:
        """Load both matrices; raises :class:`~speccheck.contract.matrix_loader.MatrixError`."""
        shipped = load_matrix(None)
        if path is None:
            return cls(shipped, None, shipped)
        return cls(load_matrix(path), Path(path), shipped)

    @property
    def flag(self) -> str:
        """`` --matrix PATH`` for commands that must load the same matrix, else empty."""
        return f" --matrix {shlex.quote(str(self.path))}" if self.path is not None else ""
