"""Work that runs beside an example's oracle and candidates: the fp32 reference's propose.

The fp32 reference speculator shares nothing with the speculator under test but the
example's start state, which it only reads, so its propose need not wait for the oracle and
the candidates. On CUDA it runs in a thread of its own on a stream of its own: its host work
(eager fp32 layers, one read-back per attention call) and its waits for the device overlap
theirs. PyTorch releases the GIL while an operator runs and while a copy to the host waits,
and the current stream is per thread. Elsewhere (the CPU tier, where a second thread would
only compete for the cores) the work runs on the caller's thread when its result is first
asked for.

Contract for the caller:

- The work may read device tensors the caller's stream wrote before :meth:`SideLane.submit`
  (the side stream waits for them) and must not read anything written after it.
- The caller neither writes nor frees what the work reads until :meth:`SideRun.wait` (or
  :meth:`SideRun.result`) has returned.
- The caller waits before anything that must be the process's only device work: a probe that
  sets the process-wide CUDA sync debug mode, a graph capture, the next example.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class SideRun(Generic[T]):
    """One submitted piece of work: :meth:`result` returns its value (or raises its error),
    :meth:`wait` returns once it no longer runs, whatever its outcome."""

    def __init__(self, work: Callable[[], T] | None = None,
                 future: Future[T] | None = None) -> None:
        self._work = work
        self._future = future

    def result(self) -> T:
        if self._future is None:
            assert self._work is not None
            future: Future[T] = Future()
            try:
                future.set_result(self._work())
            except Exception as exc:  # noqa: BLE001 - kept, raised by this and every later call
                future.set_exception(exc)
            self._future, self._work = future, None
        return self._future.result()

    def wait(self) -> None:
        if self._future is not None:
            wait_for([self._future])


class SideLane:
    """Runs work beside the caller's: on CUDA, one thread with a stream of its own (created
    on first use and kept for every later submission); elsewhere, deferred to
    :meth:`SideRun.result` on the caller's thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.concurrent = device.type == "cuda"
        self._pool: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None

    def submit(self, work: Callable[[], T]) -> SideRun[T]:
        if not self.concurrent:
            return SideRun(work=work)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="side-lane")
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))

        def run() -> T:
            try:
                with torch.cuda.stream(stream):
                    return work()
            finally:
                # Every read of the caller's tensors has finished once this returns, so the
                # caller may free or overwrite them after waiting.
                stream.synchronize()

        return SideRun(future=self._pool.submit(run))
