"""Propose latency of the draft-decode paths, side by side in one run, at this script's
fixed drafter (``speccheck bench`` measures the same at the verifier's config).

    python benchmarks/propose_latency.py --backend flashinfer [--paths per_step host_preplanned]
        [--steps 2 4 8] [--batches 1 64] [--repeats 30] [--json PATH] [--breakdown PATH]

The measurement is :mod:`speccheck.checks.bench` (see :mod:`speccheck.checks.bench.measure`
for the loop): for each path, K and batch size, wall time (median, unprofiled), host time
and GPU time (from a ``torch.profiler`` run, CUDA only) per ``launch`` call and the copy of
its tokens back (prefill pass, K-1 decode steps, draft tokens back on the host; the logits
stay on the device), the
graph replays per call, and the capture time and graph memory; the paths must draft the
same tokens. Ratios are against the per-step path. ``--breakdown`` writes the profiler's
tables per configuration (operators by host time, kernels by device time). With CUDA the
FULL graphs are captured first; without CUDA the eager loops run, which is useful only as a
smoke test.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

import torch
from rich.console import Console

from speccheck.checks.bench.measure import BenchSettings, run_bench
from speccheck.checks.bench.table import bench_table
from speccheck.checks.cli.verify import _commit
from speccheck.checks.verify.context import MatrixContext
from speccheck.contract.runtime_config import RuntimeConfig
from speccheck.speculator.autoregressive import DecodePath


def _config(gpu: bool) -> RuntimeConfig:
    """2 layers of 16 query / 4 KV heads of 128 in bf16 on the GPU (4 / 2 of 32 in fp32 on
    the CPU), max_model_len 512, block size 16."""
    return RuntimeConfig(
        platform="cuda" if gpu else "cpu", cudagraph_mode="full" if gpu else "none",
        block_size=16, max_model_len=512, dtype="bfloat16" if gpu else "float32",
        head_size=128 if gpu else 32, num_heads=16 if gpu else 4, num_kv_heads=4 if gpu else 2,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="flashinfer")
    parser.add_argument("--paths", type=DecodePath, nargs="+",
                        default=[DecodePath.PER_STEP, DecodePath.HOST_PREPLANNED])
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--breakdown", type=Path, help="write the profiler tables here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    gpu = torch.cuda.is_available()
    settings = BenchSettings(args.backend, _config(gpu), MatrixContext.load(None),
                             tuple(args.steps), tuple(args.batches), args.repeats,
                             paths=tuple(args.paths))
    run = run_bench(settings, torch.device("cuda" if gpu else "cpu"), commit=_commit(),
                    command="python benchmarks/propose_latency.py " + shlex.join(sys.argv[1:]))
    Console(width=200).print(bench_table(run.report))
    if args.breakdown:
        args.breakdown.write_text("\n".join(
            f"== K={k} batch={batch} path={path.value}, {args.repeats} calls\n{tables}"
            for (k, batch, path), tables in run.profiles.items()))
    if args.json:
        args.json.write_text(json.dumps(run.report.to_json(), indent=2) + "\n")


if __name__ == "__main__":
    main()
