"""Each capture-safety probe catches its bug in a tiny deliberately-bad refresh written here,
and stays silent on a good in-place refresh."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from speccheck.backends.reference.builder import ReferenceMetadata, ReferenceMetadataBuilder
from speccheck.checks.probes import (
    ALLOCATION,
    GUARD_BAND,
    HOST_SYNC,
    REPLACED_TENSOR,
    AllocationRecorder,
    GuardedBuffer,
    GuardedBufferSet,
    HostSyncRecorder,
    IdentityGuard,
    ProbeFinding,
    check_zero_tail,
    poison_,
)
from speccheck.checks.probes.state_walk import changed_paths, snapshot, walk_tensors
from speccheck.contract.builder import AttentionLayerSpec, BuilderLimits
from speccheck.contract.runtime_config import RuntimeConfig


@dataclass
class DraftMeta:
    """A toy backend metadata object: persistent buffers and views of them."""

    seq_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    scheduler_metadata: torch.Tensor
    slot_index: torch.Tensor
    active: torch.Tensor
    cap: torch.Tensor
    num_reqs: int


def _meta() -> DraftMeta:
    return DraftMeta(
        seq_lens=torch.tensor([3, 5, 7, 0], dtype=torch.int32),
        cu_seqlens=torch.zeros(5, dtype=torch.int32),
        scheduler_metadata=torch.zeros(8, dtype=torch.int32),
        slot_index=torch.tensor([4, 5, 6, 7]),
        active=torch.tensor([True, True, True, False]),
        cap=torch.full((4,), 6, dtype=torch.int32),
        num_reqs=4,
    )


def _site(fn: Callable[..., object], line_offset: int) -> str:
    """``file:line`` of the line ``line_offset`` lines below ``def fn``."""
    return f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno + line_offset}"


# --- good refreshes ---------------------------------------------------------------------------


def refresh_copy(md: DraftMeta) -> None:
    md.scheduler_metadata[: md.num_reqs].copy_(md.seq_lens)


def refresh_add(md: DraftMeta) -> None:
    md.seq_lens.add_(1)
    md.seq_lens[0] = 5


def refresh_index_copy(md: DraftMeta) -> None:
    md.scheduler_metadata.index_copy_(0, md.slot_index, md.seq_lens)


def refresh_out(md: DraftMeta) -> None:
    torch.cumsum(md.seq_lens, 0, dtype=torch.int32, out=md.cu_seqlens[1:])
    torch.minimum(md.seq_lens, md.cap, out=md.seq_lens)
    torch.add(md.seq_lens, 1, out=md.scheduler_metadata[:4])


def refresh_views(md: DraftMeta) -> None:
    md.seq_lens.view(2, 2)[:, 0].clamp_(max=100)
    md.scheduler_metadata.fill_(9).narrow(0, 4, 4).masked_fill_(md.active, 0)


GOOD_REFRESHES = [refresh_copy, refresh_add, refresh_index_copy, refresh_out, refresh_views]


@pytest.mark.parametrize("refresh", GOOD_REFRESHES, ids=lambda f: f.__name__)
def test_probes_are_silent_on_good_in_place_refresh(refresh: Callable[[DraftMeta], None]) -> None:
    md = _meta()
    before = snapshot(walk_tensors(md))
    with (
        HostSyncRecorder(cuda_sync_debug=True) as syncs,
        AllocationRecorder() as allocs,
        IdentityGuard({"metadata": md}) as ids,
    ):
        refresh(md)
    assert syncs.findings() == []
    assert allocs.events == []
    assert ids.findings() == []
    # The refresh did real work, so silence is not an artefact of doing nothing.
    assert changed_paths([before, walk_tensors(md)])


def test_reference_backend_refresh_passes_every_probe() -> None:
    layer = AttentionLayerSpec(4, 2, 8, torch.float32, block_size=4, max_model_len=32)
    builder = ReferenceMetadataBuilder(
        layer,
        RuntimeConfig(),
        torch.device("cpu"),
        BuilderLimits(4, 4),
        supports_draft_decode_metadata_update=True,
    )
    seq_lens = torch.tensor([3, 4, 5, 6], dtype=torch.int32)
    md = ReferenceMetadata(
        query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens=seq_lens,
        block_table=torch.zeros(4, 8, dtype=torch.int32),
        slot_mapping=torch.arange(4),
        num_actual_tokens=4,
        causal=True,
        dcp_local_seq_lens=seq_lens,
    )
    roots = {"metadata": md, "builder": builder}
    with HostSyncRecorder() as syncs, AllocationRecorder() as allocs, IdentityGuard(roots) as ids:
        builder.update_draft_decode_metadata(md)
    assert syncs.findings() + allocs.findings() + ids.findings() == []


# --- host synchronisation ---------------------------------------------------------------------


def bad_item(md: DraftMeta) -> None:
    md.num_reqs = md.seq_lens.sum().item()


def bad_tolist(md: DraftMeta) -> None:
    md.num_reqs = len(md.seq_lens.tolist())


def bad_nonzero(md: DraftMeta) -> None:
    md.scheduler_metadata[:3].copy_(torch.nonzero(md.seq_lens).flatten()[:3])


def bad_nonzero_method(md: DraftMeta) -> None:
    md.num_reqs = md.active.nonzero().shape[0]


def bad_bool_branch(md: DraftMeta) -> None:
    if (md.seq_lens > 6).any():
        md.seq_lens.sub_(1)


def bad_mask_index(md: DraftMeta) -> None:
    md.scheduler_metadata[0] = md.seq_lens[md.active].max()


def bad_mask_assign(md: DraftMeta) -> None:
    md.seq_lens[md.active] = 0


def bad_int(md: DraftMeta) -> None:
    md.num_reqs = int(md.seq_lens.max())


def bad_index_with_tensor(md: DraftMeta) -> None:
    md.num_reqs = [10, 20, 30, 40][md.slot_index[0] - 4]


def bad_unique(md: DraftMeta) -> None:
    md.num_reqs = torch.unique(md.seq_lens).numel()


def bad_repeat_interleave(md: DraftMeta) -> None:
    torch.repeat_interleave(md.seq_lens)


def bad_masked_select(md: DraftMeta) -> None:
    torch.masked_select(md.seq_lens, md.active)


def bad_bincount(md: DraftMeta) -> None:
    torch.bincount(md.slot_index)


def bad_cpu(md: DraftMeta) -> None:
    md.cap.copy_(md.seq_lens.cpu())


def bad_to_cpu(md: DraftMeta) -> None:
    md.cap.copy_(md.seq_lens.to("cpu"))


def bad_to_device_kwarg(md: DraftMeta) -> None:
    md.cap.copy_(md.seq_lens.to(device="cpu", non_blocking=True))


def bad_numpy(md: DraftMeta) -> None:
    md.num_reqs = int(md.seq_lens.numpy().sum())


def bad_host_tensor(md: DraftMeta) -> None:
    md.cap.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))


def bad_format(md: DraftMeta) -> None:
    md.num_reqs = len(f"{md.seq_lens}")


def bad_equal(md: DraftMeta) -> None:
    md.num_reqs = 4 if torch.equal(md.seq_lens, md.cap) else 3


def bad_contains(md: DraftMeta) -> None:
    md.num_reqs = 4 if 7 in md.seq_lens else 3


BAD_SYNC_REFRESHES = [
    (bad_item, "Tensor.item"),
    (bad_tolist, "Tensor.tolist"),
    (bad_nonzero, "aten.nonzero.default"),
    (bad_nonzero_method, "aten.nonzero.default"),
    (bad_bool_branch, "Tensor.__bool__"),
    (bad_mask_index, "aten.index.Tensor"),
    (bad_mask_assign, "aten.index_put_.default"),
    (bad_int, "Tensor.__int__"),
    (bad_index_with_tensor, "Tensor.__index__"),
    (bad_unique, "aten._unique2.default"),
    (bad_repeat_interleave, "aten.repeat_interleave.Tensor"),
    (bad_masked_select, "aten.masked_select.default"),
    (bad_bincount, "aten.bincount.default"),
    (bad_cpu, "Tensor.cpu"),
    (bad_to_cpu, "Tensor.to"),
    (bad_to_device_kwarg, "Tensor.to"),
    (bad_numpy, "Tensor.numpy"),
    (bad_host_tensor, "torch.tensor"),
    (bad_format, "Tensor.__format__"),
    (bad_equal, "torch.equal"),
    (bad_contains, "Tensor.__contains__"),
]


@pytest.mark.parametrize(
    ("refresh", "op"), BAD_SYNC_REFRESHES, ids=[f.__name__ for f, _ in BAD_SYNC_REFRESHES]
)
def test_host_sync_recorder_catches_sync_with_call_site(
    refresh: Callable[[DraftMeta], None], op: str
) -> None:
    md = _meta()
    with HostSyncRecorder() as syncs:
        refresh(md)
    site = _site(refresh, 1)
    assert [(e.op, e.site, e.function) for e in syncs.events] == [(op, site, refresh.__name__)]
    (finding,) = syncs.findings()
    assert finding.check == HOST_SYNC
    assert finding.path == site
    assert op in finding.message and "(1x)" in finding.message


def test_device_only_recorder_leaves_out_host_tensors() -> None:
    """What a launch's host work does with host tensors never waits for the device; a
    tensor built on another device (here ``meta``) is still recorded."""
    host = torch.arange(4)
    with HostSyncRecorder(device_only=True) as syncs:
        int(host[-1])
        host.cpu().tolist()
        torch.tensor([1, 2], device="meta")
    assert [event.op for event in syncs.events] == ["torch.tensor"]
    with HostSyncRecorder() as syncs:
        int(host[-1])
    assert [event.op for event in syncs.events] == ["Tensor.__int__"]


def test_host_sync_counts_repeats_once_per_site() -> None:
    def refresh(md: DraftMeta) -> None:
        for i in range(3):
            md.scheduler_metadata[i] = md.seq_lens[i].item()

    md = _meta()
    with HostSyncRecorder() as syncs:
        refresh(md)
    assert len(syncs.events) == 3
    (finding,) = syncs.findings()
    assert "(3x)" in finding.message
    assert "keep the value on the device" in finding.message


@pytest.mark.parametrize(
    "refresh",
    [
        lambda md: md.seq_lens.to(torch.int64),
        lambda md: md.seq_lens.to(md.cap),
        lambda md: torch.repeat_interleave(md.seq_lens, md.seq_lens, output_size=15),
        lambda md: torch.nonzero_static(md.seq_lens, size=4),
        lambda md: torch.where(md.active, md.seq_lens, md.cap),
        lambda md: md.seq_lens[md.slot_index - 4],
        lambda md: torch.as_tensor(md.seq_lens),
        lambda md: md.seq_lens.masked_fill_(md.active, 1),
    ],
    ids=["to_dtype", "to_tensor", "repeat_with_size", "nonzero_static", "where3", "int_index",
         "as_tensor_of_tensor", "masked_fill"],
)
def test_host_sync_recorder_ignores_capture_safe_ops(
    refresh: Callable[[DraftMeta], object],
) -> None:
    md = _meta()
    with HostSyncRecorder() as syncs:
        refresh(md)
    assert syncs.events == []


def test_host_sync_recorder_restores_modes_after_an_exception() -> None:
    md = _meta()
    with pytest.raises(ZeroDivisionError), HostSyncRecorder() as syncs:
        bad_item(md)
        raise ZeroDivisionError
    assert len(syncs.events) == 1
    md.seq_lens.sum().item()  # outside: not recorded, no mode left behind
    assert len(syncs.events) == 1


# --- allocations ------------------------------------------------------------------------------


def bad_alloc_rebind(md: DraftMeta) -> None:
    md.scheduler_metadata = md.seq_lens + 1


def bad_alloc_factory(md: DraftMeta) -> None:
    md.cap.copy_(torch.zeros(4, dtype=torch.int32))


def bad_alloc_host_data(md: DraftMeta) -> None:
    md.slot_index = torch.tensor([0, 1, 2, 3])


@pytest.mark.parametrize(
    ("refresh", "op", "nbytes"),
    [
        (bad_alloc_rebind, "aten.add.Tensor", 16),
        (bad_alloc_factory, "aten.zeros.default", 16),
        (bad_alloc_host_data, "aten.lift_fresh.default", 32),
    ],
    ids=["rebind", "factory", "host_data"],
)
def test_allocation_recorder_catches_new_tensors(
    refresh: Callable[[DraftMeta], None], op: str, nbytes: int
) -> None:
    md = _meta()
    with AllocationRecorder() as allocs:
        refresh(md)
    (event,) = allocs.events
    assert (event.op, event.kind, event.shape, event.nbytes) == (op, "new", (4,), nbytes)
    assert event.site == _site(refresh, 1)
    (finding,) = allocs.findings()
    assert finding.check == ALLOCATION and finding.path == event.site
    assert "out= or copy_()" in finding.message


def test_allocation_recorder_catches_moved_storage() -> None:
    def refresh(md: DraftMeta) -> None:
        torch.add(md.seq_lens, 1, out=md.cap[2:])

    md = _meta()
    with AllocationRecorder() as allocs, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that out= was resized
        refresh(md)
    assert [(e.op, e.kind) for e in allocs.events] == [("aten.add.out", "moved")]
    (finding,) = allocs.findings()
    assert "buffer moved" in finding.message


# --- identity of metadata tensors -------------------------------------------------------------


def bad_replace(md: DraftMeta) -> None:
    md.scheduler_metadata = torch.zeros_like(md.scheduler_metadata)


def bad_rebind_view(md: DraftMeta) -> None:
    md.seq_lens = md.seq_lens.view(-1)


def bad_resize(md: DraftMeta) -> None:
    md.scheduler_metadata.resize_(4096)


def bad_restride(md: DraftMeta) -> None:
    md.cap.as_strided_((2,), (2,))


def bad_remove(md: DraftMeta) -> None:
    md.cu_seqlens = None  # type: ignore[assignment]


def bad_add(md: DraftMeta) -> None:
    md.extra = torch.zeros(2)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("refresh", "path", "phrase"),
    [
        (
            bad_replace,
            "metadata.scheduler_metadata",
            "write into the persistent buffer with copy_()",
        ),
        (bad_rebind_view, "metadata.seq_lens", "new tensor object over the same memory"),
        (bad_resize, "metadata.scheduler_metadata", "moved the storage"),
        (bad_restride, "metadata.cap", "changed the layout"),
        (bad_remove, "metadata.cu_seqlens", "removed the tensor"),
        (bad_add, "metadata.extra", "bound a new tensor"),
    ],
    ids=["replace", "rebind_view", "resize", "restride", "remove", "add"],
)
def test_identity_guard_catches_replaced_tensors(
    refresh: Callable[[DraftMeta], None], path: str, phrase: str
) -> None:
    md = _meta()
    with IdentityGuard({"metadata": md}) as guard:
        refresh(md)
    (finding,) = guard.findings()
    assert (finding.check, finding.path) == (REPLACED_TENSOR, path)
    assert phrase in finding.message
    assert str(finding).startswith(f"[{REPLACED_TENSOR}] {path}: refresh ")


def test_identity_guard_nested_groups_and_exceptions() -> None:
    @dataclass
    class Model:
        groups: list[DraftMeta]

    model = Model([_meta(), _meta()])
    with pytest.raises(RuntimeError, match="before the with-block ended"):
        IdentityGuard({"model": model}).findings()
    with pytest.raises(KeyError), IdentityGuard({"model": model}) as guard:
        model.groups[1].seq_lens = model.groups[1].seq_lens.clone()
        raise KeyError("refresh failed half-way")
    assert [f.path for f in guard.findings()] == ["model.groups[1].seq_lens"]
    with pytest.raises(TypeError, match="mapping of root names"):
        IdentityGuard(model)  # type: ignore[arg-type]


# --- persistent-buffer tails ------------------------------------------------------------------


def _schedule(buf: torch.Tensor, lens: torch.Tensor, *, zero_tail: bool) -> None:
    """A toy scheduler-metadata refresh: one entry per live request."""
    n = lens.shape[0]
    buf[:n].copy_(lens)
    if zero_tail:
        buf[n:].zero_()


@pytest.mark.parametrize("zero_tail", [False, True])
def test_check_zero_tail_after_the_batch_shrinks(zero_tail: bool) -> None:
    buf = torch.zeros(8, dtype=torch.int32)
    _schedule(buf, torch.arange(1, 7, dtype=torch.int32), zero_tail=zero_tail)  # 6 requests
    _schedule(buf, torch.arange(1, 4, dtype=torch.int32), zero_tail=zero_tail)  # then 3
    diagnosis = check_zero_tail(buf, 3, name="scheduler_metadata")
    if zero_tail:
        assert diagnosis is None
    else:
        assert diagnosis is not None
        assert "'scheduler_metadata'" in diagnosis
        assert "3 non-zero element(s) in 3 row(s), the first at row 3 (value 4)" in diagnosis
        assert "scheduler_metadata[3:].zero_()" in diagnosis


def test_check_zero_tail_edge_cases() -> None:
    grid = torch.zeros(4, 2, 3)
    assert check_zero_tail(grid, 0) is None
    assert check_zero_tail(grid, 4) is None
    grid[3, 1, 2] = math.nan
    diagnosis = check_zero_tail(grid, 1, name="tiles")
    assert diagnosis is not None and "row 3 (value nan)" in diagnosis
    assert check_zero_tail(torch.tensor([1.0, -0.0]), 1) is None
    with pytest.raises(ValueError, match="used=5 is outside 0..4"):
        check_zero_tail(grid, 5)
    with pytest.raises(ValueError, match="0-dim"):
        check_zero_tail(torch.tensor(1.0), 0)


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.bool]
)
def test_a_poisoned_buffer_is_all_tail_until_a_build_claims_its_rows(dtype: torch.dtype) -> None:
    """What the verifier does before every example: the poison is non-zero in every dtype,
    so a build that writes its live rows but leaves the rest is caught on the spot."""
    buf = torch.zeros(6, 2, dtype=dtype)
    poison_(buf)
    assert check_zero_tail(buf, 0) is not None
    buf[:2].fill_(1)
    diagnosis = check_zero_tail(buf, 2, name="derived")
    assert diagnosis is not None and "4 row(s), the first at row 2" in diagnosis
    buf[2:].zero_()
    assert check_zero_tail(buf, 2) is None
    poison_(buf, sentinel=1)
    assert bool((buf == 1).all())


# --- guard bands ------------------------------------------------------------------------------


def _overrun(t: torch.Tensor, start: int, count: int, value: float) -> None:
    """What an out-of-bounds kernel does: write ``count`` elements from flat offset ``start``
    of ``t``'s storage view, ignoring ``t``'s bounds."""
    torch.as_strided(t, (count,), (1,), t.storage_offset() + start).fill_(value)


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.bool]
)
def test_guarded_buffer_catches_writes_past_either_end(dtype: torch.dtype) -> None:
    guarded = GuardedBuffer(16, dtype, name="tile_schedule", guard=8)
    t = guarded.tensor
    assert t.shape == (16,) and t.is_contiguous() and not t.any()
    _overrun(t, 0, 16, 1)  # in bounds
    assert guarded.violations() == []
    _overrun(t, 14, 4, 1)  # last two in bounds, two past the end
    _overrun(t, -1, 1, 0)
    before, after = guarded.violations()
    assert "guard band before 'tile_schedule' overwritten at element offset(s) -1:" in before
    assert "guard band after 'tile_schedule' overwritten at element offset(s) 16..17 " in after
    assert "writes past the end" in after
    assert [f.check for f in guarded.findings()] == [GUARD_BAND, GUARD_BAND]
    assert guarded.findings()[1] == ProbeFinding(GUARD_BAND, "tile_schedule", after)


def test_guarded_buffer_sentinels_and_like() -> None:
    ints = GuardedBuffer((2, 3), torch.int32, guard=2)
    floats = GuardedBuffer(4, torch.float16, guard=2)
    custom = GuardedBuffer(4, torch.int64, guard=2, sentinel=-1, fill=7)

    def peek(g: GuardedBuffer, offset: int) -> torch.Tensor:
        return torch.as_strided(g.tensor, (1,), (1,), g.tensor.storage_offset() + offset)

    assert peek(ints, -1).item() == -0x5A5A5A5B and peek(ints, 6).item() == -0x5A5A5A5B
    assert math.isnan(peek(floats, 4).item())
    assert peek(custom, -2).item() == -1 and custom.tensor.tolist() == [7, 7, 7, 7]
    src = torch.arange(6, dtype=torch.int32).view(2, 3)
    copy = GuardedBuffer.like(src, name="src", guard=4)
    assert torch.equal(copy.tensor, src) and copy.tensor.data_ptr() != src.data_ptr()
    assert copy.violations() == []
    with pytest.raises(ValueError, match="guard=0"):
        GuardedBuffer(4, torch.int32, guard=0)


def test_guarded_buffer_offset_runs_are_compact() -> None:
    guarded = GuardedBuffer(4, torch.int32, name="b", guard=64)
    for start in range(0, 40, 3):
        _overrun(guarded.tensor, 4 + start, 1, 9)
    (message,) = guarded.violations()
    assert "offset(s) 4, 7, 10, 13, 16, 19, ... (14 elements in all)" in message


def test_a_set_of_guarded_buffers_names_exactly_the_written_ones_and_rearms_them_all() -> None:
    guarded = GuardedBufferSet()
    buffers = [GuardedBuffer(n, dtype, name=f"b{i}", guard=g) for i, (n, dtype, g) in enumerate(
        [(5, torch.int32, 3), (16, torch.bool, 8), (4, torch.float32, 1), (7, torch.int64, 2)])]
    for buffer in buffers[:3]:
        guarded.add(buffer)
    assert guarded.written() == [False] * 3 and guarded.violations() == []
    _overrun(buffers[1].tensor, 16, 1, 1)  # the first element past the end of b1
    _overrun(buffers[2].tensor, -1, 1, 0)  # the last element before b2
    assert guarded.written() == [False, True, True]
    assert guarded.violations() == buffers[1].violations() + buffers[2].violations()
    guarded.add(buffers[3])  # added after a check: covered from now on
    _overrun(buffers[3].tensor, 8, 1, 3)  # the second element past the end of b3
    assert guarded.written() == [False, True, True, True]
    guarded.rearm()
    assert guarded.written() == [False] * 4
    _overrun(buffers[0].tensor, -3, 1, 0)  # the first element of b0's front band
    assert guarded.written() == [True, False, False, False]
    (message,) = guarded.violations()
    assert "guard band before 'b0' overwritten at element offset(s) -3:" in message
