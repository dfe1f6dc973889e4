"""Programmatic dependent launch: the rule for Triton kernels that start before the kernel
ahead of them has finished.

On Hopper and later, a kernel launched with ``launch_pdl=True``
may start while the kernel before it on the stream is still running, once every program of
that kernel has passed :func:`await_predecessor` (or exited). Its programs can read what no
earlier kernel writes (weights) before they call :func:`await_predecessor` themselves, which
waits for the kernel before to finish and its writes to be visible; everything else, reads
and writes, comes after it (a buffer the kernel writes may be one the kernel before still
reads). A decode step is a chain of short kernels, so each one's launch and the start of
its weight stream hide behind the tail of the one before. Stream capture records the
dependency, so CUDA graphs keep it.

Both the backends' kernels and the speculator's use it, so it lives here; whether a kernel
launches this way is its own choice, and a kernel launched without it waits as usual.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.lru_cache(maxsize=None)
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def programmatic_launch(t: torch.Tensor) -> bool:
    """Whether kernels over ``t`` launch as programmatic dependents (``launch_pdl`` and a
    true ``PDL`` constexpr for :func:`await_predecessor`): on CUDA devices of compute
    capability 9 or more. Never for CPU tensors, which the Triton interpreter runs (it has
    no inline assembly)."""
    index = t.device.index
    return t.is_cuda and _sm90_or_later(torch.cuda.current_device() if index is None else index)


@triton.jit
def await_predecessor(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernel before this one on the stream has finished and
    its writes are visible, then let the kernel after this one launch. Nothing without it.
    Every program of a kernel launched with ``launch_pdl`` must call it before it touches
    memory another kernel writes or reads."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


