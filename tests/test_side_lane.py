"""The side lane the fp32 reference runs on: deferred on the CPU, queued on a stream of its
own on CUDA, after what the caller's stream wrote before the submission."""

from __future__ import annotations

import pytest
import torch

from speccheck.checks.verify.side_lane import SideLane


def test_on_the_cpu_the_work_runs_once_when_its_result_is_asked() -> None:
    calls: list[int] = []

    def work() -> int:
        calls.append(1)
        return 7

    run = SideLane(torch.device("cpu")).submit(work)
    run.wait()
    assert calls == []  # waiting does not start deferred work
    assert run.result() == 7 and run.result() == 7
    assert calls == [1]


def test_deferred_work_that_raised_raises_again_when_asked_again() -> None:
    calls = 0

    def work() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("the reference failed")

    run = SideLane(torch.device("cpu")).submit(work)
    for _ in range(2):
        with pytest.raises(ValueError, match="the reference failed"):
            run.result()
    assert calls == 2


@pytest.mark.cuda
def test_on_cuda_the_work_is_queued_on_its_own_stream_after_the_callers_writes() -> None:
    device = torch.device("cuda")
    lane = SideLane(device)
    caller = torch.cuda.current_stream(device)
    streams: set[int] = set()
    for round_ in range(3):
        source = torch.zeros(1 << 24, device=device)
        for _ in range(8):  # queued on the caller's stream, not waited for
            source.add_(1)
        source.mul_(round_ + 1)

        def work(source: torch.Tensor = source) -> torch.Tensor:
            streams.add(torch.cuda.current_stream(device).cuda_stream)
            return source.sum()  # queued on the side stream

        run = lane.submit(work)
        assert torch.cuda.current_stream(device).cuda_stream == caller.cuda_stream
        total = run.result()  # the caller's stream now waits for the side stream
        assert float(total) == pytest.approx(8.0 * (round_ + 1) * (1 << 24))
    assert caller.cuda_stream not in streams and len(streams) == 1
