"""Warming L2 with the weights a layer reads next while its attention runs.

At decode batch sizes a layer alternates between weight-streaming projections, which keep
HBM busy, and its attention, which at short contexts reads a few hundred KiB of keys and
values and leaves HBM almost idle for its whole span (about 12 us a layer with FA3 on an
H200 at batch 1). :func:`weights_warmed_during` fills that span: on a side stream, one
short kernel asks L2 to fetch the weights the layer reads after the attention (its output
projection, then its MLP's first projection, as far as :data:`L2_SHARE` of L2 holds), so
that those projections read them from L2 rather than HBM.

The kernel issues Hopper's bulk L2 prefetch (``cp.async.bulk.prefetch.L2``): a hint, no
registers, no shared memory, no result, finished as soon as issued; it reads nothing a
kernel writes and writes nothing, so it needs no ordering with the attention beyond being
issued after the kernels before the fork. Under capture the fork and the join are graph
edges (the side stream waits for the current one at entry; the current one waits for the
side stream at exit), so the next projection is a node that depends on both; eager, the
same two waits. Where the prefetch does not apply (CPU tensors, devices before sm_90,
more rows than :data:`~speccheck.speculator.projection_kernels.SKINNY_ROWS`, the kernels
switched off) the block runs alone, unchanged. The numbers of every kernel are the same
with and without it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
import triton
import triton.language as tl

from speccheck.speculator.projection_kernels import SKINNY_ROWS

PREFETCH_MIN_MAJOR = 9
"""Compute capability from which devices have the bulk L2 prefetch (Hopper)."""

L2_SHARE = 0.75
"""Fraction of the device's L2 the warmed weights may fill: the rest is left to what the
attention and the projections themselves read and write."""

SPAN_BYTES = 16384
"""Bytes each lane asks for in one bulk prefetch (a multiple of 16, as the instruction
requires)."""

LANES = 32
"""Lanes of a program (one warp), each issuing one bulk prefetch."""


@triton.jit
def _prefetch_l2_kernel(base_ptr, nbytes, SPAN: tl.constexpr, LANES: tl.constexpr):
    """Program ``p``: lane ``i`` asks L2 for the ``SPAN`` bytes at byte offset ``(p * LANES
    + i) * SPAN`` of ``base_ptr`` (fewer at the end: ``nbytes`` is a multiple of 16;
    nothing past it)."""
    offsets = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * SPAN
    sizes = tl.minimum(nbytes - offsets, SPAN).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [base_ptr.to(tl.pointer_type(tl.uint8)) + offsets, sizes],
        dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    """The stream the prefetch runs on, one per device, made once (its priority is the
    default's, so it never delays the attention)."""
    return torch.cuda.Stream(device=index)


@functools.cache
def _l2_budget(index: int) -> int:
    """Bytes the warmed weights may fill on device ``index``."""
    return int(torch.cuda.get_device_properties(index).L2_cache_size * L2_SHARE)


def _prefetches(rows: torch.Tensor, enabled: bool) -> bool:
    """Whether the prefetch applies to a step over ``rows`` (see the module's doc)."""
    if not (enabled and rows.is_cuda and rows.shape[0] <= SKINNY_ROWS):
        return False
    index = rows.device.index if rows.device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= PREFETCH_MIN_MAJOR


def _spans(weights: Sequence[torch.Tensor], budget: int) -> Iterator[tuple[torch.Tensor, int]]:
    """``(weight, bytes)`` to prefetch from the start of each weight, in order, until
    ``budget`` bytes; bytes rounded down to a multiple of 16, weights not 16-byte aligned
    or not contiguous left out."""
    for weight in weights:
        if budget < 16:
            return
        if not weight.is_contiguous() or weight.data_ptr() % 16:
            continue
        nbytes = min(weight.numel() * weight.element_size(), budget) // 16 * 16
        budget -= nbytes
        yield weight, nbytes


@contextlib.contextmanager
def weights_warmed_during(rows: torch.Tensor, weights: Sequence[torch.Tensor], *,
                          enabled: bool = True) -> Iterator[None]:
    """Run the block (a layer's attention over ``rows``, its query rows) while a side
    stream prefetches ``weights`` into L2, in order, up to :data:`L2_SHARE` of it; on exit
    the current stream waits for the side stream. A plain block where the prefetch does not
    apply. Capture-safe: grids from sizes, no host synchronisation."""
    if not _prefetches(rows, enabled):
        yield
        return
    index = rows.device.index if rows.device.index is not None else torch.cuda.current_device()
    current, side = torch.cuda.current_stream(rows.device), _side_stream(index)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for weight, nbytes in _spans(weights, _l2_budget(index)):
            grid = (triton.cdiv(nbytes, SPAN_BYTES * LANES),)
            _prefetch_l2_kernel[grid](weight, nbytes, SPAN=SPAN_BYTES, LANES=LANES,
                                      num_warps=1)
    try:
        yield
    finally:
        current.wait_stream(side)
