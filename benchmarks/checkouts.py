"""Running another checkout of speccheck beside this one: what the side-by-side benchmarks
(``verify_speed.py``, ``bench_ab.py``) share."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""This checkout."""


def not_a_checkout(path: Path) -> str | None:
    """Why ``path`` cannot be run as another checkout (one line), or ``None``."""
    if not (path / "checks" / "cli").is_dir():
        return f"--against {path}: not a speccheck checkout (no checks/cli)"
    return None


@contextlib.contextmanager
def importable(checkout: Path, **extra: str) -> Iterator[tuple[Path, dict[str, str]]]:
    """``(folder, env)`` for a fresh process that imports ``checkout`` as ``speccheck``: a
    temporary folder holding a ``speccheck`` link to it (run the process there), and this
    process's environment with that folder first on ``PYTHONPATH`` (then whatever the
    caller had: wheels installed beside the image), plus ``extra``."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / "speccheck").symlink_to(checkout.resolve())
        path = os.pathsep.join(p for p in (name, os.environ.get("PYTHONPATH", "")) if p)
        yield folder, {**os.environ, "PYTHONPATH": path, **extra}
