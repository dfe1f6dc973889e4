"""Whether the work being issued now is recorded into a CUDA graph: the one question an
attention call may ask to choose between a host-informed eager path and a fixed-shape path.

A graph is captured for real on a GPU; the verifier also *emulates* a capture
(:func:`emulated_capture`) around the attention calls it traces on any tier, so that a
CPU-only run takes, and checks, the path a graph would record. Code whose work depends on
being captured must ask :func:`capturing`, not torch, or the CPU tier traces a path no
graph ever runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_emulated_depth = 0
"""How many :func:`emulated_capture` blocks are open (the verifier's calls are
single-threaded per process)."""


def capturing() -> bool:
    """True while the current CUDA stream captures a graph, or inside
    :func:`emulated_capture`: host values must not shape the work then (no read-back, no
    data-dependent shape), because a graph replays what it recorded with any values."""
    if _emulated_depth:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextmanager
def emulated_capture() -> Iterator[None]:
    """Inside the block, :func:`capturing` is True although nothing is captured: the
    verifier runs an attention call eagerly on the path a graph would record, and traces
    it for what a capture would reject."""
    global _emulated_depth
    _emulated_depth += 1
    try:
        yield
    finally:
        _emulated_depth -= 1
