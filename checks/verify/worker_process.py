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


def task_files(folder: Path, number: int) -> tuple[Path, Path]:
    """The RESULT and PROGRESS files of a worker's ``number``-th task (from 1) in its
    ``folder``."""
    return folder / f"result-{number}.json", folder / f"progress-{number}.jsonl"


_EXIT_SECONDS = 30.0
"""How long :meth:`WorkerProcess.close` waits for a worker that took a task to end on its
closed input (its exit handlers run: a line tracer writes what it recorded) before it is
killed."""


class WorkerProcess:
    """A worker process, ``python -m speccheck.checks.verify.worker FOLDER``, that reads
    :class:`~speccheck.checks.verify.run.WorkerTask` lines from its standard input: it can
    start before its first task is known, so its imports (torch, Triton, the engine:
    seconds) overlap the parent's planning, and it takes task after task (a backend's
    single-rank cells) while it is :attr:`idle` between them. Its output is drained from
    the start (:class:`OutputTail`).
    :func:`~speccheck.checks.verify.runner.run_worker` sends a task and follows it;
    :meth:`close` ends the process (on its closed input, or killed) and removes its
    files."""

    def __init__(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="speccheck-")
        self.folder = Path(self._directory.name)
        self.tasks = 0
        """Tasks sent so far."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "speccheck.checks.verify.worker", str(self.folder)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=WORKER_ENV | dict(os.environ),
        )
        assert self.proc.stdout is not None
        self.output = OutputTail(self.proc.stdout, OUTPUT_TAIL_BYTES)

    def send(self, task: WorkerTask) -> None:
        """Write ``task`` (a JSON line) to the worker's input. A worker that already died
        (during its imports, say) is left to its exit status and output to explain."""
        assert self.proc.stdin is not None
        self.tasks += 1
        self.progress.touch()
        try:
            self.proc.stdin.write(task.model_dump_json().encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass

    @property
    def result(self) -> Path:
        """The RESULT file of the task sent last (of the first, before any is sent)."""
        return task_files(self.folder, max(self.tasks, 1))[0]

    @property
    def progress(self) -> Path:
        """The PROGRESS file of the task sent last (of the first, before any is sent)."""
        return task_files(self.folder, max(self.tasks, 1))[1]

    @property
    def done(self) -> bool:
        """Whether the task sent last has its result (the worker may take another)."""
        return self.result.exists()

    @property
    def idle(self) -> bool:
        """Whether the process still runs and may be sent a task: none sent yet, or the
        last one done."""
        return self.proc.poll() is None and (self.tasks == 0 or self.done)

    def close(self) -> None:
        """End the process: one that took a task is given its closed input and
        :data:`_EXIT_SECONDS` to exit on its own, any other is killed; then its files go."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        if self.proc.poll() is None and self.tasks and self.done:
            try:
                self.proc.wait(_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._directory.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
