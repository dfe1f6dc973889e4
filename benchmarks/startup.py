"""Startup time of the torch-free commands, side by side in one run.

    python benchmarks/startup.py [--runs 5] [--json OUT]

Times, as fresh processes: ``python -c "import speccheck"`` (the floor), ``speccheck matrix
--json``, ``speccheck schema`` and ``speccheck docs``, each ``--runs`` times (median), and
checks with ``python -X importtime`` that none of the three commands imports torch. Prints
a table and the ratio of each command to the floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

CLI = "from speccheck.checks.cli.app import main; main()"
COMMANDS: dict[str, list[str]] = {
    "import speccheck": [sys.executable, "-c", "import speccheck"],
    "speccheck matrix --json": [sys.executable, "-c", CLI, "matrix", "--json"],
    "speccheck schema": [sys.executable, "-c", CLI, "schema"],
    "speccheck docs": [sys.executable, "-c", CLI, "docs"],
}


def _median_seconds(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _imports_torch(argv: list[str]) -> bool:
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True, text=True,
                          check=True)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in proc.stderr.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = {name: (_median_seconds(argv, args.runs), _imports_torch(argv))
            for name, argv in COMMANDS.items()}
    floor = rows["import speccheck"][0]
    table = Table(title=f"startup, median of {args.runs} fresh processes")
    for column in ("command", "seconds", "× import speccheck", "imports torch"):
        table.add_column(column)
    for name, (seconds, torch_imported) in rows.items():
        table.add_row(name, f"{seconds:.3f}", f"{seconds / floor:.2f}", "yes" if torch_imported else "no")
    Console(emoji=False).print(table)
    if args.json:
        args.json.write_text(json.dumps(
            {name: {"seconds": s, "imports_torch": t} for name, (s, t) in rows.items()}, indent=2))


if __name__ == "__main__":
    main()
