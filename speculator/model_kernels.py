"""The drafter's elementwise layers as single Triton kernels on CUDA.

RMSNorm (alone, or fused with the residual add before it), NeoX rotary embedding (alone,
or applied to a fused QKV projection's queries and keys while its values are copied out)
and the SwiGLU gate are each several PyTorch kernels when
written with tensor ops (a decode step of a two-layer drafter launched about 180 kernels,
most of them a couple of microseconds of GPU time each: far more than reading the weights).
Each function here is one kernel on a CUDA tensor and the same math in PyTorch ops
elsewhere (CPU tensors, where the Triton interpreter would be slow; the kernels are tested
against these under the interpreter). All are capture-safe: fixed grids from shapes, no
host synchronisation; each returns a new tensor (from the graph pool under capture). The
kernels of a decode step launch as programmatic dependents on Hopper
(:mod:`~speccheck.contract.dependent_launch`).

Math is fp32 with one rounding to the input dtype at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccheck.contract.dependent_launch import (
    await_predecessor,
    dependent_launch,
    release_dependents,
)


def use_kernels(x: torch.Tensor) -> bool:
    """Triton kernels for CUDA tensors; PyTorch ops for the rest."""
    return x.is_cuda


# ----------------------------------------------------------------------------- RMSNorm

@triton.jit
def _rms_normalised(x, w_ptr, cols, mask, width, eps):
    """The fp32 row ``x`` (zero past ``width``) normalised and scaled by the weights."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)) * w


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_row_stride, out_row_stride, width, eps,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    release_dependents(PDL)
    await_predecessor(PDL)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = _rms_normalised(x, w_ptr, cols, mask, width, eps)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             kernel: bool | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension of a 2-D ``x``
    whose rows are contiguous. ``kernel`` forces (True) or avoids (False) the Triton
    kernel; default: :func:`use_kernels`."""
    if not (use_kernels(x) if kernel is None else kernel):
        return rms_norm_torch(x, weight, eps)
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), width, eps,
                                  BLOCK=triton.next_power_of_2(width), **dependent_launch(x))
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, x_row_stride, d_row_stride,
                         width, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    release_dependents(PDL)
    await_predecessor(PDL)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * d_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # The sum is rounded to the residual's dtype first, as ``x + d`` in PyTorch is, and the
    # norm reads the rounded sum.
    s = (x + d).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * width + cols, s, mask=mask)
    y = _rms_normalised(s.to(tl.float32), w_ptr, cols, mask, width, eps)
    tl.store(out_ptr + row * width + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + delta), x + delta)`` for 2-D ``x`` and ``delta`` of one shape and
    dtype (rows contiguous): the residual add of a pre-norm layer and the norm after it,
    one kernel on CUDA. The sum is rounded to ``x``'s dtype before it is normalised, as the
    two separate ops do."""
    if not (use_kernels(x) if kernel is None else kernel):
        summed = x + delta
        return rms_norm_torch(summed, weight, eps), summed
    rows, width = x.shape
    summed = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows:
        _add_rms_norm_kernel[(rows,)](x, delta, weight, summed, out, x.stride(0),
                                      delta.stride(0), width, eps,
                                      BLOCK=triton.next_power_of_2(width),
                                      **dependent_launch(x))
    return out, summed


# ------------------------------------------------------------------------------ rotary

@triton.jit
def _rotated(x1, x2, pos_ptr, token, inv_freq_ptr, j, mask):
    """NeoX rotary of one head's halves ``x1``, ``x2`` (fp32) at ``token``'s position."""
    pos = tl.load(pos_ptr + token).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + j, mask=mask, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, inv_freq_ptr, out_ptr, x_tok_stride, x_head_stride,
                   num_heads, half, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    mask = j < half
    base = x_ptr + token * x_tok_stride + head * x_head_stride
    x1 = tl.load(base + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + j, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = _rotated(x1, x2, pos_ptr, token, inv_freq_ptr, j, mask)
    out = out_ptr + (token * num_heads + head) * 2 * half
    ty = out_ptr.dtype.element_ty
    tl.store(out + j, y1.to(ty), mask=mask)
    tl.store(out + half + j, y2.to(ty), mask=mask)


def rotary_inv_freq(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """fp32 ``[dim // 2]`` inverse frequencies of NeoX rotary over ``dim`` channels."""
    return 1.0 / (theta ** (torch.arange(dim // 2, device=device, dtype=torch.float32) * 2 / dim))


def rotary_torch(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
           kernel: bool | None = None) -> torch.Tensor:
    """NeoX rotary embedding of ``x`` (``[T, heads, D]``, last dimension contiguous) at
    ``positions`` (``[T]``) with :func:`rotary_inv_freq`'s frequencies; a new contiguous
    ``[T, heads, D]`` tensor of ``x``'s dtype."""
    if not (use_kernels(x) if kernel is None else kernel):
        return rotary_torch(x, positions, inv_freq)
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        half = dim // 2
        _rotary_kernel[(tokens, heads)](x, positions, inv_freq, out, x.stride(0), x.stride(1),
                                        heads, half, BLOCK=triton.next_power_of_2(half))
    return out


@triton.jit
def _rotary_qkv_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_ptr, v_ptr, qkv_tok_stride,
                       num_heads, num_kv_heads, half, BLOCK: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)  # 0 .. num_heads + 2 * num_kv_heads - 1, in the projection's order
    release_dependents(PDL)
    await_predecessor(PDL)
    j = tl.arange(0, BLOCK)
    mask = j < half
    dim = 2 * half
    src = qkv_ptr + token * qkv_tok_stride + head * dim
    x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + j, mask=mask, other=0.0).to(tl.float32)
    if head < num_heads + num_kv_heads:
        y1, y2 = _rotated(x1, x2, pos_ptr, token, inv_freq_ptr, j, mask)
        if head < num_heads:
            dst = q_ptr + (token * num_heads + head) * dim
        else:
            dst = k_ptr + (token * num_kv_heads + head - num_heads) * dim
    else:
        y1 = x1
        y2 = x2
        dst = v_ptr + (token * num_kv_heads + head - num_heads - num_kv_heads) * dim
    ty = q_ptr.dtype.element_ty
    tl.store(dst + j, y1.to(ty), mask=mask)
    tl.store(dst + half + j, y2.to(ty), mask=mask)


def rotary_qkv(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               num_heads: int, num_kv_heads: int, head_size: int, *,
               kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of a fused projection ``qkv`` (``[T, (num_heads + 2 * num_kv_heads) *
    head_size]``, rows contiguous, in that order): :func:`rotary` applied to the queries and
    keys, the values copied; three new contiguous ``[T, heads, head_size]`` tensors, one
    kernel on CUDA."""
    t = qkv.shape[0]
    if not (use_kernels(qkv) if kernel is None else kernel):
        rotated_heads = num_heads + num_kv_heads  # queries and keys: one rotary for both
        qk = rotary_torch(qkv[:, : rotated_heads * head_size].view(t, rotated_heads, head_size),
                          positions, inv_freq)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        v = qkv[:, rotated_heads * head_size:].reshape(t, num_kv_heads, head_size)
        return q.contiguous(), k.contiguous(), v.contiguous()
    q = torch.empty((t, num_heads, head_size), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, head_size), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty((t, num_kv_heads, head_size), dtype=qkv.dtype, device=qkv.device)
    if t:
        half = head_size // 2
        _rotary_qkv_kernel[(t, num_heads + 2 * num_kv_heads)](
            qkv, positions, inv_freq, q, k, v, qkv.stride(0), num_heads, num_kv_heads, half,
            BLOCK=triton.next_power_of_2(half), **dependent_launch(qkv))
    return q, k, v


# --------------------------------------------------------------------------- SwiGLU gate

@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_row_stride, width, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    row = tl.program_id(0)
    release_dependents(PDL)
    await_predecessor(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


_SILU_BLOCK = 1024


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def silu_mul(gate_up: torch.Tensor, *, kernel: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` (``[T, 2 * I]``, rows contiguous):
    ``[T, I]``."""
    if not (use_kernels(gate_up) if kernel is None else kernel):
        return silu_mul_torch(gate_up)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        grid = (rows, triton.cdiv(width, _SILU_BLOCK))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), width, BLOCK=_SILU_BLOCK,
                               **dependent_launch(gate_up))
    return out
