"""Work that runs beside an example's oracle and candidates: the fp32 reference's propose.

The fp32 reference speculator shares nothing with the speculator under test but the
example's start state, which it only reads, so its propose need not wait for the oracle and
the candidates. On CUDA it is queued, from the caller's thread, on a stream of its own, and
the device runs it beside their work: the reference never waits for the device while it
queues (its builder hands the attention the host lengths of each build,
:class:`~speccheck.checks.verify.oracle.builder.OracleMetadataBuilder`), so queueing
costs the caller only the launches. Elsewhere (the CPU tier) the work runs on the caller's
thread when its result is first asked for.

Contract for the caller:

- The work may read device tensors the caller's stream wrote before :meth:`SideLane.submit`
  (the side stream waits for them) and must not read anything written after it.
- The caller neither writes nor frees what the work reads before :meth:`SideRun.wait` or
  :meth:`SideRun.result` (either makes the caller's stream wait for the work).
- Device tensors the work returns are read on the caller's stream after
  :meth:`SideRun.result`, and read to the host before they are freed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")

SIDE_STREAM_PRIORITY = -1
"""The side stream's priority: a high one, drawn from PyTorch's pool of high-priority
streams, which nothing else in the verifier or the speculator draws from.
``torch.cuda.Stream()`` hands default-priority streams out round-robin from a small
per-device pool that the speculator's graph warm-ups draw from, and the caching allocator
keys its free blocks by stream: a side stream from that pool would share them with the
warm-ups, and with any memory a captured graph still writes after it was freed (a step
recorder that replaced its buffers once did: ``tests/test_step_recorder.py``)."""


class SideRun(Generic[T]):
    """One submitted piece of work: queued on the side stream (``done`` is recorded after
    it), or deferred (``work`` runs at the first :meth:`result`)."""

    def __init__(self, *, work: Callable[[], T] | None = None, value: T | None = None,
                 done: torch.cuda.Event | None = None, device: torch.device | None = None
                 ) -> None:
        self._work = work
        self._value = value
        self._done = done
        self._device = device

    def wait(self) -> None:
        """Make the caller's current stream wait for the work (queued: the host goes on).
        Deferred work does not run."""
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)
            self._done = None

    def result(self) -> T:
        """The work's value, after :meth:`wait`; deferred work runs now (until it has
        returned once: a call after it raised runs it again)."""
        self.wait()
        if self._work is not None:
            self._value = self._work()
            self._work = None
        return self._value  # type: ignore[return-value]


class SideLane:
    """Queues work on a CUDA stream of its own (high-priority, :data:`SIDE_STREAM_PRIORITY`;
    created on first use and kept), or defers it where the device is not CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None

    def submit(self, work: Callable[[], T]) -> SideRun[T]:
        if self.device.type != "cuda":
            return SideRun(work=work)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device, priority=SIDE_STREAM_PRIORITY)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            value = work()
            done = torch.cuda.Event()
            done.record(self._stream)
        return SideRun(value=value, done=done, device=self.device)
