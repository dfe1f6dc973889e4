"""The side lane the fp32 reference runs on: deferred on the CPU, a thread and a stream of
its own on CUDA that sees what the caller's stream wrote before the submission."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from speccheck.checks.verify.side_lane import SideLane


def test_on_the_cpu_the_work_runs_once_on_the_callers_thread_when_its_result_is_asked() -> None:
    calls: list[int] = []

    def work() -> int:
        calls.append(threading.get_ident())
        return 7

    run = SideLane(torch.device("cpu")).submit(work)
    run.wait()
    assert calls == []  # waiting does not start deferred work
    assert run.result() == 7 and run.result() == 7
    assert calls == [threading.get_ident()]


def test_an_error_of_the_work_is_raised_by_every_result_call_and_never_by_wait() -> None:
    calls = 0

    def work() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("the reference failed")

    run = SideLane(torch.device("cpu")).submit(work)
    for _ in range(2):
        with pytest.raises(ValueError, match="the reference failed"):
            run.result()
    run.wait()
    assert calls == 1


@pytest.mark.cuda
def test_on_cuda_the_work_runs_on_its_own_thread_and_stream_after_the_callers_writes() -> None:
    device = torch.device("cuda")
    lane = SideLane(device)
    caller_stream = torch.cuda.current_stream(device)
    seen: list[tuple[int, int]] = []
    for round_ in range(3):
        source = torch.zeros(1 << 24, device=device)
        # queued on the caller's stream, not waited for: the side stream must wait for it
        for _ in range(8):
            source.add_(1)
        source.mul_(round_ + 1)

        def work(source: torch.Tensor = source) -> float:
            seen.append((threading.get_ident(), torch.cuda.current_stream(device).cuda_stream))
            return float(source.sum())

        run = lane.submit(work)
        assert run.result() == pytest.approx(8.0 * (round_ + 1) * (1 << 24))
        run.wait()
    threads, streams = {t for t, _ in seen}, {s for _, s in seen}
    assert threading.get_ident() not in threads and len(threads) == 1
    assert caller_stream.cuda_stream not in streams and len(streams) == 1


def test_no_torch_operation_of_the_side_work_runs_while_the_caller_is_quiet() -> None:
    lane = SideLane(torch.device("cpu"), concurrent=True)
    inside = threading.Event()
    seen: list[bool] = []

    def note(value: float) -> float:  # runs inside the operation (apply_), under its gate
        seen.append(inside.is_set())
        return value

    def work() -> int:
        for _ in range(300):
            torch.zeros(4).apply_(note)
        return threading.get_ident()

    run = lane.submit(work)
    windows = 0
    while not run.done():
        with lane.quiet():
            inside.set()
            time.sleep(0.0005)
            inside.clear()
        windows += 1
    assert run.result() != threading.get_ident()
    assert len(seen) == 1200 and not any(seen) and windows > 1


@pytest.mark.cuda
def test_on_cuda_side_work_that_synchronises_runs_beside_windows_of_the_sync_error_mode() -> None:
    device = torch.device("cuda")
    lane = SideLane(device)
    x = torch.ones(1 << 20, device=device)

    def work() -> float:
        return sum(float((x * 2).sum()) for _ in range(300))  # each float() synchronises

    run = lane.submit(work)
    for _ in range(300):
        with lane.quiet():
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with pytest.raises(RuntimeError):  # the mode is on, for this thread too
                    torch.zeros(1, device=device).item()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        time.sleep(0.0002)
    assert run.result() == 300 * 2.0 * (1 << 20)
