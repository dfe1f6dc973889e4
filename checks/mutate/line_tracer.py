"""A line tracer for the unmutated coverage run, installed in every process of a verify run
as its ``sitecustomize`` module: :mod:`speccheck.checks.mutate.coverage_run` copies this
file, as ``sitecustomize.py``, into a folder on ``PYTHONPATH``, so the verify command, its
worker processes and any process they spawn start it before anything else runs.

Self-contained (standard library only, nothing of speccheck is imported: it runs before
the shadow copy is importable). It does nothing unless :data:`TRACE_DIR_ENV` and
:data:`TRACE_FILES_ENV` are set; then it traces, on every thread, the lines executed in the
files named there (``os.pathsep``-separated absolute paths, compared with each code
object's ``co_filename``) and at exit writes them to ``<dir>/<pid>.json`` as
``{path: {phase: [line, ...]}}`` (whole: a partial file has another name). Frames of other
files are not traced line by line, so the cost is one call per Python function call, and a
walk up the stack per call of a traced file's function.

A line's *phase* is what the adapter was doing when it ran: ``metadata`` under a method of
a metadata builder (a class with ``AttentionMetadataBuilder`` among its bases' names:
build, refresh, planning, construction), ``attention`` under a method of an attention impl
(``AttentionImpl``), whichever is the innermost on the stack; ``other`` under neither. A
mutant of a metadata line changes a field a check can name; one of an attention line
changes only what the attention computes. A process that ends with ``os._exit`` records
nothing.
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

PHASE_CLASSES = (("AttentionMetadataBuilder", "metadata"), ("AttentionImpl", "attention"))
"""The contract's base classes by name, and the phase of a line run under their methods."""
OTHER_PHASE = "other"


def phase_of(frame: FrameType | None) -> str:
    """The phase of the code ``frame`` runs: that of the innermost frame on its stack (itself
    included) whose ``self`` is an instance of a class of :data:`PHASE_CLASSES`."""
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            bases = {cls.__name__ for cls in type(frame.f_locals.get("self")).__mro__}
            for name, phase in PHASE_CLASSES:
                if name in bases:
                    return phase
        frame = frame.f_back
    return OTHER_PHASE


def start_from_environment() -> None:
    """Start tracing as the environment says (see the module docstring)."""
    directory, files = os.environ.get(TRACE_DIR_ENV), os.environ.get(TRACE_FILES_ENV)
    if not directory or not files:
        return
    targets = frozenset(files.split(os.pathsep))
    executed: dict[str, dict[str, set[int]]] = {}

    def trace_calls(frame: FrameType, event: str, arg: Any) -> Any:
        filename = frame.f_code.co_filename
        if filename not in targets:
            return None
        lines = executed.setdefault(filename, {}).setdefault(phase_of(frame), set())

        def trace_lines(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                lines.add(frame.f_lineno)
            return trace_lines

        return trace_lines

    def write() -> None:
        sys.settrace(None)
        lines = {path: {phase: sorted(numbers) for phase, numbers in phases.items()}
                 for path, phases in executed.items()}
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
