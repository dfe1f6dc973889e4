"""Capture and replay of FULL CUDA graphs, keyed by what they run and their padded size."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from speccheck.contract.cudagraph import CUDAGraphMode

logger = logging.getLogger(__name__)


class CudaGraphUnavailable(RuntimeError):
    """A graph mode other than NONE was asked for on a machine without CUDA."""


def require_graph_support(mode: CUDAGraphMode, device: torch.device) -> None:
    """Refuse graph modes that cannot run here, instead of silently running eagerly."""
    if mode == CUDAGraphMode.NONE:
        return
    if device.type != "cuda" or not torch.cuda.is_available():
        raise CudaGraphUnavailable(
            f"cudagraph_mode={mode.name.lower()} needs a CUDA device, but the drafter runs on "
            f"{device.type!s} (torch.cuda.is_available()={torch.cuda.is_available()}); "
            "use cudagraph_mode=none on this machine"
        )


class CudaGraphManager:
    """Buckets of padded batch sizes and the graphs captured for them.

    All graphs share one memory pool. A body is warmed up on a side stream before capture
    (lazy initialisation, autotuning and allocator growth must not be captured). Bodies must
    read and write only persistent buffers: a replay re-runs the recorded kernels on the
    recorded addresses.
    """

    def __init__(self, capture_sizes: Sequence[int], device: torch.device) -> None:
        if not capture_sizes or min(capture_sizes) < 1:
            raise ValueError(f"capture sizes must be positive, got {list(capture_sizes)}")
        self.capture_sizes = sorted(set(capture_sizes))
        self.device = device
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        """The memory pool every graph of this manager shares (a CUDA pool handle, opaque
        to Python)."""

    def capture(self, key: Hashable, body: Callable[[], None], warmup_runs: int = 1) -> None:
        """Warm ``body`` up on a side stream, then capture it into the shared pool."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup_runs):
                body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # No cyclic garbage collection while the stream captures: a collection there runs
        # the finalizers of unrelated dropped objects, and one that frees a CUDA graph (or
        # anything else the driver refuses during capture) invalidates this capture.
        # torch.cuda.graph does not collect before it begins (unless torch.compiler's
        # force_cudagraph_gc is set): a process that dropped earlier speculators frees them
        # with gc.collect() before capturing new ones.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                body()
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize(self.device)
        self._graphs[key] = graph
        logger.debug("captured CUDA graph %s", key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def captured(self) -> Mapping[Hashable, torch.cuda.CUDAGraph]:
        """The captured graphs by key, read-only (what a benchmark inspects: nodes, launch
        cost); replay them through :meth:`replay` only, with their inputs written."""
        return MappingProxyType(self._graphs)

    def replay(self, key: Hashable) -> None:
        graph = self._graphs.get(key)
        if graph is None:
            raise KeyError(f"no CUDA graph captured for {key}; captured: {sorted(map(str, self._graphs))}")
        graph.replay()

    def reset(self) -> None:
        self._graphs.clear()
