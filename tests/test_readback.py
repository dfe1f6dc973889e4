"""The verifier's batched read-back (checks/verify/readback.py): one transfer per dtype,
copies equal to the tensors and sharing no memory with them or with each other's runs."""

from __future__ import annotations

import pytest
import torch

from speccheck.checks.verify.readback import HostCopyPlan, host_copies


def _tensors(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [t.to(device) for t in (
        torch.randint(0, 9, (3, 4), generator=gen, dtype=torch.int32),
        torch.randn(5, generator=gen),
        torch.randint(0, 9, (0,), dtype=torch.int32),
        torch.randint(0, 9, (2, 2, 2), generator=gen, dtype=torch.int32),
    )]


def _check(device: str) -> None:
    tensors = _tensors(device)
    plan = HostCopyPlan(tensors)
    first = plan.copies()
    for tensor, copy in zip(tensors, first, strict=True):
        assert copy.device.type == "cpu" and copy.shape == tensor.shape
        assert torch.equal(copy, tensor.cpu())
    for tensor in tensors:
        tensor.add_(1)
    second = plan.copies()
    for tensor, old, new in zip(tensors, first, second, strict=True):
        assert torch.equal(new, tensor.cpu()) and torch.equal(old + 1, new)
    assert [c.tolist() for c in host_copies(tensors)] == [c.tolist() for c in second]


def test_copies_on_cpu() -> None:
    _check("cpu")


@pytest.mark.cuda
def test_copies_from_the_device_land_in_page_locked_memory() -> None:
    _check("cuda")
    assert all(c.is_pinned() for c in HostCopyPlan(_tensors("cuda")).copies() if c.numel())
