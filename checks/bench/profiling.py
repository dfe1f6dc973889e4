"""Host and device time of repeated calls, from one ``torch.profiler`` run (CUDA only).

- host: the profiled wall time minus the time spent in the CUDA runtime's synchronising
  calls (:data:`BLOCKING_CALLS`), i.e. the time the launching thread works rather than
  waits. It includes the profiler's own overhead and the wait inside blocking copies to
  pageable memory, so it is an upper bound and can exceed the unprofiled wall time;
- device: the sum of the kernels, copies and memsets the profiler traced (busy time, not
  the span from first launch to last completion).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

logger = logging.getLogger(__name__)

BLOCKING_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize",
                            "cudaEventSynchronize", "cudaMemcpy"})
"""CUDA runtime calls in which the host waits for the device."""


@dataclass(frozen=True)
class ProfiledTimes:
    """Per call, in ms: ``host_ms``; ``gpu_ms`` (``None`` when the profiler traced no
    device activity, e.g. without CUPTI); ``tables``: the profiler's operators by host
    time and kernels by device time, as text."""

    host_ms: float
    gpu_ms: float | None
    tables: str


def blocked_and_device_us(events: Iterable[Any]) -> tuple[float, float]:
    """Microseconds the host spent in :data:`BLOCKING_CALLS`, and the device's busy time,
    summed over profiler ``events`` (``FunctionEvent``\\ s: ``device_type``, ``name``,
    ``time_range.elapsed_us()``)."""
    blocked = device = 0.0
    for event in events:
        if event.device_type == DeviceType.CPU and event.name in BLOCKING_CALLS:
            blocked += event.time_range.elapsed_us()
        elif event.device_type == DeviceType.CUDA:
            device += event.time_range.elapsed_us()
    return blocked, device


def profile_calls(call: Callable[[], object], repeats: int) -> ProfiledTimes:
    """Run ``call`` ``repeats`` times under the profiler (CPU and CUDA activity) after a
    device synchronisation, and return the figures per call. Needs CUDA."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 acc_events=True) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        wall_us = (time.perf_counter() - start) * 1e6
    blocked_us, device_us = blocked_and_device_us(prof.events())
    if device_us == 0:
        logger.warning("the profiler traced no device activity (CUPTI missing?): no GPU time")
    averages = prof.key_averages()
    tables = averages.table(sort_by="self_cpu_time_total", row_limit=15)
    if device_us:
        tables += "\n" + averages.table(sort_by="self_device_time_total", row_limit=10)
    return ProfiledTimes((wall_us - blocked_us) / repeats / 1e3,
                         device_us / repeats / 1e3 if device_us else None, tables)
