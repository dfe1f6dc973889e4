"""The process that verifies backends (:func:`main` on FOLDER, in a process forked from
the fork server: :func:`~speccheck.checks.verify.worker_process.serve_tasks`; ``python -m
speccheck.checks.verify.worker FOLDER`` runs it in a fresh interpreter), one
:class:`~speccheck.checks.verify.run.WorkerTask` (JSON) per line of its standard input,
read once its imports are done, taken in turn until the input closes. Run by
:mod:`speccheck.checks.verify.runner`, which may start it before the first task is known and
hands it a backend's single-rank configuration cells one after another (each task's engine
built afresh; device memory given back between tasks).

For its ``n``-th task (:func:`~speccheck.checks.verify.worker_process.task_files`) it writes
one JSON line per example to PROGRESS before running it (so a parent that kills a hung or
crashed worker knows the last example), and the :class:`BackendReport` to RESULT, whole
(renamed into place: a parent that sees RESULT reads all of it). A ``--reproduce`` example
it cannot take (not an example, or outside the harness's limits:
``BackendVerifier.example_problem``) is no crash: RESULT is then ``{"bad_input": LINE}``.
A task that raises writes ``{"raised": ROOT CAUSE}`` and ends the process (status 1, the
traceback in its output): nothing after it runs in a state the error left.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from speccheck.checks.triton_interpreter import interpret_triton_without_cuda

# Before anything imports Triton: the interpreter must also stand in for triton.language's
# own jitted functions (tl.cdiv, ...), which are decorated when Triton is first imported.
# The modules below import the speculator's kernels, and with them Triton.
interpret_triton_without_cuda()

from speccheck.backends.availability import BackendUnavailable
from speccheck.checks.device_memory import release_device_memory
from speccheck.checks.verify.context import MatrixContext
from speccheck.checks.verify.engine import BackendVerifier, VerifySettings
from speccheck.checks.verify.examples import (
    BadExample,
    Example,
    decode_example,
    encode_example,
    example_from_json,
    reproduce_command,
)
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.one_line import RaisedError
from speccheck.checks.verify.search import ExampleRaised
from speccheck.checks.verify.run import WorkerTask
from speccheck.checks.verify.vocabulary import Result, Status, Tier
from speccheck.checks.verify.worker_process import task_files
from speccheck.contract.resolution import resolve_backend
from speccheck.speculator.attention_setup import device_name, machine_platform, unrunnable_reason


def verify_backend(task: WorkerTask, progress_path: Path) -> BackendReport:
    """Run the verification ``task`` describes. Raises :class:`BadExample` for a
    ``reproduce`` example the harness cannot take."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    matrices = MatrixContext.load(task.run.matrix)
    settings = VerifySettings.for_task(task, Tier.GPU if gpu else Tier.CPU, matrices)
    name, config = settings.backend, settings.config
    report = BackendReport(name, Tier.GPU if gpu else Tier.CPU, Status.PASSED,
                           device=device_name(device), runtime_config=config.model_dump(),
                           worker_task=task.model_dump(mode="json"))
    resolution = resolve_backend(matrices.matrix.backend(name), config)
    report.fused_allowed = resolution.fused_multi_step
    report.fused_reason = resolution.reason
    unrunnable = unrunnable_reason(name, machine_platform(), matrices.matrix)
    if unrunnable is not None:
        report.status, report.tier, report.detail = Status.SKIPPED, Tier.NONE, unrunnable
        return report
    started = time.perf_counter()
    try:
        verifier = BackendVerifier(settings, device)
        report.fused_allowed = verifier.fused_allowed
        report.candidates = [candidate.name for candidate in verifier.candidates()]
    except BackendUnavailable as exc:
        report.status, report.tier, report.detail = Status.SKIPPED, Tier.NONE, str(exc)
        return report
    reproduce = _reproduce_example(task.reproduce, verifier) if task.reproduce else None
    with progress_path.open("a") as progress:
        def on_example(index: int, example: Example) -> None:
            progress.write(json.dumps({"index": index, "example": encode_example(example)}) + "\n")
            progress.flush()

        if reproduce is not None:
            example = reproduce
            on_example(1, example)
            report.examples = report.examples_asked = 1
            outcomes = verifier.run_example(example)
            if any(o.result is Result.FAILED for o in outcomes):
                verifier.record_failure(report, example, outcomes)
            else:
                report.tally(outcomes)
        else:
            verifier.run(report, on_example)
    report.capture_seconds = verifier.capture_seconds
    report.seconds = time.perf_counter() - started
    for finding in report.findings:
        blob = encode_example(example_from_json(finding.example))
        finding.reproduce = reproduce_command(task.reproduce_prefix, blob)
    if report.findings:
        report.reproduce = report.findings[0].reproduce
    return report


def _reproduce_example(blob: str, verifier: BackendVerifier) -> Example:
    """The example of a ``--reproduce`` blob, if the harness can run it; else
    :class:`BadExample` (the command line checks the same before starting a worker: this
    is the safety net)."""
    try:
        example = decode_example(blob)
    except ValueError as exc:
        raise BadExample(str(exc)) from None
    problem = verifier.example_problem(example)
    if problem is not None:
        raise BadExample(problem)
    return example


def root_cause(exc: BaseException) -> RaisedError:
    """The first leaf of ``exc`` as text, with where it was raised: hypothesis wraps an
    error that did not recur on its re-run (out of GPU memory beside another process, say)
    in exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc.raised if isinstance(exc, ExampleRaised) else RaisedError.of(exc)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    (folder,) = map(Path, argv)
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.init()  # while the parent still plans (a worker may start before that)
    for number, line in enumerate(iter(sys.stdin.buffer.readline, b""), 1):
        task = WorkerTask.model_validate_json(line)
        result_path, progress_path = task_files(folder, number)
        try:
            result = verify_backend(task, progress_path).to_json()
        except BadExample as exc:
            result = {"bad_input": str(exc)}
        except Exception as exc:
            # The traceback still goes to the log (re-raised); the report gets the root
            # cause in one line, not the last lines of a traceback.
            cause = root_cause(exc)
            _write_whole(result_path, {"raised": cause.summary, "raised_at": cause.site})
            raise
        _write_whole(result_path, result)
        release_device_memory(torch.device("cuda" if gpu else "cpu"))
    return 0


def _write_whole(path: Path, result: dict[str, object]) -> None:
    """``result`` as JSON at ``path``, renamed into place once written."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
