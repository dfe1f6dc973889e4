"""Giving device memory back between runs that share one process."""

from __future__ import annotations

import gc

import torch


def release_device_memory(device: torch.device) -> None:
    """Free what dropped speculators and verifiers still hold on ``device`` and return the
    allocator's cache to the driver. Dropped is not freed: a verifier that found a failure
    stays in reference cycles (hypothesis keeps the failing example's traceback, whose
    frames close over the verifier: KV caches and graph pools, gigabytes at serving scale),
    which only the cycle collector frees. Call it between speculators or verifiers run in
    one process (the benchmark's cases, the self-test's verifiers, a verify worker's tasks,
    tests)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
