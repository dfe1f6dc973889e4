"""The drafter's projections at decode batch sizes, with the elementwise op before each one
folded into the projection's kernel.

At one to a few rows a projection only streams its weight: a step of a two-layer drafter
spends as much GPU time on the fixed cost of its short kernels (ramp-up, tail, the gap to
the next dependent kernel) as on reading weights. Each function here computes ``op(x) @
weight.T`` where ``op`` is what the layer does just before the projection:

- :func:`norm_linear`: the residual add and RMSNorm of a pre-norm layer (or the norm
  alone), whose normalised rows feed the projection and whose sum is the next residual;
- :func:`silu_linear`: the SwiGLU gate before the MLP's down projection;
- :func:`linear`: nothing (the attention output projection, the LM head).

On CUDA, for rows of a half-precision dtype and at most :data:`SKINNY_ROWS` rows (a decode
step of a small batch), each is one Triton kernel that streams the weight through tensor
cores and recomputes the prologue per program from the activations (a few KiB, read from
L2). Elsewhere (CPU tensors, fp32, prefill-sized batches) it is the separate kernels of
:mod:`~speccheck.speculator.model_kernels` and a cuBLAS matmul, so the numbers are those of
the unfused layer: the prologue's result is rounded to the activations' dtype before it is
multiplied, as the unfused ops round it when they store it.

All are capture-safe: grids from shapes, no host synchronisation; each returns new tensors
(from the graph pool under capture).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from speccheck.speculator.model_kernels import add_rms_norm, rms_norm, silu_mul

SKINNY_ROWS = 16
"""Most rows the fused kernels take: their tensor-core tile is 16 rows, padded by masks
(one to 16 rows cost the same). More rows go to cuBLAS."""

_HALF_DTYPES = (torch.bfloat16, torch.float16)


class Prologue(enum.IntEnum):
    """What the fused kernel applies to its input rows before the projection."""

    NONE = 0
    RMS_NORM = 1
    ADD_RMS_NORM = 2
    SILU_MUL = 3


@dataclass(frozen=True)
class Tiling:
    """One launch configuration of :func:`_skinny_linear_kernel`."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiling_for(n: int, k: int) -> Tiling:
    """The tiling for a ``[n, k]`` weight: the best of a graph-replayed sweep on an H200
    (``docs/verification/decode-step-tiles/``) for the drafter's projection of the nearest
    shape: wide outputs stream in short reduction tiles, narrow ones in long tiles so that
    enough programs run."""
    if n >= 8192:
        return Tiling(64, 128, 4, 5)
    if n >= 3072:
        return Tiling(32, 256, 4, 5)
    return Tiling(16, 512, 4, 4 if k <= 2048 else 5)


@triton.jit
def _prologue_block(x_ptr, d_ptr, nw_ptr, r, rmask, kk, kmask, k, x_stride, d_stride, rstd,
                    PROLOGUE: tl.constexpr):
    """The prologue's rows ``r``, columns ``kk``, rounded to the activations' dtype."""
    ty = x_ptr.dtype.element_ty
    m = rmask[:, None] & kmask[None, :]
    a = tl.load(x_ptr + r[:, None] * x_stride + kk[None, :], mask=m, other=0.0)
    if PROLOGUE == 3:
        up = tl.load(x_ptr + r[:, None] * x_stride + k + kk[None, :], mask=m,
                     other=0.0).to(tl.float32)
        gate = a.to(tl.float32)
        a = (gate / (1.0 + tl.exp(-gate)) * up).to(ty)
    if PROLOGUE == 2:
        d = tl.load(d_ptr + r[:, None] * d_stride + kk[None, :], mask=m, other=0.0)
        a = (a.to(tl.float32) + d.to(tl.float32)).to(ty)
    if PROLOGUE == 1 or PROLOGUE == 2:
        w = tl.load(nw_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        a = (a.to(tl.float32) * rstd[:, None] * w[None, :]).to(ty)
    return a


@triton.jit
def _skinny_linear_kernel(x_ptr, d_ptr, nw_ptr, sum_ptr, w_ptr, out_ptr, rows, n, k,
                          x_stride, d_stride, out_stride, eps,
                          PROLOGUE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < n
    r = tl.arange(0, ROWS)
    rmask = r < rows
    rstd = tl.zeros((ROWS,), dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        squares = tl.zeros((ROWS,), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            kk = start + tl.arange(0, BLOCK_K)
            kmask = kk < k
            m = rmask[:, None] & kmask[None, :]
            s = tl.load(x_ptr + r[:, None] * x_stride + kk[None, :], mask=m, other=0.0)
            if PROLOGUE == 2:
                d = tl.load(d_ptr + r[:, None] * d_stride + kk[None, :], mask=m, other=0.0)
                # rounded to the residual's dtype, as ``x + delta`` is when stored
                s = (s.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
                if pid == 0:
                    tl.store(sum_ptr + r[:, None] * k + kk[None, :], s, mask=m)
            s32 = s.to(tl.float32)
            squares += tl.sum(s32 * s32, axis=1)
        rstd = 1.0 / tl.sqrt(squares / k + eps)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        kmask = kk < k
        a = _prologue_block(x_ptr, d_ptr, nw_ptr, r, rmask, kk, kmask, k, x_stride, d_stride,
                            rstd, PROLOGUE)
        w = tl.load(w_ptr + cols[:, None] * k + kk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w))
    tl.store(out_ptr + r[:, None] * out_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def fused(x: torch.Tensor, weight: torch.Tensor, kernel: bool | None) -> bool:
    """Whether a projection of ``x`` runs as the fused kernel: forced by ``kernel``
    (``True``/``False``), else on CUDA for half-precision rows, at most
    :data:`SKINNY_ROWS` of them."""
    if kernel is not None:
        return kernel
    return (x.is_cuda and x.dtype in _HALF_DTYPES and weight.dtype == x.dtype
            and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] <= SKINNY_ROWS)


def _launch(prologue: Prologue, x: torch.Tensor, weight: torch.Tensor, k: int,
            delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            summed: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    rows, n = x.shape[0], weight.shape[0]
    if rows > SKINNY_ROWS:
        raise ValueError(f"the fused projection takes at most {SKINNY_ROWS} rows, got {rows}")
    if weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"the weight must be a contiguous [n, {k}] matrix, got "
                         f"{tuple(weight.shape)}")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        tiling = tiling_for(n, k)
        _skinny_linear_kernel[(triton.cdiv(n, tiling.block_n),)](
            x, x if delta is None else delta, x if norm_weight is None else norm_weight,
            x if summed is None else summed, weight, out, rows, n, k, x.stride(0),
            x.stride(0) if delta is None else delta.stride(0), out.stride(0), eps,
            PROLOGUE=int(prologue), ROWS=SKINNY_ROWS, BLOCK_N=tiling.block_n,
            BLOCK_K=tiling.block_k, num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, *, kernel: bool | None = None) -> torch.Tensor:
    """``x @ weight.T`` for 2-D ``x`` (rows contiguous) and a contiguous ``weight``
    (``[n, k]``); ``kernel`` as for :func:`fused`."""
    if not fused(x, weight, kernel):
        return torch.nn.functional.linear(x, weight)
    return _launch(Prologue.NONE, x, weight, x.shape[1])


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, *,
                kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s) @ weight.T, s)`` where ``s = x + delta`` (``x`` when ``delta`` is
    ``None``), for 2-D ``x`` and ``delta`` of one shape and dtype, rows contiguous: a
    pre-norm layer's residual add, its norm and the projection after it. ``s`` is rounded
    to ``x``'s dtype before it is normalised, the normalised rows before they are
    multiplied. ``kernel`` as for :func:`fused`; without the fused kernel, the norm is
    :func:`~speccheck.speculator.model_kernels.add_rms_norm` (or ``rms_norm``) on CUDA and
    PyTorch ops elsewhere."""
    if not fused(x, weight, kernel):
        elementwise = None if x.is_cuda and kernel is None else False
        if delta is None:
            return torch.nn.functional.linear(
                rms_norm(x, norm_weight, eps, kernel=elementwise), weight), x
        normed, summed = add_rms_norm(x, delta, norm_weight, eps, kernel=elementwise)
        return torch.nn.functional.linear(normed, weight), summed
    if delta is None:
        return _launch(Prologue.RMS_NORM, x, weight, x.shape[1], norm_weight=norm_weight,
                       eps=eps), x
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = _launch(Prologue.ADD_RMS_NORM, x, weight, x.shape[1], delta=delta,
                  norm_weight=norm_weight, summed=summed, eps=eps)
    return out, summed


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor, *,
                kernel: bool | None = None) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T`` of ``gate_up = [gate | up]`` (``[T, 2 * I]``, rows
    contiguous) and ``weight`` ``[n, I]``: the SwiGLU gate and the down projection, the
    gated rows rounded before they are multiplied. ``kernel`` as for :func:`fused`."""
    if not fused(gate_up, weight, kernel):
        elementwise = None if gate_up.is_cuda and kernel is None else False
        return torch.nn.functional.linear(silu_mul(gate_up, kernel=elementwise), weight)
    return _launch(Prologue.SILU_MUL, gate_up, weight, gate_up.shape[1] // 2)
