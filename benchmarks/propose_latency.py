"""Propose latency of the draft-decode paths, side by side in one run.

    python benchmarks/propose_latency.py --backend flashinfer [--paths per_step preplanned]
        [--steps 2 4 8] [--batches 1 64] [--repeats 30] [--json PATH] [--breakdown PATH]

For each path, K and batch size, three figures per ``propose_tokens`` (prefill pass, K-1
decode steps, draft tokens back on the host; the logits stay on the device, as in a serving
loop), measured side by side in one process:

- ``wall``: median end-to-end time, without the profiler;
- ``host``: time the host thread is not blocked on the device (planning, metadata builds,
  launches), from a ``torch.profiler`` run: the profiled wall time minus the time spent in
  the CUDA runtime's synchronising calls. It includes the profiler's own overhead, so it is
  an upper bound;
- ``gpu``: device busy time, the sum of the kernels, copies and memsets the profiler traced.

The ratio column divides each path's wall time by the first path's. ``--breakdown`` writes
the profiler's tables per configuration (operators by host time, kernels by device time). With CUDA the FULL
graphs are captured first; without CUDA the eager loops run and ``gpu`` is absent, which is
useful only as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import AutoregressiveSpeculator
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig
from speccheck.contract.matrix_loader import load_matrix

MATRIX = load_matrix()

log = logging.getLogger("speccheck.benchmarks.propose_latency")

BLOCK_SIZE, CONTEXT, WARMUP = 16, 200, 3
#: CUDA runtime calls in which the host waits for the device.
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                  "cudaMemcpy")


@dataclass(frozen=True)
class ProposeTiming:
    """Per-call figures in milliseconds; ``gpu_ms`` is None without a device trace."""

    wall_ms: float
    host_ms: float
    gpu_ms: float | None


def _batch(num_reqs: int, max_model_len: int) -> DraftBatch:
    blocks = -(-max_model_len // BLOCK_SIZE)
    rows = tuple(tuple(range(1 + r * blocks, 1 + (r + 1) * blocks)) for r in range(num_reqs))
    return DraftBatch((CONTEXT,) * num_reqs, ((1, 2),) * num_reqs, rows, tuple(range(num_reqs)))


def _speculator(backend: str, k: int, batch: int, gpu: bool) -> AutoregressiveSpeculator:
    device = torch.device("cuda" if gpu else "cpu")
    config = RuntimeConfig(
        platform="cuda" if gpu else "cpu", cudagraph_mode="full" if gpu else "none",
        num_speculative_steps=k, block_size=BLOCK_SIZE, max_model_len=512,
        dtype="bfloat16" if gpu else "float32", head_size=128 if gpu else 32,
        num_heads=16 if gpu else 4, num_kv_heads=4 if gpu else 2,
    )
    drafter = DrafterConfig.for_runtime(config, vocab_size=32000 if gpu else 256)
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if s <= max(batch, 1)) or (1,)
    options = SpeculatorOptions(capture_sizes=sizes, num_blocks=batch * 32 + 1,
                                max_num_prefill_tokens=2 * batch)
    spec = create_speculator("autoregressive", [backend] * 2, config, drafter, device, options, matrix=MATRIX)
    assert isinstance(spec, AutoregressiveSpeculator)
    spec.capture()
    return spec


def _profiled(spec: AutoregressiveSpeculator, work: DraftBatch, path: str, repeats: int,
              gpu: bool) -> tuple[float, float | None, str]:
    """Host and device milliseconds per ``propose_tokens`` from one profiled loop, and the
    profiler's tables of it."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=activities, acc_events=True) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            spec.propose_tokens(work, path)  # type: ignore[arg-type]
        wall_us = (time.perf_counter() - start) * 1e6
    events = prof.events()
    blocked_us = sum(e.time_range.elapsed_us() for e in events
                     if e.device_type == DeviceType.CPU and e.name in BLOCKING_CALLS)
    device_us = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA)
    if gpu and device_us == 0:
        log.warning("the profiler traced no device activity (CUPTI missing?): no GPU time")
    gpu_ms = device_us / repeats / 1e3 if device_us else None
    averages = prof.key_averages()
    tables = averages.table(sort_by="self_cpu_time_total", row_limit=15)
    if device_us:
        tables += "\n" + averages.table(sort_by="self_device_time_total", row_limit=10)
    return (wall_us - blocked_us) / repeats / 1e3, gpu_ms, tables


def measure(backend: str, paths: list[str], k: int, batch: int,
            repeats: int) -> dict[str, tuple[ProposeTiming, str]]:
    """Capture one speculator (its graphs serve every path), warm it up, time ``repeats``
    rounds in which every path runs once (the order rotates each round, so drift and
    order effects fall on all paths alike), then profile each path. Per path: the timing
    and the profiler's tables."""
    gpu = torch.cuda.is_available()
    spec = _speculator(backend, k, batch, gpu)
    work = _batch(batch, spec.config.max_model_len)
    walls: dict[str, list[float]] = {p: [] for p in paths}
    for i in range(repeats + WARMUP):
        for path in paths[i % len(paths):] + paths[: i % len(paths)]:
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            spec.propose_tokens(work, path)  # type: ignore[arg-type]
            walls[path].append(time.perf_counter() - start)
    out = {}
    for path in paths:
        host_ms, gpu_ms, tables = _profiled(spec, work, path, repeats, gpu)
        out[path] = ProposeTiming(statistics.median(walls[path][WARMUP:]) * 1e3, host_ms, gpu_ms), tables
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="flashinfer")
    parser.add_argument("--paths", nargs="+", default=["per_step", "preplanned"])
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--breakdown", type=Path, help="write the profiler tables here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rows: list[dict[str, object]] = []
    timings: dict[tuple[int, int, str], ProposeTiming] = {}
    breakdown: list[str] = []
    for k in args.steps:
        for batch in args.batches:
            for path, (timing, tables) in measure(args.backend, args.paths, k, batch, args.repeats).items():
                timings[k, batch, path] = timing
                breakdown.append(f"== K={k} batch={batch} path={path}, {args.repeats} calls\n{tables}")
            rows.append({"k": k, "batch": batch,
                         **{p: asdict(timings[k, batch, p]) for p in args.paths}})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (eager, smoke test)"
    table = Table(title=f"{args.backend} propose latency per call, ms ({device})")
    table.add_column("K", justify="right")
    table.add_column("batch", justify="right")
    for p in args.paths:
        for figure in ("wall", "host", "gpu"):
            table.add_column(f"{p} {figure}", justify="right")
    for p in args.paths[1:]:
        table.add_column(f"{p} / {args.paths[0]} wall", justify="right")
    for k in args.steps:
        for batch in args.batches:
            cells = [str(k), str(batch)]
            for p in args.paths:
                t = timings[k, batch, p]
                cells += [f"{t.wall_ms:.3f}", f"{t.host_ms:.3f}",
                          "-" if t.gpu_ms is None else f"{t.gpu_ms:.3f}"]
            base = timings[k, batch, args.paths[0]].wall_ms
            cells += [f"{timings[k, batch, p].wall_ms / base:.2f}" for p in args.paths[1:]]
            table.add_row(*cells)
    Console(width=200).print(table)
    if args.breakdown:
        args.breakdown.write_text("\n".join(breakdown))
    if args.json:
        args.json.write_text(json.dumps({"backend": args.backend, "device": device,
                                         "repeats": args.repeats, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
