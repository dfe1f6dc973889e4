"""Triton on a machine without CUDA: kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch


def interpret_triton_without_cuda() -> None:
    """Set ``TRITON_INTERPRET=1`` (unless already set) when there is no CUDA device. It must
    run before the process first imports Triton: ``triton.language`` decorates its own
    helpers (``tl.cdiv``, ...) then, and every kernel module (the speculator's, a
    backend's) is decorated when it is imported. Every command that runs kernels in its
    own process calls it first."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
