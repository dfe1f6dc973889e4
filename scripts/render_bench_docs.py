"""Render ``speccheck bench --json`` reports as markdown: a table per report.
Columns: path, K, batch, wall, host and GPU ms, replays per propose, capture time, graph
memory, ratios to per-step.

    python scripts/render_bench_docs.py BENCH.json [MORE.json ...] [--output FILE] [--plots DIR]

Prints to stdout unless ``--output`` is given. ``--plots`` also draws each report's PNG
plots into DIR, as ``speccheck bench --plots`` does (needs matplotlib). A file that is not such a report is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from speccheck.checks.bench.markdown import render_markdown
from speccheck.checks.bench.plots import matplotlib_missing, write_plots
from speccheck.checks.bench.records import BenchReport

EXIT_BAD_INPUT = 2


class BadReport(ValueError):
    """A file that cannot be read as a report; ``str()`` is one line naming it."""


def _load(path: Path) -> BenchReport:
    try:
        return BenchReport.from_json(json.loads(path.read_text(encoding="utf-8")))
    except OSError as exc:
        raise BadReport(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise BadReport(f"{path}: not a `speccheck bench --json` report: "
                        f"{type(exc).__name__}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+", help="speccheck bench --json files")
    parser.add_argument("--output", type=Path, help="write the markdown here")
    parser.add_argument("--plots", type=Path, help="draw each report's PNG plots into this folder")
    args = parser.parse_args(argv)
    if args.plots is not None and (missing := matplotlib_missing()) is not None:
        print(missing, file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        reports = [_load(path) for path in args.reports]
    except BadReport as exc:
        print(exc, file=sys.stderr)
        return EXIT_BAD_INPUT
    text = render_markdown(reports)
    if args.plots is not None:
        for report in reports:
            write_plots(report, args.plots)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
