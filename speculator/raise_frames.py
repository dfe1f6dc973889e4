"""Where an error was raised, as plain data that crosses a process boundary (a traceback
does not pickle; its files and line numbers do). Torch-free."""

from __future__ import annotations

import traceback

RaiseFrames = tuple[tuple[str, int | None], ...]
"""Where an error was raised, as ``(file, line)`` pairs: every frame of its traceback, then
of its cause's and so on (:func:`raise_frames`)."""


def raise_frames(error: BaseException) -> RaiseFrames:
    """The frames of ``error``'s traceback, outermost first, followed by those of its
    ``__cause__`` chain: what a rank reports of where it raised (a traceback does not
    cross the process boundary, its file and line numbers do)."""
    frames: list[tuple[str, int | None]] = []
    cause: BaseException | None = error
    while cause is not None:
        frames.extend((frame.filename, frame.lineno)
                      for frame in traceback.extract_tb(cause.__traceback__))
        cause = cause.__cause__
    return tuple(frames)
