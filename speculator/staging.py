"""One host-to-device copy for a call's host inputs.

A propose call brings host data (block-table rows, seeds, lengths, positions, token ids):
one small copy each costs a ``cudaMemcpyAsync`` from pageable memory (tens of microseconds
of host time apiece). :class:`HostStaging` packs them into one pinned host buffer and
sends them in a single copy; the caller then copies device views into its persistent
buffers (device-to-device, asynchronous).

Each array starts :data:`ALIGN_BYTES`-aligned in the buffer. Triton compiles a kernel once
per pointer alignment it is handed (16-byte aligned or not): views at arbitrary offsets
would make every kernel that reads staged inputs compile twice per pointer argument as
batch shapes vary, seconds of compilation each the first time a verifier run meets them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

ALIGN_BYTES = 16
_ALIGN = ALIGN_BYTES // torch.int64.itemsize
"""Staged arrays start at multiples of this many int64 values."""


class HostStaging:
    """A pinned int64 host buffer for ``capacity`` values in up to ``max_arrays`` arrays a
    call (with room for each one's alignment padding), and its device twin, both
    persistent. :meth:`stage` never overwrites host memory a pending copy still reads: it
    waits for the previous copy first (normally long done: every propose ends by copying
    its draft tokens back, which waits for all earlier work)."""

    def __init__(self, capacity: int, device: torch.device, max_arrays: int = 16) -> None:
        pinned = device.type == "cuda"
        self.capacity = capacity + max_arrays * (_ALIGN - 1)
        self.host = torch.zeros(self.capacity, dtype=torch.int64, pin_memory=pinned)
        self.device_buffer = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self._host_view = self.host.numpy()
        self._copied = torch.cuda.Event() if pinned else None
        """Recorded after each copy (CUDA only); waited on before the pinned buffer is
        rewritten."""

    def stage(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Copy ``arrays`` (integers, any shapes) to the device in one transfer; returns
        int64 device views of the same shapes, each :data:`ALIGN_BYTES`-aligned, valid
        until the next :meth:`stage`. Host work: never call it inside graph capture."""
        offsets = []
        total = 0
        for array in arrays:
            offsets.append(total)
            total = -(-(total + int(array.size)) // _ALIGN) * _ALIGN
        if total > self.capacity:
            raise ValueError(f"{total} staged values (with alignment) exceed the staging "
                             f"capacity {self.capacity}")
        if self._copied is not None:
            self._copied.synchronize()  # returns at once before the first record
        for offset, array in zip(offsets, arrays, strict=True):
            self._host_view[offset: offset + array.size] = np.asarray(array).reshape(-1)
        self.device_buffer[:total].copy_(self.host[:total], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return [self.device_buffer[o: o + math.prod(a.shape)].view(a.shape)
                for o, a in zip(offsets, arrays, strict=True)]
