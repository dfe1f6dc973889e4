"""What the profilers say about repeated launches (CUDA only).

- :func:`profile_calls`: ``torch.profiler`` over ``repeats`` launches: the device's busy
  time (the union of the kernels, copies and memsets it traced, not the span from first
  launch to last completion), its operator and kernel tables, and ``cProfile``'s table of
  the launching thread's Python functions (where host time goes; the profilers' own
  overhead inflates both, so host time itself is measured unprofiled, by the caller);
- :func:`launch_sync_sites`: the call sites in one launch that may wait for the device (a
  launch's host time would include the wait).
"""

from __future__ import annotations

import cProfile
import io
import logging
import pstats
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from speccheck.checks.probes.host_sync import HostSyncRecorder

logger = logging.getLogger(__name__)

HOST_FUNCTIONS = 25
"""Rows of the launching thread's Python profile (by own time) in the tables."""

KERNEL_ROWS = 40
"""Rows of the kernel table (by device time): every kernel a propose of the two-layer
drafter launches (a decode step is about 25), so a step's whole breakdown is in it."""


@dataclass(frozen=True)
class ProfiledTimes:
    """Per call: ``gpu_ms`` (``None`` when the profiler traced no device activity, e.g.
    without CUPTI); ``tables``: the profiler's operators by host time and kernels by device
    time, then the launching thread's Python functions by own time, as text."""

    gpu_ms: float | None
    tables: str


def device_us(events: Iterable[Any]) -> float:
    """Microseconds in which the device was busy, from profiler ``events``
    (``FunctionEvent``\\ s: ``device_type``, ``time_range.start`` and ``.end``): the length
    of the union of the device events' intervals. Kernels that overlap count once: a
    kernel launched as a programmatic dependent is resident, waiting, while the kernel
    ahead finishes, and a sum of durations would count that stretch twice."""
    spans = sorted((event.time_range.start, event.time_range.end) for event in events
                   if event.device_type == DeviceType.CUDA)
    busy, covered = 0.0, float("-inf")
    for start, end in spans:
        if end > covered:
            busy += end - max(start, covered)
            covered = end
    return busy


def profile_calls(call: Callable[[], object], repeats: int) -> ProfiledTimes:
    """Run ``call`` ``repeats`` times under the profiler (CPU and CUDA activity), then
    ``repeats`` times under ``cProfile``, waiting for the device after each call (as a
    serving loop does when it copies the tokens back: back to back, a replay of a graph
    still in flight blocks the launching thread, and the tables would show that wait), and
    return the figures per call. Needs CUDA."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 acc_events=True) as prof:
        for _ in range(repeats):
            call()
            torch.cuda.synchronize()
    busy_us = device_us(prof.events())
    if busy_us == 0:
        logger.warning("the profiler traced no device activity (CUPTI missing?): no GPU time")
    averages = prof.key_averages()
    tables = averages.table(sort_by="self_cpu_time_total", row_limit=15)
    if busy_us:
        tables += "\n" + averages.table(sort_by="self_device_time_total", row_limit=KERNEL_ROWS)
    tables += "\n" + _python_profile(call, repeats)
    return ProfiledTimes(busy_us / repeats / 1e3 if busy_us else None, tables)


def _python_profile(call: Callable[[], object], repeats: int) -> str:
    """``cProfile``'s functions of ``repeats`` calls by own time (:data:`HOST_FUNCTIONS`)."""
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    for _ in range(repeats):
        profiler.enable()
        call()
        profiler.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats(pstats.SortKey.TIME).print_stats(HOST_FUNCTIONS)
    return f"launching thread, Python functions by own time ({repeats} calls):\n{text.getvalue()}"


def launch_sync_sites(call: Callable[[], object]) -> tuple[str, ...]:
    """The distinct ``op at site`` of every operation in one ``call`` that may wait for the
    device, in first-seen order (:class:`~speccheck.checks.probes.host_sync.HostSyncRecorder`,
    device tensors only: host-side tensor work does not wait for the device)."""
    torch.cuda.synchronize()
    with HostSyncRecorder(device_only=True) as syncs:
        call()
    torch.cuda.synchronize()
    return tuple(dict.fromkeys(f"{event.op} at {event.site}" for event in syncs.events))
