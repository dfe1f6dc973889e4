"""Reading a file a user names, within a bound and without blocking.

Input files (a matrix, a reproduce blob) are untrusted: a FIFO, a device or a directory
must give one line saying what it is, never a hang or an unbounded read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def printable_path(path: str | Path) -> str:
    """``path`` as messages show it: as given, but with everything escaped (``ascii``) when
    any character is unprintable (a newline, an undecodable byte), so a message stays one
    printable line."""
    text = str(path)
    return text if text.isprintable() else ascii(text)[1:-1]


class UnreadableFile(Exception):
    """The file cannot be read; the message is one line (the reason), without the path."""


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``path`` (more than ``limit`` tells the caller the file
    is too long, even one that grows meanwhile). Refuses anything but a regular file before
    reading: a FIFO is opened without blocking. Raises :class:`UnreadableFile`."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(descriptor, "rb") as stream:
            mode = os.fstat(stream.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise UnreadableFile(f"it is {_file_kind(mode)}, not a regular file")
            return stream.read(limit + 1)
    except OSError as exc:
        raise UnreadableFile(exc.strerror or str(exc)) from None


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((word for test, word in kinds if test(mode)), "a special file")
