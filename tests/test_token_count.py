"""The seed-004 attention token-count rule and the two metadata helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.metadata import AttentionInputBuffers
from speccheck.contract.token_count import (
    at_later_draft_step,
    attention_token_count,
    build_attention_metadata,
    build_uniform_attention_metadata,
    draft_seq_lens_upper_bound,
    draft_steps_seq_lens_upper_bound,
    padded_query_start_loc,
)


def _buffers() -> AttentionInputBuffers:
    return AttentionInputBuffers.allocate(16, 128, 8, torch.device("cpu"))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [(CUDAGraphMode.FULL, 52), (CUDAGraphMode.PIECEWISE, 48), (CUDAGraphMode.NONE, 48)],
)
def test_token_count_rule_per_mode(mode: CUDAGraphMode, expected: int) -> None:
    """The seed's numbers: 12 requests x 4 tokens = 48 real, padded to 52 by DP."""
    qsl = np.arange(13) * 4
    desc = BatchExecutionDescriptor(mode, 52, 13 if mode == CUDAGraphMode.FULL else None, None)
    assert attention_token_count(desc, qsl) == expected


def test_full_metadata_uses_padded_counts_and_repeats_offsets() -> None:
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 8, 1)
    md = build_uniform_attention_metadata(
        buffers=_buffers(), batch_desc=desc, num_reqs=5, num_query_per_req=1,
        base_seq_lens_np=np.array([3, 9, 30, 31, 32]), step=2, max_model_len=32,
    )
    assert md.num_actual_tokens == 8 and md.num_reqs == 8 and md.num_real_reqs == 5
    assert md.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu.tolist()
    assert md.seq_lens_cpu_upper_bound.tolist() == [5, 11, 32, 32, 32, 0, 0, 0]
    assert md.max_seq_len == 32
    assert md.slot_mapping.shape[0] == 8 and md.seq_lens.shape[0] == 8


@pytest.mark.parametrize("mode", [CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE])
def test_eager_metadata_uses_real_token_count_despite_padding(mode: CUDAGraphMode) -> None:
    desc = BatchExecutionDescriptor(mode, 52, None, 4)
    md = build_uniform_attention_metadata(
        buffers=_buffers(), batch_desc=desc, num_reqs=12, num_query_per_req=4,
        base_seq_lens_np=np.full(12, 10), step=0, max_model_len=64,
    )
    assert md.num_actual_tokens == 48
    assert md.num_reqs == 12
    assert int(md.query_start_loc_cpu[-1]) == md.num_actual_tokens


def test_descriptor_rejects_fewer_padded_requests_than_real() -> None:
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 2, 2, 1)
    with pytest.raises(ValueError, match="pads to num_reqs=2"):
        build_uniform_attention_metadata(
            buffers=_buffers(), batch_desc=desc, num_reqs=3, num_query_per_req=1,
            base_seq_lens_np=np.ones(3), step=1, max_model_len=8,
        )


@given(
    base=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    pad=st.integers(0, 4),
    step=st.integers(0, 8),
    max_model_len=st.integers(1, 48),
)
def test_upper_bound_adds_step_clamps_and_zeroes_tail(base, pad, step, max_model_len) -> None:
    n = len(base)
    out = draft_seq_lens_upper_bound(np.array(base), n, n + pad, step, max_model_len)
    assert out.tolist() == [min(b + step, max_model_len) for b in base] + [0] * pad


@given(
    base=st.lists(st.integers(0, 40), min_size=0, max_size=8),
    pad=st.integers(0, 4),
    first=st.integers(0, 4),
    steps=st.integers(1, 7),
    max_model_len=st.integers(1, 48),
)
def test_every_step_bound_at_once_equals_the_bounds_one_by_one(
    base, pad, first, steps, max_model_len
) -> None:
    n = len(base)
    rows = draft_steps_seq_lens_upper_bound(np.array(base, dtype=np.int64), n, n + pad, first,
                                            steps, max_model_len)
    assert rows.dtype == np.int32 and rows.shape == (steps, n + pad)
    for i, row in enumerate(rows):
        one = draft_seq_lens_upper_bound(np.array(base, dtype=np.int64), n, n + pad, first + i,
                                         max_model_len)
        assert row.tolist() == one.tolist()


@given(lens=st.lists(st.integers(0, 5), min_size=1, max_size=6), pad=st.integers(0, 3))
def test_padded_query_start_loc_is_non_decreasing(lens, pad) -> None:
    qsl = np.concatenate([[0], np.cumsum(lens)])
    out = padded_query_start_loc(qsl, len(lens), len(lens) + pad)
    assert (np.diff(out) >= 0).all()
    assert out[: len(lens) + 1].tolist() == qsl.tolist()
    assert set(out[len(lens):].tolist()) == {int(qsl[-1])}


def test_varlen_metadata_in_eager_mode_covers_real_tokens() -> None:
    qsl = np.array([0, 2, 3, 6])
    md = build_attention_metadata(
        buffers=_buffers(), batch_desc=BatchExecutionDescriptor(CUDAGraphMode.NONE, 6),
        num_reqs=3, query_start_loc_np=qsl, base_seq_lens_np=np.array([4, 5, 9]), step=0,
        max_model_len=16,
    )
    assert md.num_actual_tokens == 6 and md.max_query_len == 3
    assert md.seq_lens_cpu_upper_bound.tolist() == [4, 5, 9]



@given(reqs=st.integers(0, 12), pad=st.integers(0, 3), q=st.integers(1, 4), dirty=st.booleans())
def test_uniform_offsets_on_the_device_equal_the_host_copy(reqs: int, pad: int, q: int,
                                                           dirty: bool) -> None:
    """A uniform build computes the offsets on the device (no host copy); they must equal
    the host copy whatever the buffer held before, and past the padded head it is
    untouched."""
    buffers = _buffers()
    if dirty:
        buffers.query_start_loc.fill_(99)
    padded = reqs + pad
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, padded * q, padded, q)
    md = build_uniform_attention_metadata(
        buffers=buffers, batch_desc=desc, num_reqs=reqs, num_query_per_req=q,
        base_seq_lens_np=np.full(reqs, 5), step=0, max_model_len=64,
    )
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu.tolist()
    assert md.query_start_loc_cpu.tolist() == [min(i, reqs) * q for i in range(padded + 1)]
    assert buffers.query_start_loc[padded + 1:].tolist() == [99 if dirty else 0] * (16 - padded)


def test_offsets_on_device_leave_the_buffer_to_the_caller() -> None:
    """``offsets_on_device``: the build takes the offsets the caller's device work wrote
    (a decode step's lanes) and writes nothing; the host copy is the same as ever. Only
    uniform offsets can be there already."""
    buffers = _buffers()
    buffers.query_start_loc.fill_(99)
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 4, 4, 1)
    md = build_uniform_attention_metadata(
        buffers=buffers, batch_desc=desc, num_reqs=3, num_query_per_req=1,
        base_seq_lens_np=np.full(3, 5), step=1, max_model_len=64, offsets_on_device=True,
    )
    assert md.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 3]
    assert buffers.query_start_loc.tolist() == [99] * 17
    with pytest.raises(ValueError, match="offsets_on_device needs uniform_query_len"):
        build_attention_metadata(
            buffers=buffers, batch_desc=BatchExecutionDescriptor(CUDAGraphMode.NONE, 3),
            num_reqs=2, query_start_loc_np=np.array([0, 1, 3]),
            base_seq_lens_np=np.full(2, 5), step=0, max_model_len=64, offsets_on_device=True)


def test_builds_of_one_size_share_their_views() -> None:
    """Views of the persistent buffers are made once per size: every build of that size
    hands out the same tensors (same storage, as before: only the slicing is saved)."""
    buffers = _buffers()
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 4, 4, 1)
    first, again = (build_uniform_attention_metadata(
        buffers=buffers, batch_desc=desc, num_reqs=3, num_query_per_req=1,
        base_seq_lens_np=np.full(3, 5), step=step, max_model_len=64) for step in (1, 2))
    assert first.seq_lens is again.seq_lens and first.slot_mapping is again.slot_mapping
    assert first.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()
    other = build_uniform_attention_metadata(
        buffers=buffers, batch_desc=BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 8, 1),
        num_reqs=3, num_query_per_req=1, base_seq_lens_np=np.full(3, 5), step=1,
        max_model_len=64)
    assert other.seq_lens.shape[0] == 8 and other.seq_lens is not first.seq_lens


@given(base=st.lists(st.integers(0, 40), min_size=0, max_size=6), pad=st.integers(0, 3),
       step=st.integers(2, 9))
def test_a_later_draft_step_derived_equals_its_build(base: list[int], pad: int,
                                                     step: int) -> None:
    """What the host_preplanned path derives for step ``step`` from step 1's build is that
    step's build: every host field equal, the device views the same."""
    n = len(base) + pad
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, n, n, 1)
    bufs, base_np = _buffers(), np.array(base, dtype=np.int32)

    def build(at: int):  # type: ignore[no-untyped-def]
        return build_uniform_attention_metadata(
            buffers=bufs, batch_desc=desc, num_reqs=len(base), num_query_per_req=1,
            base_seq_lens_np=base_np, step=at, max_model_len=42)

    derived, built = at_later_draft_step(build(1), base_np, step), build(step)
    for field, value in vars(built).items():
        got = getattr(derived, field)
        if isinstance(value, torch.Tensor):
            assert torch.equal(got, value), field
        else:
            assert got == value, field
    for view in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions"):
        assert getattr(derived, view).data_ptr() == getattr(built, view).data_ptr(), view
