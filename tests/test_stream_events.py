"""Events recorded on the current stream of a known device (contract/stream_events.py)."""

from __future__ import annotations

import pytest
import torch

from speccheck.contract.stream_events import cuda_device_index, record_on_current_stream


def test_an_explicit_index_is_taken_as_it_is() -> None:
    assert cuda_device_index(torch.device("cuda", 3)) == 3
    assert cuda_device_index("cuda:1") == 1


@pytest.mark.cuda
def test_the_event_goes_on_whichever_stream_is_current() -> None:
    """Recorded inside a side stream's context, the event waits for that stream's work,
    as ``event.record()`` would: the index replaces only torch's device lookup."""
    index = cuda_device_index(torch.device("cuda"))
    assert index == torch.cuda.current_device()
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        record_on_current_stream(event, index)
    assert not event.query()
    event.synchronize()
    assert event.query()
    side.synchronize()
