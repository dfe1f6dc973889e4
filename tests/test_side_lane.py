"""The side lane the fp32 reference runs on: deferred on the CPU, a thread and a stream of
its own on CUDA that sees what the caller's stream wrote before the submission."""

from __future__ import annotations

import threading

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
