"""What a result was measured at: the commit under test, its place in history, whether the
tree matched it, and the library versions. Shared by the commands that write results
(``verify --json``, ``bench``, ``status``).

A copy of the tree without a usable ``.git`` (as on the lent GPU machine) names its commit
through ``$SPECCHECK_COMMIT`` and, optionally, ``$SPECCHECK_COMMIT_INDEX`` (the commit's
``git rev-list --count``); the launching script sets both.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path

COMMIT_ENV = "SPECCHECK_COMMIT"
COMMIT_INDEX_ENV = "SPECCHECK_COMMIT_INDEX"
_TREE = Path(__file__).resolve().parents[1]


def _git(*args: str, cwd: Path = _TREE) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd,
                              check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commit_under_test() -> str:
    """``$SPECCHECK_COMMIT`` when set, else ``git rev-parse HEAD``, else ``unknown``."""
    return os.environ.get(COMMIT_ENV) or _git("rev-parse", "HEAD") or "unknown"


def commit_index() -> int | None:
    """How many commits the history holds up to the commit under test (``None``: unknown)."""
    given = os.environ.get(COMMIT_INDEX_ENV)
    if given is not None:
        return int(given) if given.isdecimal() else None
    if os.environ.get(COMMIT_ENV):
        return None  # a named commit whose history this copy may not hold
    counted = _git("rev-list", "--count", "HEAD")
    return int(counted) if counted and counted.isdecimal() else None


def tree_dirty() -> bool | None:
    """Whether tracked files outside ``docs/`` differ from the commit under test (``None``
    where git cannot tell, e.g. a copy without ``.git``)."""
    if os.environ.get(COMMIT_ENV):
        return None
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs")
    return None if changed is None else bool(changed)


def uncommitted(paths: Iterable[Path]) -> list[Path] | None:
    """Those of ``paths`` (resolved; all in the repository of the first one's folder) that
    differ from its HEAD, the commit under test: changed, staged or untracked; ``None``
    where git cannot tell (a copy without ``.git``, or one that names its commit through
    ``$SPECCHECK_COMMIT``)."""
    chosen = [path.resolve() for path in paths]
    if os.environ.get(COMMIT_ENV):
        return None
    if not chosen:
        return []
    where = chosen[0].parent
    root = _git("rev-parse", "--show-toplevel", cwd=where)
    if root is None:
        return None
    changed = _git("status", "--porcelain", "--untracked-files=all", "--", *map(str, chosen),
                   cwd=where)
    if changed is None:
        return None
    listed = {Path(root) / line.split(None, 1)[1] for line in changed.splitlines() if line}
    return [path for path in chosen if path in listed]


def library_versions(*distributions: str) -> dict[str, str]:
    """Python's version and each installed distribution's (speccheck, torch, triton, numpy
    and ``distributions``); one that is not installed is left out."""
    versions = {"python": platform.python_version()}
    for name in ("speccheck", "torch", "triton", "numpy", *distributions):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
