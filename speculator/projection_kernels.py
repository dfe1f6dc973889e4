"""The drafter's projections at decode batch sizes, with the elementwise op before each one
folded into the projection's kernel.

At one to a few rows a projection only streams its weight: a step of a two-layer drafter
spends as much GPU time on the fixed cost of its short kernels (ramp-up, tail, the gap to
the next dependent kernel) as on reading weights. Each function here computes ``op(x) @
weight.T`` where ``op`` is what the layer does just before the projection:

- :func:`norm_qkv`: the embedding gather or residual add and RMSNorm before a fused QKV
  projection, and rotary after it;
- :func:`norm_linear`: the residual add and RMSNorm of a pre-norm layer (or the norm
  alone), whose normalised rows feed the projection and whose sum is the next residual;
- :func:`silu_linear`: the SwiGLU gate before the MLP's down projection;
- :func:`linear`: nothing (the attention output projection, the LM head).

On CUDA, for half-precision rows, each is one Triton kernel: at most :data:`FUSED_ROWS`
rows, a CUDA-core reduction over whole rows that recomputes the prologue per program from
the activations (a few KiB, read from L2); :func:`linear` also streams up to
:data:`SKINNY_ROWS` rows through tensor cores (:func:`runs_skinny`). Elsewhere (CPU
tensors, fp32, larger batches) it is the separate kernels of
:mod:`~speccheck.speculator.model_kernels` and a cuBLAS matmul, so the numbers are those of
the unfused layer: the prologue's result is rounded to the activations' dtype before it is
multiplied, as the unfused ops round it when they store it.

The tensor-core kernel is a tile (:func:`skinny_tile`) and a launch (:func:`launch_skinny`)
that other kernels share with their own epilogues: the end of a decode step
(:mod:`~speccheck.speculator.sampling`) takes the LM head's logits unprojected
(:class:`UnprojectedLogits`) and samples in the epilogue of the same tile.

All are capture-safe: grids from shapes, no host synchronisation; each returns new tensors
(from the graph pool under capture).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from speccheck.contract.dependent_launch import (
    await_predecessor,
    dependent_launch,
    release_dependents,
)
from speccheck.speculator.model_kernels import add_rms_norm, rms_norm, rotary_qkv, silu_mul

SKINNY_ROWS = 16
"""Most rows :func:`linear` runs as its tensor-core kernel: the tile is 16 rows, padded by
masks (one to 16 rows cost the same). More rows go to cuBLAS."""

FUSED_ROWS = 2
"""Most rows the projections with a prologue run as one kernel. Their kernel reduces on
CUDA cores, one program per few output features over whole input rows (the prologue needs
the whole row, and a tensor-core tile would have to stage it through shared memory on every
reduction step: measured 1.5 to 2 times slower): every row multiplies the registers it
holds, so more rows go to the unfused kernels."""

_HALF_DTYPES = (torch.bfloat16, torch.float16)


class Prologue(enum.IntEnum):
    """What the fused kernel applies to its input rows before the projection."""

    NONE = 0
    RMS_NORM = 1
    ADD_RMS_NORM = 2
    SILU_MUL = 3
    GATHER_RMS_NORM = 4
    """RMSNorm of embedding-table rows picked by token ids (the QKV kernel only)."""


@dataclass(frozen=True)
class Tiling:
    """One launch configuration of :func:`_skinny_linear_kernel`."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiling_for(n: int, k: int) -> Tiling:
    """The tensor-core tiling for a ``[n, k]`` weight: the best of a graph-replayed sweep on
    an H200 (``docs/notes/decode-step-kernels.md``) for the drafter's projection of the
    nearest shape: wide outputs stream in short reduction tiles, narrow ones in long tiles
    so that enough programs run."""
    if n >= 8192:
        return Tiling(64, 128, 4, 5)
    if n >= 3072:
        return Tiling(32, 256, 4, 5)
    return Tiling(16, 512, 4, 4 if k <= 2048 else 5)


WIDE_OUTPUT = 8192
"""Output features from which :func:`linear` streams the weight through tensor cores at any
row count: in the sweep the CUDA-core reduction was faster at one row for the narrower
projections (QKV, attention output, down) and slower for the MLP's gate_up and the LM
head."""

REDUCE_BLOCK_K = 2048
"""Reduction tile of the fused kernel: the drafter's hidden rows in one step (the sweep's
best CUDA-core tiling at one row: 4 output features by 2048; from :data:`WIDE_OUTPUT`
features, 8 by 1024; twice as long behind the SwiGLU gate, :func:`reduce_block_k`)."""


def reduce_block_k(prologue: Prologue, n: int, k: int) -> int:
    """The fused kernel's reduction tile for a ``[n, k]`` weight behind ``prologue``.

    A program loads its first weight tile before it waits for the kernel ahead, so a tile
    as long as the row has every weight of the program requested while that kernel still
    runs. Behind the SwiGLU gate (the down projection, whose input row is the drafter's
    4096-wide intermediate) the tile is ``2 * REDUCE_BLOCK_K``: on an H200 the decode step
    at batch 1 took 2.7 % less GPU time than with the 2048 tile
    (``docs/notes/decode-step-kernels.md``); lengthening the wide projection's tile too gained
    less, with or without eight warps."""
    if prologue is Prologue.SILU_MUL:
        tile = 2 * REDUCE_BLOCK_K
    elif n >= WIDE_OUTPUT:
        tile = REDUCE_BLOCK_K // 2
    else:
        tile = REDUCE_BLOCK_K
    return min(tile, triton.next_power_of_2(k))


@triton.jit
def skinny_tile(x_ptr, w_ptr, r, rmask, cols, nmask, k, x_stride, ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 tile ``x[r] @ w[cols].T`` (``[ROWS, BLOCK_N]``; zero where ``rmask`` or
    ``nmask`` is off), reduced on tensor cores in ``BLOCK_K`` steps: the body of every
    kernel :func:`launch_skinny` launches, so that they all compute the same numbers."""
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        kmask = kk < k
        a = tl.load(x_ptr + r[:, None] * x_stride + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * k + kk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w))
    return acc


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, rows, n, k, x_stride, out_ptr, out_stride,
                          ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PDL: tl.constexpr):
    release_dependents(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < n
    r = tl.arange(0, ROWS)
    rmask = r < rows
    await_predecessor(PDL)
    acc = skinny_tile(x_ptr, w_ptr, r, rmask, cols, nmask, k, x_stride, ROWS, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + r[:, None] * out_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _prologue_block(x_ptr, d_ptr, nw_ptr, x_rows, r, rmask, kk, kmask, k, d_stride, rstd,
                    PROLOGUE: tl.constexpr):
    """The prologue's rows ``r`` (at element offsets ``x_rows`` of ``x``), columns ``kk``
    (fp32), rounded through the activations' dtype as the unfused op rounds what it
    stores."""
    ty = x_ptr.dtype.element_ty
    m = rmask[:, None] & kmask[None, :]
    a = tl.load(x_ptr + x_rows[:, None] + kk[None, :], mask=m, other=0.0).to(tl.float32)
    if PROLOGUE == 3:
        up = tl.load(x_ptr + x_rows[:, None] + k + kk[None, :], mask=m,
                     other=0.0).to(tl.float32)
        a = (a / (1.0 + tl.exp(-a)) * up).to(ty).to(tl.float32)
    if PROLOGUE == 2:
        d = tl.load(d_ptr + r[:, None] * d_stride + kk[None, :], mask=m, other=0.0)
        a = (a + d.to(tl.float32)).to(ty).to(tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2 or PROLOGUE == 4:
        w = tl.load(nw_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        a = (a * rstd[:, None] * w[None, :]).to(ty).to(tl.float32)
    return a


@triton.jit
def _inverse_rms(x_ptr, d_ptr, sum_ptr, x_rows, r, rmask, k, d_stride, eps, store_sum,
                 PROLOGUE: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``1 / rms`` of each row of ``x + delta`` (``x`` for ``RMS_NORM`` and
    ``GATHER_RMS_NORM``), the sum rounded to the residual's dtype first; the sum (the
    gathered rows) is stored when ``store_sum``."""
    squares = tl.zeros((ROWS,), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (kk < k)[None, :]
        s = tl.load(x_ptr + x_rows[:, None] + kk[None, :], mask=m, other=0.0)
        if PROLOGUE == 2:
            d = tl.load(d_ptr + r[:, None] * d_stride + kk[None, :], mask=m, other=0.0)
            s = (s.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if PROLOGUE == 2 or PROLOGUE == 4:
            if store_sum:
                tl.store(sum_ptr + r[:, None] * k + kk[None, :], s, mask=m)
        s32 = s.to(tl.float32)
        squares += tl.sum(s32 * s32, axis=1)
    return 1.0 / tl.sqrt(squares / k + eps)


@triton.jit
def _weight_tile(w_ptr, cols, nmask, kk, k):
    """Rows ``cols``, columns ``kk`` of the ``[n, k]`` weight, in its dtype (zero where
    masked: past ``k``, a load of nothing)."""
    return tl.load(w_ptr + cols[:, None] * k + kk[None, :],
                   mask=nmask[:, None] & (kk < k)[None, :], other=0.0)


@triton.jit
def _fused_projection_kernel(x_ptr, d_ptr, nw_ptr, sum_ptr, w_ptr, out_ptr, rows, n, k,
                             x_stride, d_stride, out_stride, eps,
                             PROLOGUE: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program ``pid``: output features ``[pid * BLOCK_N, (pid + 1) * BLOCK_N)`` of every
    row. Each reduction tile's weights are loaded one tile ahead, the first before the
    program waits for the kernel ahead (:mod:`~speccheck.contract.dependent_launch`)."""
    pid = tl.program_id(0)
    release_dependents(PDL)
    r = tl.arange(0, ROWS)
    rmask = r < rows
    x_rows = r.to(tl.int64) * x_stride
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < n
    w = _weight_tile(w_ptr, cols, nmask, tl.arange(0, BLOCK_K), k)
    await_predecessor(PDL)
    rstd = tl.zeros((ROWS,), dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        rstd = _inverse_rms(x_ptr, d_ptr, sum_ptr, x_rows, r, rmask, k, d_stride, eps,
                            pid == 0, PROLOGUE, ROWS, BLOCK_K)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        kmask = kk < k
        a = _prologue_block(x_ptr, d_ptr, nw_ptr, x_rows, r, rmask, kk, kmask, k, d_stride,
                            rstd, PROLOGUE)
        acc += tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        w = _weight_tile(w_ptr, cols, nmask, kk + BLOCK_K, k)
    tl.store(out_ptr + r[:, None] * out_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _fused_qkv_kernel(x_ptr, d_ptr, ids_ptr, nw_ptr, sum_ptr, w_ptr, pos_ptr, inv_freq_ptr,
                      q_ptr, k_ptr, v_ptr, o_ptr, rows, k, x_stride, d_stride, eps, num_heads,
                      num_kv_heads, PROLOGUE: tl.constexpr, HALF: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    """A fused QKV projection's ``BLOCK_P`` channel pairs ``(j, j + HALF)`` of its heads,
    rotated (queries and keys) or copied (values) into ``q``, ``k``, ``v``, and zeros where
    it stores queries into ``o`` (the attention output, shaped as ``q``). With
    ``GATHER_RMS_NORM`` the input rows are rows ``ids`` of ``x`` (an embedding table).
    Weights are loaded one reduction tile ahead, the first before the program waits for
    the kernel ahead (:mod:`~speccheck.contract.dependent_launch`)."""
    pid = tl.program_id(0)
    release_dependents(PDL)
    r = tl.arange(0, ROWS)
    rmask = r < rows
    pair = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    head = pair // HALF
    j = pair % HALF
    first = head * (2 * HALF) + j
    pmask = head < num_heads + 2 * num_kv_heads
    w1 = _weight_tile(w_ptr, first, pmask, tl.arange(0, BLOCK_K), k)
    w2 = _weight_tile(w_ptr, first + HALF, pmask, tl.arange(0, BLOCK_K), k)
    await_predecessor(PDL)
    if PROLOGUE == 4:
        x_rows = tl.load(ids_ptr + r, mask=rmask, other=0).to(tl.int64) * x_stride
    else:
        x_rows = r.to(tl.int64) * x_stride
    rstd = _inverse_rms(x_ptr, d_ptr, sum_ptr, x_rows, r, rmask, k, d_stride, eps, pid == 0,
                        PROLOGUE, ROWS, BLOCK_K)
    acc1 = tl.zeros((ROWS, BLOCK_P), dtype=tl.float32)
    acc2 = tl.zeros((ROWS, BLOCK_P), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        kmask = kk < k
        a = _prologue_block(x_ptr, d_ptr, nw_ptr, x_rows, r, rmask, kk, kmask, k, d_stride,
                            rstd, PROLOGUE)
        acc1 += tl.sum(a[:, None, :] * w1.to(tl.float32)[None, :, :], axis=2)
        acc2 += tl.sum(a[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
        w1 = _weight_tile(w_ptr, first, pmask, kk + BLOCK_K, k)
        w2 = _weight_tile(w_ptr, first + HALF, pmask, kk + BLOCK_K, k)
    ty = q_ptr.dtype.element_ty
    # rounded as the unfused projection stores them, then rotated as rotary_qkv rotates
    x1 = acc1.to(ty).to(tl.float32)
    x2 = acc2.to(ty).to(tl.float32)
    angle = (tl.load(pos_ptr + r, mask=rmask, other=0).to(tl.float32)[:, None]
             * tl.load(inv_freq_ptr + j, mask=pmask, other=0.0)[None, :])
    cos, sin = tl.cos(angle), tl.sin(angle)
    rotated = (head < num_heads + num_kv_heads)[None, :]
    y1 = tl.where(rotated, x1 * cos - x2 * sin, x1).to(ty)
    y2 = tl.where(rotated, x2 * cos + x1 * sin, x2).to(ty)
    m = rmask[:, None] & pmask[None, :]
    dim = 2 * HALF
    is_q = (head < num_heads)[None, :]
    is_k = ((head >= num_heads) & (head < num_heads + num_kv_heads))[None, :]
    is_v = (head >= num_heads + num_kv_heads)[None, :]
    q_at = (r[:, None] * num_heads + head[None, :]) * dim + j[None, :]
    k_at = (r[:, None] * num_kv_heads + (head - num_heads)[None, :]) * dim + j[None, :]
    v_head = head - num_heads - num_kv_heads
    v_at = (r[:, None] * num_kv_heads + v_head[None, :]) * dim + j[None, :]
    tl.store(q_ptr + q_at, y1, mask=m & is_q)
    tl.store(q_ptr + q_at + HALF, y2, mask=m & is_q)
    tl.store(o_ptr + q_at, tl.zeros_like(y1), mask=m & is_q)
    tl.store(o_ptr + q_at + HALF, tl.zeros_like(y2), mask=m & is_q)
    tl.store(k_ptr + k_at, y1, mask=m & is_k)
    tl.store(k_ptr + k_at + HALF, y2, mask=m & is_k)
    tl.store(v_ptr + v_at, y1, mask=m & is_v)
    tl.store(v_ptr + v_at + HALF, y2, mask=m & is_v)


def fused(x: torch.Tensor, weight: torch.Tensor, kernel: bool | None, most: int) -> bool:
    """Whether a projection of ``x`` runs as one kernel: forced by ``kernel``
    (``True``/``False``), else on CUDA for half-precision rows, at most ``most`` of them
    (:data:`SKINNY_ROWS` without a prologue, :data:`FUSED_ROWS` with one)."""
    if kernel is not None:
        return kernel
    return (x.is_cuda and x.dtype in _HALF_DTYPES and weight.dtype == x.dtype
            and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] <= most)


def _check(x: torch.Tensor, weight: torch.Tensor, k: int, most: int) -> None:
    if x.shape[0] > most:
        raise ValueError(f"this projection kernel takes at most {most} rows, got {x.shape[0]}")
    if weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"the weight must be a contiguous [n, {k}] matrix, got "
                         f"{tuple(weight.shape)}")


def _launch_fused(prologue: Prologue, x: torch.Tensor, weight: torch.Tensor, k: int,
                  delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  summed: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    _check(x, weight, k, FUSED_ROWS)
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        row_tile = triton.next_power_of_2(rows)
        wide = n >= WIDE_OUTPUT
        block_n = max(1, (8 if wide else 4) // row_tile)
        _fused_projection_kernel[(triton.cdiv(n, block_n),)](
            x, x if delta is None else delta, x if norm_weight is None else norm_weight,
            x if summed is None else summed, weight, out, rows, n, k, x.stride(0),
            x.stride(0) if delta is None else delta.stride(0), out.stride(0), eps,
            PROLOGUE=int(prologue), ROWS=row_tile, BLOCK_N=block_n,
            BLOCK_K=reduce_block_k(prologue, n, k),
            num_warps=4, num_stages=1, **dependent_launch(x))
    return out


def runs_skinny(x: torch.Tensor, weight: torch.Tensor, kernel: bool | None) -> bool:
    """Whether :func:`linear` runs ``x @ weight.T`` as the tensor-core kernel: :func:`fused`
    says so for :data:`SKINNY_ROWS`, and ``x`` has more than :data:`FUSED_ROWS` rows or
    ``weight`` at least :data:`WIDE_OUTPUT` output features."""
    return (fused(x, weight, kernel, SKINNY_ROWS)
            and (x.shape[0] > FUSED_ROWS or weight.shape[0] >= WIDE_OUTPUT))


def skinny_tiles(weight: torch.Tensor) -> int:
    """Programs of a tensor-core kernel over ``weight`` (``[n, k]``), one per ``BLOCK_N``
    output features of :func:`tiling_for`'s tiling (:func:`launch_skinny`'s grid)."""
    n, k = weight.shape
    return triton.cdiv(n, tiling_for(n, k).block_n)


def launch_skinny(kernel: triton.JITFunction, x: torch.Tensor, weight: torch.Tensor,
                  *args: object, **constants: object) -> None:
    """Launch ``kernel``, built around :func:`skinny_tile`, over ``x`` (2-D, rows contiguous,
    at most :data:`SKINNY_ROWS` rows) and a contiguous ``weight`` (``[n, k]``): one program
    per ``BLOCK_N`` output features (:func:`skinny_tiles`), tiled as :func:`tiling_for`
    says. Its parameters start ``(x_ptr, w_ptr, rows, n, k, x_stride)``, then ``args``;
    ``constants``, the tiling's ``ROWS``, ``BLOCK_N``, ``BLOCK_K`` and ``PDL`` go by name:
    it launches as a programmatic dependent where ``PDL`` says so, so it must keep
    :mod:`~speccheck.contract.dependent_launch`'s contract. What it writes is its own.
    Nothing is launched for zero rows. Capture-safe: grid and tiling are functions of the
    shapes."""
    _check(x, weight, x.shape[1], SKINNY_ROWS)
    rows, (n, k) = x.shape[0], weight.shape
    if rows:
        tiling = tiling_for(n, k)
        kernel[(skinny_tiles(weight),)](
            x, weight, rows, n, k, x.stride(0), *args, **constants, ROWS=SKINNY_ROWS,
            BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
            num_warps=tiling.num_warps, num_stages=tiling.num_stages, **dependent_launch(x))


def linear(x: torch.Tensor, weight: torch.Tensor, *, kernel: bool | None = None) -> torch.Tensor:
    """``x @ weight.T`` for 2-D ``x`` (rows contiguous) and a contiguous ``weight``
    (``[n, k]``); ``kernel`` as for :func:`fused` (up to :data:`SKINNY_ROWS` rows): the
    tensor-core kernel where :func:`runs_skinny` says so, else the CUDA-core one."""
    if runs_skinny(x, weight, kernel):
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        launch_skinny(_skinny_linear_kernel, x, weight, out, out.stride(0))
        return out
    if fused(x, weight, kernel, SKINNY_ROWS):
        return _launch_fused(Prologue.NONE, x, weight, x.shape[1])
    return torch.nn.functional.linear(x, weight)


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, *,
                kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s) @ weight.T, s)`` where ``s = x + delta`` (``x`` when ``delta`` is
    ``None``), for 2-D ``x`` and ``delta`` of one shape and dtype, rows contiguous: a
    pre-norm layer's residual add, its norm and the projection after it. ``s`` is rounded
    to ``x``'s dtype before it is normalised, the normalised rows before they are
    multiplied. ``kernel`` as for :func:`fused`; without the fused kernel, the norm is
    :func:`~speccheck.speculator.model_kernels.add_rms_norm` (or ``rms_norm``) given the
    same ``kernel`` (its Triton form on CUDA by default)."""
    if not fused(x, weight, kernel, FUSED_ROWS):
        if delta is None:
            return torch.nn.functional.linear(rms_norm(x, norm_weight, eps, kernel=kernel),
                                              weight), x
        normed, summed = add_rms_norm(x, delta, norm_weight, eps, kernel=kernel)
        return torch.nn.functional.linear(normed, weight), summed
    if delta is None:
        return _launch_fused(Prologue.RMS_NORM, x, weight, x.shape[1],
                             norm_weight=norm_weight, eps=eps), x
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = _launch_fused(Prologue.ADD_RMS_NORM, x, weight, x.shape[1], delta=delta,
                        norm_weight=norm_weight, summed=summed, eps=eps)
    return out, summed


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor, *,
                kernel: bool | None = None) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T`` of ``gate_up = [gate | up]`` (``[T, 2 * I]``, rows
    contiguous) and ``weight`` ``[n, I]``: the SwiGLU gate and the down projection, the
    gated rows rounded before they are multiplied. ``kernel`` as for :func:`fused`."""
    if not fused(gate_up, weight, kernel, FUSED_ROWS):
        return torch.nn.functional.linear(silu_mul(gate_up, kernel=kernel), weight)
    return _launch_fused(Prologue.SILU_MUL, gate_up, weight, gate_up.shape[1] // 2)


class ProjectedQKV(NamedTuple):
    """What :func:`norm_qkv` returns."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor
    """``x + delta`` (the gathered rows, for embedded tokens): the residual stream."""
    out: torch.Tensor
    """Zeros shaped as ``q``: the attention output buffer, cleared in the same kernel."""


class EmbeddedTokens(NamedTuple):
    """Token rows not gathered yet: rows ``ids`` of the embedding ``table``. The first
    layer's QKV kernel gathers them itself (:func:`norm_qkv`), saving the embedding's
    kernel."""

    ids: torch.Tensor
    table: torch.Tensor

    def rows(self) -> torch.Tensor:
        """The gathered rows, ``[len(ids), hidden]``."""
        return torch.nn.functional.embedding(self.ids, self.table)


class UnprojectedLogits(NamedTuple):
    """Logits not computed yet: ``linear(rows, weight)``, the LM head over hidden ``rows``
    (``[R, hidden]``). The end of a decode step
    (:func:`~speccheck.speculator.sampling.finish_decode_step`) projects them itself,
    sampling in the epilogue of the LM head's tensor-core kernel where :func:`runs_skinny`
    says so (one kernel less)."""

    rows: torch.Tensor
    weight: torch.Tensor

    def project(self, *, kernel: bool | None = None) -> torch.Tensor:
        """The logits, ``[R, vocab]`` in the rows' dtype: :func:`linear`."""
        return linear(self.rows, self.weight, kernel=kernel)


def norm_qkv(x: torch.Tensor | EmbeddedTokens, delta: torch.Tensor | None,
             norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
             positions: torch.Tensor, inv_freq: torch.Tensor, num_heads: int,
             num_kv_heads: int, head_size: int, *, kernel: bool | None = None
             ) -> ProjectedQKV:
    """``(q, k, v, s, out)``: :func:`norm_linear` into a fused QKV projection ``weight``
    (``[(num_heads + 2 * num_kv_heads) * head_size, k]``, in that order), then
    :func:`~speccheck.speculator.model_kernels.rotary_qkv` (NeoX rotary of the queries and
    keys at ``positions``, values copied; three new contiguous ``[T, heads, head_size]``
    tensors) and a zeroed attention output ``out`` shaped as ``q``. ``x`` may be
    :class:`EmbeddedTokens` (then ``delta`` is ``None`` and ``s`` the gathered rows). One
    kernel where :func:`fused` says so for :data:`FUSED_ROWS`: each program computes
    channel pairs ``(j, j + head_size / 2)`` of the projection and rotates them before they
    are stored."""
    if isinstance(x, EmbeddedTokens):
        if delta is not None:
            raise ValueError("embedded tokens have no residual to add")
        # the table's first rows stand for the gathered ones in the checks: same dtype,
        # device and row layout
        source, ids, rows_like = x.table, x.ids, x.table[: x.ids.shape[0]]
    else:
        source, ids, rows_like = x, None, x
    if not fused(rows_like, weight, kernel, FUSED_ROWS) or head_size % 2:
        hidden = x.rows() if isinstance(x, EmbeddedTokens) else x
        qkv, summed = norm_linear(hidden, delta, norm_weight, eps, weight, kernel=kernel)
        q, k, v = rotary_qkv(qkv, positions, inv_freq, num_heads, num_kv_heads, head_size,
                             kernel=kernel)
        return ProjectedQKV(q, k, v, summed, torch.zeros_like(q))
    gather = ids is not None
    t, width = rows_like.shape
    _check(rows_like, weight, width, FUSED_ROWS)
    if weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_size:
        raise ValueError(f"the QKV weight has {weight.shape[0]} rows, not "
                         f"({num_heads} + 2 * {num_kv_heads}) * {head_size}")
    dtype, device = source.dtype, source.device
    q = torch.empty((t, num_heads, head_size), dtype=dtype, device=device)
    k = torch.empty((t, num_kv_heads, head_size), dtype=dtype, device=device)
    v = torch.empty((t, num_kv_heads, head_size), dtype=dtype, device=device)
    out = torch.empty((t, num_heads, head_size), dtype=dtype, device=device)
    summed = (source if delta is None and not gather
              else torch.empty((t, width), dtype=dtype, device=device))
    if t:
        row_tile = triton.next_power_of_2(t)
        block_p = max(1, 2 // row_tile)
        prologue = (Prologue.GATHER_RMS_NORM if gather else
                    Prologue.RMS_NORM if delta is None else Prologue.ADD_RMS_NORM)
        _fused_qkv_kernel[(triton.cdiv(weight.shape[0] // 2, block_p),)](
            source, source if delta is None else delta, ids if gather else source,
            norm_weight, summed, weight, positions, inv_freq, q, k, v, out, t, width,
            source.stride(0), source.stride(0) if delta is None else delta.stride(0), eps,
            num_heads, num_kv_heads, PROLOGUE=int(prologue), HALF=head_size // 2,
            ROWS=row_tile, BLOCK_P=block_p,
            BLOCK_K=min(REDUCE_BLOCK_K, triton.next_power_of_2(width)),
            num_warps=4, num_stages=1, **dependent_launch(source))
    return ProjectedQKV(q, k, v, summed, out)
