"""Runs each backend's verification in a process of its own and collects the reports.

A worker that exits without a report (an illegal memory access, a segfault) or that makes
no progress for ``example_timeout`` seconds (a hang) is killed and reported as ``crashed``
with the last example it started; the run then goes on with the next backend. A worker's
output is drained while it runs (the last :data:`OUTPUT_TAIL_BYTES` kept), so however much
it prints it never blocks on a full pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from rich.progress import Progress

from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.vocabulary import Status, Tier
from speccheck.contract.runtime_config import RuntimeConfig


def worker_request(
    backend: str, config: RuntimeConfig, examples: int, seed: int, steps: Sequence[int],
    reproduce: str | None, reproduce_prefix: str, matrix: Path | None = None,
) -> dict[str, object]:
    """What :mod:`speccheck.checks.verify.worker` reads: JSON-serialisable settings."""
    return {"backend": backend, "config": config.model_dump(), "examples": examples,
            "seed": seed, "steps": list(steps), "reproduce": reproduce,
            "reproduce_prefix": reproduce_prefix, "matrix": str(matrix) if matrix else None}


OUTPUT_TAIL_BYTES = 64 * 1024
"""How much of a worker's most recent output (stdout and stderr) is kept for the report."""

_POLL_SECONDS = 0.2
_DRAIN_SECONDS = 5.0
"""How long to wait, after a worker ends, for the rest of its output (a grandchild that
inherited the pipe may hold it open for ever)."""


class _OutputTail:
    """Drains a worker's output pipe on a thread of its own while the worker runs, keeping
    only the last ``limit`` bytes: a chatty worker never blocks on a full pipe (and is then
    never mistaken for a hung one), and its output costs bounded memory. The thread closes
    the pipe when it reaches its end."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self._stream = stream
        self._limit = limit
        self._tail = bytearray()
        self._thread = threading.Thread(target=self._drain, name="worker-output", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        with self._stream:
            while chunk := os.read(self._stream.fileno(), self._limit):
                self._tail += chunk
                del self._tail[: -self._limit]

    def last_lines(self, count: int) -> list[str]:
        """The last ``count`` non-empty lines, once the pipe is closed (or after
        :data:`_DRAIN_SECONDS`)."""
        self._thread.join(_DRAIN_SECONDS)
        text = bytes(self._tail).decode("utf-8", errors="replace")
        return [line for line in text.splitlines() if line.strip()][-count:]


class _ProgressLog:
    """Follows the progress file a worker appends one JSON line to per example, reading
    only what is new and only complete lines."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._partial = b""
        self.latest: dict[str, Any] | None = None

    def poll(self) -> bool:
        """Read what the worker appended; ``True`` when it completed a line."""
        lines = (self._partial + self._stream.read()).split(b"\n")
        self._partial = lines.pop()
        if not lines:
            return False
        self.latest = json.loads(lines[-1])
        return True


def run_worker(
    request: dict[str, object], progress: Progress, example_timeout: float, tier: str
) -> BackendReport:
    """Run the worker for ``request`` and return its report, or a ``crashed`` report that
    names the last example it started when it dies without one or makes no progress for
    ``example_timeout`` seconds (then it is killed). The worker's output is drained as it
    runs; the last lines of it explain a crash."""
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
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        assert proc.stdout is not None
        output = _OutputTail(proc.stdout, OUTPUT_TAIL_BYTES)
        last_change = time.monotonic()
        hung = False
        with prog.open("rb") as stream:
            log = _ProgressLog(stream)
            while proc.poll() is None:
                time.sleep(_POLL_SECONDS)
                if log.poll():
                    last_change = time.monotonic()
                    assert log.latest is not None
                    progress.update(task, completed=log.latest["index"] - 1)
                elif time.monotonic() - last_change > example_timeout:
                    proc.kill()
                    proc.wait()
                    hung = True
            log.poll()
        tail = " | ".join(output.last_lines(3))
        progress.update(task, completed=progress.tasks[task].total)
        if res.exists() and not hung:
            return BackendReport.from_json(json.loads(res.read_text()))
        what = (f"no progress for {example_timeout:.0f}s (hang); killed" if hung
                else f"worker exited with status {proc.returncode}: {tail}")
        report = BackendReport(backend, Tier(tier), Status.CRASHED, detail=what)
        if log.latest is not None:
            report.reproduce = f"{request['reproduce_prefix']} --reproduce {log.latest['example']}"
        return report
