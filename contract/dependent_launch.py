"""Programmatic dependent launch (PDL) of the kernels of a draft step: the rule that lets
the speculator's kernels and a backend's overlap safely.

Between two dependent kernels in a CUDA graph the GPU idles for the second one's launch
(about 0.4 us on an H200) and for its programs to ramp up while the first one's last
programs drain; a decode step at batch 1 is some 15 such kernels of 1 to 12 us. Launched as
a programmatic dependent (sm_90 and later), a kernel may start before the one ahead of it
in the stream has finished: its programs become resident as the earlier kernel's programs
release it (:func:`release_dependents`), issue loads of data no kernel writes (weights),
then block in :func:`await_predecessor` until the earlier kernel has completed and its
writes are visible.

The contract, for every kernel launched with ``launch_pdl=True`` (:func:`dependent_launch`
gives it): each of its programs calls :func:`await_predecessor` before it reads anything a
kernel may have written (activations, token ids, positions, step counters, any buffer a
replay updates) and before its first store. Waiting completes the kernel ahead, which in
turn waited for its own predecessor, so the guarantee is transitive along the stream. A
kernel launched without the flag waits for its predecessor as usual, so launches with and
without it mix freely, and an adapter need not use it. Capture-safe: a launch flag and two
instructions, nothing on the host."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

PDL_MIN_MAJOR = 9
"""Compute capability from which devices run programmatic dependent launches (Hopper)."""


@functools.cache
def _device_runs_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= PDL_MIN_MAJOR


def dependent_launch(x: torch.Tensor) -> dict[str, bool]:
    """The launch keywords of a kernel over ``x`` that takes a ``PDL`` constexpr: ``PDL``
    (its programs release and await, :func:`release_dependents`, :func:`await_predecessor`)
    and Triton's ``launch_pdl`` (the launch attribute), both true where ``x`` is on a CUDA
    device of compute capability 9 or later (never under the Triton interpreter, whose
    tensors are on the CPU). One call gives both, so no kernel launches early without
    waiting: ``kernel[grid](..., **dependent_launch(x))``."""
    index = x.device.index
    runs = x.is_cuda and _device_runs_pdl(torch.cuda.current_device() if index is None
                                          else index)
    return {"PDL": runs, "launch_pdl": runs}


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel in the stream launch once every program of this one has been
    here (no-op without ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def await_predecessor(PDL: tl.constexpr):
    """Block until the kernel ahead in the stream has completed and its writes are visible
    (no-op without ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
