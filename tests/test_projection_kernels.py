"""The fused decode-step projections (speculator/projection_kernels.py) against the unfused
layers they replace: under the Triton interpreter on CPU (fp32: the interpreter's bf16 math
is wrong), with tilings small enough that a weight spans several programs and reduction
tiles; compiled on CUDA in half precision (marked ``cuda``); and compiled for sm_90 on any
machine."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.speculator import projection_kernels
from speccheck.speculator.model_kernels import (
    rms_norm_torch,
    rotary_inv_freq,
    rotary_qkv,
    silu_mul_torch,
)
from speccheck.speculator.projection_kernels import (
    FUSED_ROWS,
    REDUCE_BLOCK_K,
    SKINNY_ROWS,
    WIDE_OUTPUT,
    EmbeddedTokens,
    Prologue,
    Tiling,
    fused,
    linear,
    norm_linear,
    norm_qkv,
    reduce_block_k,
    runs_skinny,
    silu_linear,
    tiling_for,
)
from tests.fixtures.sm90_compile import run_without_interpreter

SMALL = settings(max_examples=20, deadline=None)
TILINGS = st.sampled_from([Tiling(16, 16, 4, 1), Tiling(32, 64, 4, 1), Tiling(64, 512, 4, 1)])
REDUCE_TILES = st.sampled_from([16, 32, 2048])
"""Reduction tiles of the fused kernels: short ones split the interpreter's small rows over
several steps, as 2048 splits the MLP's 4096 on a GPU."""


def _rows(seed: int, rows: int, width: int, device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(device=device, dtype=dtype)


def _weight(seed: int, n: int, k: int, device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (_rows(seed, n, k) / k**0.5).to(device=device, dtype=dtype)


def _tiled(tiling: Tiling) -> mock._patch:  # type: ignore[type-arg]
    return mock.patch.object(projection_kernels, "tiling_for", lambda n, k: tiling)


def _reduce_tile(block_k: int) -> mock._patch:  # type: ignore[type-arg]
    return mock.patch.object(projection_kernels, "REDUCE_BLOCK_K", block_k)


@SMALL
@given(rows=st.integers(0, FUSED_ROWS), n=st.integers(1, 40), k=st.integers(1, 70),
       block_k=REDUCE_TILES, add=st.booleans(), seed=st.integers(0, 99))
def test_norm_linear_kernel_matches_the_unfused_layer(rows: int, n: int, k: int, block_k: int,
                                                      add: bool, seed: int) -> None:
    """The projection of the normalised sum, and the sum itself exactly, from rows whose
    stride is wider than their width (as a split gives them)."""
    x = _rows(seed, rows, k + 3)[:, :k]
    delta = _rows(seed + 1, rows, k) if add else None
    norm_weight = 1 + 0.1 * _rows(seed + 2, 1, k)[0]
    weight = _weight(seed + 3, n, k)
    with _reduce_tile(block_k):
        out, summed = norm_linear(x, delta, norm_weight, 1e-6, weight, kernel=True)
    want_sum = x + delta if delta is not None else x
    want = rms_norm_torch(want_sum, norm_weight, 1e-6) @ weight.T
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    unfused, unfused_sum = norm_linear(x, delta, norm_weight, 1e-6, weight, kernel=False)
    assert torch.equal(unfused_sum, want_sum)
    torch.testing.assert_close(unfused, want, rtol=1e-5, atol=1e-5)


@SMALL
@given(rows=st.integers(0, FUSED_ROWS), n=st.integers(1, 40), width=st.integers(1, 70),
       block_k=REDUCE_TILES, seed=st.integers(0, 99))
def test_silu_linear_kernel_matches_the_unfused_layer(rows: int, n: int, width: int,
                                                      block_k: int, seed: int) -> None:
    gate_up = 3 * _rows(seed, rows, 2 * width)
    weight = _weight(seed + 1, n, width)
    with _reduce_tile(block_k):
        out = silu_linear(gate_up, weight, kernel=True)
    want = silu_mul_torch(gate_up) @ weight.T
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(silu_linear(gate_up, weight, kernel=False), want,
                               rtol=1e-5, atol=1e-5)


@SMALL
@given(rows=st.integers(0, SKINNY_ROWS), n=st.integers(1, 80), k=st.integers(1, 70),
       tiling=TILINGS, block_k=REDUCE_TILES, seed=st.integers(0, 99))
def test_linear_kernel_matches_matmul(rows: int, n: int, k: int, tiling: Tiling, block_k: int,
                                     seed: int) -> None:
    """Both kernels: the CUDA-core one (up to FUSED_ROWS rows) and the tensor-core one."""
    x = _rows(seed, rows, k + 2)[:, :k]
    weight = _weight(seed + 1, n, k)
    with _tiled(tiling), _reduce_tile(block_k):
        out = linear(x, weight, kernel=True)
    assert out.shape == (rows, n)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-4, atol=1e-4)


@SMALL
@given(rows=st.integers(0, FUSED_ROWS), heads=st.integers(1, 3), kv_heads=st.integers(1, 2),
       half=st.integers(1, 9), k=st.integers(1, 40), block_k=REDUCE_TILES,
       source=st.sampled_from([Prologue.RMS_NORM, Prologue.ADD_RMS_NORM,
                               Prologue.GATHER_RMS_NORM]), seed=st.integers(0, 99))
def test_norm_qkv_kernel_matches_the_unfused_layers(rows: int, heads: int, kv_heads: int,
                                                    half: int, k: int, block_k: int,
                                                    source: Prologue, seed: int) -> None:
    """Queries and keys rotated, values copied, each contiguous, and the sum (the gathered
    rows, for embedded tokens) exactly: as the embedding, the norm, the projection and
    rotary_qkv give them one after another."""
    dim = 2 * half
    table = _rows(seed + 4, 11, k + 1)[:, :k]
    ids = torch.randint(0, 11, (rows,), generator=torch.Generator().manual_seed(seed))
    x: torch.Tensor | EmbeddedTokens = (EmbeddedTokens(ids, table)
                                        if source is Prologue.GATHER_RMS_NORM
                                        else _rows(seed, rows, k + 1)[:, :k])
    delta = _rows(seed + 1, rows, k) if source is Prologue.ADD_RMS_NORM else None
    norm_weight = 1 + 0.1 * _rows(seed + 2, 1, k)[0]
    weight = _weight(seed + 3, (heads + 2 * kv_heads) * dim, k)
    positions = torch.randint(0, 40000, (rows,), generator=torch.Generator().manual_seed(seed))
    inv_freq = rotary_inv_freq(dim, 10000.0, torch.device("cpu"))
    args = (x, delta, norm_weight, 1e-6, weight, positions, inv_freq, heads, kv_heads, dim)
    with _reduce_tile(block_k):
        *got, got_sum, got_out = norm_qkv(*args, kernel=True)
    *want, want_sum, want_out = norm_qkv(*args, kernel=False)
    assert torch.equal(got_out, torch.zeros_like(got[0]))
    assert torch.equal(want_out, torch.zeros_like(want[0]))
    rows_in = table[ids] if isinstance(x, EmbeddedTokens) else x
    qkv, unfused_sum = norm_linear(rows_in, delta, norm_weight, 1e-6, weight, kernel=False)
    unfused = rotary_qkv(qkv, positions, inv_freq, heads, kv_heads, dim, kernel=False)
    assert torch.equal(got_sum, want_sum) and torch.equal(want_sum, unfused_sum)
    for g, w, u in zip(got, want, unfused, strict=True):
        assert g.is_contiguous() and g.shape == w.shape
        assert torch.equal(w, u)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)


def test_which_projections_fuse() -> None:
    """Half-precision CUDA rows, rows contiguous, up to the kernel's row limit; never CPU
    tensors or fp32 (whose tensor-core dot would round to tf32) unless forced. The
    tensor-core kernel from FUSED_ROWS + 1 rows, or at any count for wide outputs."""
    weight = torch.zeros(8, 4, dtype=torch.bfloat16)
    assert not fused(torch.zeros(1, 4, dtype=torch.bfloat16), weight, None, SKINNY_ROWS)
    assert fused(torch.zeros(1, 4), weight, True, SKINNY_ROWS)
    assert not fused(torch.zeros(1, 4), weight, False, SKINNY_ROWS)
    x = torch.zeros(FUSED_ROWS, 4)
    assert not runs_skinny(x, torch.zeros(8, 4), True)
    assert runs_skinny(x, torch.zeros(WIDE_OUTPUT, 4), True)
    assert runs_skinny(torch.zeros(FUSED_ROWS + 1, 4), torch.zeros(8, 4), True)
    assert not runs_skinny(torch.zeros(FUSED_ROWS + 1, 4), torch.zeros(8, 4), None)
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear(torch.zeros(SKINNY_ROWS + 1, 4), torch.zeros(8, 4), kernel=True)
    with pytest.raises(ValueError, match=f"at most {FUSED_ROWS} rows"):
        silu_linear(torch.zeros(FUSED_ROWS + 1, 8), torch.zeros(8, 4), kernel=True)


def test_tilings_cover_the_drafters_projections() -> None:
    """The swept shapes get their sweep's best tilings."""
    assert tiling_for(3072, 2048) == Tiling(32, 256, 4, 5)
    assert tiling_for(8192, 2048) == tiling_for(32000, 2048) == Tiling(64, 128, 4, 5)
    assert tiling_for(2048, 2048).block_n == tiling_for(2048, 4096).block_n == 16


def test_reduction_tiles_of_the_drafters_fused_projections() -> None:
    """Behind the SwiGLU gate the whole 4096-wide intermediate row is one tile; wide outputs
    reduce in half tiles; a short row is one tile of its power-of-two length."""
    assert reduce_block_k(Prologue.SILU_MUL, 2048, 4096) == 2 * REDUCE_BLOCK_K == 4096
    assert reduce_block_k(Prologue.ADD_RMS_NORM, WIDE_OUTPUT, 2048) == REDUCE_BLOCK_K // 2
    assert reduce_block_k(Prologue.NONE, 2048, 2048) == REDUCE_BLOCK_K
    assert reduce_block_k(Prologue.SILU_MUL, 8, 40) == 64


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, FUSED_ROWS, 5, SKINNY_ROWS])
def test_cuda_fused_projections_match_the_unfused_layers(dtype: torch.dtype, rows: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, delta = _rows(1, rows, 2048, "cuda", dtype), _rows(2, rows, 2048, "cuda", dtype)
    norm_weight = (1 + 0.1 * _rows(3, 1, 2048))[0].to("cuda", dtype)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    for n, k in ((3072, 2048), (8192, 2048), (2048, 2048), (32000, 2048)):
        weight = _weight(4, n, k, "cuda", dtype)
        out, summed = norm_linear(x, delta, norm_weight, 1e-6, weight)
        want, want_sum = norm_linear(x, delta, norm_weight, 1e-6, weight, kernel=False)
        assert torch.equal(summed, want_sum)
        torch.testing.assert_close(out, want, **tol)
        torch.testing.assert_close(linear(x, weight), x @ weight.T, **tol)
    gate_up = _rows(5, rows, 8192, "cuda", dtype)
    down = _weight(6, 2048, 4096, "cuda", dtype)
    torch.testing.assert_close(silu_linear(gate_up, down),
                               silu_linear(gate_up, down, kernel=False), **tol)
    positions = torch.arange(rows, device="cuda") * 997
    inv_freq = rotary_inv_freq(128, 10000.0, torch.device("cuda"))
    qkv_weight = _weight(7, 24 * 128, 2048, "cuda", dtype)
    table = _rows(8, 500, 2048, "cuda", dtype)
    embedded = EmbeddedTokens(torch.arange(rows, device="cuda") * 31, table)
    for rows_in, add in ((x, None), (x, delta), (embedded, None)):
        args = (rows_in, add, norm_weight, 1e-6, qkv_weight, positions, inv_freq, 16, 4, 128)
        for got, want in zip(norm_qkv(*args), norm_qkv(*args, kernel=False), strict=True):
            torch.testing.assert_close(got, want, **tol)


_AOT_SCRIPT = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from speccheck.speculator import projection_kernels as p

target = GPUTarget("cuda", 90, 32)
ints = ("rows", "n", "k", "x_stride", "d_stride", "out_stride")
for dtype in ("bf16", "fp16"):
    for n, k in ((3072, 2048), (8192, 2048), (2048, 4096)):
        t = p.tiling_for(n, k)
        signature = {"x_ptr": "*" + dtype, "w_ptr": "*" + dtype, "rows": "i32", "n": "i32",
                     "k": "i32", "x_stride": "i32", "out_ptr": "*" + dtype,
                     "out_stride": "i32"}
        constants = {"ROWS": p.SKINNY_ROWS, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,
                     "PDL": True}
        signature.update(dict.fromkeys(constants, "constexpr"))
        compile(ASTSource(p._skinny_linear_kernel, signature, constants), target=target,
                options={"num_warps": t.num_warps, "num_stages": t.num_stages})
    print(dtype, "linear ok")
    pointers = ("x_ptr", "d_ptr", "nw_ptr", "sum_ptr", "w_ptr")
    for prologue in (p.Prologue.NONE, p.Prologue.RMS_NORM, p.Prologue.ADD_RMS_NORM,
                     p.Prologue.SILU_MUL):
        for rows in (1, 2):
            signature = {name: "*" + dtype for name in (*pointers, "out_ptr")}
            signature.update(dict.fromkeys(ints, "i32"))
            signature["eps"] = "fp32"
            constants = {"PROLOGUE": int(prologue), "ROWS": rows, "BLOCK_N": 4 // rows,
                         "BLOCK_K": p.reduce_block_k(prologue, 2048, 4096), "PDL": True}
            signature.update(dict.fromkeys(constants, "constexpr"))
            compile(ASTSource(p._fused_projection_kernel, signature, constants), target=target,
                    options={"num_warps": 4, "num_stages": 1})
        print(dtype, prologue.name, "ok")
    for prologue in (p.Prologue.RMS_NORM, p.Prologue.ADD_RMS_NORM, p.Prologue.GATHER_RMS_NORM):
        signature = {name: "*" + dtype for name in (*pointers, "q_ptr", "k_ptr", "v_ptr", "o_ptr")}
        signature.update({"ids_ptr": "*i64", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32"})
        signature.update(dict.fromkeys(("rows", "k", "x_stride", "d_stride", "num_heads",
                                        "num_kv_heads"), "i32"))
        signature["eps"] = "fp32"
        constants = {"PROLOGUE": int(prologue), "HALF": 64, "ROWS": 1, "BLOCK_P": 2,
                     "BLOCK_K": p.REDUCE_BLOCK_K, "PDL": True}
        signature.update(dict.fromkeys(constants, "constexpr"))
        compile(ASTSource(p._fused_qkv_kernel, signature, constants), target=target,
                options={"num_warps": 4, "num_stages": 1})
        print(dtype, "qkv", prologue.name, "ok")
"""


def test_the_fused_kernel_compiles_for_sm90() -> None:
    """``triton.compile`` for Hopper on any machine, every prologue and tiling; a
    subprocess, because kernels decorated under ``TRITON_INTERPRET=1`` cannot be
    compiled."""
    out = run_without_interpreter(_AOT_SCRIPT)
    assert out.count(" ok") == 2 * (1 + 4 + 3), out
