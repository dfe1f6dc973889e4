"""The weight-streaming product of a few rows (speculator/skinny_linear.py) against
``x @ weight.T``: under the Triton interpreter on CPU (fp32: the interpreter's bf16 math is
wrong), compiled on CUDA in bf16 and fp16 at the drafter's shapes (marked ``cuda``), and
compiled for sm_90 on any machine; and where it hands over to cuBLAS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.speculator.skinny_linear import (
    MAX_ROWS,
    SkinnyTiles,
    default_tiles,
    kernel_applies,
    skinny_linear,
)


def _operands(seed: int, rows: int, n: int, k: int, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(0, MAX_ROWS), n=st.integers(1, 70), k=st.integers(1, 300),
       tiles=st.sampled_from([SkinnyTiles(16, 64), SkinnyTiles(32, 128)]),
       seed=st.integers(0, 99))
def test_kernel_matches_the_product(rows: int, n: int, k: int, tiles: SkinnyTiles,
                                    seed: int) -> None:
    """Any row count up to the tile, features and reduction lengths that are no multiple
    of the tiles (masked edges), rows with a stride wider than their width."""
    x, w = _operands(seed, rows, n, k + 3)
    x = x[:, :k]
    w = w[:, :k].contiguous()
    torch.testing.assert_close(skinny_linear(x, w, kernel=True, tiles=tiles), x @ w.T,
                               rtol=1e-5, atol=1e-5)


def test_what_takes_cublas() -> None:
    """More rows than a tile, fp32 weights and CPU tensors go to ``linear`` by default; a
    non-contiguous weight even when the kernel is forced."""
    x, w = _operands(0, MAX_ROWS + 1, 8, 32)
    assert not kernel_applies(x, w)
    torch.testing.assert_close(skinny_linear(x, w, kernel=True), x @ w.T)
    x1 = x[:1]
    assert not kernel_applies(x1, w)  # CPU, fp32
    assert torch.equal(skinny_linear(x1, w.T.contiguous().T, kernel=True),
                       torch.nn.functional.linear(x1, w.T.contiguous().T))


def test_default_tiles_spread_the_serving_projections_over_the_sms() -> None:
    """At least one program per SM of an H200 (132) for every projection of the
    serving-size drafter."""
    for n, k in ((3072, 2048), (2048, 2048), (8192, 2048), (2048, 4096), (32000, 2048)):
        tiles = default_tiles(n, k)
        assert -(-n // tiles.block_n) >= 128, (n, k, tiles)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_cublas(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for n, k in ((3072, 2048), (2048, 2048), (8192, 2048), (2048, 4096), (500, 72)):
        for rows in (1, 3, 8, MAX_ROWS):
            x, w = _operands(rows, rows, n, k, "cuda", dtype)
            assert kernel_applies(x, w)
            torch.testing.assert_close(skinny_linear(x, w), torch.nn.functional.linear(x, w),
                                       rtol=2e-2, atol=2e-2)


_AOT_SCRIPT = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from speccheck.speculator import skinny_linear as s

for dtype in ("bf16", "fp16"):
    for n, k in ((3072, 2048), (32000, 2048)):
        t = s.default_tiles(n, k)
        signature = {"x_ptr": "*" + dtype, "w_ptr": "*" + dtype, "out_ptr": "*" + dtype,
                     "rows": "i32", "n": "i32", "k": "i32", "x_row_stride": "i32",
                     "out_row_stride": "i32", "ROWS": "constexpr", "BLOCK_N": "constexpr",
                     "BLOCK_K": "constexpr", "UPCAST": "constexpr"}
        constants = {"ROWS": s.MAX_ROWS, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,
                     "UPCAST": False}
        compile(ASTSource(s._skinny_linear_kernel, signature, constants),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": t.num_warps, "num_stages": t.num_stages})
        print(dtype, n, "ok")
"""


def test_kernel_compiles_for_sm90() -> None:
    """``triton.compile`` for Hopper with the default tiles; a subprocess, because kernels
    decorated under ``TRITON_INTERPRET=1`` cannot be compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok") == 4, proc.stdout
