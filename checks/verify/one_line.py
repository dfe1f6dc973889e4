"""An exception as one line of a report: its type and first line, and, for a crash, where
it was raised (:mod:`~speccheck.checks.verify.raise_site`)."""

from __future__ import annotations

from speccheck.checks.verify.raise_site import raised_at


def exception_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (the message's other lines, often a traceback
    or a long hint, left out): an error a check expected or explains itself."""
    first_line = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}"


def error_line(error: BaseException) -> str:
    """``module.Type: first line of the message`` of ``error``: how a report names an error
    nothing expected, in one line."""
    lines = str(error).strip().splitlines()
    return (f"{type(error).__module__}.{type(error).__qualname__}: "
            f"{lines[0] if lines else ''}").strip()


def error_summary(error: BaseException) -> str:
    """:func:`error_line` of ``error`` and where it was raised
    (:func:`~speccheck.checks.verify.raise_site.raised_at`): how a report names a raise."""
    site = raised_at(error)
    return f"{error_line(error)} ({site})" if site else error_line(error)
