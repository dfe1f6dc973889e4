"""Where an error was raised, as a one-line report names it.

A kernel interpreter or a library often re-raises what went wrong (Triton's interpreter
wraps every error of a kernel's body in an ``InterpreterError``), so the site is read from
the error's deepest ``__cause__``: its innermost frame, and, where that frame lies in a
library, the innermost frame of the code under verification on the way there (the adapter's
line that called the library). Files are shown relative to the import root that holds them
(``triton/language/semantic.py``, ``speccheck/backends/sparse_swa/impl.py``), else to the
working directory, else whole.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from speccheck.speculator.raise_frames import RaiseFrames, raise_frames

LIBRARIES = frozenset({"torch", "triton", "numpy", "hypothesis", "flashinfer"})
"""Top-level packages whose frames are not the code under verification."""

TRITON_FRONT_END = "triton/language/"
"""Where Triton's language front end lies: an error raised there is a kernel Triton would
not compile (a shape, type or constant-expression check), on a GPU and in the interpreter
alike; a ``tl.device_assert`` that fails at run time is raised elsewhere
(``triton/runtime/interpreter.py``)."""


def raised_at(error: BaseException) -> str:
    """``at FILE:LINE`` of the innermost frame of ``error``'s deepest cause, followed by
    ``, from FILE:LINE`` (the innermost frame outside :data:`LIBRARIES` and the standard
    library) where the innermost frame lies in one; ``""`` when ``error`` carries no
    traceback."""
    return site_of(raise_frames(error))


def site_of(frames: RaiseFrames) -> str:
    """:func:`raised_at` of an error raised through ``frames`` (another process's:
    :class:`~speccheck.speculator.dp_launch.RankFailed` carries them)."""
    if not frames:
        return ""
    roots = [*_import_roots(), Path.cwd().resolve()]
    sites: list[tuple[str, int | None, bool]] = []
    for filename, lineno in frames:
        shown = _shown(filename, roots)
        sites.append((shown, lineno, _in_library(filename, shown)))
    shown, line, in_library = sites[-1]
    site = f"at {shown}:{line}"
    if in_library:
        own = next(((f, n) for f, n, library in reversed(sites) if not library), None)
        if own is not None:
            site += f", from {own[0]}:{own[1]}"
    return site


def _import_roots() -> list[Path]:
    """Import roots, longest first (the most specific one that holds a file names it)."""
    roots = {Path(entry or ".").resolve() for entry in sys.path}
    return sorted(roots, key=lambda root: len(root.parts), reverse=True)


def _shown(filename: str, roots: list[Path]) -> str:
    """``filename`` relative to the first of ``roots`` that holds it, else whole."""
    path = Path(filename)
    if not path.is_absolute():
        return filename
    path = path.resolve()
    for root in roots:
        if path.is_relative_to(root) and path != root:
            return path.relative_to(root).as_posix()
    return path.as_posix()


_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def _in_library(filename: str, shown: str) -> bool:
    """Whether ``filename`` (shown as ``shown``) lies in one of :data:`LIBRARIES` or the
    standard library."""
    if shown.partition("/")[0] in LIBRARIES:
        return True
    path = Path(filename)
    return path.is_absolute() and path.resolve().is_relative_to(_STDLIB) and \
        "site-packages" not in path.parts
