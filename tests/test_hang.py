"""When a verify worker counts as hung (:mod:`speccheck.checks.verify.hang`), the
reproduce check of a hang holding its example to the bound that killed the original, and
what the report of a worker that died keeps of its output."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from speccheck.checks.verify import runner
from speccheck.checks.verify.hang import HANG_FACTOR, HANG_FLOOR_SECONDS, HangClock
from speccheck.checks.verify.report import BackendReport
from speccheck.checks.verify.run import VerifyRun, WorkerTask
from speccheck.checks.verify.worker_process import cause_lines
from speccheck.checks.verify.vocabulary import Status, Tier


def _clock(limit: float = 300.0, bound: float | None = None) -> HangClock:
    return HangClock(limit, bound, last_progress=0.0)


def test_set_up_and_a_first_example_get_the_whole_example_timeout() -> None:
    clock = _clock()
    assert not clock.hung(299.0) and clock.hung(301.0)
    clock.progressed(250.0)  # the first example starts after a long set-up
    assert clock.bound == 300.0 and not clock.hung(549.0) and clock.hung(551.0)
    assert clock.why() == "the example timeout"


def test_after_an_example_a_hang_is_twenty_times_the_slowest_at_least_the_floor() -> None:
    clock = _clock()
    for now in (10.0, 11.0, 13.0, 13.5):  # examples of 1, 2 and 0.5 s
        clock.progressed(now)
    assert clock.slowest_example == 2.0
    assert clock.bound == HANG_FLOOR_SECONDS
    hang_at = 13.5 + HANG_FLOOR_SECONDS
    assert not clock.hung(hang_at - 1) and clock.hung(hang_at + 1)
    clock.progressed(23.5)  # a 10 s example: the bound grows with it
    assert clock.bound == HANG_FACTOR * 10.0
    assert "20x its slowest example (10.0s)" in clock.why()


def test_the_bound_never_exceeds_the_example_timeout() -> None:
    clock = _clock(limit=60.0)
    clock.progressed(0.0)
    clock.progressed(1.0)
    assert clock.bound == 60.0 and clock.why() == "the example timeout"


def test_a_given_example_bound_applies_once_the_example_starts() -> None:
    clock = _clock(bound=130.0)
    assert clock.bound == 300.0  # the fresh worker's set-up
    clock.progressed(40.0)
    assert clock.bound == 130.0 and clock.hung(171.0) and not clock.hung(169.0)
    assert clock.why() == "the bound that ended the original run, 130s"


def test_the_reproduce_check_of_a_hang_is_held_to_the_original_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    def fake_run_worker(task: WorkerTask, progress: Any, tier: Tier, label: str | None = None,
                        worker: Any = None, example_bound: float | None = None) -> BackendReport:
        seen["bound"], seen["reproduce"] = example_bound, task.reproduce
        return BackendReport(task.backend, tier, Status.CRASHED, detail="hung again")

    monkeypatch.setattr(runner, "run_worker", fake_run_worker)
    task = WorkerTask(run=VerifyRun(backend="reference"), backend="reference", examples=4,
                      seed=0)
    hung = BackendReport("reference", Tier.CPU, Status.CRASHED, detail="no progress",
                         reproduce="speccheck verify --backend reference --reproduce AAAA",
                         hang_seconds=130.0)
    progress = runner.PlainProgress(Console(file=io.StringIO()))
    assert runner.confirm_reproduce(task, hung, progress, Tier.CPU) is None
    assert seen == {"bound": 130.0, "reproduce": "AAAA"} and hung.reproduced is True



C10_ABORT = """progress: example 5
terminate called after throwing an instance of 'c10::AcceleratorError'
  what():  CUDA error: an illegal memory access was encountered
Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/ for more information.
Exception raised from c10_cuda_check_implementation at /pytorch/c10/cuda/CUDAException.cpp:44
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)
frame #31: __libc_start_main + 0x8b (0x7faf59a2a28b in /lib/x86_64-linux-gnu/libc.so.6)
frame #32: _start + 0x25 (0x657a05 in /opt/torch/.venv/bin/python3)
"""


def test_a_dead_workers_report_keeps_the_lines_that_say_why_not_its_backtrace() -> None:
    lines = cause_lines(C10_ABORT, 3)
    assert any("illegal memory access" in line for line in lines)
    assert not any(line.startswith("frame #") for line in lines)


def test_output_naming_no_cause_keeps_its_last_lines() -> None:
    assert cause_lines("a\n\nb\nc\n", 2) == ["b", "c"]
