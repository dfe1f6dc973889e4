"""A verify worker's process, apart from the runner: this module imports neither torch nor
the engine, so a command can start a worker before it imports them itself (their imports
then overlap: seconds each)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Self

from speccheck.checks.verify.run import WorkerTask

WORKER_ENV = {"OMP_NUM_THREADS": "1"}
"""Defaults for a worker's environment, below whatever the caller's environment sets: the
verifier's tensors are small, and one BLAS thread per worker runs them several times faster
than contending threads (7 s against 42 s for a 20-example CPU gate on a loaded 2-core
machine)."""

OUTPUT_TAIL_BYTES = 64 * 1024
"""How much of a worker's most recent output (stdout and stderr) is kept for the report."""

_DRAIN_SECONDS = 5.0
"""How long to wait, after a worker ends, for the rest of its output (a grandchild that
inherited the pipe may hold it open for ever)."""


class OutputTail:
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


class WorkerProcess:
    """A worker process, ``python -m speccheck.checks.verify.worker RESULT PROGRESS``, that
    reads its :class:`~speccheck.checks.verify.run.WorkerTask` from its standard input: it
can start before the task is known,
    so its imports (torch, Triton, the engine: seconds) overlap the parent's planning. Its
    output is drained from the start (:class:`OutputTail`).
    :func:`~speccheck.checks.verify.runner.run_worker` sends the task; :meth:`close`
    kills a process still running (one never sent a task waits on its input) and
    removes its files."""

    def __init__(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="speccheck-")
        root = Path(self._directory.name)
        self.result, self.progress = root / "result.json", root / "progress.jsonl"
        self.progress.touch()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "speccheck.checks.verify.worker", str(self.result),
             str(self.progress)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=WORKER_ENV | dict(os.environ),
        )
        assert self.proc.stdout is not None
        self.output = OutputTail(self.proc.stdout, OUTPUT_TAIL_BYTES)

    def send(self, task: WorkerTask) -> None:
        """Write ``task`` (as JSON) to the worker's input and close it. A worker that already died
        (during its imports) is left to its exit status and output to explain."""
        assert self.proc.stdin is not None
        try:
            with self.proc.stdin:
                self.proc.stdin.write(task.model_dump_json().encode())
        except BrokenPipeError:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self._directory.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
