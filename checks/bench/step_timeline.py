"""What one decode step's GPU time is made of: its kernels in the order they start, each
one's duration and the gap before it (CUDA only).

The single-step graph is replayed alone as :func:`~speccheck.checks.bench.roofline.
decode_step_gpu_ms` replays it (inputs rewound, a spin kernel holding the stream while the
host launches), under ``torch.profiler``; a short spin kernel after each replay closes it,
so a replay's kernels are the device events between a long spin and the next short one.
A negative gap is a kernel that started before the one ahead of it ended: a programmatic
dependent, resident and waiting, or a kernel on another stream of the graph.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from speccheck.checks.bench.roofline import HOLD_CYCLES, rewound_step, step_graph_key
from speccheck.speculator.autoregressive import AutoregressiveSpeculator

SPIN_KERNEL = "spin_kernel"
"""The name (a substring of it) of the kernel ``torch.cuda._sleep`` launches."""

CLOSING_SPIN_CYCLES = 1000
"""Cycles of the spin kernel that closes each replay (short: it only marks the end)."""

NAME_WIDTH = 64
"""Characters of a kernel's name in the table."""


@dataclass(frozen=True)
class TimelineKernel:
    """One position of the step's kernel sequence, medians over the replays."""

    name: str
    duration_us: float
    gap_us: float
    """Start minus the end of the kernel that started before it (the spin kernel, for the
    first)."""


@dataclass(frozen=True)
class StepTimeline:
    """The kernels of the replays that launched the most common sequence of kernels."""

    batch: int
    replays: int
    span_us: float
    """Median from the first kernel's start to the last kernel's end."""
    kernels: tuple[TimelineKernel, ...]

    def text(self) -> str:
        lines = [f"decode step timeline, batch {self.batch}: {len(self.kernels)} kernels, "
                 f"median span {self.span_us:.1f} us over {self.replays} replays "
                 "(negative gap: started before the kernel ahead ended)"]
        lines += [f"{i:3d} {k.name[:NAME_WIDTH]:<{NAME_WIDTH}} {k.duration_us:8.2f} us   "
                  f"gap {k.gap_us:7.2f} us" for i, k in enumerate(self.kernels)]
        return "\n".join(lines) + "\n"


def _replays(events: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    """``(name, start, end)`` device events in start order, cut into replays: the events
    after each opening spin kernel (long) until the next closing one; each replay is
    preceded by its opening spin, kept as the first entry."""
    replays: list[list[tuple[str, float, float]]] = []
    current: list[tuple[str, float, float]] | None = None
    for event in events:
        if SPIN_KERNEL in event[0]:
            if current is None:
                current = [event]
            else:
                replays.append(current)
                current = None
        elif current is not None:
            current.append(event)
    return replays


def decode_step_timeline(spec: AutoregressiveSpeculator, batch: int,
                         replays: int) -> StepTimeline | None:
    """The single-step graph's kernels for ``batch`` requests over ``replays`` replays;
    ``None`` without that graph, or when the profiler traced no kernel (no CUPTI)."""
    key = step_graph_key(spec, batch)
    if key is None or spec.graphs is None:
        return None
    torch.cuda.synchronize()
    with rewound_step(spec) as rewind, profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            rewind()
            torch.cuda._sleep(HOLD_CYCLES)
            spec.graphs.replay(key)
            torch.cuda._sleep(CLOSING_SPIN_CYCLES)
        torch.cuda.synchronize()
    events = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == DeviceType.CUDA), key=lambda e: e[1])
    cut = [r for r in _replays(events) if len(r) > 1]
    if not cut:
        return None
    common, _ = Counter(tuple(name for name, _, _ in r[1:]) for r in cut).most_common(1)[0]
    chosen = [r for r in cut if tuple(name for name, _, _ in r[1:]) == common]
    kernels = tuple(
        TimelineKernel(
            name=name,
            duration_us=statistics.median(r[i][2] - r[i][1] for r in chosen),
            gap_us=statistics.median(r[i][1] - r[i - 1][2] for r in chosen))
        for i, name in enumerate(common, start=1))
    span = statistics.median(max(e[2] for e in r[1:]) - r[1][1] for r in chosen)
    return StepTimeline(batch, len(chosen), span, kernels)
