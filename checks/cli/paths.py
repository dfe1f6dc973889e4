"""Checks on the files a command will write, made before any work starts, so that a bad
``--json``, ``--junit`` or ``--output`` costs nothing and ends in one line, not in a
traceback after a long run."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from speccheck.contract.bounded_read import printable_path


def output_path_problem(path: Path, *, create_parents: bool = False) -> str | None:
    """Why ``path`` cannot be written as an output file, as one line
    (``cannot write PATH: WHY``), or ``None`` when it can.

    An existing ``path`` must not be a directory and must be writable; any other kind of
    file (``/dev/null``, ``/dev/stdout``, a FIFO) is accepted as the caller's choice. A new
    ``path`` needs its parent directory to exist and to be writable, or, with
    ``create_parents``, the nearest existing ancestor (the command creates the rest). The
    answer holds at the moment of the call only; writing can still fail later (a full disk).
    """
    shown = printable_path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return _directory_problem(path.parent, shown, create_parents)
    except OSError as exc:
        return f"cannot write {shown}: {exc.strerror or exc}"
    if stat.S_ISDIR(mode):
        return f"cannot write {shown}: it is a directory"
    if not os.access(path, os.W_OK):
        return f"cannot write {shown}: permission denied"
    return None


def _directory_problem(directory: Path, shown: str, create_parents: bool) -> str | None:
    """What stops a new file from being created in ``directory`` (created first, with
    ``create_parents``)."""
    missing = None
    while create_parents and not os.path.lexists(directory) and directory != directory.parent:
        missing, directory = directory, directory.parent
    where = printable_path(directory)
    try:
        mode = os.stat(directory).st_mode
    except FileNotFoundError:
        return f"cannot write {shown}: directory {where} does not exist"
    except OSError as exc:
        return f"cannot write {shown}: {where}: {exc.strerror or exc}"
    if not stat.S_ISDIR(mode):
        return f"cannot write {shown}: {where} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        action = "create directories" if missing is not None else "create files"
        return f"cannot write {shown}: permission denied to {action} in {where}"
    return None
