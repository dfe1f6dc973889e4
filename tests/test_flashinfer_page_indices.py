"""FlashInfer's page indices built on the device, and plans that never read the device.

On CPU the Triton kernel runs in the interpreter (conftest sets ``TRITON_INTERPRET=1``) and
is checked against the host reference :func:`paged_kv_layout` over random page tables:
zero-length requests (padding lanes), lengths exactly at page boundaries, every block-table
column used, block tables that are column slices of wider buffers, and buffers full of
stale block ids, as an earlier, larger batch leaves them. A subprocess compiles the kernel
for sm_90 to catch what the interpreter accepts but compiled Triton rejects.

Tests marked ``cuda`` run the compiled kernel under CUDA-graph replay and, with FlashInfer
installed, plan the wrappers under ``torch.cuda.set_sync_debug_mode("error")`` (a plan
makes no synchronising CUDA call) and compare a decode run on the device-built indices
with one planned the old way, from a page table built on the host.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.backends.flashinfer.page_indices import (
    paged_kv_layout,
    paged_kv_lengths,
    stage_paged_kv_lengths,
    write_paged_kv_indices,
    write_paged_kv_table,
)
from speccheck.backends.kv_cache_write import write_kv_cache
from speccheck.contract.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from speccheck.contract.token_count import build_attention_metadata
from tests.fixtures.sm90_compile import run_without_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the kernel tests run: the interpreter on CPU, the compiled kernel on a GPU."""
STALE = 7777
"""A block id no table here holds: what an earlier batch left in the buffer."""


# -- kernel against the host reference --------------------------------------------------


def check_against_layout(
    indices: torch.Tensor, seq_lens: np.ndarray, table: torch.Tensor, page_size: int
) -> None:
    """Build ``indices`` on the device for a batch and compare it with the host reference:
    the used head equals the reference's indices, and the whole tail is zero."""
    layout = paged_kv_layout(seq_lens, table.cpu().numpy(), page_size)
    write_paged_kv_indices(indices, table, layout.indptr.to(DEVICE), len(seq_lens))
    got = indices.cpu()
    used = layout.num_pages
    assert torch.equal(got[:used], layout.indices), (got[:used], layout.indices)
    assert torch.count_nonzero(got[used:]) == 0, got[used:]


@st.composite
def page_tables(draw: st.DrawFn) -> tuple[int, np.ndarray, torch.Tensor, int]:
    """``(page_size, seq_lens, block_table, capacity)``: ``num_reqs`` lanes, each a padding
    lane, a length at a page boundary, the full table row, or any length; the block table
    is a column slice of a wider buffer; ``capacity`` is at least every row in use."""
    page_size = draw(st.integers(1, 8), label="page_size")
    max_blocks = draw(st.integers(1, 6), label="max_blocks")
    num_reqs = draw(st.integers(1, 6), label="num_reqs")
    full = page_size * max_blocks
    length = st.one_of(
        st.just(0),
        st.integers(0, max_blocks).map(lambda pages: pages * page_size),
        st.just(full),
        st.integers(0, full),
    )
    seq_lens = np.array(draw(st.lists(length, min_size=num_reqs, max_size=num_reqs)))
    extra_rows = draw(st.integers(0, 2), label="extra_rows")
    extra_cols = draw(st.integers(0, 3), label="extra_cols")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    wide = rng.integers(1, 5000, size=(num_reqs + extra_rows, max_blocks + extra_cols))
    table = torch.from_numpy(wide.astype(np.int32)).to(DEVICE)[:, :max_blocks]
    capacity = num_reqs * max_blocks + draw(st.integers(0, 9), label="extra_capacity")
    return page_size, seq_lens, table, capacity


@settings(max_examples=40)
@given(case=page_tables(), more=st.lists(st.integers(0, 2**32 - 1), max_size=2))
def test_kernel_matches_host_layout(case: tuple[int, np.ndarray, torch.Tensor, int],
                                    more: list[int]) -> None:
    """One buffer, stale to begin with, then reused by up to two more batches of the same
    lanes with fresh lengths: each time the head is the reference and the tail zero."""
    page_size, seq_lens, table, capacity = case
    indices = torch.full((capacity,), STALE, dtype=torch.int32, device=DEVICE)
    check_against_layout(indices, seq_lens, table, page_size)
    full = page_size * table.shape[1]
    for seed in more:
        lens = np.random.default_rng(seed).integers(0, full + 1, size=len(seq_lens))
        check_against_layout(indices, lens, table, page_size)


@settings(max_examples=15)
@given(case=page_tables(), steps=st.integers(2, 4))
def test_one_launch_fills_the_tables_of_several_steps(
    case: tuple[int, np.ndarray, torch.Tensor, int], steps: int
) -> None:
    """The draft steps of one replay: rows of one stale buffer, step ``s`` one token
    longer per live request than step ``s - 1`` (clamped at the table's width), one launch
    over their stacked indptr rows; each row is its own reference, and no row's tail or
    neighbour is touched by another's."""
    page_size, seq_lens, table, capacity = case
    full = page_size * table.shape[1]
    lens = np.stack([np.where(seq_lens > 0, np.minimum(seq_lens + s, full), 0)
                     for s in range(steps)])
    lengths = paged_kv_lengths(lens, page_size, table.shape[1])
    backing = torch.full((steps, capacity + 3), STALE, dtype=torch.int32, device=DEVICE)
    indices = backing[:, :capacity]
    write_paged_kv_indices(indices, table, lengths.indptr.to(DEVICE), len(seq_lens))
    got = backing.cpu()
    for step in range(steps):
        layout = paged_kv_layout(lens[step], table.cpu().numpy(), page_size)
        assert torch.equal(lengths.indptr[step], layout.indptr)
        assert torch.equal(lengths.last_page_len[step], layout.last_page_len)
        used = layout.num_pages
        assert torch.equal(got[step, :used], layout.indices), (step, got[step], layout.indices)
        assert torch.count_nonzero(got[step, used:capacity]) == 0
        assert (got[step, capacity:] == STALE).all()


def check_device_table(
    seq_lens: np.ndarray, table: torch.Tensor, page_size: int, buffers: dict[str, torch.Tensor]
) -> None:
    """Build the whole table on the device from device lengths (with stale lanes past the
    batch) and compare it with the host reference; entries past the batch stay as they
    were."""
    n = len(seq_lens)
    lens = torch.full((n + 2,), 99999, dtype=torch.int32)
    lens[:n] = torch.from_numpy(seq_lens.astype(np.int32))
    indptr, last, indices = buffers["indptr"], buffers["last"], buffers["indices"]
    indptr_tail = indptr[n + 1 :].clone()
    last_tail = last[n:].clone()
    write_paged_kv_table(lens.to(DEVICE), table, page_size, indptr=indptr, last_page_len=last,
                         indices=indices, num_reqs=n)
    layout = paged_kv_layout(seq_lens, table.cpu().numpy(), page_size)
    assert torch.equal(indptr[: n + 1].cpu(), layout.indptr), (indptr, layout.indptr)
    assert torch.equal(last[:n].cpu(), layout.last_page_len), (last, layout.last_page_len)
    used = layout.num_pages
    got = indices.cpu()
    assert torch.equal(got[:used], layout.indices), (got[:used], layout.indices)
    assert torch.count_nonzero(got[used:]) == 0, got[used:]
    assert torch.equal(indptr[n + 1 :], indptr_tail)
    assert torch.equal(last[n:], last_tail)


@settings(max_examples=40)
@given(case=page_tables(), more=st.lists(st.integers(0, 2**32 - 1), max_size=2))
def test_device_table_matches_host_layout(case: tuple[int, np.ndarray, torch.Tensor, int],
                                          more: list[int]) -> None:
    """The table from device lengths, in stale buffers, then again for up to two more
    batches of the same lanes: indptr, last-page lengths and indices are the reference's,
    the indices' tail zero."""
    page_size, seq_lens, table, capacity = case
    n = len(seq_lens)
    buffers = {
        "indptr": torch.full((n + 3,), STALE, dtype=torch.int32, device=DEVICE),
        "last": torch.full((n + 2,), STALE, dtype=torch.int32, device=DEVICE),
        "indices": torch.full((capacity,), STALE, dtype=torch.int32, device=DEVICE),
    }
    check_device_table(seq_lens, table, page_size, buffers)
    full = page_size * table.shape[1]
    for seed in more:
        lens = np.random.default_rng(seed).integers(0, full + 1, size=n)
        check_device_table(lens, table, page_size, buffers)


def test_device_table_cuts_what_the_block_table_cannot_hold() -> None:
    """Negative lengths count as empty, lengths past the table's width take its last page
    full; nothing is written past the indices' capacity."""
    table = torch.arange(1, 7, dtype=torch.int32, device=DEVICE).view(2, 3)
    indptr = torch.full((3,), STALE, dtype=torch.int32, device=DEVICE)
    last = torch.full((2,), STALE, dtype=torch.int32, device=DEVICE)
    backing = torch.full((8,), STALE, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([-5, 40], dtype=torch.int32, device=DEVICE)
    write_paged_kv_table(lens, table, 4, indptr=indptr, last_page_len=last,
                         indices=backing[:5], num_reqs=2)
    assert indptr.tolist() == [0, 0, 3]
    assert last.tolist() == [0, 4]
    assert backing.tolist() == [4, 5, 6, 0, 0, STALE, STALE, STALE]


def test_device_table_rejects_what_it_cannot_write_safely() -> None:
    table = torch.zeros((2, 3), dtype=torch.int32, device=DEVICE)
    ok = {"indptr": torch.zeros(3, dtype=torch.int32, device=DEVICE),
          "last_page_len": torch.zeros(2, dtype=torch.int32, device=DEVICE),
          "indices": torch.zeros(6, dtype=torch.int32, device=DEVICE)}
    lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        write_paged_kv_table(lens.long(), table, 4, num_reqs=2, **ok)
    with pytest.raises(ValueError, match="indptr of shape"):
        write_paged_kv_table(lens, table, 4, num_reqs=2, **{**ok, "indptr": ok["indptr"][:2]})
    with pytest.raises(ValueError, match="block_table of shape"):
        write_paged_kv_table(lens, table[:1], 4, num_reqs=2, **ok)
    with pytest.raises(ValueError, match="one contiguous row"):
        write_paged_kv_table(lens, table, 4, num_reqs=2,
                             **{**ok, "indices": ok["indices"].view(2, 3)})


def test_smaller_batch_after_a_full_one_leaves_no_stale_block_id() -> None:
    """Every column of every row used, then lengths at and one past page boundaries with
    padding lanes at the end: everything past the new last page is zero."""
    page_size, max_blocks, lanes = 4, 5, 4
    table = torch.arange(1, lanes * max_blocks + 1, dtype=torch.int32, device=DEVICE)
    table = table.view(lanes, max_blocks)
    indices = torch.zeros(lanes * max_blocks, dtype=torch.int32, device=DEVICE)
    check_against_layout(indices, np.full(lanes, page_size * max_blocks), table, page_size)
    assert torch.count_nonzero(indices) == indices.numel()  # max_blocks fully used
    check_against_layout(indices, np.array([4, 5, 0, 0]), table, page_size)
    assert indices.cpu().tolist()[:4] == [1, 6, 7, 0]


def test_capacity_not_a_multiple_of_the_lanes_is_zeroed_to_the_end() -> None:
    """The tail is shared out in ``ceil(capacity / num_reqs)`` pieces: the last piece
    reaches the buffer's end and no further."""
    table = torch.tensor([[3, 4, 5], [6, 7, 8], [9, 1, 2]], dtype=torch.int32, device=DEVICE)
    backing = torch.full((40,), STALE, dtype=torch.int32, device=DEVICE)
    indices = backing[3:35]  # 32 entries, 3 lanes
    check_against_layout(indices, np.array([1, 0, 2]), table, 1)
    assert (backing[:3] == STALE).all() and (backing[35:] == STALE).all()


def test_no_lanes_zero_the_whole_buffer() -> None:
    indices = torch.full((6,), STALE, dtype=torch.int32, device=DEVICE)
    empty = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    write_paged_kv_indices(indices, empty, torch.zeros(1, dtype=torch.int32, device=DEVICE), 0)
    assert torch.count_nonzero(indices) == 0


def test_rejects_what_it_cannot_write_safely() -> None:
    table = torch.ones(2, 3, dtype=torch.int32, device=DEVICE)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    indices = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        write_paged_kv_indices(indices.long(), table, indptr, 2)
    with pytest.raises(ValueError, match="contiguous rows"):
        write_paged_kv_indices(indices, table.t(), indptr, 2)
    with pytest.raises(ValueError, match="does not cover"):
        write_paged_kv_indices(indices, table, indptr[:2], 2)
    with pytest.raises(ValueError, match="one contiguous row"):
        write_paged_kv_indices(indices[::2], table, indptr, 2)
    with pytest.raises(ValueError, match="one indptr row each"):
        write_paged_kv_indices(indices.view(2, 3), table, indptr, 2)
    with pytest.raises(ValueError, match="each of the 3 index rows"):
        write_paged_kv_indices(indices.view(3, 2), table, indptr.repeat(2, 1), 2)


def test_host_lengths() -> None:
    """``indptr`` and ``last_page_len`` straight from host lengths (what plan() is given)."""
    lengths = paged_kv_lengths(np.array([0, 4, 5, 12]), 4, 3)
    assert lengths.indptr.tolist() == [0, 0, 1, 3, 6]
    assert lengths.last_page_len.tolist() == [0, 4, 1, 4]
    assert lengths.num_pages == 6
    steps = paged_kv_lengths(np.array([[0, 4, 5, 12], [0, 5, 6, 12]]), 4, 3)
    assert steps.indptr.tolist() == [[0, 0, 1, 3, 6], [0, 0, 2, 4, 7]]
    assert steps.last_page_len.tolist() == [[0, 4, 1, 4], [0, 1, 2, 4]]
    assert steps.num_pages == 7
    with pytest.raises(ValueError, match="columns"):
        paged_kv_lengths(np.array([13]), 4, 3)
    with pytest.raises(ValueError, match="negative"):
        paged_kv_lengths(np.array([-1]), 4, 3)


def test_staged_lengths_are_the_host_lengths() -> None:
    """The draft steps' staging rows (indptr, then last_page_len) hold what
    ``paged_kv_lengths`` computes, whatever the rows held before; the page counts come
    back; the same checks raise."""
    seq = np.array([[0, 4, 5, 12], [0, 5, 6, 12], [1, 6, 7, 12]])
    rows = np.full((3, 9), 77, dtype=np.int32)
    assert stage_paged_kv_lengths(seq, 4, 3, rows) == [6, 7, 8]
    want = paged_kv_lengths(seq, 4, 3)
    assert rows[:, :5].tolist() == want.indptr.tolist()
    assert rows[:, 5:].tolist() == want.last_page_len.tolist()
    with pytest.raises(ValueError, match="columns"):
        stage_paged_kv_lengths(np.array([[13]]), 4, 3, np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="negative"):
        stage_paged_kv_lengths(np.array([[-1]]), 4, 3, np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="staging rows"):
        stage_paged_kv_lengths(seq, 4, 3, np.zeros((3, 8), np.int32))


_AOT_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from speccheck.backends.flashinfer.page_indices import (
        INDEX_BLOCK, REQ_BLOCK, paged_kv_indices_kernel, paged_kv_table_kernel,
    )
    from tests.fixtures.sm90_compile import signature

    for fn, constexprs in ((paged_kv_indices_kernel, {"BLOCK": INDEX_BLOCK}),
                           (paged_kv_table_kernel, {"BLOCK": INDEX_BLOCK, "REQ_BLOCK": REQ_BLOCK})):
        src = ASTSource(fn, signature(fn, constexprs, {}, "*i32"), constexprs)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
        print(fn.__name__, "ok", flush=True)
    """
)


def test_kernel_compiles_for_sm90() -> None:
    """``triton.compile`` for Hopper on any machine; in a subprocess because kernels
    decorated under ``TRITON_INTERPRET=1`` cannot be compiled."""
    out = run_without_interpreter(_AOT_SCRIPT)
    assert "paged_kv_indices_kernel ok" in out, out
    assert "paged_kv_table_kernel ok" in out, out


@pytest.mark.cuda
def test_kernel_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed after the indptr and block table changed in place."""
    table = torch.randint(1, 1000, (4, 6), dtype=torch.int32, device="cuda")
    indptr = torch.zeros(5, dtype=torch.int32, device="cuda")
    indices = torch.full((24,), STALE, dtype=torch.int32, device="cuda")
    write_paged_kv_indices(indices, table, indptr, 4)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_paged_kv_indices(indices, table, indptr, 4)
    for lens in ([24, 24, 24, 24], [1, 0, 9, 4], [0, 0, 0, 0]):
        table.copy_(torch.randint(1, 1000, (4, 6), dtype=torch.int32))
        layout = paged_kv_layout(np.array(lens), table.cpu().numpy(), 4)
        indptr.copy_(layout.indptr)
        indices.fill_(STALE)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(indices[: layout.num_pages].cpu(), layout.indices)
        assert torch.count_nonzero(indices[layout.num_pages :]) == 0


# -- the builder on a GPU with FlashInfer ------------------------------------------------


@pytest.fixture
def flashinfer() -> ModuleType:
    try:
        return pytest.importorskip("flashinfer", exc_type=ImportError)
    except TypeError:  # pytest < 8.2 has no exc_type
        return pytest.importorskip("flashinfer")


@contextmanager
def sync_debug_error() -> Iterator[None]:
    """Every synchronising CUDA call (a device-to-host copy, a blocking copy, a stream or
    device synchronisation, ``.item()``) raises inside this block."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _decode_common(case: Any, seq_lens: list[int], lanes: int) -> Any:
    """FULL-mode decode metadata over ``lanes`` lanes for the real ``seq_lens``, written
    into the case's persistent buffers."""
    n = len(seq_lens)
    case.buffers.seq_lens.zero_()
    case.buffers.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32))
    return build_attention_metadata(
        buffers=case.buffers,
        batch_desc=BatchExecutionDescriptor(CUDAGraphMode.FULL, lanes, lanes, 1),
        num_reqs=n,
        query_start_loc_np=np.arange(n + 1, dtype=np.int32),
        base_seq_lens_np=np.array(seq_lens, dtype=np.int32),
        step=0,
        max_model_len=case.layer.max_model_len,
    )


def _full_indices(builder: Any, md: Any) -> torch.Tensor:
    """The whole persistent indices buffer (or row of one: a draft step's) ``md``'s head
    view belongs to."""
    for name, buffer in builder.persistent_buffers().items():
        if not name.endswith("paged_kv_indices"):
            continue
        for row in buffer.view(-1, buffer.shape[-1]):
            if row.data_ptr() == md.paged_kv_indices.data_ptr():
                return row
    raise AssertionError("no persistent indices buffer starts at the metadata's indices")


def _check_indices(builder: Any, md: Any, common: Any) -> None:
    layout = paged_kv_layout(
        common.seq_lens_cpu_upper_bound.numpy(), common.block_table.cpu().numpy(),
        builder.layer.block_size,
    )
    full = _full_indices(builder, md).cpu()
    assert torch.equal(md.paged_kv_indptr.cpu(), layout.indptr)
    assert torch.equal(md.paged_kv_last_page_len.cpu(), layout.last_page_len)
    assert torch.equal(full[: layout.num_pages], layout.indices)
    assert torch.count_nonzero(full[layout.num_pages :]) == 0


@pytest.mark.cuda
def test_plan_makes_no_synchronising_call(flashinfer: ModuleType) -> None:
    """After a first build (wrappers created, kernels loaded), decode and prefill builds
    and ``plan_draft_steps`` (with its device half, ``finish_draft_step_plans``) run with
    every synchronising CUDA call an error; the page tables they leave on the device equal
    the host reference."""
    from tests.test_gpu_kernels import fi_builder, fi_layer, make_case

    layer = fi_layer()
    builder = fi_builder(layer)
    builder.make_impl(layer.head_size**-0.5)
    decode = make_case(layer, query_lens=[1] * 5, seq_lens=[3, 40, 17, 200, 129],
                       num_reqs_padded=8)
    prefill = make_case(layer, query_lens=[3, 1, 6, 2], seq_lens=[3, 20, 200, 33])
    builder.build(decode.common)
    builder.build(prefill.common)
    builder.finish_draft_step_plans(
        builder.plan_draft_steps([_decode_common(decode, [5, 6], 8) for _ in range(3)])
    )
    torch.cuda.synchronize()

    commons = [_decode_common(decode, [256, 16 * s + 16, 1, 0][: 2 + s], 8) for s in range(3)]
    with sync_debug_error():
        decode_md = builder.build(commons[0])
        prefill_md = builder.build(prefill.common)
        step_mds = builder.plan_draft_steps(commons)
        builder.finish_draft_step_plans(step_mds)
    torch.cuda.synchronize()
    _check_indices(builder, decode_md, commons[0])
    _check_indices(builder, prefill_md, prefill.common)
    for md, common in zip(step_mds, commons, strict=True):
        _check_indices(builder, md, common)


@pytest.mark.cuda
def test_replan_plans_what_plan_draft_steps_plans(flashinfer: ModuleType) -> None:
    """``replan_draft_steps`` on metadata planned for one batch, given another batch's host
    lengths, leaves every draft step's device page table, page indices, FlashInfer plan
    info and staged schedule as ``plan_draft_steps`` on that batch does, and synchronises
    with nothing; on metadata that was never planned it is a one-line error."""
    from tests.test_gpu_kernels import fi_builder, fi_layer, make_case

    layer = fi_layer()
    builder = fi_builder(layer)
    builder.make_impl(layer.head_size**-0.5)
    case = make_case(layer, query_lens=[1] * 5, seq_lens=[3, 40, 17, 200, 129],
                     num_reqs_padded=8)

    def commons(lengths: list[int]) -> list[Any]:
        return [_decode_common(case, [n + s for n in lengths], 8) for s in range(3)]

    def plans(mds: list[Any]) -> list[Any]:
        builder.finish_draft_step_plans(mds)
        torch.cuda.synchronize()
        state = []
        for md in mds:
            wrapper = md.run.__self__
            state.append((md.paged_kv_indptr.clone(), md.paged_kv_last_page_len.clone(),
                          _full_indices(builder, md).clone(), list(wrapper._plan_info),
                          wrapper._pin_memory_int_workspace_buffer.clone()))
        return state

    live = [1, 300, 16, 47]
    captured = builder.plan_draft_steps(commons([5, 6]))
    builder.finish_draft_step_plans(captured)
    torch.cuda.synchronize()
    wanted = plans(builder.plan_draft_steps(commons(live)))
    builder.plan_draft_steps(commons([5, 6]))
    torch.cuda.synchronize()
    lengths = np.stack([c.seq_lens_cpu_upper_bound.numpy() for c in commons(live)])
    with sync_debug_error():
        builder.replan_draft_steps(captured, lengths)
    for got, want in zip(plans(captured), wanted, strict=True):
        for g, w in zip(got, want, strict=True):
            assert (g == w) if isinstance(g, list) else torch.equal(g, w)

    other = make_case(layer, query_lens=[1] * 2, seq_lens=[3, 4], num_reqs_padded=2)
    with pytest.raises(ValueError, match="plan_draft_steps has not planned"):
        builder.replan_draft_steps(_unplanned(builder, other), lengths[:, :2])


def _unplanned(builder: Any, case: Any) -> list[Any]:
    """Metadata of two draft steps over ``case``'s two lanes, made without a plan."""
    md = builder._empty_metadata(case.common, draft_step=0)
    return [md, md]


@pytest.mark.cuda
def test_device_indices_decode_matches_host_built_layout(flashinfer: ModuleType) -> None:
    """A padded decode batch (page boundaries, a full row, padding lanes) run on the
    device-built indices equals the same wrapper planned the old way, from the page table
    built on the host, bit for bit, and the reference within bf16 tolerance. Then a
    smaller batch on the same wrapper leaves no stale block id in its buffer."""
    from tests.test_gpu_kernels import ATOL, RTOL, fi_builder, fi_layer, make_case, reference_output

    layer = fi_layer()
    builder = fi_builder(layer)
    case = make_case(layer, query_lens=[1] * 5, seq_lens=[16, 17, 256, 1, 32],
                     num_reqs_padded=8)
    impl = builder.make_impl(case.scale)

    def run(md: Any) -> torch.Tensor:
        out = torch.full_like(case.query, float("nan"))
        kc, vc = case.key_cache.clone(), case.value_cache.clone()
        impl.forward(case.query, case.key, case.value, kc, vc, md, out)
        torch.cuda.synchronize()
        return out

    md = builder.build(case.common)
    _check_indices(builder, md, case.common)
    on_device = run(md)

    layout = paged_kv_layout(
        case.common.seq_lens_cpu_upper_bound.numpy(), case.table[:8], layer.block_size
    )
    md.wrapper.plan(
        layout.indptr, layout.indices, layout.last_page_len, layer.num_heads,
        layer.num_kv_heads, layer.head_size, layer.block_size, q_data_type=layer.dtype,
        kv_data_type=layer.dtype, sm_scale=case.scale,
    )
    on_host = run(md)
    assert torch.equal(on_device, on_host)

    kc_ref, vc_ref = case.key_cache.clone(), case.value_cache.clone()
    write_kv_cache(case.key, case.value, kc_ref, vc_ref, case.common.slot_mapping)
    ref = reference_output(case, kc_ref, vc_ref)
    torch.testing.assert_close(on_device[:5].float(), ref[:5].float(), atol=ATOL, rtol=RTOL)
    assert torch.count_nonzero(on_device[5:]) == 0

    smaller = _decode_common(case, [2, 1], 8)
    md_small = builder.build(smaller)
    assert md_small.wrapper is md.wrapper
    torch.cuda.synchronize()
    _check_indices(builder, md_small, smaller)
