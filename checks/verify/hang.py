"""When a verify worker that stopped making progress counts as hung.

A worker writes a progress line as it starts each example (shrink candidates included), so
the gap between two lines is one example's run time. Until a worker has finished an
example, its set-up (drafters, caches, breakpoint probe, graph capture, a kernel compile
on the first call) is bounded by the run's ``example_timeout`` alone. Once it has finished
one, an example that takes :data:`HANG_FACTOR` times its slowest one so far (at least
:data:`HANG_FLOOR_SECONDS`, at most ``example_timeout``) is a hang: a FlashInfer graph
replayed with a plan for other lengths can spin on the device for ever (measured on an
H200: killed after 6 minutes), and waiting the full ``example_timeout`` for it, then as long
again to confirm its reproduce command, spends minutes of a GPU session on one known-bad
builder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

HANG_FACTOR = 20.0
"""An example that runs this many times as long as the worker's slowest finished one is a
hang ..."""
HANG_FLOOR_SECONDS = 120.0
"""... but never before this many seconds: a kernel compiled for a shape not seen before
(FlashInfer's sm90 prefill JIT: 98 s on an H200) falls within it."""


@dataclass
class HangClock:
    """Follows one worker task's progress lines (:meth:`progressed`) and says when the
    worker counts as hung (:meth:`hung`).

    ``limit`` is the run's ``example_timeout``: the bound before the first example ends,
    and the most any bound can be. ``example_bound``, where given, replaces the adaptive
    bound from the first progress line on: a reproduce run of an example that hung holds
    that one example to the bound that killed the original (it has no earlier example to
    compare with)."""

    limit: float
    example_bound: float | None = None
    last_progress: float = field(default_factory=time.monotonic)
    lines: int = 0
    slowest_example: float = 0.0

    def progressed(self, now: float) -> None:
        """The worker wrote a progress line at ``now`` (monotonic seconds)."""
        if self.lines:
            self.slowest_example = max(self.slowest_example, now - self.last_progress)
        self.lines += 1
        self.last_progress = now

    @property
    def bound(self) -> float:
        """Seconds without a progress line after which the worker counts as hung."""
        return self._bound_and_reason()[0]

    def hung(self, now: float) -> bool:
        """Whether the worker has made no progress for longer than :attr:`bound` at
        ``now``."""
        return now - self.last_progress > self.bound

    def why(self) -> str:
        """How :attr:`bound` came about, for the crash report."""
        return self._bound_and_reason()[1]

    def _bound_and_reason(self) -> tuple[float, str]:
        if self.lines and self.example_bound is not None and self.example_bound < self.limit:
            return self.example_bound, (
                f"the bound that ended the original run, {self.example_bound:.0f}s")
        if self.lines >= 2 and self.example_bound is None:
            adaptive = max(HANG_FLOOR_SECONDS, HANG_FACTOR * self.slowest_example)
            if adaptive < self.limit:
                return adaptive, (f"{HANG_FACTOR:.0f}x its slowest example "
                                  f"({self.slowest_example:.1f}s), at least "
                                  f"{HANG_FLOOR_SECONDS:.0f}s")
        return self.limit, "the example timeout"
