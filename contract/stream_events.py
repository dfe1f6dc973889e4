"""CUDA events recorded on the current stream of a known device, without torch's lookup.

``torch.cuda.Event.record()`` with no stream asks ``torch.cuda.current_stream()`` for the
current device's stream, and that resolves the device on every call through
``torch.cuda.is_available()`` (an NVML check and an environment read). Given the device
index, the stream is one call. Per-propose host work that records events (the pinned
staging buffer, FlashInfer's plan uploads) uses :func:`record_on_current_stream`.
"""

from __future__ import annotations

import torch


def cuda_device_index(device: torch.device | str) -> int:
    """The index of the CUDA ``device`` (the current device when it names none)."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def record_on_current_stream(event: torch.cuda.Event, device_index: int) -> None:
    """``event.record()`` on the current stream of device ``device_index``."""
    event.record(torch.cuda.current_stream(device_index))
