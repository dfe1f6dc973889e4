"""``--json PATH|-``, the same for every command that writes a JSON report: ``-`` writes the
JSON to stdout, and then nothing else does (the command's tables and lines go to stderr),
so ``speccheck CMD --json - > out.json`` and ``speccheck CMD --json - | jq`` hold JSON
alone. Exit statuses do not depend on where the JSON goes."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from speccheck.checks.cli.paths import output_path_problem

STDOUT = Path("-")
"""The ``--json`` value that means stdout."""

JSON_HELP = ("Write the JSON report to this file, or to stdout with '-' (everything else "
             "then goes to stderr).")
"""The ``--json`` option's help, shared by the commands."""


def to_stdout(path: Path | None) -> bool:
    """Whether ``path`` is ``-``: the JSON goes to stdout."""
    return path == STDOUT


def json_path_problem(path: Path | None) -> str | None:
    """Why the ``--json`` target cannot be written (one line), or ``None``: stdout always
    can; a file as :func:`~speccheck.checks.cli.paths.output_path_problem` says."""
    if path is None or to_stdout(path):
        return None
    return output_path_problem(path)


def write_json_text(path: Path, text: str) -> None:
    """``text`` (a whole JSON document) to ``path``, or to stdout where ``path`` is ``-``."""
    if to_stdout(path):
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    else:
        path.write_text(text, encoding="utf-8")


def report_console(json_path: Path | None, *, width: int | None = None) -> Console:
    """The console a command prints its tables and lines on: stdout, or stderr where the
    JSON goes to stdout. ``width`` as for :class:`rich.console.Console` (``None``: the
    terminal's)."""
    return Console(stderr=to_stdout(json_path), highlight=False, emoji=False, width=width)
