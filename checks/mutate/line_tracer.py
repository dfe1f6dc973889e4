"""A line tracer for the unmutated coverage run, installed in every process of a verify run
as its ``sitecustomize`` module: :mod:`speccheck.checks.mutate.coverage_run` copies this
file, as ``sitecustomize.py``, into a folder on ``PYTHONPATH``, so the verify command, its
worker processes and any process they spawn start it before anything else runs.

Self-contained (standard library only, nothing of speccheck is imported: it runs before
the shadow copy is importable). It does nothing unless :data:`TRACE_DIR_ENV` and
:data:`TRACE_FILES_ENV` are set; then it traces, on every thread, the lines executed in the
files named there (``os.pathsep``-separated absolute paths, compared with each code
object's ``co_filename``) and at exit writes them to ``<dir>/<pid>.json`` as
``{path: [line, ...]}`` (whole: a partial file has another name). Frames of other files are
not traced line by line, so the cost is one call per Python function call. A process that
ends with ``os._exit`` records nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from types import FrameType
from typing import Any

TRACE_DIR_ENV = "SPECCHECK_LINE_TRACE_DIR"
TRACE_FILES_ENV = "SPECCHECK_LINE_TRACE_FILES"


def start_from_environment() -> None:
    """Start tracing as the environment says (see the module docstring)."""
    directory, files = os.environ.get(TRACE_DIR_ENV), os.environ.get(TRACE_FILES_ENV)
    if not directory or not files:
        return
    targets = frozenset(files.split(os.pathsep))
    executed: dict[str, set[int]] = {}

    def trace_lines(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            executed[frame.f_code.co_filename].add(frame.f_lineno)
        return trace_lines

    def trace_calls(frame: FrameType, event: str, arg: Any) -> Any:
        filename = frame.f_code.co_filename
        if filename not in targets:
            return None
        executed.setdefault(filename, set())
        return trace_lines

    def write() -> None:
        sys.settrace(None)
        lines = {path: sorted(numbers) for path, numbers in executed.items()}
        # Whole files only: a reader may list the folder while a process still writes (the
        # fork server's handlers run as the command that reads is returning).
        path = os.path.join(directory, f"{os.getpid()}.json")
        with open(f"{path}.partial", "w", encoding="utf-8") as out:
            json.dump(lines, out)
        os.replace(f"{path}.partial", path)

    atexit.register(write)
    threading.settrace(trace_calls)
    sys.settrace(trace_calls)


if __name__ == "sitecustomize":
    start_from_environment()
