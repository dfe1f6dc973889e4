"""Propose latency of one backend, this checkout against another, in alternating rounds:
each figure's median and range per checkout, and the ratio of the medians.

    python benchmarks/bench_ab.py [--against DIR] [--backend triton_attn] [--steps 4]
        [--batches 1] [--repeats 20] [--rounds 5] [--json OUT]

A round runs ``speccheck bench --json`` once from each checkout, each in a fresh process
that imports its own checkout as ``speccheck``; the order within a round alternates, so
that a machine whose speed drifts during the call weighs on both alike. Without
``--against`` the rounds are of this checkout alone: the spread of one commit's figures.

Why: a lent machine's figures move between calls, and within one call by a few per cent
from run to run (the decode step of one commit measured 0.1275 to 0.1324 ms in one call),
as much as a change worth making. One bench each, side by side, cannot tell such a change
from noise; the medians and ranges of several alternating rounds can, and say how sure.

Per case (path, K, batch) the table gives: wall, host and GPU time per propose (ms), the
single decode step's GPU time (ms) and its multiple of the weight-read bound, and the
wall, host and GPU ratios to the per-step path of the same run (what issue targets such
as "fused / per-step host time <= 0.5" compare). A figure a run does not measure (host and
GPU time without CUDA) is left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from checkouts import checkouts_to_run, importable

RUN = "from speccheck.checks.cli.app import main; main()"
"""The command line of ``speccheck`` in a process whose ``speccheck`` is one checkout's."""

Case = tuple[str, int, int]
"""(path, K, batch)."""


def bench_once(checkout: Path, args: list[str]) -> dict[str, Any]:
    """``speccheck bench`` of ``checkout`` with ``args`` in a fresh process: its JSON
    report."""
    with importable(checkout) as (folder, env):
        report = folder / "bench.json"
        out = subprocess.run([sys.executable, "-c", RUN, "bench", *args, "--json", str(report)],
                             env=env, capture_output=True, text=True, cwd=folder, check=False)
        if out.returncode:
            sys.exit(f"the bench of {checkout} exited {out.returncode}:\n{out.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(report.read_text())
    return result


def figures(report: Mapping[str, Any]) -> Iterator[tuple[Case, str, float]]:
    """Every measured figure of a bench report: ``(case, name, value)``."""
    bound_ms = None
    if report.get("bandwidth_gbps"):
        bound_ms = report["weight_bytes"] / (report["bandwidth_gbps"] * 1e9) * 1e3
    for row in report["rows"]:
        case = (row["path"], row["k"], row["batch"])
        for name in ("wall_ms", "host_ms", "gpu_ms", "step_gpu_ms"):
            if row[name] is not None:
                yield case, name, row[name]
        if row["step_gpu_ms"] is not None and bound_ms:
            yield case, "step_over_bound", row["step_gpu_ms"] / bound_ms
        for name, value in row["ratios"].items():
            if value is not None:
                yield case, f"{name}_ratio", value


def collect(reports: list[Mapping[str, Any]]) -> dict[Case, dict[str, list[float]]]:
    """Each case's figures over ``reports``, in report order."""
    table: dict[Case, dict[str, list[float]]] = {}
    for report in reports:
        for case, name, value in figures(report):
            table.setdefault(case, {}).setdefault(name, []).append(value)
    return table


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} [{min(values):.4g}..{max(values):.4g}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout to run alternately")
    parser.add_argument("--backend", default="triton_attn")
    parser.add_argument("--steps", default="4")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    bench_args = ["--backend", args.backend, "--steps", args.steps, "--batches", args.batches,
                  "--repeats", str(args.repeats)]
    checkouts = checkouts_to_run(parser, args.against)
    reports: dict[str, list[dict[str, Any]]] = {label: [] for label in checkouts}
    for round_ in range(1, args.rounds + 1):
        order = list(checkouts) if round_ % 2 else list(reversed(checkouts))
        for label in order:
            report = bench_once(checkouts[label], bench_args)
            reports[label].append(report)
            print(f"round {round_} {label}: {report['device']}, commit {report['commit'][:12]}",
                  flush=True)
    tables = {label: collect(rs) for label, rs in reports.items()}
    print(f"{args.backend}: median [min..max] of {args.rounds} round(s) per checkout")
    for case in tables["this"]:
        path, k, batch = case
        print(f"path={path} k={k} batch={batch}")
        for name, values in tables["this"][case].items():
            line = f"  {name:<16} this {summary(values)}"
            other = tables.get("against", {}).get(case, {}).get(name)
            if other:
                ratio = statistics.median(values) / statistics.median(other)
                line += f"  against {summary(other)}  this/against {ratio:.3f}"
            print(line)
    if args.json:
        args.json.write_text(json.dumps({"checkouts": {k: str(v) for k, v in checkouts.items()},
                                         "reports": reports}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
