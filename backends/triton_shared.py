"""Triton device functions the attention kernels of several backends share (``triton_attn``,
``triton_mla``, ``sparse_swa``): called from inside their ``@triton.jit`` kernels, never
launched on their own."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def request_of_token(query_start_loc_ptr, token, num_reqs):
    """The request owning a real ``token`` (``token < query_start_loc[num_reqs]``): the
    largest ``r < num_reqs`` with ``query_start_loc[r] <= token``, by binary search (a
    request with no query tokens shares its offset with the next, so it is skipped)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def online_softmax_step(m_i, l_i, acc, scores, values):
    """One tile of a numerically stable streaming softmax, log2 domain.

    ``scores`` ``[rows, tile]`` are scaled by ``log2(e)`` and ``-inf`` where masked;
    ``values`` ``[tile, width]``; ``m_i`` (running maximum), ``l_i`` (denominator relative
    to it) and ``acc`` (value sum relative to it, fp32 ``[rows, width]``) are the state so
    far. Returns the updated ``(m_i, l_i, acc)``. A row whose scores are all ``-inf`` so far
    keeps ``l_i = 0`` and ``acc = 0`` and produces no NaN."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision="ieee")
    return m_new, l_i, acc
