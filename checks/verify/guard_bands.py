"""The guard-band check: the persistent buffers of the backend under test are allocated with
poisoned bands around them (:class:`GuardedAllocator`), and no write may land in a band."""

from __future__ import annotations

import torch

from speccheck.checks.probes import GuardedBuffer, GuardedBufferSet
from speccheck.checks.verify.comparisons import Outcome
from speccheck.checks.verify.vocabulary import Check, Result


class GuardedAllocator(GuardedBufferSet):
    """A :data:`~speccheck.contract.builder.BufferAllocator` that surrounds every persistent
    buffer with poisoned guard bands and keeps it in this set (checked and rearmed
    together)."""

    def __call__(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        buffer = GuardedBuffer(shape, dtype, device, name=name)
        self.add(buffer)
        return buffer.tensor


def guard_bands(guards: GuardedBufferSet) -> list[Outcome]:
    """No write landed in the poisoned bands around any buffer of ``guards`` since they were
    last rearmed: one outcome, naming the first three violations if any."""
    if not guards.buffers:
        return [Outcome(Check.GUARD_BANDS, Result.SKIPPED, "no persistent buffers")]
    violations = guards.violations()
    if violations:
        return [Outcome(Check.GUARD_BANDS, Result.FAILED, "; ".join(violations[:3]))]
    return [Outcome(Check.GUARD_BANDS, Result.PASSED)]
