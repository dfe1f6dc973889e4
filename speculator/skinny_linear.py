"""``x @ weight.T`` for a few rows ``x``, as one weight-streaming Triton kernel on CUDA.

A decode step multiplies one token row per request by every weight matrix of the drafter:
at small batches the step is bound by reading the weights, and its GPU time is those bytes
over the memory bandwidth. cuBLAS's kernels for these shapes (a handful of rows against
a 2048- or 4096-wide reduction) stayed well below the bandwidth on the H200: 5.8 us for
an 8 or 12 MiB projection whose read takes 2 to 3 us, and a split-K pass plus a reduce
kernel for the down projection. :func:`skinny_linear` reads each weight element once:
every program owns ``BLOCK_N`` output features and walks the reduction dimension in
``BLOCK_K`` tiles, multiplying the (at most :data:`MAX_ROWS`) rows, padded to the tensor
cores' 16, by each tile, with fp32 accumulation and one rounding to the output dtype.

More rows than :data:`MAX_ROWS`, fp32 weights (the kernel's products are bf16/fp16 tensor
core products), CPU tensors and ``kernel=False`` take ``torch.nn.functional.linear``.
Capture-safe: the grid follows the weight's shape only, no host synchronisation; the
output is a new tensor (from the graph pool under capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16
"""Most rows the kernel takes (one tensor-core tile of rows); more go to cuBLAS."""

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SkinnyTiles:
    """One launch configuration: output features per program, reduction tile, warps and
    pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def default_tiles(n: int, k: int) -> SkinnyTiles:
    """Enough programs to spread the weight over every SM: 16 output features per program
    unless the matrix has features for several waves of wider ones."""
    block_n = 64 if n >= 16384 else 16
    return SkinnyTiles(block_n=block_n, block_k=256)


@triton.jit(do_not_specialize=["rows"])
def _skinny_linear_kernel(x_ptr, w_ptr, out_ptr, rows, n, k, x_row_stride, out_row_stride,
                          ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          UPCAST: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    col_ok = cols < n
    row_ok = r < rows
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        w = tl.load(w_ptr + cols[:, None] * k + kk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + r[:, None] * x_row_stride + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 arithmetic is wrong: compute in fp32 there
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + r[:, None] * out_row_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`skinny_linear` would launch its kernel for these operands by default
    (CUDA, at most :data:`MAX_ROWS` rows, a bf16/fp16 contiguous weight)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and weight.dtype in KERNEL_DTYPES and weight.is_contiguous())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, *, kernel: bool | None = None,
                  tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """``x @ weight.T`` for a 2-D ``x`` (rows contiguous) and an ``[n, k]`` weight.

    ``kernel``: ``None`` launches the kernel where :func:`kernel_applies`, ``False`` never
    (PyTorch's ``linear``), ``True`` whenever the shape allows (at most :data:`MAX_ROWS`
    rows, contiguous weight; on CPU tensors under Triton's interpreter, for tests).
    ``tiles`` overrides :func:`default_tiles` (the tile benchmark)."""
    rows = x.shape[0] if x.dim() == 2 else MAX_ROWS + 1
    use = kernel_applies(x, weight) if kernel is None else (
        kernel and rows <= MAX_ROWS and weight.is_contiguous() and x.stride(-1) == 1)
    if not use:
        return torch.nn.functional.linear(x, weight)
    n, k = weight.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        t = tiles or default_tiles(n, k)
        _skinny_linear_kernel[(triton.cdiv(n, t.block_n),)](
            x, weight, out, rows, n, k, x.stride(0), out.stride(0), ROWS=MAX_ROWS,
            BLOCK_N=t.block_n, BLOCK_K=t.block_k, UPCAST=not x.is_cuda,
            num_warps=t.num_warps, num_stages=t.num_stages)
    return out
