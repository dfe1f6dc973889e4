"""An exception as one line of a report: its type and first line, and, for a crash, where
it was raised (:mod:`~speccheck.checks.verify.raise_site`)."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class RaisedError:
    """An error nothing expected, as text: what a report keeps of a raise (no frames, no
    locals)."""

    line: str
    """:func:`error_line` of the error (of a rank's: the first line of its
    :class:`~speccheck.speculator.dp_launch.RankFailed`)."""
    site: str
    """Where it was raised (:func:`~speccheck.checks.verify.raise_site.raised_at`:
    ``at FILE:LINE[, from FILE:LINE]``); ``""`` for an error that carries no traceback."""

    @classmethod
    def of(cls, error: BaseException) -> RaisedError:
        return cls(error_line(error), raised_at(error))

    @property
    def summary(self) -> str:
        """The line and the site in parentheses: how a report names a raise."""
        return f"{self.line} ({self.site})" if self.site else self.line
