"""What every probe reports, and where an offending call came from."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import FrameType

import torch

HOST_SYNC = "host_sync"
ALLOCATION = "allocation"
REPLACED_TENSOR = "replaced_tensor"
ZERO_TAIL = "zero_tail"
GUARD_BAND = "guard_band"


@dataclass(frozen=True)
class ProbeFinding:
    """One capture-safety problem."""

    check: str
    """Which probe found it: ``host_sync``, ``allocation``, ``replaced_tensor``,
    ``zero_tail`` or ``guard_band``."""
    path: str
    """Where: a metadata path (``metadata.scheduler_metadata``), a buffer name, or the
    ``file:line`` call site of the offending call."""
    message: str
    """What is wrong, and what to change."""

    def __str__(self) -> str:
        return f"[{self.check}] {self.path}: {self.message}"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PROBES_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def call_site() -> tuple[str, str]:
    """``("file:line", function)`` of the innermost frame outside torch and the probes."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH_DIR, _PROBES_DIR)):
            return f"{filename}:{frame.f_lineno}", frame.f_code.co_name
        frame = frame.f_back
    return "<unknown>", "<unknown>"
