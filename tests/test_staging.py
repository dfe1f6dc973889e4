"""One host-to-device copy per call: :class:`~speccheck.speculator.staging.HostStaging`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speccheck.speculator.staging import HostStaging


def test_staged_arrays_come_back_at_their_offsets_call_after_call() -> None:
    """Each call's arrays, end to end from offset 0, whatever an earlier (longer or shorter)
    call left in the buffers; the copy rounds up to a power of two within capacity."""
    staging = HostStaging(40, torch.device("cpu"))
    for sizes in ((3, 5), (17, 1, 9), (0, 2), (20, 20)):
        arrays = [np.arange(n, dtype=np.int64) * 7 + i for i, n in enumerate(sizes)]
        staged = staging.stage(arrays)
        assert list(staged.offsets) == [sum(sizes[:i]) for i in range(len(sizes))]
        for got, want in zip(staged, arrays, strict=True):
            assert got.tolist() == want.tolist()


def test_staging_more_than_capacity_is_refused() -> None:
    staging = HostStaging(8, torch.device("cpu"))
    with pytest.raises(ValueError, match="9 staged values exceed the staging capacity 8"):
        staging.stage([np.zeros(4, np.int64), np.zeros((5, 1), np.int64)])
