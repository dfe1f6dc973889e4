"""A verify worker's process, apart from the runner: this module imports neither torch nor
the engine, so a command can start a worker before it imports them itself (the fork
server's imports then overlap the command's)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Self

from speccheck.checks.verify.run import WorkerTask
from speccheck.speculator.fork_server import fork_context, run_exit_handlers, take_environment

WORKER_ENV = {"OMP_NUM_THREADS": "1"}
"""Defaults for a worker's environment, below whatever the caller's environment sets: the
verifier's tensors are small, and one BLAS thread per worker runs them several times faster
than contending threads (7 s against 42 s for a 20-example CPU gate on a loaded 2-core
machine)."""

OUTPUT_TAIL_BYTES = 64 * 1024
"""How much of a worker's most recent output (stdout and stderr) is kept for the report."""

_DRAIN_SECONDS = 5.0
"""How long to wait, after a worker ends, for the rest of its output (a process that
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
        """The last ``count`` lines that say why the worker ended (:func:`cause_lines`),
        once the pipe is closed (or after :data:`_DRAIN_SECONDS`)."""
        self._thread.join(_DRAIN_SECONDS)
        return cause_lines(bytes(self._tail).decode("utf-8", errors="replace"), count)


_BACKTRACE_LINE = re.compile(r"^\s*(frame #\d+:|Exception raised from )")
"""A line of a C++ backtrace (c10's), which says where, never why."""

_CAUSE_LINE = re.compile(r"what\(\):|Error\b|error:|[Aa]ssertion|[Aa]borted|[Ss]egmentation")
"""A line that names why a process ended: an exception's message, a CUDA error, a failed
assertion, a signal."""


def cause_lines(output: str, count: int) -> list[str]:
    """The last ``count`` lines of a dead worker's ``output`` that name why it ended,
    backtrace frames left out (a device fault aborts the process with c10's error message
    followed by some 30 frames); its last ``count`` other non-empty lines where none
    does."""
    lines = [line for line in output.splitlines()
             if line.strip() and not _BACKTRACE_LINE.match(line)]
    causes = [line.strip() for line in lines if _CAUSE_LINE.search(line)]
    return (causes or lines)[-count:]


def task_files(folder: Path, number: int) -> tuple[Path, Path]:
    """The RESULT and PROGRESS files of a worker's ``number``-th task (from 1) in its
    ``folder``."""
    return folder / f"result-{number}.json", folder / f"progress-{number}.jsonl"


_EXIT_SECONDS = 30.0
"""How long :meth:`WorkerProcess.close` waits for a worker that took a task to end on its
closed input (its exit handlers run: a line tracer writes what it recorded) before it is
killed."""


class WorkerProcess:
    """A worker process, forked from the fork server
    (:mod:`~speccheck.speculator.fork_server`: torch and the other heavy libraries already
    imported, no CUDA context), that runs :func:`serve_tasks`: it reads
    :class:`~speccheck.checks.verify.run.WorkerTask` lines from its input pipe, which stands
    in for its standard input, and writes its standard output and error to an output pipe
    drained from the start (:class:`OutputTail`). It is started on a thread of its own, so
    that the fork server's imports overlap the parent's planning, and it takes task after
    task (a backend's single-rank cells) while it is :attr:`idle` between them.
    :func:`~speccheck.checks.verify.runner.run_worker` sends a task and follows it;
    :meth:`close` ends the process (on its closed input, or killed) and removes its
    files."""

    def __init__(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="speccheck-")
        self.folder = Path(self._directory.name)
        self.tasks = 0
        """Tasks sent so far."""
        task_read, task_write = os.pipe()
        output_read, output_write = os.pipe()
        self._input: IO[bytes] = os.fdopen(task_write, "wb")
        self.output = OutputTail(os.fdopen(output_read, "rb"), OUTPUT_TAIL_BYTES)
        child_ends = (Connection(task_read), Connection(output_write))
        self._process = fork_context().Process(
            target=serve_tasks, name="speccheck-worker", daemon=True,
            args=(str(self.folder), *child_ends, WORKER_ENV | dict(os.environ)))
        self._start_failed = False
        self._starting = threading.Thread(target=self._start, args=child_ends,
                                          name="worker-start", daemon=True)
        self._starting.start()

    def _start(self, tasks: Connection, output: Connection) -> None:
        """Start the process; the parent's copies of the child's pipe ends are closed
        either way, and a start that fails writes why to the output pipe."""
        try:
            self._process.start()
        except Exception:
            self._start_failed = True
            os.write(output.fileno(), traceback.format_exc().encode())
        finally:
            tasks.close()
            output.close()

    @property
    def exit_code(self) -> int | None:
        """The process's exit status (negative: the signal that ended it; 1 for a process
        that could not start), ``None`` while it runs."""
        self._starting.join()
        return 1 if self._start_failed else self._process.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (for ever: ``None``) for the process to end; its
        :attr:`exit_code`."""
        if self.exit_code is None:
            self._process.join(timeout)
        return self.exit_code

    def kill(self) -> None:
        """Kill the process (``SIGKILL``) and reap it."""
        if self.exit_code is None:
            self._process.kill()
            self._process.join()

    def send(self, task: WorkerTask) -> None:
        """Write ``task`` (a JSON line) to the worker's input. A worker that already died
        (during its imports, say) is left to its exit status and output to explain."""
        self.tasks += 1
        self.progress.touch()
        try:
            self._input.write(task.model_dump_json().encode() + b"\n")
            self._input.flush()
        except (BrokenPipeError, ValueError):  # ValueError: the input is closed
            pass

    def close_input(self) -> None:
        """Close the worker's input: it ends once its current task is done."""
        try:
            self._input.close()
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
        return self.exit_code is None and (self.tasks == 0 or self.done)

    def close(self) -> None:
        """End the process: one that took a task is given its closed input and
        :data:`_EXIT_SECONDS` to exit on its own, any other is killed; then its files go."""
        self.close_input()
        if self.exit_code is None and self.tasks and self.done:
            self.wait(_EXIT_SECONDS)
        self.kill()
        self._directory.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_tasks(folder: str, tasks: Connection, output: Connection,
                environ: dict[str, str]) -> None:
    """A worker process's body (forked from the fork server): :func:`attach_streams`, then
    :func:`speccheck.checks.verify.worker.main` on ``folder`` (imported only now, under the
    parent's environment: its first import sets ``TRITON_INTERPRET`` before any Triton
    kernel is decorated); its status is the process's."""
    attach_streams(tasks, output, environ)
    try:
        from speccheck.checks.verify.worker import main

        status = main([folder])
    finally:
        run_exit_handlers()
    sys.exit(status)


def attach_streams(tasks: Connection, output: Connection, environ: dict[str, str]) -> None:
    """Make a forked worker what a worker is: the parent's ``environ`` its environment,
    ``tasks`` its standard input, ``output`` its standard output and error."""
    take_environment(environ)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    os.dup2(tasks.fileno(), 0)
    output.close()
    tasks.close()
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - for the process's life
