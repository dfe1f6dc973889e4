"""Clearing FULL-mode padding rows (``backends/batch_layout.zero_padding_rows``): the Triton
kernel against the tensor-op form, under the interpreter on CPU, compiled for sm_90, and
on CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.batch_layout import PADDING_ROW_BLOCK, zero_padding_rows
from tests.fixtures.sm90_compile import compile_one_kernel


def _offsets(lengths: list[int], padded_reqs: int) -> torch.Tensor:
    """Query offsets of requests of ``lengths`` tokens, padded to ``padded_reqs`` requests
    by repeating the last offset (padding requests own no token)."""
    qsl = torch.zeros(padded_reqs + 1, dtype=torch.int32)
    qsl[1: len(lengths) + 1] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    qsl[len(lengths) + 1:] = qsl[len(lengths)]
    return qsl


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.integers(0, 3), min_size=0, max_size=4),
       padding_tokens=st.integers(0, 3), padding_reqs=st.integers(0, 2),
       heads=st.integers(1, 3), head_size=st.sampled_from([1, 5, 8]),
       seed=st.integers(0, 2**16))
def test_kernel_matches_tensor_ops(lengths: list[int], padding_tokens: int, padding_reqs: int,
                                   heads: int, head_size: int, seed: int) -> None:
    """Real tokens untouched, padding tokens (past the last real offset) zero, whatever
    the row width; the rows a view of a wider buffer, as an attention output's head is."""
    tokens = sum(lengths) + padding_tokens
    qsl = _offsets(lengths, len(lengths) + padding_reqs)
    gen = torch.Generator().manual_seed(seed)
    backing = torch.randn(tokens + 2, heads, head_size, generator=gen)
    want = backing.clone()
    zero_padding_rows(want[:tokens], qsl, kernel=False)
    zero_padding_rows(backing[:tokens], qsl, kernel=True)
    assert torch.equal(backing, want)
    assert torch.count_nonzero(want[sum(lengths):tokens]) == 0
    assert torch.count_nonzero(want[tokens:]) == want[tokens:].numel()


def test_rows_wider_than_one_block_and_strided_rows() -> None:
    """A row of more than one store block is cleared to its end; rows whose elements are
    not one contiguous run take the tensor ops."""
    rows = torch.ones(3, 2, PADDING_ROW_BLOCK // 2 + 3)
    zero_padding_rows(rows, _offsets([1], 2), kernel=True)
    assert rows[0].eq(1).all() and torch.count_nonzero(rows[1:]) == 0
    strided = torch.ones(3, 4, 6)[:, :, ::2]
    zero_padding_rows(strided, _offsets([2], 1), kernel=True)
    assert strided[:2].eq(1).all() and torch.count_nonzero(strided[2]) == 0


def test_kernel_compiles_for_sm90() -> None:
    compile_one_kernel(
        "speccheck.backends.batch_layout", "_zero_padding_rows_kernel",
        {"rows_ptr": "*bf16", "query_start_loc_ptr": "*i32", "num_reqs": "i32",
         "row_stride": "i32", "width": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 1024})


@pytest.mark.cuda
def test_kernel_matches_tensor_ops_on_cuda_graph_replay() -> None:
    """Serving shapes (16 heads of 128, bf16), the kernel chosen by default on CUDA,
    captured once and replayed with fewer real tokens than at capture."""
    rows = torch.randn(64, 16, 128, device="cuda").bfloat16()
    qsl = _offsets([16] * 4, 4).cuda()
    zero_padding_rows(rows, qsl)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        zero_padding_rows(rows, qsl)
    for lengths in ([5, 0, 3, 1], [16, 16, 16, 16], [0, 0, 0, 0]):
        rows.copy_(torch.randn(64, 16, 128, device="cuda").bfloat16())
        want = rows.clone()
        qsl.copy_(_offsets(lengths, 4))
        zero_padding_rows(want, qsl, kernel=False)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(rows, want)
