"""Verifier throughput: examples per second per backend at the tier's default scale, side by
side with the previous defaults, in one run (each backend and scale in a worker of its own,
exactly as ``speccheck verify`` runs it).

The previous defaults (before serving scale): up to 8 requests of up to 3 new tokens,
``max_model_len`` 1024 (FA3 at block size = ``max_model_len`` = 1024), K from 2 to 8. The
new ones are whatever ``speccheck verify`` uses today (see ``speccheck verify --help``).

Usage: python benchmarks/verify_throughput.py [--backends reference,triton_attn,fa3]
       [--examples 50] [--json FILE]
Prints one table row per backend and scale, and the new/old ratio of examples per second.
Each row's seconds are the worker's own (graph capture and breakpoint discovery included,
process start-up not).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from speccheck.checks.api import plan_verification
from speccheck.checks.verify.report import BackendReport


@dataclass(frozen=True)
class Scale:
    label: str
    config: dict[str, Any]
    capture_sizes: tuple[int, ...] | None
    max_new_tokens: int | None
    steps: tuple[int, ...] | None


OLD = Scale("old defaults", {"max_model_len": 1024}, (1, 2, 4, 8), 3, tuple(range(2, 9)))
NEW = Scale("new defaults", {}, None, None, None)
OLD_BACKEND_CONFIG = {"fa3": {"block_size": 1024}}
"""FA3 needs block_size == max_model_len; the old runs set both."""


def measure(backend: str, scale: Scale, examples: int) -> dict[str, Any]:
    config = dict(scale.config)
    if scale is OLD:
        config.update(OLD_BACKEND_CONFIG.get(backend, {}))
    plan = plan_verification(backend, config=config or None, examples=examples,
                             capture_sizes=scale.capture_sizes,
                             max_new_tokens=scale.max_new_tokens, steps=scale.steps)
    (report,) = plan.run().backends
    return _row(backend, scale, plan.scale().capture_sizes, plan.scale().max_new_tokens,
                plan.config_for(backend).max_model_len, report)


def _row(backend: str, scale: Scale, sizes: tuple[int, ...], new_tokens: int,
         max_model_len: int, report: BackendReport) -> dict[str, Any]:
    rate = report.examples / report.seconds if report.seconds else 0.0
    return {"backend": backend, "scale": scale.label, "status": report.status.value,
            "max_requests": max(sizes), "max_new_tokens": new_tokens,
            "max_model_len": max_model_len, "examples": report.examples,
            "seconds": round(report.seconds, 2), "capture_seconds": round(report.capture_seconds, 2),
            "examples_per_second": round(rate, 3), "device": report.device}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="reference,triton_attn,fa3")
    parser.add_argument("--examples", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'backend':<12} {'scale':<13} {'status':<8} {'reqs':>4} {'new':>3} {'mml':>6} "
          f"{'examples':>8} {'seconds':>8} {'capture':>8} {'ex/s':>7}")
    for backend in args.backends.split(","):
        for scale in (OLD, NEW):
            row = measure(backend, scale, args.examples)
            rows.append(row)
            if args.json:  # after every row: a run cut by a time limit keeps what it measured
                with open(args.json, "w") as handle:
                    json.dump(rows, handle, indent=2)
            print(f"{row['backend']:<12} {row['scale']:<13} {row['status']:<8} "
                  f"{row['max_requests']:>4} {row['max_new_tokens']:>3} {row['max_model_len']:>6} "
                  f"{row['examples']:>8} {row['seconds']:>8.1f} {row['capture_seconds']:>8.1f} "
                  f"{row['examples_per_second']:>7.2f}", flush=True)
        old, new = rows[-2], rows[-1]
        if old["examples_per_second"]:
            ratio = new["examples_per_second"] / old["examples_per_second"]
            print(f"{backend}: new/old examples per second = {ratio:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
