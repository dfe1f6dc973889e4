"""Running another checkout of speccheck beside this one: what the side-by-side benchmarks
(``verify_speed.py``, ``bench_ab.py``) share."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""This checkout."""


def checkouts_to_run(parser: argparse.ArgumentParser, against: Path | None) -> dict[str, Path]:
    """The checkouts a side-by-side benchmark runs, by label: ``this``, and ``against`` when
    given. A folder that is not a speccheck checkout ends the command through
    ``parser.error`` (one line, exit 2) before anything runs."""
    if against is None:
        return {"this": ROOT}
    if not (against / "checks" / "cli").is_dir():
        parser.error(f"--against {against}: not a speccheck checkout (no checks/cli)")
    return {"this": ROOT, "against": against.resolve()}


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
