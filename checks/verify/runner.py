"""Runs each backend's verification in a process of its own and collects the reports.

A worker that exits without a report (an illegal memory access, a segfault) or that makes
no progress for ``example_timeout`` seconds (a hang) is killed and reported as ``crashed``
with the last example it started; the run then goes on with the next backend.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rich.progress import Progress

from speccheck.checks.verify.report import BackendReport
from speccheck.contract.runtime_config import RuntimeConfig


def worker_request(
    backend: str, config: RuntimeConfig, examples: int, seed: int, steps: Sequence[int],
    reproduce: str | None, reproduce_prefix: str, matrix: Path | None = None,
) -> dict[str, object]:
    """What :mod:`speccheck.checks.verify.worker` reads: JSON-serialisable settings."""
    return {"backend": backend, "config": config.model_dump(), "examples": examples,
            "seed": seed, "steps": list(steps), "reproduce": reproduce,
            "reproduce_prefix": reproduce_prefix, "matrix": str(matrix) if matrix else None}


def run_worker(
    request: dict[str, object], progress: Progress, example_timeout: float, tier: str
) -> BackendReport:
    backend = str(request["backend"])
    examples = request["examples"]
    assert isinstance(examples, int)
    task = progress.add_task(backend, total=examples if not request["reproduce"] else 1)
    with tempfile.TemporaryDirectory(prefix="speccheck-") as tmp:
        req, res, prog = (Path(tmp) / n for n in ("request.json", "result.json", "progress.jsonl"))
        req.write_text(json.dumps(request))
        prog.touch()
        proc = subprocess.Popen(
            [sys.executable, "-m", "speccheck.checks.verify.worker", str(req), str(res), str(prog)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        last_example: str | None = None
        last_change, seen = time.monotonic(), 0
        hung = False
        while proc.poll() is None:
            time.sleep(0.2)
            lines = prog.read_text().splitlines()
            if len(lines) > seen:
                seen, last_change = len(lines), time.monotonic()
                latest = json.loads(lines[-1])
                last_example = latest["example"]
                progress.update(task, completed=latest["index"] - 1)
            elif time.monotonic() - last_change > example_timeout:
                proc.kill()
                hung = True
        output = proc.stdout.read() if proc.stdout else ""
        progress.update(task, completed=progress.tasks[task].total)
        if res.exists() and not hung:
            return BackendReport.from_json(json.loads(res.read_text()))
        tail = " | ".join(output.strip().splitlines()[-3:])
        what = (f"no progress for {example_timeout:.0f}s (hang); killed" if hung
                else f"worker exited with status {proc.returncode}: {tail}")
        report = BackendReport(backend, tier, "crashed", detail=what)
        if last_example is not None:
            report.reproduce = f"{request['reproduce_prefix']} --reproduce {last_example}"
        return report
