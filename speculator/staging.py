"""One host-to-device copy for a call's host inputs.

A propose call brings host data (block-table rows, seeds, lengths, positions, token ids):
one small copy each costs a ``cudaMemcpyAsync`` from pageable memory (tens of microseconds
of host time apiece). :class:`HostStaging` packs them into one pinned host buffer and
sends them in a single copy; the caller then reads them on the device: a kernel from the
one buffer at each array's offset, or tensor ops through views, made only when asked for
(each view is a few microseconds of host time).

A kernel gets the buffer (one pointer, always the same) and finds the arrays in it from
sizes staged with them (:func:`~speccheck.speculator.pass_inputs.stage_pass_inputs`), not
from views or batch-dependent launch arguments: Triton compiles a kernel again for each new
pointer alignment and each integer divisible by 16 or equal to 1, so views at
batch-dependent offsets would compile it again and again as batch shapes vary (seconds
each, the first time a verifier run meets them), and a graph could not hold its launch.

The device buffer is persistent: the whole-propose graph reads it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import overload

import numpy as np
import torch

from speccheck.contract.stream_events import cuda_device_index, record_on_current_stream


class StagedArrays(Sequence[torch.Tensor]):
    """The arrays one :meth:`HostStaging.stage` sent, in order: int64 values in
    :attr:`buffer` (device) from :attr:`offsets` on, shaped :attr:`shapes`. As a sequence:
    device views of them, made on access. Valid until the next :meth:`HostStaging.stage`."""

    def __init__(self, buffer: torch.Tensor, offsets: Sequence[int],
                 shapes: Sequence[tuple[int, ...]]) -> None:
        self.buffer = buffer
        self.offsets = tuple(offsets)
        self.shapes = tuple(shapes)

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        offset, shape = self.offsets[index], self.shapes[index]
        return self.buffer[offset: offset + math.prod(shape)].view(shape)


class HostStaging:
    """A pinned int64 host buffer of ``capacity`` entries and its device twin, both
    persistent. :meth:`stage` never overwrites host memory a pending copy still reads: it
    waits for the previous copy first (normally long done: every propose ends by copying
    its draft tokens back, which waits for all earlier work)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.capacity = capacity
        self.host = torch.zeros(capacity, dtype=torch.int64, pin_memory=pinned)
        self.device_buffer = torch.zeros(capacity, dtype=torch.int64, device=device)
        self._host_view = self.host.numpy()
        self._spans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """``(device, host)`` views of the first ``size`` entries, by size: a copy covers
        the staged values rounded up to a power of two, so a call makes no view of its
        own (each is a few microseconds of host time)."""
        self._copied = torch.cuda.Event() if pinned else None
        """Recorded after each copy (CUDA only); waited on before the pinned buffer is
        rewritten."""
        self._device_index = cuda_device_index(device) if pinned else -1

    def stage(self, arrays: Sequence[np.ndarray]) -> StagedArrays:
        """Copy ``arrays`` (integers, any shapes) to the device in one transfer, one after
        the other. Host work: never call it inside graph capture."""
        offsets = []
        total = 0
        for array in arrays:
            offsets.append(total)
            total += int(array.size)
        if total > self.capacity:
            raise ValueError(f"{total} staged values exceed the staging capacity {self.capacity}")
        if self._copied is not None:
            self._copied.synchronize()  # returns at once before the first record
        for offset, array in zip(offsets, arrays, strict=True):
            self._host_view[offset: offset + array.size] = np.asarray(array).reshape(-1)
        device, host = self._span(total)
        device.copy_(host, non_blocking=True)
        if self._copied is not None:
            record_on_current_stream(self._copied, self._device_index)
        return StagedArrays(self.device_buffer, offsets, [a.shape for a in arrays])

    def _span(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = min(1 << max(total - 1, 0).bit_length(), self.capacity)
        span = self._spans.get(size)
        if span is None:
            span = self._spans[size] = (self.device_buffer[:size], self.host[:size])
        return span
