"""The step recorder's snapshot buffers (``checks/verify/step_recorder``) under one lane
count that runs with fields of several shapes: padded first passes of 32 requests of 2
tokens and of 64 requests of 1 token both run 64 lanes, and their query offsets have 33 and
65 entries.

The recorder used to replace a buffer whose field came with another shape. A graph captured
with the old buffer writes into it on every replay, so the allocator handed that memory to
whatever was allocated next on the warm-up stream's pool: on an H100 the fp32 reference's
draft tokens, read back as zeros (triton_attn, dtype=float32 cell). Each shape now keeps its
own buffer for the recorder's lifetime once a capture wrote into it, and a collect reads the
shape last observed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pytest
import torch

from speccheck.checks.verify.step_recorder import StepMetadataRecorder

LANES = 64
PATH = "fake.metadata.query_start_loc"


class _Builder:
    def persistent_buffers(self) -> Mapping[str, torch.Tensor]:
        return {}

    def workspace_buffers(self) -> Mapping[str, torch.Tensor]:
        return {}


@dataclass
class _Group:
    backend_name: str = "fake"
    builder: _Builder = _Builder()


@dataclass
class _Metadata:
    query_start_loc: torch.Tensor


def _offsets(requests: int, width: int, device: str = "cpu") -> _Metadata:
    return _Metadata(torch.arange(requests + 1, device=device) * width)


def _collected(recorder: StepMetadataRecorder) -> list[int]:
    return recorder.collect(LANES)[0][PATH].tolist()


def test_a_collect_reads_the_shape_last_observed_over_the_lanes() -> None:
    recorder = StepMetadataRecorder([_Group()])  # type: ignore[list-item]
    recorder(LANES, 0, [_offsets(32, 2)])
    assert _collected(recorder) == list(range(0, 65, 2))
    recorder(LANES, 0, [_offsets(64, 1)])
    assert _collected(recorder) == list(range(65))
    recorder(LANES, 0, [_offsets(32, 2)])
    assert _collected(recorder) == list(range(0, 65, 2))


@dataclass
class _PlannedMetadata:
    """A FlashInfer-like metadata: query offsets only where a prefill wrapper plans."""

    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor | None


def test_a_collect_reports_only_the_paths_last_observed_over_the_lanes() -> None:
    """A prefill-planned pass (32 requests of 2 tokens) and a decode-planned one (64 of 1)
    over the same lanes: the second's collect has no query offsets, as its step had none
    (the first's stale snapshot was reported beside it, and a candidate's step, checked
    against that collect, was said to miss the field)."""
    recorder = StepMetadataRecorder([_Group()])  # type: ignore[list-item]
    offsets = "fake.metadata.qo_indptr"
    recorder(LANES, 0, [_PlannedMetadata(torch.ones(32), torch.arange(33) * 2)])
    assert list(recorder.collect(LANES)[0]) == ["fake.metadata.seq_lens", offsets]
    recorder(LANES, 0, [_PlannedMetadata(torch.ones(64), None)])
    assert list(recorder.collect(LANES)[0]) == ["fake.metadata.seq_lens"]
    assert list(recorder.latest()[0]) == ["fake.metadata.seq_lens"]
    recorder(LANES, 0, [_PlannedMetadata(torch.ones(32), torch.arange(33) * 2)])
    assert recorder.collect(LANES)[0][offsets].tolist() == list(range(0, 65, 2))


@pytest.mark.cuda
def test_a_replayed_snapshot_never_writes_memory_the_allocator_handed_on() -> None:
    """A graph records the snapshot of a pass of 32 requests of 2 tokens; an eager pass of
    64 requests of 1 token over the same lanes follows, then an allocation of the old
    buffer's size on the warm-up stream: the replay must leave it alone and refresh the
    snapshot the collect reads."""
    device = "cuda"
    recorder = StepMetadataRecorder([_Group()])  # type: ignore[list-item]
    source = _offsets(32, 2, device)
    warm_up = torch.cuda.Stream()
    warm_up.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm_up):
        recorder(LANES, 0, [source])
    torch.cuda.current_stream().wait_stream(warm_up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorder(LANES, 0, [source])
    recorder(LANES, 0, [_offsets(64, 1, device)])
    with torch.cuda.stream(warm_up):
        bystander = torch.full((33,), -1, dtype=torch.int64, device=device)
    torch.cuda.current_stream().wait_stream(warm_up)
    recorder(LANES, 0, [_offsets(32, 2, device)])  # the oracle's eager run of the geometry
    source.query_start_loc.mul_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert bystander.tolist() == [-1] * 33
    assert _collected(recorder) == list(range(0, 193, 6))
