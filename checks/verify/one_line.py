"""An exception as one line of a report."""

from __future__ import annotations


def exception_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (the message's other lines, often a traceback
    or a long hint, left out)."""
    first_line = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}"
