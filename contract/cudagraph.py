"""CUDA-graph modes and the batch execution descriptor."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CUDAGraphMode(enum.IntEnum):
    """How one forward is executed. Ordered: the weakest mode across DP ranks wins."""

    NONE = 0
    """Eager: every kernel is launched from Python."""
    PIECEWISE = 1
    """Graphs around everything except attention, which runs eagerly between pieces."""
    FULL = 2
    """One graph holds the whole forward, attention included: metadata must live in
    persistent buffers and be refreshed by capture-safe GPU work."""

    @classmethod
    def from_name(cls, name: str) -> CUDAGraphMode:
        """``"none" | "piecewise" | "full"`` (case-insensitive) to a mode."""
        try:
            return cls[name.upper()]
        except KeyError:
            valid = ", ".join(m.name.lower() for m in cls)
            raise ValueError(f"unknown CUDA-graph mode {name!r}; valid: {valid}") from None


@dataclass(frozen=True)
class BatchExecutionDescriptor:
    """What a batch is executed as: the key of a captured graph.

    ``num_tokens`` and ``num_reqs`` are *padded* counts (the captured bucket), not the real
    ones. ``num_reqs`` is ``None`` when requests are not padded (PIECEWISE, eager).
    ``uniform_token_count`` is the query tokens per request when every request has the same
    count (1 for single-token decode, 1+K for a DFlash block), else ``None``.
    """

    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None = None
    uniform_token_count: int | None = None

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens={self.num_tokens} must be >= 0")
        if self.num_reqs is not None and self.num_reqs < 0:
            raise ValueError(f"num_reqs={self.num_reqs} must be >= 0")
        if (
            self.uniform_token_count is not None
            and self.num_reqs is not None
            and self.num_reqs * self.uniform_token_count != self.num_tokens
        ):
            raise ValueError(
                f"uniform batch of num_reqs={self.num_reqs} x uniform_token_count="
                f"{self.uniform_token_count} does not cover num_tokens={self.num_tokens}"
            )
