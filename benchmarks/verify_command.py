"""Wall time of the whole ``speccheck verify`` command, as a user runs it: the command's own
process start, every worker's start-up, breakpoint discovery, graph capture, every example
and the merge, timed from outside. One row per backend and ``--jobs`` setting, the runs of
one backend back to back in this one process's run; the ratio column is each row's
examples per second over the ``--jobs 1`` row's (a single worker drawing every example from
``--seed``, as ``verify`` ran before ``--jobs``).

    python benchmarks/verify_command.py --backend triton_attn --examples 200
        [--jobs default,1] [--cells on,off] [--json OUT]

``default`` leaves ``--jobs`` out (:func:`~speccheck.checks.verify.scale.default_jobs`
decides); ``--cells off`` runs ``verify --no-cells`` (the run's configuration alone, as
before configuration cells). Each row also gives the CPU time of the command and every
process under it (user + system), and the machine's load average when it ended: on a
shared machine the wall time is the CPU time stretched by the load.

The figures the issue that asked for this recorded before it (the same command,
one worker) are printed beside them where there is one for the backend and example count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ISSUE_SECONDS = {("triton_attn", 200): 49.5, ("fa3", 200): 45.7, ("reference", 200): 54.8,
                 ("flashinfer", 100): 137.0}
"""``speccheck verify --backend B --examples N`` on the H200 as issue 15 recorded it, in
seconds (one worker: before ``--jobs``)."""


SPECCHECK = shutil.which("speccheck") or str(Path(sys.executable).with_name("speccheck"))
"""The installed command (this interpreter's, where it is not on ``PATH``)."""


def run_command(backend: str, examples: int, jobs: str, seed: int,
                cells: str = "on") -> dict[str, Any]:
    """One ``speccheck verify`` run in a fresh process: its wall time, CPU time, status,
    exit code, and what its JSON report says of the backend (its configuration cells
    included)."""
    with tempfile.TemporaryDirectory() as folder:
        report_path = Path(folder) / "report.json"
        command = [SPECCHECK, "verify", "--backend", backend,
                   "--examples", str(examples), "--seed", str(seed), "--json", str(report_path)]
        if jobs != "default":
            command += ["--jobs", jobs]
        if cells == "off":
            command.append("--no-cells")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        workers = next((line for line in proc.stdout.splitlines() if "workers at once" in line),
                       None)
        row: dict[str, Any] = {"backend": backend, "jobs": jobs, "cells": cells,
                               "examples": examples, "wall_seconds": wall,
                               "cpu_seconds": (after.ru_utime - before.ru_utime
                                               + after.ru_stime - before.ru_stime),
                               "load_average": os.getloadavg()[0],
                               "exit_code": proc.returncode,
                               "workers": int(workers.split(": ")[1].split()[0]) if workers else 1}
        if report_path.exists():
            (backend_report,) = json.loads(report_path.read_text())["backends"]
            row |= {"status": backend_report["status"],
                    "examples_run": backend_report["examples"],
                    "worker_seconds": backend_report["seconds"],
                    "cell_verdicts": {c["name"]: c["status"] if c["run"] else "not run"
                                      for c in backend_report.get("cells", [])}}
        else:
            row |= {"status": "no report", "examples_run": 0, "worker_seconds": None,
                    "stderr_tail": proc.stderr[-2000:]}
    row["examples_per_second"] = row["examples_run"] / wall
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", default="default,1",
                        help="comma-separated --jobs settings, 'default' leaving it out")
    parser.add_argument("--cells", default="on",
                        help="comma-separated: on (the default cells), off (--no-cells)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for jobs in args.jobs.split(","):
        for cells in args.cells.split(","):
            row = run_command(args.backend, args.examples, jobs.strip(), args.seed,
                              cells.strip())
            print(f"{args.backend} --jobs {row['jobs']} cells {row['cells']}: {row['status']}, "
                  f"{row['examples_run']} examples, {row['wall_seconds']:.1f} s wall, "
                  f"{row['cpu_seconds']:.1f} s CPU, load {row['load_average']:.1f}; cells: "
                  f"{row.get('cell_verdicts') or '-'}", flush=True)
            if "stderr_tail" in row:
                print(row["stderr_tail"], flush=True)
            rows.append(row)
    single = next((r for r in rows if r["jobs"] == "1" and r["cells"] == "on"
                   and r["examples_per_second"]), None)
    table = Table(title=f"speccheck verify --backend {args.backend} --examples {args.examples}"
                        " (wall time of the command)")
    for column in ("--jobs", "cells", "workers", "status", "examples", "wall s", "CPU s",
                   "load", "worker s", "ex/s", "× --jobs 1"):
        table.add_column(column, justify="right")
    for row in rows:
        ratio = row["examples_per_second"] / single["examples_per_second"] if single else None
        row["ratio_to_one_worker"] = ratio
        table.add_row(row["jobs"], row["cells"], str(row["workers"]), row["status"],
                      str(row["examples_run"]), f"{row['wall_seconds']:.1f}",
                      f"{row['cpu_seconds']:.1f}", f"{row['load_average']:.1f}",
                      "-" if row["worker_seconds"] is None else f"{row['worker_seconds']:.1f}",
                      f"{row['examples_per_second']:.2f}",
                      "-" if ratio is None else f"{ratio:.2f}")
    Console(width=120).print(table)
    recorded = ISSUE_SECONDS.get((args.backend, args.examples))
    if recorded is not None:
        print(f"recorded by issue 15 (one worker): {recorded:.1f} s, "
              f"{args.examples / recorded:.2f} examples/s")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "issue_seconds": recorded}, indent=2)
                             + "\n")
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
