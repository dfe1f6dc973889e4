"""Host integers to the device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def int64_on(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``. On CUDA the copy comes from page-locked
    memory, so it is queued on the current stream and the host goes on (from pageable memory
    it would first wait for every earlier launch on the stream); PyTorch's host allocator
    keeps the pinned block until the copy ran."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
