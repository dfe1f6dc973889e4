"""Runs each backend's verification in a process of its own and collects the reports.

A worker that exits without a report (an illegal memory access, a segfault) or that makes
no progress for ``example_timeout`` seconds, or for 20 times its slowest example once it
has finished some (a hang, :mod:`~speccheck.checks.verify.hang`), is killed and reported
as ``crashed`` with the last example it started; the run then goes on with the next
backend. A worker's output is drained while it runs (:class:`~speccheck.checks.verify.
worker_process.WorkerProcess`), so however much it prints it never blocks on a full pipe.
A worker given a ``--reproduce`` example it cannot take writes ``{"bad_input": LINE}`` as
its result; :func:`run_worker` raises it as :class:`~speccheck.checks.verify.examples.
BadExample`.

Progress goes to a :class:`ProgressDisplay`: rich's live bar on a terminal, or
:class:`PlainProgress`, which prints a line per backend every few seconds for CI logs.
Either way a backend's count ends at the examples it really ran, never at N/N for a run
that stopped early or was skipped. :func:`confirm_reproduce` re-runs each failure's
reproduce command in a fresh worker before it is printed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, Protocol

from rich.console import Console
from rich.progress import TaskID

from speccheck.checks.verify.examples import BadExample, reproduce_blob, reproduce_command
from speccheck.checks.verify.hang import HangClock
from speccheck.checks.verify.report import BackendReport, Finding
from speccheck.checks.verify.run import WorkerTask
from speccheck.checks.verify.vocabulary import Status, Tier
from speccheck.checks.verify.worker_process import WorkerProcess


class ProgressDisplay(Protocol):
    """Where :func:`run_worker` reports progress: one task per worker. Rich's
    ``rich.progress.Progress`` is one (a live bar); :class:`PlainProgress` is the other."""

    def add_task(self, description: str, *, total: float | None) -> TaskID: ...

    def update(
        self, task_id: TaskID, *, completed: float | None = None, description: str | None = None
    ) -> None: ...

    def stop_task(self, task_id: TaskID) -> None: ...


@dataclass
class _PlainTask:
    description: str
    total: int
    started: float
    printed: float
    completed: int = 0


class PlainProgress:
    """:class:`ProgressDisplay` for logs without a terminal: a line when a worker starts,
    one every ``interval`` seconds while it runs (``update`` is called on every poll) and
    one when it ends, each naming the backend, the examples done of the total and the
    time elapsed. ``clock`` gives seconds (monotonic)."""

    def __init__(self, console: Console, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._console = console
        self._interval = interval
        self._clock = clock
        self._tasks: list[_PlainTask] = []

    def add_task(self, description: str, *, total: float | None) -> TaskID:
        now = self._clock()
        self._tasks.append(_PlainTask(description, int(total or 0), now, now))
        self._print(f"{description}: started, {int(total or 0)} example(s)")
        return TaskID(len(self._tasks) - 1)

    def update(
        self, task_id: TaskID, *, completed: float | None = None, description: str | None = None
    ) -> None:
        task = self._tasks[task_id]
        if completed is not None:
            task.completed = int(completed)
        if description is not None:
            task.description = description
        now = self._clock()
        if now - task.printed >= self._interval:
            task.printed = now
            self._print(f"{task.description}: {task.completed}/{task.total} examples, "
                        f"{now - task.started:.0f}s elapsed")

    def stop_task(self, task_id: TaskID) -> None:
        """The task's last line: examples done, seconds taken (capture included) and, when
        any time passed, examples per second."""
        task = self._tasks[task_id]
        elapsed = self._clock() - task.started
        rate = f" ({task.completed / elapsed:.2f} examples/s)" if elapsed > 0 else ""
        self._print(f"{task.description}: {task.completed}/{task.total} examples in "
                    f"{elapsed:.0f}s{rate}")

    def _print(self, line: str) -> None:
        self._console.print(f"progress: {line}", markup=False, highlight=False)


_POLL_SECONDS = 0.2


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
    task: WorkerTask, progress: ProgressDisplay, tier: Tier, label: str | None = None,
    worker: WorkerProcess | None = None, example_bound: float | None = None,
) -> BackendReport:
    """Run ``task`` in a worker process and return its report, or a ``crashed`` report
    that names the last example it started when it dies without one or makes no progress
    for longer than a :class:`~speccheck.checks.verify.hang.HangClock` allows (the run's
    ``example_timeout``, less once the worker has finished examples; ``example_bound``
    where given), then it is killed. The worker's output is
    drained as it runs; the last lines of it explain a crash. Raises
    :class:`~speccheck.checks.verify.examples.BadExample` when the worker rejects its
    ``reproduce`` example. ``label`` names the progress task (default: the backend); the
    task ends at the examples the worker ran, with the status in its description.
    ``worker``: an :attr:`~WorkerProcess.idle` process started earlier, left to the caller
    afterwards (to take another task while it stays idle, or to close); else a fresh
    process, closed here."""
    with contextlib.ExitStack() as owned:
        process = worker if worker is not None else owned.enter_context(WorkerProcess())
        return _follow(process, task, progress, tier, label or task.backend, example_bound)


def _follow(process: WorkerProcess, task: WorkerTask, progress: ProgressDisplay, tier: Tier,
            label: str, example_bound: float | None = None) -> BackendReport:
    """Send ``task`` to ``process`` and follow it to its report (see :func:`run_worker`)."""
    progress_task = progress.add_task(label, total=task.progress_total)
    process.send(task)
    clock = HangClock(task.run.example_timeout, example_bound)
    hung = False
    with process.progress.open("rb") as stream:
        log = _ProgressLog(stream)
        while process.exit_code is None and not process.done:
            time.sleep(_POLL_SECONDS)
            if log.poll():
                clock.progressed(time.monotonic())
                assert log.latest is not None
                progress.update(progress_task, completed=log.latest["index"] - 1)
            elif clock.hung(time.monotonic()):
                process.kill()
                hung = True
            else:
                progress.update(progress_task)
        log.poll()
    result = json.loads(process.result.read_text()) if process.done and not hung else None
    if result is not None and "bad_input" in result:
        _end_task(progress, progress_task, label, 0, "bad input")
        raise BadExample(result["bad_input"])
    raised = result.pop("raised", None) if result is not None else None
    site = result.pop("raised_at", "") if result is not None else ""
    if result is not None and raised is None:
        report = BackendReport.from_json(result)
        _end_task(progress, progress_task, label, report.examples, report.status.value)
        return report
    process.wait()  # raised: the worker ends on its own, its traceback printed
    tail = raised or " | ".join(process.output.last_lines(3))
    what = (f"no progress for {clock.bound:.0f}s (hang: {clock.why()}); killed" if hung
            else f"worker exited with status {process.exit_code}: {tail}")
    if log.latest is not None:
        what += f" (during example {log.latest['index']})"
    report = BackendReport(task.backend, tier, Status.CRASHED, detail=what,
                           hang_seconds=clock.bound if hung else None, raised_at=site)
    started = 0
    if log.latest is not None:
        started = log.latest["index"]
        report.reproduce = reproduce_command(task.reproduce_prefix, log.latest["example"])
    _end_task(progress, progress_task, label, max(started - 1, 0), report.status.value)
    return report


def _end_task(progress: ProgressDisplay, task: TaskID, label: str, done: int, status: str) -> None:
    """End a worker's task at the ``done`` examples it ran (not at its total), with its
    status."""
    progress.update(task, completed=done, description=f"{label} ({status})")
    progress.stop_task(task)


def confirm_reproduce(
    task: WorkerTask, report: BackendReport, progress: ProgressDisplay, tier: Tier,
) -> str | None:
    """Run each of ``report``'s reproduce commands in a fresh worker (``task`` with the
    failing example as its ``reproduce``): each finding's (recorded in its ``reproduced``:
    whether that worker fails the finding's checks again), or, for a report without
    findings (a crash), the report's own (the same status and failed checks).
    ``report.reproduced`` says whether every one did. Returns why not (one line), or
    ``None`` when each did or there is no command. A reproduce task already ran its
    example alone in a fresh worker: it counts as reproduced without a second run."""
    if report.reproduce is None:
        return None
    if task.reproduce is not None:
        report.reproduced = True
        for finding in report.findings:
            finding.reproduced = True
        return None
    if not report.findings:
        why = _run_again(task, report.reproduce, progress, tier, report.backend,
                         lambda again: _difference(report, again), report.hang_seconds)
        report.reproduced = why is None
        return why
    problems = []
    for number, finding in enumerate(report.findings, 1):
        if finding.reproduce is None:
            continue
        why = _run_again(task, finding.reproduce, progress, tier, report.backend,
                         functools.partial(_finding_difference, finding))
        finding.reproduced = why is None
        if why is not None:
            checks = ", ".join(check.value for check in finding.checks)
            problems.append(f"failure {number} ({checks}): {why}")
    report.reproduced = not problems
    return "; ".join(problems) or None


def _run_again(
    task: WorkerTask, command: str, progress: ProgressDisplay, tier: Tier, backend: str,
    difference: Callable[[BackendReport], str | None], example_bound: float | None = None,
) -> str | None:
    """Run the example of reproduce ``command`` in a fresh worker, the example held to
    ``example_bound`` seconds where given (a hang's); how it ended other than expected
    (``difference`` of its report), or ``None``."""
    again_task = task.model_copy(update={"reproduce": reproduce_blob(command)})
    try:
        again = run_worker(again_task, progress, tier, label=f"{backend} reproduce check",
                           example_bound=example_bound)
    except BadExample as exc:
        return f"the fresh worker rejected the example ({exc})"
    return difference(again)


_ENDED = {Status.PASSED: "passed", Status.FAILED: "failed", Status.SKIPPED: "was skipped",
          Status.CRASHED: "crashed"}


def _difference(original: BackendReport, again: BackendReport) -> str | None:
    """How ``again`` (the reproduce run) ended differently from ``original``, or ``None``."""
    if again.status is not original.status:
        detail = f" ({again.detail})" if again.detail else ""
        return f"it {_ENDED[again.status]} there{detail}"
    want = sorted({f.check.value for f in original.failures})
    got = sorted({f.check.value for f in again.failures})
    if want != got:
        return f"it failed {', '.join(got)} there, not {', '.join(want)}"
    return None


def _finding_difference(finding: Finding, again: BackendReport) -> str | None:
    """Why ``again`` (the run of ``finding``'s reproduce command) does not reproduce it:
    it did not fail, or failed none or only some of the finding's checks; ``None`` when it
    failed each of them (a minimal example may fail more)."""
    if again.status is not Status.FAILED:
        detail = f" ({again.detail})" if again.detail else ""
        return f"it {_ENDED[again.status]} there{detail}"
    got = {f.check for f in again.failures}
    missing = [check.value for check in finding.checks if check not in got]
    if missing:
        failed = ", ".join(sorted(check.value for check in got))
        return f"it failed {failed} there, not {', '.join(missing)}"
    return None
