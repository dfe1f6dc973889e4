"""The propose call's index-buffer kernels against their tensor-op form: the scatter of a
pass's inputs (speculator/pass_inputs.py), the slot mapping (speculator/kv_cache.py) and
the decode lanes' inputs after the first pass (speculator/decode_inputs.py), under the
Triton interpreter on CPU, and compiled for sm_90. The scatter and the decode lanes also
write the slot mapping: it must be what ``compute_slot_mapping`` writes for the buffers
they leave, real and padding lanes alike."""

from __future__ import annotations

from dataclasses import fields
from typing import TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.speculator.decode_inputs import DecodeLaneBuffers, prepare_decode_lanes
from speccheck.speculator.kv_cache import PAD_SLOT, compute_slot_mapping
from speccheck.speculator.pass_inputs import (
    HEADER_SIZE,
    IndexBuffers,
    PassInputs,
    scatter_pass_inputs,
    stage_pass_inputs,
)
from speccheck.speculator.staging import HostStaging
from tests.fixtures.sm90_compile import run_without_interpreter

SMALL = settings(max_examples=15, deadline=None)


@SMALL
@given(tokens=st.integers(0, 300), reqs=st.integers(1, 5), width=st.integers(1, 6),
       block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 99))
def test_slot_mapping_kernel_matches_torch(tokens: int, reqs: int, width: int,
                                           block_size: int, seed: int) -> None:
    """Real lanes map through their request's row (a table wider than the rows in use, as
    the speculator's is), padding lanes to the sink; more lanes than one program holds."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 1000, (reqs + 2, width + 3), generator=gen, dtype=torch.int32)
    token_request = torch.randint(0, reqs, (tokens,), generator=gen)
    positions = torch.randint(0, width * block_size, (tokens,), generator=gen)
    is_real = torch.rand(tokens, generator=gen) < 0.8
    got = torch.full((tokens,), -7, dtype=torch.int64)
    want = torch.full((tokens,), -7, dtype=torch.int64)
    compute_slot_mapping(positions, token_request, table, is_real, block_size, got, kernel=True)
    compute_slot_mapping(positions, token_request, table, is_real, block_size, want, kernel=False)
    assert torch.equal(got, want)
    assert bool((got[~is_real] == PAD_SLOT).all())


def _index_buffers(reqs: int, blocks: int, tokens: int, k: int, seed: int) -> IndexBuffers:
    """Whole index buffers full of an earlier call's leftovers (nothing zero)."""
    gen = torch.Generator().manual_seed(seed)

    def ints(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.randint(1, 99, shape, generator=gen, dtype=dtype)

    return IndexBuffers(
        block_table=ints(reqs, blocks, dtype=torch.int32), seeds=ints(reqs),
        seq_lens=ints(reqs, dtype=torch.int32), query_start_loc=ints(reqs + 1, dtype=torch.int32),
        is_real_req=torch.ones(reqs, dtype=torch.bool), positions=ints(tokens),
        input_ids=ints(tokens), token_request=ints(tokens), slot_mapping=ints(tokens),
        is_real_token=torch.ones(tokens, dtype=torch.bool), draft_tokens=ints(reqs, k),
        current_step=torch.tensor(3), num_reqs=torch.tensor(17))


def _staged(arrays: list[torch.Tensor], uniform_width: int, device: torch.device) -> PassInputs:
    """``arrays`` (table, seeds, lengths, positions, ids, token requests) staged as the
    speculator stages a pass's inputs: one buffer, the sizes' header first, then each
    array at its own offset."""
    staging = HostStaging(sum(a.numel() for a in arrays) + HEADER_SIZE + 1, device)
    return stage_pass_inputs(staging, *(a.numpy() for a in arrays), uniform_width)


def _assert_slots_as_computed(buffers: IndexBuffers | DecodeLaneBuffers, block_size: int,
                              real: int) -> None:
    """``buffers.slot_mapping`` is what ``compute_slot_mapping`` (both forms) writes from the
    buffers' positions, requests, block table and real flags, over every lane; lanes from
    ``real`` on (padding) hold the sink slot, real lanes a slot of a live block."""
    lanes = buffers.slot_mapping.shape[0]
    for kernel in (False, True):
        want = torch.full((lanes,), -7, dtype=torch.int64, device=buffers.slot_mapping.device)
        compute_slot_mapping(buffers.positions, buffers.token_request, buffers.block_table,
                             buffers.is_real_token, block_size, want, kernel=kernel)
        assert torch.equal(buffers.slot_mapping, want), kernel
    assert bool((buffers.slot_mapping[real:] == PAD_SLOT).all())
    assert bool(buffers.is_real_token[:real].all()) and not bool(buffers.is_real_token[real:].any())


@SMALL
@given(data=st.data(), reqs=st.integers(1, 6), blocks=st.integers(1, 200),
       tokens=st.integers(1, 40), k=st.integers(1, 3), block_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 99))
def test_scatter_pass_inputs_kernel_matches_torch(data: st.DataObject, reqs: int, blocks: int,
                                                  tokens: int, k: int, block_size: int,
                                                  seed: int) -> None:
    """Every buffer equal to the tensor-op form's: the batch's rows, lengths and tokens at
    the head, every other entry reset (seeds past the batch left as they were), block tables
    larger than one program's share; the slot mapping is ``compute_slot_mapping``'s for the
    buffers written (positions past a row's staged blocks included: block 0 there)."""
    r = data.draw(st.integers(0, reqs))
    width = data.draw(st.integers(0, blocks))
    t = data.draw(st.integers(0, tokens))
    gen = torch.Generator().manual_seed(seed + 7)
    positions = torch.randint(0, blocks * block_size, (t,), generator=gen)
    token_request = torch.randint(0, max(r, 1), (t,), generator=gen)
    width_per_req = data.draw(st.integers(0, 4))
    inputs = _staged([torch.randint(1, 500, (r, width), generator=gen),
                      torch.randint(0, 2**31, (r,), generator=gen),
                      torch.randint(1, 300, (r,), generator=gen), positions,
                      torch.randint(0, 300, (t,), generator=gen), token_request],
                     width_per_req, torch.device("cpu"))
    got = _index_buffers(reqs, blocks, tokens, k, seed)
    want = _index_buffers(reqs, blocks, tokens, k, seed)
    scatter_pass_inputs(got, inputs, block_size, kernel=True)
    scatter_pass_inputs(want, inputs, block_size, kernel=False)
    for name in IndexBuffers.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert int(want.block_table[r:].abs().sum()) == 0 and int(want.num_reqs) == r
    assert want.query_start_loc.tolist() == [min(i, r) * width_per_req
                                             for i in range(reqs + 1)]
    _assert_slots_as_computed(got, block_size, t)
    inside = (positions // block_size < width) & (token_request < r)
    assert bool((got.slot_mapping[:t][inside] >= block_size).all()), "a staged block is live"


def _lanes(n: int, k: int, seed: int, base: torch.Tensor, cols: int = 40) -> DecodeLaneBuffers:
    """Decode-lane buffers as a pass over ``len(base)`` requests leaves them: its
    requests' lengths ``base`` at the head of ``seq_lens``, every other entry a leftover of
    an earlier call (stale), and a block table of more rows than lanes whose rows are
    contiguous but strided (a column slice of a wider table), every entry a live block."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(0, 99, (n,), generator=gen, dtype=torch.int32)
    seq_lens[: len(base)] = base
    return DecodeLaneBuffers(
        positions=torch.randint(0, 99, (n,), generator=gen),
        seq_lens=seq_lens,
        input_ids=torch.randint(0, 99, (n,), generator=gen),
        token_request=torch.randint(0, 99, (n,), generator=gen),
        is_real_req=torch.rand(n, generator=gen) < 0.5,
        is_real_token=torch.rand(n, generator=gen) < 0.5,
        slot_mapping=torch.randint(1, 99, (n,), generator=gen),
        query_start_loc=torch.randint(0, 99, (n + 1,), generator=gen, dtype=torch.int32),
        block_table=torch.randint(1, 999, (n + 2, cols + 3), generator=gen,
                                  dtype=torch.int32)[:, :cols],
        draft_tokens=torch.randint(0, 99, (n, k), generator=gen),
        current_step=torch.tensor(5),
        num_reqs=torch.tensor(len(base)),
    )


@SMALL
@given(n=st.integers(1, 300), data=st.data(), k=st.integers(1, 3),
       block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 99))
def test_prepare_decode_lanes_kernel_matches_torch(n: int, data: st.DataObject, k: int,
                                                   block_size: int, seed: int) -> None:
    """Every buffer equal to the tensor-op form's, lengths clamped at max_model_len, padding
    lanes zeroed and not real, the step reset to 1; step 1's slot mapping is
    ``compute_slot_mapping``'s for the lanes written (padding lanes: the sink)."""
    r = data.draw(st.integers(0, n))
    max_len = 40
    base = torch.randint(max_len - 3, max_len + 2, (r,), generator=torch.Generator().manual_seed(seed))
    got, want = _lanes(n, k, seed, base), _lanes(n, k, seed, base)
    prepare_decode_lanes(got, max_len, block_size, kernel=True)
    prepare_decode_lanes(want, max_len, block_size, kernel=False)
    for name in DecodeLaneBuffers.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert int(want.current_step) == 1 and not bool(want.is_real_req[r:].any())
    assert want.seq_lens[:r].tolist() == (base + 1).clamp(max=max_len).tolist()
    assert want.query_start_loc.tolist() == [min(i, r) for i in range(n + 1)]
    _assert_slots_as_computed(got, block_size, r)
    assert bool((got.slot_mapping[:r] >= block_size).all()), "real lanes write live blocks"


_AOT_SCRIPT = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from speccheck.speculator import decode_inputs, kv_cache

target = GPUTarget("cuda", 90, 32)
compile(ASTSource(kv_cache._slot_mapping_kernel, {"positions_ptr": "*i64",
        "token_request_ptr": "*i64", "block_table_ptr": "*i32", "is_real_ptr": "*i1",
        "out_ptr": "*i64", "table_row_stride": "i32", "num_tokens": "i32", "block_size": "i32",
        "pad_slot": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256}), target=target)
print("slots ok")
compile(ASTSource(decode_inputs._prepare_decode_lanes_kernel, {"num_reqs_ptr": "*i64",
        "positions_ptr": "*i64", "seq_lens_ptr": "*i32", "input_ids_ptr": "*i64",
        "token_request_ptr": "*i64", "is_real_req_ptr": "*i1", "is_real_token_ptr": "*i1",
        "slot_mapping_ptr": "*i64", "query_start_loc_ptr": "*i32", "block_table_ptr": "*i32",
        "table_row_stride": "i32", "draft_tokens_ptr": "*i64", "current_step_ptr": "*i64",
        "draft_row_stride": "i32",
        "num_lanes": "i32", "max_model_len": "i32", "block_size": "i32",
        "BLOCK": "constexpr"}, {"BLOCK": 256}), target=target)
print("lanes ok")
from speccheck.speculator import pass_inputs
compile(ASTSource(pass_inputs._scatter_pass_inputs_kernel, {"staged_ptr": "*i64",
        "block_size": "i32",
        "block_table_ptr": "*i32", "table_row_stride": "i32",
        "table_rows": "i32", "table_cols": "i32", "seeds_ptr": "*i64", "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32", "is_real_req_ptr": "*i1", "positions_ptr": "*i64",
        "input_ids_ptr": "*i64", "token_request_ptr": "*i64", "slot_mapping_ptr": "*i64",
        "is_real_token_ptr": "*i1", "max_tokens": "i32", "draft_tokens_ptr": "*i64",
        "draft_size": "i32", "current_step_ptr": "*i64", "num_reqs_ptr": "*i64",
        "HEADER": "constexpr", "BLOCK": "constexpr"},
        {"HEADER": pass_inputs.HEADER_SIZE, "BLOCK": 1024}), target=target)
print("scatter ok")
"""


def test_lane_kernels_compile_for_sm90() -> None:
    """``triton.compile`` for Hopper on any machine (a subprocess: kernels decorated under
    ``TRITON_INTERPRET=1`` cannot be compiled)."""
    out = run_without_interpreter(_AOT_SCRIPT)
    assert out.count(" ok") == 3, out


B = TypeVar("B", IndexBuffers, DecodeLaneBuffers)


def _on(buffers: B, device: torch.device) -> B:
    """A copy of a record of tensors with every tensor on ``device``."""
    return type(buffers)(**{f.name: getattr(buffers, f.name).to(device) for f in fields(buffers)})


@pytest.mark.cuda
def test_cuda_lane_kernels_match_torch() -> None:
    """Compiled on the GPU, each index-buffer kernel writes what its tensor-op form writes
    (the speculator's oracle and candidates both run them, so the verifier cannot tell a
    wrong kernel from a right one: this test can)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    reqs, blocks, tokens, k = 64, 2048, 256, 8
    arrays = [torch.randint(1, 9999, (40, 300), generator=gen),
              torch.randint(0, 2**31, (40,), generator=gen),
              torch.randint(1, 4800, (40,), generator=gen),
              torch.randint(0, 4800, (200,), generator=gen),
              torch.randint(0, 32000, (200,), generator=gen),
              torch.randint(0, 40, (200,), generator=gen)]
    inputs, on_gpu = _staged(arrays, 3, torch.device("cpu")), _staged(arrays, 3, cuda)
    got = _on(_index_buffers(reqs, blocks, tokens, k, 1), cuda)
    want = _index_buffers(reqs, blocks, tokens, k, 1)
    scatter_pass_inputs(got, on_gpu, 16)
    scatter_pass_inputs(want, inputs, 16, kernel=False)
    for name in IndexBuffers.__dataclass_fields__:
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    _assert_slots_as_computed(got, 16, 200)
    is_real = torch.rand(tokens, generator=gen) < 0.8
    slots_got = torch.full((tokens,), -1, dtype=torch.int64, device=cuda)
    slots_want = torch.full((tokens,), -1, dtype=torch.int64)
    positions = torch.randint(0, 300 * 16, (tokens,), generator=gen)
    requests = torch.randint(0, 40, (tokens,), generator=gen)
    table = arrays[0].int()
    compute_slot_mapping(positions.to(cuda), requests.to(cuda), table.to(cuda),
                         is_real.to(cuda), 16, slots_got)
    compute_slot_mapping(positions, requests, table, is_real, 16, slots_want, kernel=False)
    assert torch.equal(slots_got.cpu(), slots_want)
    base = torch.randint(4000, 4100, (40,), generator=gen, dtype=torch.int32)
    lanes_got = _on(_lanes(reqs, k, 2, base, cols=256), cuda)
    lanes_want = _lanes(reqs, k, 2, base, cols=256)
    prepare_decode_lanes(lanes_got, 4096, 16)
    prepare_decode_lanes(lanes_want, 4096, 16, kernel=False)
    for name in DecodeLaneBuffers.__dataclass_fields__:
        assert torch.equal(getattr(lanes_got, name).cpu(), getattr(lanes_want, name)), name
    _assert_slots_as_computed(lanes_got, 16, 40)
