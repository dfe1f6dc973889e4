"""Examples per second of one backend's verification, this checkout against another, back
to back.

    python benchmarks/verify_speed.py [--backend reference] [--examples 100] [--seed 0]
        [--rounds 5] [--against DIR] [--json OUT]

Each run is a fresh process that runs what a ``speccheck verify`` worker runs for the
backend at the tier's defaults (``verify_backend``: breakpoint discovery, graph capture and
every example), timed as the worker times it; the worker's process start and the parent's
reproduce check are not included. With ``--against DIR`` (a checkout of another commit,
e.g. ``git worktree add --detach /tmp/base BASE``), the runs alternate between the two
checkouts, each imported as ``speccheck`` from its own folder, so that the load of a shared
machine falls on both alike. Prints every run, the median examples per second of each
checkout and their ratio, and whether the two drew the same examples and tallied the same
check outcomes (hashes of the examples in drawing order and of the per-check tallies), and
each run's workload (requests, new tokens, draft steps, context tokens of the examples
drawn). Two commits may draw different examples at one seed even where nothing in the
search changed: hypothesis mixes the integer literals of the modules it finds loaded into
its integer draws.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from checkouts import checkouts_to_run, importable

RUN = """
import hashlib, json, os, sys, tempfile, time
from pathlib import Path
import torch
from speccheck.checks.triton_interpreter import interpret_triton_without_cuda
interpret_triton_without_cuda()
from speccheck.checks.api import plan_verification
from speccheck.checks.verify.examples import decode_example
from speccheck.checks.verify.worker import verify_backend

backend, examples, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
plan = plan_verification(backend, examples=examples, seed=seed)
task = plan.task(backend)
progress = Path(tempfile.mkdtemp()) / "progress.jsonl"
cpu = time.process_time()
report = verify_backend(task, progress)
cpu = time.process_time() - cpu
tallies = json.dumps(report.to_json()["checks"], sort_keys=True) + report.status.value
drawn = [json.loads(line)["example"] for line in progress.read_text().splitlines()]
batches = [decode_example(blob) for blob in drawn]
workload = {"requests": sum(b.num_reqs for _, b in batches),
            "new_tokens": sum(len(t) for _, b in batches for t in b.new_tokens),
            "draft_steps": sum(k * b.num_reqs for k, b in batches),
            "context_tokens": sum(sum(b.context_lens) for _, b in batches)}
print(json.dumps({"status": report.status.value, "examples": report.examples,
                  "seconds": report.seconds, "cpu_seconds": cpu,
                  "drawn": hashlib.sha1(json.dumps(drawn).encode()).hexdigest()[:12],
                  "tallies": hashlib.sha1(tallies.encode()).hexdigest()[:12],
                  "workload": workload}))
"""


def run_once(checkout: Path, backend: str, examples: int, seed: int) -> dict[str, Any]:
    """One run of ``checkout``'s verifier in a fresh process (``checkout`` imported as
    ``speccheck``), as the worker's environment has it."""
    with importable(checkout, OMP_NUM_THREADS="1") as (folder, env):
        out = subprocess.run([sys.executable, "-c", RUN, backend, str(examples), str(seed)],
                             env=env, capture_output=True, text=True, cwd=folder, check=False)
    if out.returncode:
        sys.exit(f"the run of {checkout} exited {out.returncode}:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["examples_per_second"] = result["examples"] / result["seconds"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout to run alternately")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    checkouts = checkouts_to_run(parser, args.against)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in checkouts}
    for round_ in range(1, args.rounds + 1):
        for label, checkout in checkouts.items():
            run = run_once(checkout, args.backend, args.examples, args.seed)
            runs[label].append(run)
            print(f"round {round_} {label:<8} {run['status']:<8} {run['examples']:>4} examples "
                  f"{run['seconds']:7.2f} s {run['examples_per_second']:7.2f} ex/s "
                  f"(cpu {run['cpu_seconds']:6.2f} s) drawn {run['drawn']} "
                  f"tallies {run['tallies']}", flush=True)
            work = run["workload"]
            print(f"  workload: {work['requests']} requests, {work['new_tokens']} new tokens, "
                  f"{work['draft_steps']} draft steps (K x requests), "
                  f"{work['context_tokens']} context tokens", flush=True)
    medians = {label: statistics.median(r["examples_per_second"] for r in rs)
               for label, rs in runs.items()}
    for label, value in medians.items():
        print(f"{label} ({checkouts[label]}): median {value:.2f} examples/s")
    if "against" in medians:
        print(f"this/against = {medians['this'] / medians['against']:.3f}")
        same = {key: len({r[key] for rs in runs.values() for r in rs}) == 1
                for key in ("drawn", "tallies")}
        print(f"same examples drawn: {same['drawn']}; same check tallies: {same['tallies']}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
