"""How far one decode step is from reading the drafter's weights once.

A decode step at batch 1 is memory-bound: it must read every weight it multiplies with
(every parameter but the embedding table, of which it reads one row per token). The
*weight-read bound* is those bytes over the device's copy bandwidth, measured here with a
device-to-device copy (the report divides them:
:attr:`~speccheck.checks.bench.records.BenchReport.weight_read_bound_ms`); a step's GPU
time is the single-step graph replayed alone between CUDA events, the graph already queued
when the first event fires (:func:`decode_step_gpu_ms`). Both need CUDA.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator

import torch

from speccheck.speculator.autoregressive import AutoregressiveSpeculator

COPY_BYTES = 1 << 30
"""Bytes copied per bandwidth measurement: large enough to stream from HBM, not cache."""

HOLD_CYCLES = 2_000_000
"""GPU clock cycles (about a millisecond on an H200) a spin kernel holds the stream before
each timed replay: far longer than the host takes to launch the graph, so the start event
fires with the whole replay queued behind it."""


def copy_bandwidth_gbps(device: torch.device, rounds: int = 5, copies: int = 4) -> float:
    """GB/s of a device-to-device copy of :data:`COPY_BYTES` (bytes read plus written): the
    fastest of ``rounds`` timed runs of ``copies`` copies each. Whatever disturbs a round (a
    clock dip, another process's kernels) only slows it, so the fastest round is the
    device's bandwidth; a slow one would lengthen the weight-read bound and flatter every
    ratio to it (one H200 gave 3806 GB/s in a single run of ten copies, against 4240 to
    4270 in every other run)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    fastest_ms = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(copies):
            dst.copy_(src)
        end.record()
        end.synchronize()
        fastest_ms = min(fastest_ms, start.elapsed_time(end))
    return 2 * COPY_BYTES * copies / (fastest_ms / 1e3) / 1e9


@contextlib.contextmanager
def rewound_step(spec: AutoregressiveSpeculator) -> Iterator[Callable[[], None]]:
    """A function that puts back the inputs a decode step advances (positions, lengths,
    token ids, step counter) as the last propose left them, so that every replay of the
    single-step graph after it is the same step 1; on exit they are put back once more.
    Device copies on the current stream, outside any graph."""
    advanced = (spec.buffers.positions, spec.buffers.seq_lens, spec.input_ids)
    saved = [tensor.clone() for tensor in advanced]

    def rewind() -> None:
        for tensor, value in zip(advanced, saved, strict=True):
            tensor.copy_(value)
        spec.current_step.fill_(1)

    try:
        yield rewind
    finally:
        for tensor, value in zip(advanced, saved, strict=True):
            tensor.copy_(value)


def step_graph_key(spec: AutoregressiveSpeculator, batch: int) -> tuple[str, int] | None:
    """The key of the single-step graph for ``batch`` requests, ``None`` without one."""
    key = ("step", spec.bucket_for(batch))
    return key if spec.graphs is not None and key in spec.graphs else None


def decode_step_gpu_ms(spec: AutoregressiveSpeculator, batch: int, repeats: int) -> float | None:
    """Median GPU time of the single-step graph for ``batch`` requests, replayed alone
    from the state the last propose left (:func:`rewound_step`, outside the timed span).
    ``None`` without that graph.

    The timed span holds the step's kernels only. Before the start event a spin kernel
    (:data:`HOLD_CYCLES`) keeps the GPU busy while the host launches the replay: started
    on an idle GPU, the span would also hold the host's graph launch (the event fires at
    once, the first kernel only when the launch call has submitted the graph), which is
    host time, and which a fused propose's steps, back to back in one graph, never pay."""
    key = step_graph_key(spec, batch)
    if key is None or spec.graphs is None:
        return None
    times = []
    with rewound_step(spec) as rewind:
        for _ in range(repeats):
            rewind()
            torch.cuda._sleep(HOLD_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            spec.graphs.replay(key)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)
