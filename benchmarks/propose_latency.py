"""Propose latency of the draft-decode paths, side by side in one run.

    python benchmarks/propose_latency.py --backend flashinfer [--paths per_step preplanned]
        [--steps 2 4 8] [--batches 1 64] [--json PATH]

For each path, K and batch size: the median wall time of one ``propose`` (prefill pass,
decode steps, results back on the host), and each path's ratio to the first path, measured
side by side in one process. Host and GPU time are not separated. With CUDA the FULL graphs
are captured first; without CUDA the eager loops run, which is useful only as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import AutoregressiveSpeculator
from speccheck.speculator.base import SpeculatorOptions
from speccheck.speculator.batch import DraftBatch
from speccheck.speculator.factory import create_speculator
from speccheck.speculator.model import DrafterConfig

BLOCK_SIZE, CONTEXT = 16, 200


def _batch(num_reqs: int, max_model_len: int) -> DraftBatch:
    blocks = -(-max_model_len // BLOCK_SIZE)
    rows = tuple(tuple(range(1 + r * blocks, 1 + (r + 1) * blocks)) for r in range(num_reqs))
    return DraftBatch((CONTEXT,) * num_reqs, ((1, 2),) * num_reqs, rows, tuple(range(num_reqs)))


def measure(backend: str, path: str, k: int, batch: int, repeats: int) -> float:
    gpu = torch.cuda.is_available()
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
    spec = create_speculator("autoregressive", [backend] * 2, config, drafter, device, options)
    assert isinstance(spec, AutoregressiveSpeculator)
    spec.capture()
    work = _batch(batch, config.max_model_len)
    times = []
    for _ in range(repeats + 3):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        spec.propose(work, path)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="flashinfer")
    parser.add_argument("--paths", nargs="+", default=["per_step", "preplanned"])
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for k in args.steps:
        for batch in args.batches:
            row = {"k": k, "batch": batch}
            for path in args.paths:
                row[path] = measure(args.backend, path, k, batch, args.repeats)
            rows.append(row)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (eager, smoke test)"
    table = Table(title=f"{args.backend} propose latency, ms ({device})")
    for column in ("K", "batch", *args.paths, *(f"{p} / {args.paths[0]}" for p in args.paths[1:])):
        table.add_column(column, justify="right")
    for row in rows:
        base = row[args.paths[0]]
        table.add_row(str(row["k"]), str(row["batch"]), *(f"{row[p]:.3f}" for p in args.paths),
                      *(f"{row[p] / base:.2f}" for p in args.paths[1:]))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"backend": args.backend, "device": device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
