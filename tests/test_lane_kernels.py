"""The propose call's index-buffer kernels against their tensor-op form: the slot mapping
(speculator/kv_cache.py) and the decode lanes' inputs after the first pass
(speculator/decode_inputs.py), under the Triton interpreter on CPU, and compiled for sm_90."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.speculator.decode_inputs import DecodeLaneBuffers, prepare_decode_lanes
from speccheck.speculator.kv_cache import PAD_SLOT, compute_slot_mapping

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


def _lanes(n: int, k: int, seed: int) -> DecodeLaneBuffers:
    """Decode-lane buffers holding leftovers of an earlier call (every entry stale)."""
    gen = torch.Generator().manual_seed(seed)
    return DecodeLaneBuffers(
        positions=torch.randint(0, 99, (n,), generator=gen),
        seq_lens=torch.randint(0, 99, (n,), generator=gen, dtype=torch.int32),
        input_ids=torch.randint(0, 99, (n,), generator=gen),
        token_request=torch.randint(0, 99, (n,), generator=gen),
        is_real_req=torch.rand(n, generator=gen) < 0.5,
        is_real_token=torch.rand(n, generator=gen) < 0.5,
        draft_tokens=torch.randint(0, 99, (n, k), generator=gen),
        current_step=torch.tensor(5),
    )


@SMALL
@given(n=st.integers(1, 300), data=st.data(), k=st.integers(1, 3), seed=st.integers(0, 99))
def test_prepare_decode_lanes_kernel_matches_torch(n: int, data: st.DataObject, k: int,
                                                   seed: int) -> None:
    """Every buffer equal to the tensor-op form's, lengths clamped at max_model_len, padding
    lanes zeroed and not real, the step reset to 1."""
    r = data.draw(st.integers(0, n))
    max_len = 40
    base = torch.randint(max_len - 3, max_len + 2, (r,), generator=torch.Generator().manual_seed(seed))
    got, want = _lanes(n, k, seed), _lanes(n, k, seed)
    prepare_decode_lanes(got, base, max_len, kernel=True)
    prepare_decode_lanes(want, base, max_len, kernel=False)
    for name in DecodeLaneBuffers.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert int(want.current_step) == 1 and not bool(want.is_real_req[r:].any())


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
compile(ASTSource(decode_inputs._prepare_decode_lanes_kernel, {"base_ptr": "*i64",
        "positions_ptr": "*i64", "seq_lens_ptr": "*i32", "input_ids_ptr": "*i64",
        "token_request_ptr": "*i64", "is_real_req_ptr": "*i1", "is_real_token_ptr": "*i1",
        "draft_tokens_ptr": "*i64", "current_step_ptr": "*i64", "draft_row_stride": "i32",
        "num_lanes": "i32", "num_reqs": "i32", "max_model_len": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 256}), target=target)
print("lanes ok")
"""


def test_lane_kernels_compile_for_sm90() -> None:
    """``triton.compile`` for Hopper on any machine (a subprocess: kernels decorated under
    ``TRITON_INTERPRET=1`` cannot be compiled)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok") == 2, proc.stdout
