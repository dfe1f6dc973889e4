"""Triton on a machine without CUDA: kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch


def interpret_triton_without_cuda() -> None:
    """Set ``TRITON_INTERPRET=1`` (unless already set) when there is no CUDA device. It must
    run before a backend's kernels are decorated, which adapters do when they are first
    imported, lazily; every command that runs backends in its own process calls it first."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
